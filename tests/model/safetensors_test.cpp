#include "model/safetensors.hpp"

#include <doctest/doctest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

namespace {

namespace fs = std::filesystem;
namespace st = troupe::model::safetensors;
using troupe::core::dtype;
using troupe::core::tensor;

struct temp_dir {
  fs::path path;
  temp_dir() {
    path = fs::temp_directory_path() /
           ("troupe_safetensors_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    fs::create_directories(path);
  }
  ~temp_dir() { fs::remove_all(path); }
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A file assembled by hand, as another implementation would write it: header length, JSON, data.
std::string hand_made(const std::string& header_json, const std::string& data) {
  std::string out(8, '\0');
  std::uint64_t n = header_json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header_json + data;
}

std::string floats(std::initializer_list<float> v) {
  std::string out(v.size() * 4, '\0');
  std::memcpy(out.data(), v.begin(), out.size());
  return out;
}

std::vector<st::named_tensor> sample_tensors() {
  tensor a = tensor::zeros({2, 3}, dtype::f32);
  for (int i = 0; i < 6; ++i) a.data<float>()[i] = 0.5f * i - 1.0f;
  tensor b = tensor::zeros({4}, dtype::i32);
  for (int i = 0; i < 4; ++i) b.data<std::int32_t>()[i] = -7 + 1000 * i;
  tensor c = tensor::zeros({3}, dtype::bf16);
  for (int i = 0; i < 3; ++i) c.data<std::uint16_t>()[i] = troupe::core::f32_to_bf16(1.5f * i);
  tensor scalar = tensor::zeros({}, dtype::f32);
  scalar.data<float>()[0] = 42.0f;
  return {{"layer.weight", a}, {"ids", b}, {"half", c}, {"scale", scalar}};
}

}  // namespace

TEST_CASE("safetensors round trip keeps names, dtypes, shapes, bytes and metadata") {
  temp_dir tmp;
  const std::string path = tmp.file("a.safetensors");
  auto tensors = sample_tensors();
  auto info = st::write(path, tensors, {{"format", "pt"}});
  REQUIRE(info.ok());
  CHECK(info->bytes == fs::file_size(path));

  auto f = st::file::open(path);
  REQUIRE_MESSAGE(f.ok(), f.err().to_string());
  CHECK(f->metadata().at("format") == "pt");
  REQUIRE(f->entries().size() == tensors.size());
  const char* codes[] = {"F32", "I32", "BF16", "F32"};
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& want = tensors[i];
    const st::entry* e = f->find(want.name);
    REQUIRE(e != nullptr);
    CHECK(e->dtype == codes[i]);
    CHECK(e->shape == want.value.shape());
    auto got = f->load(want.name);
    REQUIRE(got.ok());
    CHECK(got->type() == want.value.type());
    CHECK(got->shape() == want.value.shape());
    CHECK(std::memcmp(got->raw(), want.value.raw(), want.value.bytes()) == 0);
  }
}

TEST_CASE("safetensors writer lays out the reference format") {
  temp_dir tmp;
  const std::string path = tmp.file("a.safetensors");
  auto tensors = sample_tensors();
  auto info = st::write(path, tensors);
  REQUIRE(info.ok());
  std::string bytes = read_all(path);
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  CHECK((8 + n) % 8 == 0);  // data section 8-byte aligned
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  CHECK_FALSE(header.contains("__metadata__"));
  CHECK(header["layer.weight"]["dtype"] == "F32");
  CHECK(header["layer.weight"]["shape"] == nlohmann::json::array({2, 3}));
  CHECK(header["layer.weight"]["data_offsets"] == nlohmann::json::array({0, 24}));
  CHECK(header["ids"]["data_offsets"] == nlohmann::json::array({24, 40}));
  CHECK(header["half"]["data_offsets"] == nlohmann::json::array({40, 46}));
  CHECK(header["scale"]["shape"] == nlohmann::json::array());
  CHECK(bytes.size() == 8 + n + 50);
  CHECK(std::memcmp(bytes.data() + 8 + n, tensors[0].value.raw(), 24) == 0);
  // The hashes the writer reports are those of the bytes on disk.
  CHECK(info->file_xxh64 == st::xxh64(bytes.data(), bytes.size()));
  CHECK(info->tensor_xxh64[1] == st::xxh64(bytes.data() + 8 + n + 24, 16));
}

TEST_CASE("safetensors reader accepts a file written by another implementation") {
  temp_dir tmp;
  const std::string path = tmp.file("hf.safetensors");
  // Keys out of data order, metadata last, header padded with spaces as the Rust writer does.
  std::string header =
      R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"format":"pt"}}    )";
  write_raw(path, hand_made(header, floats({1.0f, 2.0f, 3.0f})));
  auto f = st::file::open(path);
  REQUIRE_MESSAGE(f.ok(), f.err().to_string());
  REQUIRE(f->entries().size() == 2);
  CHECK(f->entries()[0].name == "a");  // entries come in data order
  auto b = f->load("b");
  REQUIRE(b.ok());
  CHECK(b->data<float>()[0] == 3.0f);
  CHECK_FALSE(f->load("c").ok());
}

TEST_CASE("a truncated safetensors file is refused naming the file and the cut tensor") {
  temp_dir tmp;
  const std::string path = tmp.file("cut.safetensors");
  REQUIRE(st::write(path, sample_tensors()).ok());
  fs::resize_file(path, fs::file_size(path) - 3);
  auto f = st::file::open(path);
  REQUIRE_FALSE(f.ok());
  std::string msg = f.err().to_string();
  CHECK(msg.find(path) != std::string::npos);
  CHECK(msg.find("'scale'") != std::string::npos);
  CHECK(msg.find("truncated") != std::string::npos);

  fs::resize_file(path, 5);
  auto g = st::file::open(path);
  REQUIRE_FALSE(g.ok());
  CHECK(g.err().to_string().find("too short") != std::string::npos);
}

TEST_CASE("safetensors headers that lie about their data are refused naming the tensor") {
  temp_dir tmp;
  const std::string path = tmp.file("bad.safetensors");
  const std::string data = floats({1.0f, 2.0f, 3.0f});
  struct bad_case {
    std::string header;
    std::string expect;
  };
  const bad_case cases[] = {
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
       "tensor 'a'"},  // shape needs 12 bytes, offsets give 8
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       "overlaps"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", "hole"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "follow the last tensor"},
      {R"({"a":{"dtype":"Q4","shape":[3],"data_offsets":[0,12]}})", "unknown dtype 'Q4'"},
      {R"({"a":{"dtype":"F32","shape":[-3],"data_offsets":[0,12]}})", "non-negative"},
      {R"({"a":{"dtype":"F32","shape":[3]}})", "lacks"},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]})", "not valid JSON"},
      {R"([1,2,3])", "does not start with '{'"},
  };
  for (const auto& c : cases) {
    write_raw(path, hand_made(c.header, data));
    auto f = st::file::open(path);
    REQUIRE_FALSE(f.ok());
    std::string msg = f.err().to_string();
    INFO(c.header, " -> ", msg);
    CHECK(msg.find(c.expect) != std::string::npos);
    CHECK(msg.find(path) != std::string::npos);
  }
  std::string huge = hand_made("{}", "");
  huge[6] = 1;  // header length far beyond the file
  write_raw(path, huge);
  auto f = st::file::open(path);
  REQUIRE_FALSE(f.ok());
  CHECK(f.err().to_string().find("exceeds the file") != std::string::npos);
}

TEST_CASE("safetensors writer refuses duplicate and reserved names") {
  temp_dir tmp;
  tensor a = tensor::zeros({1});
  CHECK_FALSE(st::write(tmp.file("d.safetensors"), {{"x", a}, {"x", a}}).ok());
  CHECK_FALSE(st::write(tmp.file("m.safetensors"), {{"__metadata__", a}}).ok());
}
