#include "storage/clock.h"

#include <chrono>

#include "absl/time/clock.h"

namespace kvdepot {
namespace {

class RealClock final : public Clock {
 public:
  RealClock()
      : wall_start_(absl::Now()), steady_start_(std::chrono::steady_clock::now()) {}

  absl::Time Now() const override {
    return wall_start_ +
           absl::FromChrono(std::chrono::steady_clock::now() - steady_start_);
  }

 private:
  const absl::Time wall_start_;
  const std::chrono::steady_clock::time_point steady_start_;
};

}  // namespace

Clock* SystemClock() {
  static RealClock* clock = new RealClock();  // never destroyed
  return clock;
}

}  // namespace kvdepot
