#include "storage/work_pool.h"

#include <pthread.h>

#include <algorithm>
#include <utility>

namespace kvdepot {

WorkPool::WorkPool(int threads, std::string name) : name_(std::move(name)) {
  threads = std::max(threads, 1);
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] { Run(); });
    // Linux limits thread names to 15 characters.
    pthread_setname_np(threads_.back().native_handle(),
                       name_.substr(0, 15).c_str());
  }
}

WorkPool::~WorkPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void WorkPool::Submit(absl::AnyInvocable<void() &&> task) {
  absl::MutexLock lock(&mu_);
  tasks_.push_back(std::move(task));
}

size_t WorkPool::queued() const {
  absl::MutexLock lock(&mu_);
  return tasks_.size();
}

void WorkPool::Run() {
  while (true) {
    absl::AnyInvocable<void() &&> task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stop_ || !tasks_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (tasks_.empty()) return;  // stopping, and nothing left to run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    std::move(task)();
  }
}

}  // namespace kvdepot
