// What the fuzz targets share: the input as text, and as a file for the readers that map files.
// Every target must turn any input into a value or a core::error, never a crash, a hang, a leak
// or undefined behaviour (the targets are built with AddressSanitizer and UBSan: scripts/fuzz.sh).
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

namespace troupe::fuzz {

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

/// Writes the input to a file of this process (reused by every input) and returns its path.
inline const std::string& as_file(const std::uint8_t* data, std::size_t size, const char* suffix) {
  static const std::string path = [&] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir && *dir ? dir : "/tmp") + "/troupe_fuzz_" +
           std::to_string(static_cast<long>(::getpid())) + suffix;
  }();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();  // the harness cannot run: not an input's fault, but must not pass silently
  if (size && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

}  // namespace troupe::fuzz
