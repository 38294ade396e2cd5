// Disjoint shares of one GPU's streaming multiprocessors (runtime.split_gpu): the backends of the
// workers that one process runs on one GPU each get a CUDA green context over its own group of
// SMs, and queue their work on a stream made in it, so a kernel of one never runs on another's
// SMs. Pipeline stages on one GPU then behave as if each had a smaller GPU of its own: a stage
// with nothing to run leaves its SMs idle instead of lending them to the others, which is what a
// schedule's bubble is on a GPU per stage (docs/runtime.md, "One GPU split between stages").
//
// The driver functions are looked up at run time (cudaGetDriverEntryPointByVersion), so nothing
// links libcuda; a driver without green contexts is an error that says so.
#pragma once

#include <cuda_runtime.h>

namespace troupe::kernels::cuda {

struct context;

/// Moves ctx onto share `index` of `count` equal, disjoint groups of its GPU's SMs: its stream
/// becomes one made in the share's green context (nothing may have been queued on ctx yet) and
/// ctx.sm_count the share's SMs. The groups are as large as the GPU's SM alignment allows (on
/// compute capability 9.0 a multiple of 8: 132 SMs make 4 groups of 32 or 2 of 64); SMs left over
/// run none of the shares' work. A share's green context is made once per process and kept for
/// its life (the stage and the optimizer shard of a worker use the same one). Throws
/// core::failure naming why the GPU cannot be split so.
void adopt_partition(context& ctx, int index, int count);

}  // namespace troupe::kernels::cuda
