// gather_cuda.cu's kernels and LaunchCopyChunks compiled as host code
// against the fake runtime: include/cuda_runtime.h makes each launch a
// closure that runs every (block, thread) of the grid later, on the
// stream's worker thread.
#include "gpu/gather_cuda.cu"
