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

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_WORK_POOL_H_
