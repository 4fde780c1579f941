#include "storage/work_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <memory>
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

namespace {

// One ForEachHelped call's indices, shared with its helpers.
struct HelpedWork {
  std::atomic<size_t> next{0};
  size_t n = 0;
  const absl::FunctionRef<void(size_t)>* fn = nullptr;  // valid while next < n
  absl::Mutex mu;
  size_t done ABSL_GUARDED_BY(mu) = 0;

  void Run() {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      (*fn)(i);
      absl::MutexLock lock(&mu);
      ++done;
    }
  }
  bool AllDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return done == n; }
};

}  // namespace

void ForEachHelped(WorkPool& pool, size_t n, size_t helpers,
                   absl::FunctionRef<void(size_t)> fn) {
  auto work = std::make_shared<HelpedWork>();
  work->n = n;
  work->fn = &fn;
  // The caller takes indices too: at most n - 1 helpers can have one.
  for (size_t h = 0; h < std::min(helpers, n > 0 ? n - 1 : 0); ++h) {
    pool.Submit([work] { work->Run(); });
  }
  work->Run();
  absl::MutexLock lock(&work->mu);
  work->mu.Await(absl::Condition(work.get(), &HelpedWork::AllDone));
}

}  // namespace kvdepot
