// Test sync points: named places in the engine's code where a test runs a
// callback of its own, to force a race into a fixed order (the idea of
// rocksdb's test_util/sync_point.h, much reduced). The engine marks a place
// with TestSyncPoint("Class::Method:Where", arg); a test sets a callback for
// that name (SyncPointCallback, for its scope) and receives `arg`, whose
// meaning the point's comment gives. Production code never sets one: a point
// without callbacks costs one relaxed atomic load.
//
// A callback runs on the thread that reaches the point, with no engine lock
// held (every point is placed where the engine holds none), so it may call
// into the engine. Thread-safe.
#ifndef KVDEPOT_STORAGE_INTERNAL_SYNC_POINT_H_
#define KVDEPOT_STORAGE_INTERNAL_SYNC_POINT_H_

#include <atomic>
#include <functional>
#include <string>

#include "absl/strings/string_view.h"

namespace kvdepot {
namespace internal {

using SyncPointFn = std::function<void(void* arg)>;

// Callbacks set now (all names).
extern std::atomic<int> sync_point_callbacks;

// Runs the callback set for `name`, if any.
void RunSyncPoint(absl::string_view name, void* arg);

inline void TestSyncPoint(absl::string_view name, void* arg = nullptr) {
  if (sync_point_callbacks.load(std::memory_order_relaxed) == 0) return;
  RunSyncPoint(name, arg);
}

// Sets the callback of sync point `name` while it lives (at most one per
// name: a second replaces the first until either goes). Its destructor does
// not wait for a call in progress: a test joins its threads first.
class SyncPointCallback {
 public:
  SyncPointCallback(std::string name, SyncPointFn fn);
  SyncPointCallback(const SyncPointCallback&) = delete;
  SyncPointCallback& operator=(const SyncPointCallback&) = delete;
  ~SyncPointCallback();

 private:
  const std::string name_;
};

}  // namespace internal
}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_INTERNAL_SYNC_POINT_H_
