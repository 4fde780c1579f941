#include "storage/process_tuning.h"

#include <malloc.h>

#include "absl/synchronization/mutex.h"

namespace kvdepot {

void TuneProcessForBlockIo() {
  mallopt(M_MMAP_THRESHOLD, 512 << 20);
  mallopt(M_TRIM_THRESHOLD, 32 << 20);
  mallopt(M_ARENA_MAX, 4);
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

}  // namespace kvdepot
