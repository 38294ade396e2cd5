// The attention kernels built for Hopper alone (kernels/cuda/sm90/, compiled for sm_90a when the
// build targets compute capability 9.0: TROUPE_CUDA_SM90A is then defined). attention.cu calls
// them on a device of compute capability 9.0 and falls back to its own kernels elsewhere.
#pragma once

#include <cuda_runtime.h>

#include "core/tensor.hpp"

namespace troupe::kernels::cuda {

struct attn_shape;

/// How the Hopper forward brings its key/value tiles into shared memory: by the TMA from a
/// producer warpgroup, by cp.async from every thread, or whichever is faster at the shape
/// (docs/cuda.md, "The Hopper kernels"). Both give the same bits.
enum class tile_loads { by_shape, cp_async, tma };

/// The causal forward with wgmma (sm90/attention_fwd.cu): out and lse as attention.cu's forward
/// writes them. Launches on `stream` and returns true, or returns false without launching when it
/// does not cover the case (head size other than 64, a type other than bf16 or fp16). The
/// pointers must be 16-byte aligned.
bool attention_forward_sm90(core::dtype type, const void* qkv, void* out, float* lse, int batch,
                            const attn_shape& s, tile_loads loads, cudaStream_t stream);

/// The causal backward with wgmma (sm90/attention_bwd.cu), given Δ (attention.cu's launch_delta):
/// adds the gradient to dqkv (`accumulate`) or writes it. When it writes, `sums` (else null) gets
/// the column sums of the dqkv it stored, per 16 rows: partial rows
/// [attention_backward_sm90_sum_rows(batch, s), W], each written once, for column_finish_kernel
/// to add in a fixed order. Returns false without launching where it does not cover the case
/// (head size other than 64, packed documents, a type other than bf16 or fp16, sums with
/// `accumulate`). The pointers must be 16-byte aligned.
bool attention_backward_sm90(core::dtype type, const void* qkv, const void* dout,
                             const float* lse, const float* delta, void* dqkv, int batch,
                             const attn_shape& s, bool accumulate, float* sums,
                             cudaStream_t stream);

/// The partial rows of attention_backward_sm90's `sums`: batch · ⌈T/16⌉.
int attention_backward_sm90_sum_rows(int batch, const attn_shape& s);

}  // namespace troupe::kernels::cuda
