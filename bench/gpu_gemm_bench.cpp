// GEMM algorithm survey on one GPU: for every GEMM of a GPT-2 training step (forward, input
// gradient, weight gradient of qkv / proj / fc / fc2 and the tied head, at N = B·T rows), asks
// cuBLASLt's heuristic for its top algorithms, times each, and prints the heuristic's first choice
// next to the fastest, with their configurations (tile, stages, split-K, swizzle, cluster). It is
// how linear.cu's choice of algorithm is checked against what the hardware can do. Each GEMM is
// also timed with variants of its output: the weight gradient as fp32 accumulated (beta 1, what the
// trainer uses) and as bf16 written (beta 0, what PyTorch's autocast does).
// A program, not a test: a table on stdout and one JSON line per case.
//
// Timing: `reps` back-to-back calls between two events after warm-up calls, best of `rounds`.
//
// Usage: gpu_gemm_bench [--rows 16384] [--embd 768] [--vocab 50304] [--algos 16] [--reps 20]
//                       [--rounds 3] [--ld-align 1]
// --ld-align A rounds every leading dimension up to a multiple of A elements (the matrices keep
// their sizes): how a GEMM with an odd dimension (GPT-2's 50,257 vocabulary) runs when its buffer
// rows are padded.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda/gemm_tuning.hpp"

namespace {

void check_cuda(cudaError_t e, const char* what, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "gpu_gemm_bench:%d: %s: %s\n", line, what, cudaGetErrorString(e));
  std::exit(1);
}
void check_lt(cublasStatus_t s, const char* what, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  std::fprintf(stderr, "gpu_gemm_bench:%d: %s: %s\n", line, what, cublasGetStatusName(s));
  std::exit(1);
}
#define CK(x) check_cuda((x), #x, __LINE__)
#define LT(x) check_lt((x), #x, __LINE__)

struct options {
  long rows = 16384, embd = 768, vocab = 50304;
  int algos = 16, reps = 20, rounds = 3;
  long ld_align = 1;
};

/// One column-major GEMM D[m,n] = op(A)·op(B) (+ beta·C) with an optional epilogue.
struct gemm_case {
  std::string name;
  bool ta = false, tb = false;
  long m = 0, n = 0, k = 0;
  cudaDataType_t d_type = CUDA_R_16BF;
  float beta = 0;
  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  bool separate_c = false;  // C read from another buffer than D (a residual added on the epilogue)
  bool bias_f32 = false;    // the bias (gradient) vector in fp32 rather than D's type
};

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "gpu_gemm_bench: %s needs a value\n", a.c_str());
      return 2;
    }
    const char* v = argv[++i];
    if (a == "--rows") o.rows = std::atol(v);
    else if (a == "--embd") o.embd = std::atol(v);
    else if (a == "--vocab") o.vocab = std::atol(v);
    else if (a == "--algos") o.algos = std::atoi(v);
    else if (a == "--reps") o.reps = std::atoi(v);
    else if (a == "--rounds") o.rounds = std::atoi(v);
    else if (a == "--ld-align") o.ld_align = std::max(1L, std::atol(v));
    else {
      std::fprintf(stderr, "gpu_gemm_bench: unknown option %s (--rows --embd --vocab --algos --reps --rounds --ld-align)\n", a.c_str());
      return 2;
    }
  }
  const long N = o.rows, C = o.embd, V = o.vocab;
  // (in, out) widths of the step's linear layers.
  struct layer { const char* name; long ic, oc; bool bias; };
  const layer layers[] = {{"qkv", C, 3 * C, true}, {"proj", C, C, true}, {"fc", C, 4 * C, true},
                          {"fc2", 4 * C, C, true}, {"head", C, V, false}};
  std::vector<gemm_case> cases;
  for (const layer& l : layers) {
    // Forward y = x·wᵀ: m = OC, n = N, k = IC, A = w transposed.
    gemm_case f{std::string(l.name) + " fwd", true, false, l.oc, N, l.ic};
    f.epi = l.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    cases.push_back(f);
    // The forms the GPT-2 layer runs: fc with bias + GELU (pre-activation as aux), proj and fc2
    // adding the residual as C.
    if (std::string(l.name) == "fc") {
      gemm_case g = f;
      g.name = "fc fwd gelu_aux";
      g.epi = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
      cases.push_back(g);
    }
    if (std::string(l.name) == "proj" || std::string(l.name) == "fc2") {
      gemm_case r = f;
      r.name = std::string(l.name) + " fwd +res";
      r.beta = 1.0f;
      r.separate_c = true;
      cases.push_back(r);
    }
    if (std::string(l.name) == "fc2") {
      gemm_case d{"fc2 dx dgelu", false, false, l.ic, N, l.oc};
      d.epi = CUBLASLT_EPILOGUE_DGELU;
      cases.push_back(d);
      // The same with fc's bias gradient (Σ over rows of the result) from the epilogue, as bf16
      // (the default bias type) and as fp32.
      gemm_case g = d;
      g.name = "fc2 dx dgelu_bgrad";
      g.epi = CUBLASLT_EPILOGUE_DGELU_BGRAD;
      cases.push_back(g);
      g.name = "fc2 dx dgelu_bgrad f32";
      g.bias_f32 = true;
      cases.push_back(g);
    }
    if (std::string(l.name) == "head") {
      gemm_case d{"head dx +=", false, false, l.ic, N, l.oc};
      d.beta = 1.0f;
      cases.push_back(d);
    }
    // Input gradient dx = dy·w: m = IC, n = N, k = OC.
    cases.push_back(gemm_case{std::string(l.name) + " dx", false, false, l.ic, N, l.oc});
    // Weight gradient dw = dyᵀ·x: m = IC, n = OC, k = N, B = dy transposed.
    gemm_case w32{std::string(l.name) + " dw f32 +=", false, true, l.ic, l.oc, N, CUDA_R_32F, 1.0f};
    cases.push_back(w32);
    if (l.bias) {  // the bias gradient Σ_rows dy folded into the weight-gradient GEMM
      gemm_case wb = w32;
      wb.name = std::string(l.name) + " dw f32 += bgradb";
      wb.epi = CUBLASLT_EPILOGUE_BGRADB;
      cases.push_back(wb);
    }
    gemm_case w16{std::string(l.name) + " dw bf16 =", false, true, l.ic, l.oc, N, CUDA_R_16BF, 0.0f};
    cases.push_back(w16);
  }

  cublasLtHandle_t lt;
  LT(cublasLtCreate(&lt));
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  const size_t ws_bytes = size_t{32} << 20;
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  // One pool big enough for every operand: A, B (bf16) and C/D (fp32 at most), filled with small
  // values so nothing overflows.
  const auto ld = [&](long x) { return (x + o.ld_align - 1) / o.ld_align * o.ld_align; };
  long max_elems = 0;
  for (const auto& c : cases)
    max_elems = std::max({max_elems, ld(c.m) * ld(c.k), ld(c.k) * ld(c.n), ld(c.m) * ld(c.n)});
  void *a_buf, *b_buf, *d_buf, *c_buf, *aux_buf, *bias_buf;
  CK(cudaMalloc(&c_buf, max_elems * 4));
  CK(cudaMalloc(&aux_buf, max_elems * 2));
  CK(cudaMemset(c_buf, 0, max_elems * 4));
  CK(cudaMemset(aux_buf, 0, max_elems * 2));
  CK(cudaMalloc(&a_buf, max_elems * 2));
  CK(cudaMalloc(&b_buf, max_elems * 2));
  CK(cudaMalloc(&d_buf, max_elems * 4));
  CK(cudaMalloc(&bias_buf, 4 * V * 4));
  {
    std::vector<__nv_bfloat16> host(max_elems);
    for (long i = 0; i < max_elems; ++i) host[i] = __float2bfloat16(((i * 7919) % 2001 - 1000) * 1e-4f);
    CK(cudaMemcpy(a_buf, host.data(), max_elems * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b_buf, host.data(), max_elems * 2, cudaMemcpyHostToDevice));
    CK(cudaMemset(d_buf, 0, max_elems * 4));
    CK(cudaMemset(bias_buf, 0, 4 * V * 4));
  }
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  std::printf("%-18s %6s %6s %6s | %9s %7s | %9s %7s %4s | first / best config\n", "gemm", "m", "n",
              "k", "first ms", "TFLOP/s", "best ms", "TFLOP/s", "rank");
  for (const auto& c : cases) {
    cublasLtMatmulDesc_t desc;
    LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = c.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = c.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    if (c.epi != CUBLASLT_EPILOGUE_DEFAULT)
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &c.epi, sizeof(c.epi)));
    if (c.epi == CUBLASLT_EPILOGUE_BIAS || c.epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
        c.epi == CUBLASLT_EPILOGUE_BGRADB)
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_buf,
                                        sizeof(bias_buf)));
    if (c.epi == CUBLASLT_EPILOGUE_DGELU_BGRAD)
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_buf,
                                        sizeof(bias_buf)));
    if (c.bias_f32) {
      const cudaDataType_t bt = CUDA_R_32F;
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    }
    if (c.epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || c.epi == CUBLASLT_EPILOGUE_DGELU ||
        c.epi == CUBLASLT_EPILOGUE_DGELU_BGRAD) {
      const std::int64_t aux_ld = ld(c.m);
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux_buf,
                                        sizeof(aux_buf)));
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld,
                                        sizeof(aux_ld)));
    }
    void* const c_ptr = c.separate_c ? c_buf : d_buf;
    cublasLtMatrixLayout_t la, lb, lc;
    LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, c.ta ? c.k : c.m, c.ta ? c.m : c.k, ld(c.ta ? c.k : c.m)));
    LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, c.tb ? c.n : c.k, c.tb ? c.k : c.n, ld(c.tb ? c.n : c.k)));
    LT(cublasLtMatrixLayoutCreate(&lc, c.d_type, c.m, c.n, ld(c.m)));
    cublasLtMatmulPreference_t pref;
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                            sizeof(ws_bytes)));
    std::vector<cublasLtMatmulHeuristicResult_t> res(o.algos);
    int found = 0;
    // An epilogue or type combination cuBLASLt lacks is reported as "no algorithm", not fatal.
    if (cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, o.algos, res.data(),
                                       &found) != CUBLAS_STATUS_SUCCESS)
      found = 0;
    const double flop = 2.0 * c.m * c.n * c.k;
    const float alpha = 1.0f;
    double first_ms = 0, best_ms = 1e30;
    int best = -1;
    std::vector<double> all;
    for (int r = 0; r < found; ++r) {
      auto run = [&] {
        return cublasLtMatmul(lt, desc, &alpha, a_buf, la, b_buf, lb, &c.beta, c_ptr, lc, d_buf, lc,
                              &res[r].algo, ws, ws_bytes, stream);
      };
      if (run() != CUBLAS_STATUS_SUCCESS) {
        all.push_back(-1);
        continue;
      }
      for (int w = 0; w < 2; ++w) run();
      double t = 1e30;
      for (int round = 0; round < o.rounds; ++round) {
        CK(cudaEventRecord(e0, stream));
        for (int i = 0; i < o.reps; ++i) run();
        CK(cudaEventRecord(e1, stream));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t = std::min(t, static_cast<double>(ms) / o.reps);
      }
      all.push_back(t);
      if (r == 0) first_ms = t;
      if (t < best_ms) {
        best_ms = t;
        best = r;
      }
    }
    CK(cudaGetLastError());
    if (found == 0 || best < 0) {
      std::printf("%-18s %6ld %6ld %6ld | no algorithm\n", c.name.c_str(), c.m, c.n, c.k);
    } else {
      std::printf("%-18s %6ld %6ld %6ld | %9.4f %7.1f | %9.4f %7.1f %4d | %s / %s\n", c.name.c_str(),
                  c.m, c.n, c.k, first_ms, flop / first_ms * 1e-9, best_ms, flop / best_ms * 1e-9,
                  best, troupe::kernels::cuda::gemm_tuning::describe(res[0].algo).c_str(),
                  troupe::kernels::cuda::gemm_tuning::describe(res[best].algo).c_str());
      std::printf("{\"gemm\": \"%s\", \"m\": %ld, \"n\": %ld, \"k\": %ld, \"first_ms\": %.4f, \"best_ms\": %.4f, \"best_rank\": %d, \"all_ms\": [",
                  c.name.c_str(), c.m, c.n, c.k, first_ms, best_ms, best);
      for (size_t i = 0; i < all.size(); ++i) std::printf("%s%.4f", i ? ", " : "", all[i]);
      std::printf("]}\n");
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
  }
  return 0;
}
