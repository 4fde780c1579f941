// WorkPool: a fixed set of threads running submitted tasks in FIFO order.
// The engine uses it for disk work that must not run on a caller's thread
// (promotions from the NVMe tier).
//
// Thread-safe. The destructor runs every task already submitted, then joins
// the threads: a task that owes someone a callback always gets to call it.
#ifndef KVDEPOT_STORAGE_WORK_POOL_H_
#define KVDEPOT_STORAGE_WORK_POOL_H_

#include <cstddef>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace kvdepot {

class WorkPool {
 public:
  // Starts `threads` (at least 1) threads, named `name` for debuggers.
  WorkPool(int threads, std::string name);
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;
  ~WorkPool();

  void Submit(absl::AnyInvocable<void() &&> task);

  // Tasks submitted and not yet started.
  size_t queued() const;

 private:
  void Run();

  const std::string name_;
  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// Runs fn(0), ..., fn(n - 1) on the calling thread, helped by up to
// `helpers` threads of `pool` that are free meanwhile; returns when every
// call has returned. Indices are taken one at a time by whoever is free, so
// a pool busy with other work only leaves more of them to the caller (never
// a wait on a task that has not started), and a helper that starts after
// every index was taken does nothing: `fn` need only live until this
// returns. `pool` must outlive its tasks.
void ForEachHelped(WorkPool& pool, size_t n, size_t helpers,
                   absl::FunctionRef<void(size_t)> fn);

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_WORK_POOL_H_
