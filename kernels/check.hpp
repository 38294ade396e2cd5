// Argument checks of the ops, shared by the CPU and CUDA backends. A failed check throws
// core::failure naming the op and what was expected. op_check (the CPU ops) adds every argument's
// dtype and shape, e.g.
//   "layernorm_forward: w must be [C] = [8] (C = last dim of x); got x fp32 [4, 8], w fp32 [7],
//   ..."
// so that a wrong call is diagnosed from the message alone; the one-condition checks below it
// (the CUDA ops, whose op names start with "cuda ") name the operand at fault.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/tensor.hpp"

namespace troupe::kernels {

class op_check {
 public:
  using arg = std::pair<const char*, const core::tensor*>;

  op_check(const char* op, std::initializer_list<arg> args) : op_(op), args_(args) {}

  /// Throws unless `cond`, with `expectation` and the argument list.
  void require(bool cond, const std::string& expectation) const {
    if (!cond) fail(expectation);
  }

  [[noreturn]] void fail(const std::string& expectation) const {
    std::string msg = std::string(op_) + ": " + expectation + "; got";
    for (std::size_t i = 0; i < args_.size(); ++i) {
      const auto& [name, t] = args_[i];
      msg += (i ? ", " : " ") + std::string(name) + " ";
      if (!t->defined()) {
        msg += "undefined";
        continue;
      }
      msg += std::string(core::dtype_name(t->type())) + " " + core::shape_string(t->shape());
      if (!t->dev().is_cpu()) msg += " on " + t->dev().to_string();
    }
    throw core::failure(msg +
                        " (the cpu backend takes contiguous host tensors; see "
                        "kernels/backend.hpp for each op's shapes)");
  }

  /// `t` is defined, on the host and of type `type`.
  void host(const core::tensor& t, const char* name, core::dtype type) const {
    require(t.defined(), std::string(name) + " must be defined");
    require(t.dev().is_cpu(), std::string(name) + " must be a host tensor");
    require(t.type() == type, std::string(name) + " must be " + core::dtype_name(type));
  }

  /// Like host(), but an undefined tensor is allowed (optional argument).
  void optional(const core::tensor& t, const char* name, core::dtype type) const {
    if (t.defined()) host(t, name, type);
  }

  /// Every argument is a host fp32 tensor, and each but `ref` has as many elements as `ref` (the
  /// checks of an elementwise op).
  void elementwise(const core::tensor& ref, const char* ref_name) const {
    for (const auto& [name, t] : args_) host(*t, name, core::dtype::f32);
    for (const auto& [name, t] : args_)
      if (t != &ref)
        numel(*t, name, ref.numel(), std::string("as many elements as ") + ref_name);
  }

  /// `t` has exactly `shape`.
  void shape(const core::tensor& t, const char* name, const core::shape_t& shape,
             const std::string& meaning) const {
    require(t.shape() == shape,
            std::string(name) + " must be " + core::shape_string(shape) + " (" + meaning + ")");
  }

  /// `t` has `numel` elements, whatever its rank.
  void numel(const core::tensor& t, const char* name, std::int64_t numel,
             const std::string& meaning) const {
    require(t.numel() == numel, std::string(name) + " must have " + std::to_string(numel) +
                                    " elements (" + meaning + ")");
  }

  /// `t` is [rows, cols] seen as rows of its last dimension: rank >= 1, last dim `cols`, and
  /// `rows` rows in all. Returns nothing; use rows_of() to read the row count.
  void matrix(const core::tensor& t, const char* name, std::int64_t rows, std::int64_t cols,
              const std::string& meaning) const {
    require(t.rank() >= 1 && t.dim(-1) == cols && t.numel() == rows * cols,
            std::string(name) + " must be [" + std::to_string(rows) + ", " + std::to_string(cols) +
                "] (" + meaning + ")");
  }

 private:
  const char* op_;
  std::vector<arg> args_;
};

/// Rows of `t` seen as a matrix over its last dimension (0 for an empty tensor).
inline std::int64_t rows_of(const core::tensor& t) {
  return t.rank() == 0 || t.dim(-1) == 0 ? 0 : t.numel() / t.dim(-1);
}

// ---- one-condition checks -----------------------------------------------------------------------

inline bool is_float(core::dtype t) {
  return t == core::dtype::f32 || t == core::dtype::bf16 || t == core::dtype::f16;
}

/// Throws core::failure "<op>: <msg>" when `cond` is false.
inline void require(bool cond, const char* op, const std::string& msg) {
  if (!cond) throw core::failure(std::string(op) + ": " + msg);
}

/// `t` is a defined fp32, bf16 or fp16 tensor.
inline void require_float(const core::tensor& t, const char* op, const char* name) {
  require(t.defined() && is_float(t.type()), op,
          std::string(name) + " must be a defined fp32/bf16/fp16 tensor, got " +
              (t.defined() ? core::dtype_name(t.type()) : "undefined"));
}

/// `t` is a defined tensor of type `want`.
inline void require_type(const core::tensor& t, core::dtype want, const char* op,
                         const char* name) {
  require(t.defined() && t.type() == want, op,
          std::string(name) + " must be " + core::dtype_name(want) + ", got " +
              (t.defined() ? core::dtype_name(t.type()) : "undefined"));
}

/// `t` has `n` elements, whatever its shape.
inline void require_numel(const core::tensor& t, std::int64_t n, const char* op,
                          const char* name) {
  require(t.numel() == n, op,
          std::string(name) + " has shape " + core::shape_string(t.shape()) + ", expected " +
              std::to_string(n) + " elements");
}

/// The checks of an elementwise op on any float dtype: `ref` is a defined fp32/bf16/fp16 tensor
/// and every operand in `others` has its dtype and its element count.
inline void require_like(const core::tensor& ref, const char* ref_name,
                         std::initializer_list<std::pair<const char*, const core::tensor*>> others,
                         const char* op) {
  require_float(ref, op, ref_name);
  for (const auto& [name, t] : others) {
    require_type(*t, ref.type(), op, name);
    require_numel(*t, ref.numel(), op, name);
  }
}

}  // namespace troupe::kernels
