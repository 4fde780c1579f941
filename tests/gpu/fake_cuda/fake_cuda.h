// Test hooks of the fake CUDA runtime (fake_cudart.cc). Streams are
// asynchronous: each is a worker thread that runs its queued work in order,
// after a random delay before each item. cudaStreamWaitEvent enqueues an
// item that blocks its stream's worker until the event's stream has
// completed the work marked when it was called (nothing for an event never
// recorded), so one stream can be ordered after another's work.
#ifndef FAKE_CUDA_H_
#define FAKE_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

namespace fake_cuda {

// Set by the stream's worker while it runs a kernel, one (block, thread)
// after another.
extern thread_local uint3 tl_thread_idx;
extern thread_local uint3 tl_block_idx;
extern thread_local dim3 tl_grid_dim;
extern thread_local dim3 tl_block_dim;

// Enqueues `work` (a kernel: `params` are its copied parameters, passed to
// the kernel observer) on `stream`. Returns the launch's result (an
// injected launch failure enqueues nothing).
cudaError_t EnqueueKernel(cudaStream_t stream, std::function<void()> work,
                          const void* params, size_t params_size);

// Work enqueued on `stream` and not yet finished.
uint64_t PendingWork(cudaStream_t stream);
// Work items of every stream that have run so far (kernels and copies).
uint64_t ExecutedWork();
// Kernel launches accepted so far.
uint64_t KernelLaunches();
// cudaEventQuery calls that answered cudaErrorNotReady so far.
uint64_t NotReadyQueries();

// Upper bound of the random delay (microseconds) before each work item.
void SetMaxDelayUs(int us);
// The kernel launch numbered `n` from now (0: the next) fails with
// cudaErrorLaunchOutOfResources, enqueueing nothing. -1: none.
void FailLaunchAfter(int n);
// The kernel executed `n` kernels from now faults (does not run): a sticky
// cudaErrorIllegalAddress that every later synchronizing call returns, and
// the rest of the stream's work is dropped. -1: none.
void FaultKernelAfter(int n);
// Clears the sticky error (test-only; no real runtime can).
void ClearStickyError();
// While paused, no stream's worker starts a work item: everything enqueued
// stays pending (a kernel, a copy, a cudaStreamWaitEvent's wait), and
// events recorded after it stay incomplete, until PauseStreams(false). An
// item already running finishes. For tests that must see what the host
// does before the device has run anything; anything that waits for a
// stream (cudaStreamSynchronize, cudaEventSynchronize, a PendingTransfer's
// Wait) blocks until resumed, so resume before waiting.
void PauseStreams(bool paused);

// Called on the stream's worker after each kernel ran (`params` its
// parameters), before the work counts as finished.
using KernelObserver = std::function<void(const void* params)>;
void SetKernelObserver(KernelObserver observer);

}  // namespace fake_cuda

#endif  // FAKE_CUDA_H_
