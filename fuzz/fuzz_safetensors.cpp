// A safetensors file (a Hugging Face checkpoint shard), opened and every tensor loaded, as
// model.init and `troupe import` read them.
#include "fuzz/fuzz_input.hpp"
#include "model/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace st = troupe::model::safetensors;
  auto f = st::file::open(troupe::fuzz::as_file(data, size, ".safetensors"));
  if (f.ok())
    for (const auto& e : f.value().entries()) (void)f.value().load(e.name);
  return 0;
}
