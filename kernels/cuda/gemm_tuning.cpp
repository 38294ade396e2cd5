#include "kernels/cuda/gemm_tuning.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "core/error.hpp"
#include "kernels/cuda/cuda_backend.hpp"

namespace troupe::kernels::cuda::gemm_tuning {

namespace {

constexpr std::size_t algo_bytes = sizeof(cublasLtMatmulAlgo_t);

std::string to_hex(const cublasLtMatmulAlgo_t& a) {
  static const char digits[] = "0123456789abcdef";
  const auto* p = reinterpret_cast<const unsigned char*>(&a);
  std::string out;
  out.reserve(2 * algo_bytes);
  for (std::size_t i = 0; i < algo_bytes; ++i) {
    out.push_back(digits[p[i] >> 4]);
    out.push_back(digits[p[i] & 15]);
  }
  return out;
}

bool from_hex(const std::string& s, cublasLtMatmulAlgo_t& a) {
  if (s.size() != 2 * algo_bytes) return false;
  auto* p = reinterpret_cast<unsigned char*>(&a);
  for (std::size_t i = 0; i < algo_bytes; ++i) {
    auto nibble = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      return -1;
    };
    const int hi = nibble(s[2 * i]), lo = nibble(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    p[i] = static_cast<unsigned char>(hi << 4 | lo);
  }
  return true;
}

struct state {
  std::mutex mu;
  std::map<std::string, cublasLtMatmulAlgo_t> entries;
  std::string loaded;  // the file `entries` came from
};

state& the_state() {
  static state s;
  return s;
}

/// Reads every well-formed line of the file into `entries` (a missing file is an empty one; a
/// malformed line is an error naming the file and line: a hand-edited or truncated file).
void load(const std::string& path, std::map<std::string, cublasLtMatmulAlgo_t>& entries) {
  std::ifstream in(path);
  if (!in) return;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string key, hex;
    double ms = 0;
    cublasLtMatmulAlgo_t algo{};
    if (!(fields >> key >> hex >> ms) || !from_hex(hex, algo))
      throw core::failure("GEMM tuning file " + path + ":" + std::to_string(number) +
                          ": malformed line (want: key, 128 hex digits, milliseconds; hint: delete "
                          "the line or the file named by runtime.gemm_tune_file, it is rebuilt by "
                          "measuring again)");
    entries[key] = algo;
  }
}

/// An exclusive flock on path + ".lock" for the lifetime of the object.
class file_lock {
 public:
  explicit file_lock(const std::string& path) : lock_path_(path + ".lock") {
    fd_ = ::open(lock_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0)
      throw core::failure("GEMM tuning: cannot open lock file " + lock_path_ + ": " +
                          std::strerror(errno) +
                          " (hint: check that the folder of runtime.gemm_tune_file exists and is "
                          "writable)");
    while (::flock(fd_, LOCK_EX) != 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      ::close(fd_);
      throw core::failure("GEMM tuning: cannot lock " + lock_path_ + ": " + std::strerror(e));
    }
  }
  ~file_lock() {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
  file_lock(const file_lock&) = delete;
  file_lock& operator=(const file_lock&) = delete;

 private:
  std::string lock_path_;
  int fd_ = -1;
};

/// One configuration attribute as int: 16 bits wide for the cluster and inner shapes, 32 for the
/// others (cuBLASLt checks the size); -1 when it cannot be read.
int algo_attr(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t attr) {
  std::size_t written = 0;
  if (attr == CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID || attr == CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID) {
    std::uint16_t v = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof(v), &written) !=
        CUBLAS_STATUS_SUCCESS)
      return -1;
    return v;
  }
  std::int32_t v = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof(v), &written) !=
      CUBLAS_STATUS_SUCCESS)
    return -1;
  return v;
}

}  // namespace

std::string describe(const cublasLtMatmulAlgo_t& a) {
  char buf[160];
  std::snprintf(buf, sizeof(buf),
                "id %d tile %d stages %d splitK %d red %d swz %d custom %d cluster %d",
                algo_attr(a, CUBLASLT_ALGO_CONFIG_ID), algo_attr(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
                algo_attr(a, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                algo_attr(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                algo_attr(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                algo_attr(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                algo_attr(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
                algo_attr(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
  return buf;
}

namespace {
std::mutex path_mutex;
std::string path_value;  // runtime.gemm_tune_file (set_file_path)
}  // namespace

void set_file_path(const std::string& path) {
  std::lock_guard<std::mutex> lock(path_mutex);
  path_value = path;
}

std::string file_path() {
  std::lock_guard<std::mutex> lock(path_mutex);
  return path_value;
}

std::optional<cublasLtMatmulAlgo_t> lookup_or_tune(
    const std::string& key, const std::function<std::optional<choice>()>& tune) {
  const std::string path = file_path();
  if (path.empty()) return std::nullopt;
  state& st = the_state();
  std::lock_guard<std::mutex> guard(st.mu);
  if (st.loaded != path) {
    st.entries.clear();
    load(path, st.entries);
    st.loaded = path;
  }
  if (auto it = st.entries.find(key); it != st.entries.end()) return it->second;
  // Another process may have measured this GEMM since the file was read: look again under the
  // lock, and measure only if it is still missing.
  file_lock lock(path);
  load(path, st.entries);
  if (auto it = st.entries.find(key); it != st.entries.end()) return it->second;
  const std::optional<choice> best = tune();
  if (!best) return std::nullopt;
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (!f)
    throw core::failure("GEMM tuning: cannot append to " + path + ": " + std::strerror(errno) +
                        " (hint: check that runtime.gemm_tune_file names a writable file)");
  const std::string line = key + " " + to_hex(best->algo) + " " + std::to_string(best->ms) + "\n";
  const bool ok = std::fwrite(line.data(), 1, line.size(), f) == line.size() && std::fflush(f) == 0 &&
                  ::fsync(::fileno(f)) == 0;
  std::fclose(f);
  if (!ok) throw core::failure("GEMM tuning: writing " + path + " failed: " + std::strerror(errno));
  st.entries[key] = best->algo;
  return best->algo;
}

}  // namespace troupe::kernels::cuda::gemm_tuning

namespace troupe::kernels::cuda {

void set_gemm_tune_file(const std::string& path) { gemm_tuning::set_file_path(path); }

}  // namespace troupe::kernels::cuda
