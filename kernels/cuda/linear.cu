// Linear layers through cuBLASLt: y = x·wᵀ (+ b), dx += dy·w, dw += dyᵀ·x, db += Σ_rows dy.
// Row-major tensors are seen by cuBLASLt (column-major) as their transposes, so y = x·wᵀ becomes
// yᵀ[OC,N] = w[IC,OC]ᵀ·xᵀ[IC,N] with no copies. Compute is always fp32 (CUBLAS_COMPUTE_32F: true fp32
// for fp32 inputs, no TF32, so fp32 results match the CPU reference; fp32 accumulation for bf16/fp16).
// The bias rides on the GEMM epilogue when it has the output's dtype (one pass over y instead of
// two); db is a deterministic column sum (column_sum.cuh). dw may be fp32 while dy and x are bf16:
// cuBLASLt writes fp32 C from bf16 A/B, which is how fp32 weight gradients of a bf16 model are kept.
// Backward GEMMs use beta = 1 to accumulate in place, as the backend contract requires; the
// "write" variants use beta = 0 and so need no zeroed output.
//
// Fused variants (backend.hpp): a residual add rides on C (D = A·B + bias + 1·R, R read as C, D
// written elsewhere); GELU rides on the epilogue for 16-bit activations: GELU_AUX_BIAS writes
// gelu(x·wᵀ + b) and, as its aux matrix, the pre-activation; DGELU multiplies dy·w by gelu'(aux).
// cuBLASLt's GELU is the tanh approximation GPT-2 uses (PyTorch's _addmm_activation relies on it
// for gelu(approximate='tanh'), pytorch/pytorch#104061); its aux leading dimension must be a
// multiple of 8. fp32 keeps the exact kernels of gelu.cu instead (the epilogue's tanh is not
// within the 1e-5 agreement with the CPU reference that fp32 promises), and so does any case
// the heuristic has no fused algorithm for, and every case after set_gelu_epilogue(false).
//
// Padded rows (backend.hpp, logits_width): the LM head's logits are [N, W] with W the vocabulary
// rounded up to a multiple of 64. cuBLASLt picks slow kernels (no TMA) when m or k is odd, even
// with aligned leading dimensions (bench/gpu_gemm_bench --ld-align), so a padded forward or input
// gradient runs two GEMMs: the vocabulary's first multiple of 64 rows, then the few rows left (17
// of GPT-2's 50,257); the weight gradient, where the vocabulary is n, needs only the aligned
// leading dimension. The forward sets the padding columns to −∞.
//
// A plan (descriptors + the heuristic's algorithm) is cached per shape, layout, dtype and pointer
// alignment: a training step repeats a dozen shapes, and the heuristic costs microseconds. Without
// atomics in any chosen algorithm (cuBLASLt uses none unless asked), results are run-to-run identical.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include "kernels/cuda/column_sum.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_context.hpp"
#include "kernels/cuda/gelu.cuh"
#include "kernels/cuda/gemm_tuning.hpp"

namespace troupe::kernels::cuda {

// ------------------------------------------------------------------------------------------------
// CUDA kernels

/// y[r, c] += b[c], for a bias whose dtype differs from y's (no epilogue for that pair).
__global__ void add_bias_kernel(void* y, int yc, const void* b, int bc, std::int64_t rows,
                                int cols) {
  const std::int64_t n = rows * cols;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    store_f(y, yc, i, load_f(y, yc, i) + load_f(b, bc, i % cols));
}

struct bias_terms {
  const void* dy;
  int code;
  int cols;
  __device__ void operator()(std::int64_t r, int c, float (&acc)[1]) const {
    acc[0] += load_f(dy, code, r * cols + c);
  }
};

/// y[r, c] = −∞ for c in [from, width): the padding columns of padded rows.
template <class T>
__global__ void fill_padding_kernel(T* y, std::int64_t rows, int from, int width) {
  const int pad = width - from;
  const std::int64_t total = rows * pad;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    y[(i / pad) * width + from + i % pad] = from_f<T>(-INFINITY);
}

/// bias_terms for V adjacent columns, loaded 16 bytes at a time (column_partial_vec_kernel): the
/// same additions, about twice as fast.
template <class T, int V>
struct bias_vec_terms {
  static constexpr int rows_in_flight = 4;
  struct slot {
    pack<T, V> p;
  };
  const T* dy;
  int cols;
  __device__ void load(std::int64_t r, int c, slot& s) const {
    s.p = *reinterpret_cast<const pack<T, V>*>(dy + r * cols + c);
  }
  __device__ void add(const slot& s, float (&acc)[V]) const {
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] += to_f(s.p.v[k]);
  }
};

// ------------------------------------------------------------------------------------------------
// the backend's methods

namespace {

/// db += Σ_rows dy (db = Σ_rows dy with `write`) over a dense [rows, cols] dy: the vectorised
/// partial kernel when dy moves in 16-byte packs, the generic column_sums otherwise; both then
/// finish with column_finish_kernel (the same chunks, the same order, the same bits).
void bias_gradient(context& ctx, const tensor& dy, std::int64_t rows, int cols, tensor& db,
                   bool write) {
  bool done = false;
  dispatch_float(dy.type(), "cuda linear_backward_weight", [&](auto tag) {
    using T = decltype(tag);
    with_row_vector<T>({&dy}, cols, [&](auto v) {
      constexpr int V = decltype(v)::value;
      if constexpr (V > 1) {
        column_sums_vec<V>(ctx, bias_vec_terms<T, V>{dy.data<T>(), cols}, rows, cols, db.raw(),
                           code_of(db.type()), write);
        done = true;
      }
    });
  });
  if (done) return;
  bias_terms f{dy.raw(), code_of(dy.type()), cols};
  void* const outs[1] = {db.raw()};
  const int codes[1] = {code_of(db.type())};
  column_sums<1>(ctx, f, rows, cols, outs, codes, write);
}

cudaDataType_t cuda_type(dtype t) {
  switch (t) {
    case dtype::f32: return CUDA_R_32F;
    case dtype::bf16: return CUDA_R_16BF;
    case dtype::f16: return CUDA_R_16F;
    default: break;
  }
  throw core::failure(std::string("cuda linear: unsupported dtype ") + core::dtype_name(t));
}

std::int64_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::int64_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

/// One column-major GEMM D = alpha·op(A)·op(B) + beta·C (+ bias over the m rows, + an activation
/// epilogue); C is D unless c_in is set.
struct gemm_call {
  bool trans_a = false, trans_b = false;
  std::int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  dtype a_type = dtype::f32;
  std::int64_t lda = 0;
  const void* b = nullptr;
  dtype b_type = dtype::f32;
  std::int64_t ldb = 0;
  void* c = nullptr;
  dtype c_type = dtype::f32;
  std::int64_t ldc = 0;
  float beta = 0;
  const void* bias = nullptr;  // length m, dtype c_type
  const void* c_in = nullptr;  // C when it is not D (beta != 0): a residual read, D written
  enum class act { none, gelu, dgelu } epilogue = act::none;
  void* aux = nullptr;         // gelu: pre-activation written; dgelu: read. m×n, ld = ldc
};

/// Flags of a call that select a different plan: transposes, epilogue, beta, aux and C alignment.
std::int64_t plan_flags(const gemm_call& g) {
  return (g.trans_a ? 1 : 0) | (g.trans_b ? 2 : 0) | (g.bias ? 4 : 0) | (g.beta != 0 ? 8 : 0) |
         static_cast<std::int64_t>(g.epilogue) << 4 |
         (g.aux ? alignment_of(g.aux) : 0) << 8 | (g.c_in ? alignment_of(g.c_in) : 0) << 20;
}

// Process-wide switches of the benchmarks (cuda_backend.hpp): plan logging and the GELU epilogues.
std::atomic<bool> gemm_log{false};
std::atomic<bool> gelu_epilogue{true};

void log_plan(const gemm_call& g, const cublasLtMatmulAlgo_t& a) {
  std::fprintf(stderr,
               "gemm plan: m %lld n %lld k %lld ta %d tb %d A %s B %s C %s beta %g bias %d epi %d "
               "align a %lld b %lld c %lld | algo %s\n",
               static_cast<long long>(g.m), static_cast<long long>(g.n),
               static_cast<long long>(g.k), g.trans_a, g.trans_b, core::dtype_name(g.a_type),
               core::dtype_name(g.b_type), core::dtype_name(g.c_type), g.beta, g.bias != nullptr,
               static_cast<int>(g.epilogue), static_cast<long long>(alignment_of(g.a)),
               static_cast<long long>(alignment_of(g.b)), static_cast<long long>(alignment_of(g.c)),
               gemm_tuning::describe(a).c_str());
}

// Keys the heuristic found no algorithm for (fused epilogues only: the callers fall back to the
// unfused kernels). Shared by all contexts: support depends on the key and the GPU, not the stream.
std::mutex unsupported_mutex;
std::set<gemm_key> unsupported_keys;

/// The GEMM's line key in the tuning file: GPU name and multiprocessor count, cuBLASLt version,
/// then the plan key (no spaces).
std::string tuning_key(const context& ctx, const gemm_key& key) {
  static std::mutex mu;
  static std::map<int, std::string> names;
  std::string device;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = names.find(ctx.device);
    if (it == names.end()) {
      cudaDeviceProp prop{};
      TROUPE_CUDA_CHECK(cudaGetDeviceProperties(&prop, ctx.device));
      std::string name = prop.name;
      for (char& c : name)
        if (c == ' ' || c == '|') c = '_';
      it = names.emplace(ctx.device, name + "_sm" + std::to_string(ctx.sm_count)).first;
    }
    device = it->second;
  }
  std::string out = device + "|lt" + std::to_string(cublasLtGetVersion()) + "|";
  for (std::size_t i = 0; i < key.v.size(); ++i) out += (i ? "," : "") + std::to_string(key.v[i]);
  return out;
}

/// Times each heuristic candidate of plan p on g's own operands (an in-place accumulation runs on
/// a scratch copy of D, so g.c keeps its value) and returns the fastest; runs once per GEMM, when
/// the tuning file has no entry for it (gemm_tuning.hpp).
std::optional<gemm_tuning::choice> measure_candidates(context& ctx, const gemm_call& g,
                                                      const gemm_plan& p,
                                                      const cublasLtMatmulHeuristicResult_t* cands,
                                                      int count) {
  const bool in_place = g.beta != 0 && !g.c_in;
  const std::size_t d_bytes =
      static_cast<std::size_t>(g.ldc) * static_cast<std::size_t>(g.n) * core::dtype_size(g.c_type);
  std::optional<scratch> copy;
  void* d = g.c;
  const void* c_in = g.c_in ? g.c_in : g.c;
  if (in_place) {
    copy.emplace(ctx, d_bytes);
    TROUPE_CUDA_CHECK(cudaMemcpyAsync(copy->as<void>(), g.c, d_bytes, cudaMemcpyDeviceToDevice,
                                      ctx.stream));
    d = copy->as<void>();
    c_in = d;
  }
  cudaEvent_t e0, e1;
  TROUPE_CUDA_CHECK(cudaEventCreate(&e0));
  TROUPE_CUDA_CHECK(cudaEventCreate(&e1));
  const float alpha = 1.0f;
  std::optional<gemm_tuning::choice> best;
  for (int i = 0; i < count; ++i) {
    auto run = [&] {
      return cublasLtMatmul(ctx.lt, p.desc, &alpha, g.a, p.la, g.b, p.lb, &g.beta, c_in, p.lc, d,
                            p.lc, &cands[i].algo, ctx.workspace, ctx.workspace_bytes, ctx.stream);
    };
    if (run() != CUBLAS_STATUS_SUCCESS) continue;  // the candidate does not run here: skip it
    constexpr int reps = 5, rounds = 3;
    double ms = 1e30;
    for (int r = 0; r < rounds; ++r) {
      TROUPE_CUDA_CHECK(cudaEventRecord(e0, ctx.stream));
      for (int k = 0; k < reps; ++k) run();
      TROUPE_CUDA_CHECK(cudaEventRecord(e1, ctx.stream));
      TROUPE_CUDA_CHECK(cudaEventSynchronize(e1));
      float t = 0;
      TROUPE_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
      ms = std::min(ms, static_cast<double>(t) / reps);
    }
    if (!best || ms < best->ms) best = gemm_tuning::choice{cands[i].algo, ms};
  }
  TROUPE_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));  // the scratch copy is free to go
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  TROUPE_CUDA_CHECK(cudaGetLastError());
  return best;
}

/// The plan of g; nullptr when `optional` and cuBLASLt has no algorithm for it (else throws).
gemm_plan* plan_for(context& ctx, const gemm_call& g, bool optional) {
  gemm_key key;
  key.v = {g.m,
           g.n,
           g.k,
           plan_flags(g),
           static_cast<std::int64_t>(g.a_type) | static_cast<std::int64_t>(g.b_type) << 8 |
               static_cast<std::int64_t>(g.c_type) << 16,
           g.lda,
           g.ldb,
           g.ldc,
           alignment_of(g.a),
           alignment_of(g.b),
           alignment_of(g.c),
           g.bias ? alignment_of(g.bias) : 0};
  auto found = ctx.gemm_plans.find(key);
  if (found != ctx.gemm_plans.end()) return &found->second;
  if (optional) {
    std::lock_guard<std::mutex> lock(unsupported_mutex);
    if (unsupported_keys.count(key)) return nullptr;
  }

  gemm_plan p;
  TROUPE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  TROUPE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  TROUPE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  cublasLtEpilogue_t epi = g.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  if (g.epilogue == gemm_call::act::gelu)
    epi = g.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  else if (g.epilogue == gemm_call::act::dgelu)
    epi = CUBLASLT_EPILOGUE_DGELU;
  if (epi != CUBLASLT_EPILOGUE_DEFAULT)
    TROUPE_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  if (g.bias)
    TROUPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &g.bias, sizeof(g.bias)));
  if (g.epilogue != gemm_call::act::none) {
    // The aux matrix has D's shape and dtype (the default aux type) and D's leading dimension.
    TROUPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof(g.aux)));
    const std::int64_t aux_ld = g.ldc;
    TROUPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
  }
  // Stored shapes: op(A) is m×k, so A is k×m when transposed.
  TROUPE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.la, cuda_type(g.a_type), g.trans_a ? g.k : g.m,
                                                 g.trans_a ? g.m : g.k, g.lda));
  TROUPE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lb, cuda_type(g.b_type), g.trans_b ? g.n : g.k,
                                                 g.trans_b ? g.k : g.n, g.ldb));
  TROUPE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lc, cuda_type(g.c_type), g.m, g.n, g.ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  TROUPE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  TROUPE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ctx.workspace_bytes,
      sizeof(ctx.workspace_bytes)));
  // The heuristic assumes 256-byte aligned buffers unless told otherwise; views into flat buffers
  // (a slice of qkv, a parameter at an offset) can be less aligned.
  const std::uint32_t al_a = static_cast<std::uint32_t>(alignment_of(g.a));
  const std::uint32_t al_b = static_cast<std::uint32_t>(alignment_of(g.b));
  const std::uint32_t al_c = static_cast<std::uint32_t>(alignment_of(g.c_in ? g.c_in : g.c));
  const std::uint32_t al_d = static_cast<std::uint32_t>(alignment_of(g.c));
  TROUPE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
  TROUPE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
  TROUPE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
  TROUPE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)));
  // With a tuning file, the heuristic's top candidates are kept to be measured (once per GEMM).
  const bool tuning = !gemm_tuning::file_path().empty();
  constexpr int max_candidates = 8;
  cublasLtMatmulHeuristicResult_t results[max_candidates] = {};
  int found_count = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(ctx.lt, p.desc, p.la, p.lb, p.lc, p.lc, pref,
                                     tuning ? max_candidates : 1, results, &found_count);
  cublasLtMatmulPreferenceDestroy(pref);
  if ((st != CUBLAS_STATUS_SUCCESS || found_count == 0) && optional) {
    cublasLtMatrixLayoutDestroy(p.la);
    cublasLtMatrixLayoutDestroy(p.lb);
    cublasLtMatrixLayoutDestroy(p.lc);
    cublasLtMatmulDescDestroy(p.desc);
    std::lock_guard<std::mutex> lock(unsupported_mutex);
    unsupported_keys.insert(key);
    return nullptr;
  }
  if (st != CUBLAS_STATUS_SUCCESS || found_count == 0)
    throw core::failure("cuda linear: cuBLASLt has no algorithm for m=" + std::to_string(g.m) +
                        " n=" + std::to_string(g.n) + " k=" + std::to_string(g.k) + " A " +
                        core::dtype_name(g.a_type) + " B " + core::dtype_name(g.b_type) + " C " +
                        core::dtype_name(g.c_type) + " (status " + cublasGetStatusName(st) +
                        "; hint: dtypes of x and w must match)");
  p.algo = results[0].algo;
  if (tuning && found_count > 1) {
    const std::optional<cublasLtMatmulAlgo_t> tuned = gemm_tuning::lookup_or_tune(
        tuning_key(ctx, key), [&] { return measure_candidates(ctx, g, p, results, found_count); });
    cublasLtMatmulHeuristicResult_t check{};
    if (tuned && cublasLtMatmulAlgoCheck(ctx.lt, p.desc, p.la, p.lb, p.lc, p.lc, &*tuned,
                                         &check) == CUBLAS_STATUS_SUCCESS)
      p.algo = *tuned;
  }
  if (gemm_log.load()) log_plan(g, p.algo);
  return &ctx.gemm_plans.emplace(key, p).first->second;
}

/// Runs g; with `optional`, returns false instead of throwing when no algorithm supports it.
bool gemm(context& ctx, const gemm_call& g, bool optional = false) {
  if (g.m == 0 || g.n == 0) return true;
  gemm_plan* p = plan_for(ctx, g, optional);
  if (!p) return false;
  if (g.bias)
    TROUPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &g.bias, sizeof(g.bias)));
  if (g.epilogue != gemm_call::act::none)
    TROUPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof(g.aux)));
  const float alpha = 1.0f;
  const void* c_in = g.c_in ? g.c_in : g.c;
  TROUPE_CUBLAS_CHECK(cublasLtMatmul(ctx.lt, p->desc, &alpha, g.a, p->la, g.b, p->lb, &g.beta,
                                     c_in, p->lc, g.c, p->lc, &p->algo, ctx.workspace,
                                     ctx.workspace_bytes, ctx.stream));
  return true;
}

/// The GEMM of a row-major product, seen column-major (file comment): D (m×n) = op(A)·op(B) +
/// beta·C over dense operands, so the leading dimensions follow from the shape (A is m×k, or k×m
/// stored when transposed; likewise B; C and D have m rows).
gemm_call dense_gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                     const tensor& a, const tensor& b, const tensor& c, float beta) {
  gemm_call g;
  g.trans_a = trans_a;
  g.trans_b = trans_b;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a.raw();
  g.a_type = a.type();
  g.lda = trans_a ? k : m;
  g.b = b.raw();
  g.b_type = b.type();
  g.ldb = trans_b ? n : k;
  g.c = c.raw();
  g.c_type = c.type();
  g.ldc = m;
  g.beta = beta;
  return g;
}

/// Padded rows are padded to a multiple of this (backend.hpp, logits_width).
constexpr std::int64_t padding_multiple = 64;

/// The row width of y or dy for a weight of `oc` output rows: oc, or W > oc for padded rows.
std::int64_t padded_width(const tensor& t, std::int64_t oc) {
  return t.rank() == 2 && t.dim(1) > oc ? t.dim(1) : oc;
}

void check_matrix(const tensor& w, const char* op) {
  require_float(w, op, "w");
  require(w.rank() == 2, op, "w must be [out, in], got " + core::shape_string(w.shape()));
}

/// Checks y = x·wᵀ (+ b) and returns its GEMM (bias fused when it has y's dtype); N in `rows`.
gemm_call forward_call(const char* op, const tensor& x, const tensor& w, const tensor& b,
                       const tensor& y, std::int64_t& rows) {
  check_matrix(w, op);
  const std::int64_t OC = w.dim(0), IC = w.dim(1);
  require_float(x, op, "x");
  require_type(x, w.type(), op, "x (must match w)");
  require(x.dim(-1) == IC, op,
          "x " + core::shape_string(x.shape()) + " does not match w " +
              core::shape_string(w.shape()));
  const std::int64_t N = rows_of(x);
  require_float(y, op, "y");
  const std::int64_t W = padded_width(y, OC);
  require_numel(y, N * W, op, "y");
  if (b.defined()) {
    require(W == OC, op, "padded rows (y " + core::shape_string(y.shape()) + " for w " +
                             core::shape_string(w.shape()) + ") take no bias");
    require_float(b, op, "b");
    require_numel(b, OC, op, "b");
  }
  rows = N;
  gemm_call g = dense_gemm(true, false, OC, N, IC, w, x, y, 0);
  g.ldc = W;
  g.bias = b.defined() && b.type() == y.type() ? b.raw() : nullptr;
  return g;
}

/// The aligned part of a padded dimension: its largest multiple of 64 (file comment).
std::int64_t aligned_part(std::int64_t d) { return d / padding_multiple * padding_multiple; }

/// g over the rows [from, from + count) of the dimension `dim` ('m' or 'k') of a padded call:
/// the operands offset to those rows (A's rows are w's: lda elements each when A is transposed;
/// B is the padded matrix, its rows contiguous within a padded row; C's rows likewise).
gemm_call rows_of_call(const gemm_call& g, char dim, std::int64_t from, std::int64_t count,
                       float beta) {
  gemm_call p = g;
  auto at = [](const void* base, std::int64_t elems, dtype t) {
    return static_cast<const char*>(base) + elems * static_cast<std::int64_t>(core::dtype_size(t));
  };
  if (dim == 'm') {  // forward: A = w transposed (w's row from is at from·lda), C columns
    p.m = count;
    p.a = at(g.a, from * g.lda, g.a_type);
    p.c = const_cast<char*>(at(g.c, from, g.c_type));
  } else {  // input gradient: A = w (its row from at column from of the col-major A), B = dy
    p.k = count;
    p.a = at(g.a, from * g.lda, g.a_type);
    p.b = at(g.b, from, g.b_type);
  }
  p.beta = beta;
  return p;
}

/// Runs g, splitting its padded dimension (m or k, of size `d`) into an aligned part and the rest.
void padded_gemm(context& ctx, const gemm_call& g, char dim, std::int64_t d) {
  const std::int64_t head = aligned_part(d);
  if (head > 0) gemm(ctx, rows_of_call(g, dim, 0, head, g.beta));
  if (head < d) gemm(ctx, rows_of_call(g, dim, head, d - head, head > 0 && dim == 'k' ? 1.0f : g.beta));
}

/// y += b for a bias the GEMM did not fuse (its dtype differs from y's).
void add_unfused_bias(context& ctx, const gemm_call& g, const tensor& b, tensor& y) {
  if (!b.defined() || g.bias) return;
  add_bias_kernel<<<grid_for(g.n * g.m, 256), 256, 0, ctx.stream>>>(
      y.raw(), code_of(y.type()), b.raw(), code_of(b.type()), g.n, static_cast<int>(g.m));
  TROUPE_CUDA_CHECK_LAUNCH();
}

/// Checks dx (+)= dy·w and returns its GEMM with the given beta.
gemm_call backward_input_call(const char* op, const tensor& dy, const tensor& w, const tensor& dx,
                              float beta) {
  check_matrix(w, op);
  const std::int64_t OC = w.dim(0), IC = w.dim(1);
  require_type(dy, w.type(), op, "dy (must match w)");
  require(dy.dim(-1) >= OC, op,
          "dy " + core::shape_string(dy.shape()) + " does not match w " +
              core::shape_string(w.shape()));
  const std::int64_t N = rows_of(dy);
  require_float(dx, op, "dx");
  require_numel(dx, N * IC, op, "dx");
  gemm_call g = dense_gemm(false, false, IC, N, OC, w, dy, dx, beta);
  g.ldb = dy.dim(-1);
  return g;
}

/// True when GELU may ride on the epilogue of a GEMM writing d with aux `aux` (file comment).
bool gelu_epilogue_ok(const gemm_call& g, const tensor& d, const tensor& aux) {
  return gelu_epilogue.load() && d.type() != dtype::f32 && aux.type() == d.type() &&
         g.ldc % 8 == 0 && aligned16(aux.raw()) && aligned16(d.raw());
}

void require_distinct(const tensor& out, const tensor& in, const char* op, const char* out_name,
                      const char* in_name) {
  require(out.raw() != in.raw(), op,
          std::string(out_name) + " must not alias " + in_name + " (it is written)");
}

}  // namespace

void cuda_backend::linear_forward(const tensor& x, const tensor& w, const tensor& b, tensor& y) {
  activate();
  context& ctx = *ctx_;
  std::int64_t n = 0;
  gemm_call g = forward_call("cuda linear_forward", x, w, b, y, n);
  if (n == 0) return;
  if (g.ldc == g.m) {
    gemm(ctx, g);
    add_unfused_bias(ctx, g, b, y);
    return;
  }
  padded_gemm(ctx, g, 'm', g.m);
  dispatch_float(y.type(), "cuda linear_forward", [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t total = n * (g.ldc - g.m);
    fill_padding_kernel<T><<<grid_for(total, 256), 256, 0, ctx.stream>>>(
        y.data<T>(), n, static_cast<int>(g.m), static_cast<int>(g.ldc));
  });
  TROUPE_CUDA_CHECK_LAUNCH();
}

std::int64_t cuda_backend::logits_width(std::int64_t classes) const {
  return cuda_logits_width(classes);
}

void cuda_backend::linear_forward_residual(const tensor& x, const tensor& w, const tensor& b,
                                           const tensor& r, tensor& y) {
  activate();
  context& ctx = *ctx_;
  const char* op = "cuda linear_forward_residual";
  std::int64_t n = 0;
  gemm_call g = forward_call(op, x, w, b, y, n);
  require_type(r, y.type(), op, "r (must match y)");
  require_numel(r, y.numel(), op, "r");
  require_distinct(y, r, op, "y", "r");
  if (n == 0) return;
  // D = x·wᵀ + 1·R (+ bias): the residual is read as C, so y is written once.
  g.c_in = r.raw();
  g.beta = 1;
  gemm(ctx, g);
  add_unfused_bias(ctx, g, b, y);
}

void cuda_backend::linear_gelu_forward(const tensor& x, const tensor& w, const tensor& b,
                                       tensor& pre, tensor& y) {
  activate();
  context& ctx = *ctx_;
  const char* op = "cuda linear_gelu_forward";
  std::int64_t n = 0;
  gemm_call g = forward_call(op, x, w, b, pre, n);
  require_type(y, pre.type(), op, "y (must match pre)");
  require_numel(y, pre.numel(), op, "y");
  require_distinct(y, pre, op, "y", "pre");
  if (n == 0) return;
  if (g.bias || !b.defined()) {
    if (gelu_epilogue_ok(g, y, pre)) {
      gemm_call fused = g;
      fused.c = y.raw();
      fused.epilogue = gemm_call::act::gelu;
      fused.aux = pre.raw();
      if (gemm(ctx, fused, true)) return;
    }
  }
  gemm(ctx, g);
  add_unfused_bias(ctx, g, b, pre);
  gelu_forward(pre, y);
}

void cuda_backend::linear_backward_input(const tensor& dy, const tensor& w, tensor& dx) {
  activate();
  context& ctx = *ctx_;
  gemm_call g = backward_input_call("cuda linear_backward_input", dy, w, dx, 1);
  if (g.ldb == g.k)
    gemm(ctx, g);
  else if (g.n > 0)
    padded_gemm(ctx, g, 'k', g.k);
}

void cuda_backend::linear_backward_input_write(const tensor& dy, const tensor& w, tensor& dx) {
  activate();
  context& ctx = *ctx_;
  gemm_call g = backward_input_call("cuda linear_backward_input_write", dy, w, dx, 0);
  require(g.ldb == g.k, "cuda linear_backward_input_write", "dy must not have padded rows");
  gemm(ctx, g);
}

void cuda_backend::linear_backward_input_gelu(const tensor& dy, const tensor& w, const tensor& pre,
                                              tensor& dx) {
  activate();
  context& ctx = *ctx_;
  const char* op = "cuda linear_backward_input_gelu";
  gemm_call g = backward_input_call(op, dy, w, dx, 0);
  require(g.ldb == g.k, op, "dy must not have padded rows");
  require_type(pre, dx.type(), op, "pre (must match dx)");
  require_numel(pre, dx.numel(), op, "pre");
  require_distinct(dx, pre, op, "dx", "pre");
  if (g.n == 0) return;
  if (gelu_epilogue_ok(g, dx, pre)) {
    gemm_call fused = g;
    fused.epilogue = gemm_call::act::dgelu;
    fused.aux = pre.raw();
    if (gemm(ctx, fused, true)) return;
  }
  // Unfused: dx = dy·w, then dx = dx ⊙ gelu'(pre) in place.
  gemm(ctx, g);
  dispatch_float(dx.type(), op, [&](auto tag) {
    using T = decltype(tag);
    launch_elementwise<T>(dx.numel(), {pre.data<T>(), dx.data<T>()}, {dx.data<T>()},
                          gelu_backward_scale_op{}, ctx.stream);
  });
}

namespace {

/// dw (+)= dyᵀ·x and db (+)= Σ_rows dy: beta 1 accumulates, beta 0 writes.
void weight_gradient(context& ctx, const tensor& dy, const tensor& x, tensor& dw, tensor& db,
                     float beta, const char* op) {
  require_float(dw, op, "dw");
  require(dw.rank() == 2, op, "dw must be [out, in], got " + core::shape_string(dw.shape()));
  const std::int64_t OC = dw.dim(0), IC = dw.dim(1);
  require_float(dy, op, "dy");
  require_type(x, dy.type(), op, "x (must match dy)");
  const std::int64_t W = padded_width(dy, OC);
  require(dy.dim(-1) == W && x.dim(-1) == IC, op,
          "dy " + core::shape_string(dy.shape()) + " and x " + core::shape_string(x.shape()) +
              " do not match dw " + core::shape_string(dw.shape()));
  const std::int64_t N = rows_of(dy);
  require(rows_of(x) == N, op, "dy and x have different row counts");
  if (db.defined()) {
    require(W == OC, op, "padded rows (dy " + core::shape_string(dy.shape()) + ") take no db");
    require_float(db, op, "db");
    require_numel(db, OC, op, "db");
  }
  if (N == 0) {
    if (beta == 0) {  // an empty sum, written
      TROUPE_CUDA_CHECK(cudaMemsetAsync(dw.raw(), 0, dw.bytes(), ctx.stream));
      if (db.defined()) TROUPE_CUDA_CHECK(cudaMemsetAsync(db.raw(), 0, db.bytes(), ctx.stream));
    }
    return;
  }
  gemm_call g = dense_gemm(false, true, IC, OC, N, x, dy, dw, beta);
  g.ldb = W;  // B = dy transposed: n = OC columns of padded rows
  gemm(ctx, g);
  if (db.defined()) bias_gradient(ctx, dy, N, static_cast<int>(OC), db, beta == 0);
}

}  // namespace

void cuda_backend::linear_backward_weight(const tensor& dy, const tensor& x, tensor& dw,
                                          tensor& db) {
  activate();
  weight_gradient(*ctx_, dy, x, dw, db, 1, "cuda linear_backward_weight");
}

void cuda_backend::linear_backward_weight_write(const tensor& dy, const tensor& x, tensor& dw,
                                                tensor& db) {
  activate();
  weight_gradient(*ctx_, dy, x, dw, db, 0, "cuda linear_backward_weight_write");
}

void sum_rows_on(context& ctx, const tensor& x, tensor& out, bool write) {
  const char* op = write ? "cuda sum_rows (written)" : "cuda sum_rows";
  require_float(x, op, "x");
  require_float(out, op, "out");
  require(x.rank() >= 1, op, "x must be [N, C], got " + core::shape_string(x.shape()));
  const std::int64_t cols = x.dim(-1);
  require_numel(out, cols, op, "out");
  const std::int64_t rows = rows_of(x);
  if (rows > 0)
    bias_gradient(ctx, x, rows, static_cast<int>(cols), out, write);
  else if (write)
    TROUPE_CUDA_CHECK(cudaMemsetAsync(out.raw(), 0, out.bytes(), ctx.stream));
}

void cuda_backend::sum_rows(const tensor& x, tensor& out) {
  activate();
  sum_rows_on(*ctx_, x, out, false);
}

void set_gemm_log(bool on) { gemm_log.store(on); }

void set_gelu_epilogue(bool on) { gelu_epilogue.store(on); }

}  // namespace troupe::kernels::cuda
