#include "core/files.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>
#include <vector>

namespace troupe::core {

namespace {

namespace fs = std::filesystem;

std::string errno_text(int e) { return std::strerror(e); }

std::string cwd_note() {
  std::error_code ec;
  const fs::path cwd = fs::current_path(ec);
  return "relative paths start at the current directory (" + cwd.string() + ")";
}

std::string with_hint(const input_spec& spec, const std::string& more = {}) {
  if (spec.hint.empty()) return more;
  if (more.empty()) return spec.hint;
  return spec.hint + "; " + more;
}

// "a FIFO (named pipe)", "a directory", ...: what a non-regular file is, for messages.
std::string kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe), which would block until something writes to it";
  if (S_ISCHR(mode)) return "a character device (such as /dev/zero or a terminal), which has no end";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

error not_regular(const std::string& path, const input_spec& spec, mode_t mode) {
  return error::at_file(path, "is " + kind_of(mode) + ", expected a " + spec.what + " (a regular file)",
                        with_hint(spec, S_ISDIR(mode) ? "name the file inside the folder" : ""));
}

std::string size_text(std::uint64_t bytes) {
  if (bytes >= (std::uint64_t(1) << 30))
    return std::to_string(bytes) + " bytes (" + std::to_string(bytes >> 30) + " GiB)";
  if (bytes >= (std::uint64_t(1) << 20))
    return std::to_string(bytes) + " bytes (" + std::to_string(bytes >> 20) + " MiB)";
  return std::to_string(bytes) + " bytes";
}

status write_all(int fd, const void* data, std::size_t bytes, const std::string& path) {
  auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      return error::at_file(path, "write failed: " + errno_text(errno),
                            "check free disk space and permissions");
    }
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return {};
}

status pwrite_all(int fd, const char* p, std::size_t bytes, std::uint64_t at, const std::string& path) {
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, p, bytes, static_cast<off_t>(at));
    if (n < 0) {
      if (errno == EINTR) continue;
      return error::at_file(path, "write failed: " + errno_text(errno),
                            "check free disk space and permissions");
    }
    p += n;
    at += static_cast<std::uint64_t>(n);
    bytes -= static_cast<std::size_t>(n);
  }
  return {};
}

// The stop-signal guard: appends in flight, and the signal that arrived while one was (0: none).
// Both are lock-free atomics, so the handler may read and write them.
std::atomic<int> appends_in_flight{0};
std::atomic<int> stop_pending{0};

[[noreturn]] void stop_with(int sig) {
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(sig, &dfl, nullptr);
  ::raise(sig);  // inside the handler: delivered, with the default action, once unblocked
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  for (;;) ::pause();
}

void on_stop_signal(int sig) {
  stop_pending.store(sig);
  // An append that starts after this load sees stop_pending and does not write; one in flight
  // stops the process when it ends (sealed_file::append).
  if (appends_in_flight.load() == 0) stop_with(sig);
}

// Entered before each sealed write, left after it. With the handler's store-then-load this is
// Dekker's handshake: either the handler sees no append in flight and stops the process, or the
// last append to leave sees the pending signal and stops it; an append that would start after
// the signal does not write.
struct append_in_flight {
  append_in_flight() {
    appends_in_flight.fetch_add(1);
    if (stop_pending.load() != 0) leave();
  }
  ~append_in_flight() { leave(); }
  append_in_flight(const append_in_flight&) = delete;
  append_in_flight& operator=(const append_in_flight&) = delete;

 private:
  static void leave() {
    const bool last = appends_in_flight.fetch_sub(1) == 1;
    const int sig = stop_pending.load();
    if (sig == 0) return;
    if (last) stop_with(sig);
    for (;;) ::pause();  // an append still in flight stops the process when it ends
  }
};

}  // namespace

void guard_appends_from_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

input_file::input_file(input_file&& o) noexcept
    : fd_(std::exchange(o.fd_, -1)), size_(o.size_), path_(std::move(o.path_)) {}

input_file& input_file::operator=(input_file&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    size_ = o.size_;
    path_ = std::move(o.path_);
  }
  return *this;
}

input_file::~input_file() {
  if (fd_ >= 0) ::close(fd_);
}

int input_file::release() { return std::exchange(fd_, -1); }

status check_path_text(const std::string& path, std::string_view what) {
  const auto nul = path.find('\0');
  if (nul == std::string::npos) return {};
  std::string shown;
  for (char c : path) shown += c == '\0' ? std::string("\\0") : std::string(1, c);
  return error::at_file(shown,
                        "the " + std::string(what) + " path holds a NUL byte at position " +
                            std::to_string(nul) + ", which would cut it short",
                        "remove the \\u0000 (or \\0) from the path");
}

result<input_file> open_input(const std::string& path, const input_spec& spec) {
  if (auto st = check_path_text(path, spec.what); !st) return st.err();
  if (path.empty())
    return error::make("empty path for the " + spec.what, with_hint(spec));
  // stat first: it never blocks, whereas open() of a FIFO waits for a writer.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int e = errno;
    if (e == ENOENT || e == ENOTDIR)
      return error::at_file(path, "cannot open the " + spec.what + ": it does not exist",
                            with_hint(spec, cwd_note()));
    return error::at_file(path, "cannot read the " + spec.what + ": " + errno_text(e),
                          with_hint(spec, "check the path and its permissions"));
  }
  if (!S_ISREG(st.st_mode)) return not_regular(path, spec, st.st_mode);
  // O_NONBLOCK: should the path have become a FIFO since the stat, open returns at once.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0)
    return error::at_file(path, "cannot open the " + spec.what + ": " + errno_text(errno),
                          with_hint(spec, "check the path and its permissions"));
  input_file f;
  f.fd_ = fd;
  f.path_ = path;
  if (::fstat(fd, &st) != 0)
    return error::at_file(path, "cannot read the " + spec.what + ": " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) return not_regular(path, spec, st.st_mode);
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  f.size_ = static_cast<std::uint64_t>(st.st_size);
  if (f.size_ > spec.max_bytes)
    return error::at_file(path,
                          "the " + spec.what + " is " + size_text(f.size_) + "; a " + spec.what +
                              " is at most " + size_text(spec.max_bytes),
                          with_hint(spec, "is this the right file?"));
  return f;
}

result<std::string> read_input(const std::string& path, const input_spec& spec) {
  auto f = open_input(path, spec);
  if (!f) return f.err();
  std::string out;
  out.resize(static_cast<std::size_t>(f->size()));
  std::size_t got = 0;
  for (;;) {
    if (got == out.size()) {
      // The file may have grown since fstat: read on, but never past the limit.
      if (out.size() >= spec.max_bytes) {
        char probe;
        const ssize_t more = ::read(f->fd(), &probe, 1);
        if (more > 0)
          return error::at_file(path, "the " + spec.what + " grew past " + size_text(spec.max_bytes) +
                                          " while it was read",
                                with_hint(spec));
        break;
      }
      out.resize(std::min<std::uint64_t>(spec.max_bytes, out.size() + 65536));
    }
    const ssize_t n = ::read(f->fd(), out.data() + got, out.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      return error::at_file(path, "cannot read the " + spec.what + ": " + errno_text(errno),
                            with_hint(spec));
    }
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  out.resize(got);
  return out;
}

status fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return error::at_file(dir, "cannot open the folder: " + errno_text(errno));
  const int rc = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  if (rc != 0) return error::at_file(dir, "fsync failed: " + errno_text(e), "check the file system");
  return {};
}

status write_file_synced(const std::string& path, std::string_view text) {
  if (auto st = check_path_text(path, "output"); !st) return st;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    return error::at_file(path, "cannot create: " + errno_text(errno),
                          "check that the folder exists and is writable");
  status st = write_all(fd, text.data(), text.size(), path);
  if (st && ::fsync(fd) != 0)
    st = error::at_file(path, "fsync failed: " + errno_text(errno), "check the file system");
  if (::close(fd) != 0 && st)
    st = error::at_file(path, "close failed: " + errno_text(errno), "check the file system");
  return st;
}

status write_file_atomic(const std::string& path,
                         std::span<const std::span<const std::byte>> parts) {
  if (auto st = check_path_text(path, "output"); !st) return st;
  // rename() cannot replace a folder; say so before writing anything.
  if (struct stat st {}; ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    return error::at_file(path, "cannot create: a folder of that name is in the way",
                          "remove or rename the folder");
  static std::atomic<unsigned> counter{0};
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." +
                          std::to_string(counter.fetch_add(1));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0)
    return error::at_file(tmp, "cannot create: " + errno_text(errno),
                          "check that the output folder exists and is writable");
  auto fail = [&](status s) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  };
  for (const auto& part : parts)
    if (auto st = write_all(fd, part.data(), part.size(), tmp); !st) return fail(st);
  if (::fsync(fd) != 0)
    return fail(error::at_file(tmp, "fsync failed: " + errno_text(errno), "check the file system"));
  if (::close(fd) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    return error::at_file(tmp, "close failed: " + errno_text(e), "check the file system");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    return error::at_file(path, "cannot rename " + tmp + " into place: " + errno_text(e),
                          "check that the output folder is writable");
  }
  return fsync_dir(fs::path(path).parent_path().string());
}

status write_file_atomic(const std::string& path, std::string_view text) {
  const std::span<const std::byte> one(reinterpret_cast<const std::byte*>(text.data()), text.size());
  return write_file_atomic(path, std::span<const std::span<const std::byte>>(&one, 1));
}

result<sealed_file> sealed_file::create(const std::string& path, std::string_view head,
                                        std::string_view tail) {
  if (auto st = check_path_text(path, "output"); !st) return st.err();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    return error::at_file(path, "cannot create: " + errno_text(errno),
                          "check that the folder exists and is writable");
  sealed_file f;
  f.fd_ = fd;
  f.path_ = path;
  f.tail_ = std::string(tail);
  if (auto st = f.append(head); !st) return st.err();
  return f;
}

result<sealed_file> sealed_file::reopen(const std::string& path, std::uint64_t keep,
                                        std::string_view tail) {
  if (auto st = check_path_text(path, "output"); !st) return st.err();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    return error::at_file(path, "cannot open: " + errno_text(errno),
                          "check that the folder exists and is writable");
  sealed_file f;
  f.fd_ = fd;
  f.path_ = path;
  f.tail_ = std::string(tail);
  f.committed_ = keep;
  if (auto st = f.append({}); !st) return st.err();
  return f;
}

sealed_file::sealed_file(sealed_file&& o) noexcept
    : fd_(std::exchange(o.fd_, -1)),
      committed_(o.committed_),
      tail_(std::move(o.tail_)),
      path_(std::move(o.path_)) {}

sealed_file& sealed_file::operator=(sealed_file&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = std::exchange(o.fd_, -1);
    committed_ = o.committed_;
    tail_ = std::move(o.tail_);
    path_ = std::move(o.path_);
  }
  return *this;
}

sealed_file::~sealed_file() { close(); }

void sealed_file::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

status sealed_file::append(std::string_view bytes) {
  if (fd_ < 0) return error::at_file(path_, "write after close");
  // One write of the new bytes and the tail, so that the file ends in the tail between any two
  // system calls; then drop whatever lay beyond (only when the tail shrank, which it does not).
  const append_in_flight guard;
  std::string block;
  block.reserve(bytes.size() + tail_.size());
  block.append(bytes);
  block.append(tail_);
  if (auto st = pwrite_all(fd_, block.data(), block.size(), committed_, path_); !st) return st;
  committed_ += bytes.size();
  // EINVAL: a device or FIFO (a link to one), which has nothing beyond to drop.
  if (::ftruncate(fd_, static_cast<off_t>(committed_ + tail_.size())) != 0 && errno != EINVAL)
    return error::at_file(path_, "cannot truncate: " + errno_text(errno));
  return {};
}

}  // namespace troupe::core
