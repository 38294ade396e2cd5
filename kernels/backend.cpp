// Host transfers shared by all backends.
#include "kernels/backend.hpp"

namespace troupe::kernels {

tensor backend::to_host(const tensor& x) {
  synchronize();
  tensor host = tensor::zeros(x.shape(), x.type());
  copy(x, host);
  synchronize();
  return host;
}

tensor backend::from_host(const tensor& host) {
  tensor x = empty(host.shape(), host.type());
  copy(host, x);
  return x;
}

}  // namespace troupe::kernels
