// A source of time, injected so that lease and expiry logic can be tested by
// advancing a fake clock instead of sleeping (as rocksdb's SystemClock).
#ifndef KVDEPOT_STORAGE_CLOCK_H_
#define KVDEPOT_STORAGE_CLOCK_H_

#include "absl/time/time.h"

namespace kvdepot {

// Thread-safe. Implementations must be monotonic non-decreasing.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

// The real clock. The returned object lives for the whole process.
Clock* SystemClock();

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_CLOCK_H_
