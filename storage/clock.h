// A source of time, injected so that lease and expiry logic can be tested by
// advancing a fake clock instead of sleeping (as rocksdb's SystemClock).
#ifndef KVDEPOT_STORAGE_CLOCK_H_
#define KVDEPOT_STORAGE_CLOCK_H_

#include "absl/time/time.h"

namespace kvdepot {

// Thread-safe. Implementations must be monotonic non-decreasing: its users
// measure durations with it (leases, timeouts, ages), which a step of the
// wall clock must not end or stretch. It is not the wall clock: a time
// shown to people or written to disk as a date takes absl::Now().
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

// The real clock: the wall clock's time when it was first asked for, plus
// the time since then on the steady clock (CLOCK_MONOTONIC). So it never
// goes back, and a step of the wall clock (NTP, a resumed VM) moves it not
// at all; it may drift from the wall clock by as much as that was stepped
// (or slewed) since. The returned object lives for the whole process.
Clock* SystemClock();

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_CLOCK_H_
