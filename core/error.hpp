// Errors as values. A troupe error says what went wrong, where (file, key, line, column, rank) and
// what to do about it; `result<T>` carries either a value or such an error. Libraries return
// results; the CLI prints them and exits non-zero. Kernels and actors, whose failures are bugs or
// faults rather than user input, throw `troupe::core::failure` instead, which the actor runtime
// catches and reports with the rank and instruction.
#pragma once

#include <cassert>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

namespace troupe::core {

/// Where an error was found; every field is optional.
struct location {
  std::string file;
  std::string key;     // dotted config key, tensor name, ...
  int line = 0;        // 1-based; 0 = unknown
  int column = 0;      // 1-based; 0 = unknown
  int rank = -1;       // -1 = not rank-specific
};

/// A user-facing error: message, location and a hint.
struct error {
  std::string message;
  location where;
  std::string hint;

  static error make(std::string message, std::string hint = {}) {
    return error{std::move(message), {}, std::move(hint)};
  }
  static error at_file(std::string file, std::string message, std::string hint = {}) {
    error e{std::move(message), {}, std::move(hint)};
    e.where.file = std::move(file);
    return e;
  }
  static error at_key(std::string file, std::string key, int line, int column, std::string message,
                      std::string hint = {}) {
    return error{std::move(message), location{std::move(file), std::move(key), line, column, -1},
                 std::move(hint)};
  }

  /// "file:line:col: key: message (hint: ...)" with the absent parts left out.
  std::string to_string() const;
};

/// Thrown by kernels and runtime code for faults that are not user input (bad shapes, CUDA errors).
class failure : public std::runtime_error {
 public:
  explicit failure(const std::string& what) : std::runtime_error(what) {}
};

/// Either a T or an error. REQUIRES: value() only when ok(), err() only when !ok().
template <class T>
class result {
 public:
  result(T value) : v_(std::move(value)) {}
  result(error e) : v_(std::move(e)) {}

  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { assert(ok()); return std::get<0>(v_); }
  const T& value() const& { assert(ok()); return std::get<0>(v_); }
  T&& value() && { assert(ok()); return std::get<0>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const error& err() const { assert(!ok()); return std::get<1>(v_); }

 private:
  std::variant<T, error> v_;
};

/// A result without a value.
class status {
 public:
  status() = default;
  status(error e) : e_(std::move(e)) {}
  static status success() { return {}; }
  bool ok() const { return !e_.has_value(); }
  explicit operator bool() const { return ok(); }
  const error& err() const { assert(!ok()); return *e_; }

 private:
  std::optional<error> e_;
};

}  // namespace troupe::core

/// Throws troupe::core::failure with file:line when `cond` is false; for invariants that depend on
/// data (shapes, sizes), not for user input.
#define TROUPE_CHECK(cond, msg)                                                               \
  do {                                                                                        \
    if (!(cond))                                                                              \
      throw ::troupe::core::failure(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                                    ": check failed: " #cond ": " + (msg));                   \
  } while (0)
