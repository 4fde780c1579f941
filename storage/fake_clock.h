// A manually advanced Clock for tests. Thread-safe.
#ifndef KVDEPOT_STORAGE_FAKE_CLOCK_H_
#define KVDEPOT_STORAGE_FAKE_CLOCK_H_

#include "absl/synchronization/mutex.h"
#include "storage/clock.h"

namespace kvdepot {

class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'700'000'000))
      : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_FAKE_CLOCK_H_
