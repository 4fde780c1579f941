#include "storage/clock.h"

#include "absl/time/clock.h"

namespace kvdepot {
namespace {

class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

}  // namespace

Clock* SystemClock() {
  static RealClock* clock = new RealClock();  // never destroyed
  return clock;
}

}  // namespace kvdepot
