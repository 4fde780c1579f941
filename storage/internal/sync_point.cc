#include "storage/internal/sync_point.h"

#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace kvdepot {
namespace internal {

std::atomic<int> sync_point_callbacks{0};

namespace {

struct Registry {
  absl::Mutex mu;
  // Shared: a callback still running when its SyncPointCallback goes keeps
  // its function alive.
  absl::flat_hash_map<std::string, std::shared_ptr<const SyncPointFn>> fns
      ABSL_GUARDED_BY(mu);
};

Registry& GetRegistry() {
  static Registry* registry = new Registry;  // never destroyed
  return *registry;
}

}  // namespace

void RunSyncPoint(absl::string_view name, void* arg) {
  std::shared_ptr<const SyncPointFn> fn;
  {
    Registry& r = GetRegistry();
    absl::MutexLock lock(&r.mu);
    auto it = r.fns.find(name);
    if (it == r.fns.end()) return;
    fn = it->second;
  }
  (*fn)(arg);  // without the registry's lock: it may reach other points
}

SyncPointCallback::SyncPointCallback(std::string name, SyncPointFn fn)
    : name_(std::move(name)) {
  Registry& r = GetRegistry();
  absl::MutexLock lock(&r.mu);
  auto [it, inserted] = r.fns.insert_or_assign(
      name_, std::make_shared<const SyncPointFn>(std::move(fn)));
  if (inserted) sync_point_callbacks.fetch_add(1);
}

SyncPointCallback::~SyncPointCallback() {
  Registry& r = GetRegistry();
  absl::MutexLock lock(&r.mu);
  if (r.fns.erase(name_) > 0) sync_point_callbacks.fetch_sub(1);
}

}  // namespace internal
}  // namespace kvdepot
