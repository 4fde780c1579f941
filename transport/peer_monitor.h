// PeerMonitor: the server's watch on its clients' UCX workers. With
// one-sided transfers the server owns no endpoint to a client, so it would
// never notice a client that died holding pins or reservations. The monitor
// creates an endpoint from the server's worker back to each watched
// client's worker (the address the client sent in OpenSession), with peer
// error handling; when that endpoint fails (the client's process or worker
// is gone: TCP connection reset, or UCX keepalive, UCX_KEEPALIVE_INTERVAL,
// going unanswered) the monitor calls back with the id the server attached,
// so the server can release that client's pins at once instead of at lease
// expiry.
//
// Thread-safe. The worker must outlive the monitor.
#ifndef KVDEPOT_TRANSPORT_PEER_MONITOR_H_
#define KVDEPOT_TRANSPORT_PEER_MONITOR_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "transport/ucx_worker.h"

namespace kvdepot {

class PeerMonitor : private UcxWorker::Resident {
 public:
  // Called on the progress thread, at most once per Watch, with the watched
  // id and why the peer is considered gone. Must not block (hand the work
  // to another thread) and must not destroy the monitor.
  using FailureCallback =
      absl::AnyInvocable<void(uint64_t id, const absl::Status& why)>;

  PeerMonitor(UcxWorker& worker, FailureCallback on_failure);
  PeerMonitor(const PeerMonitor&) = delete;
  PeerMonitor& operator=(const PeerMonitor&) = delete;
  // Closes every watch, without callbacks.
  ~PeerMonitor() override;

  // Starts watching the worker at `peer_address` under `id`.
  // AlreadyExists when `id` is watched; InvalidArgument for an empty
  // address; UCX's error when it cannot create the endpoint; Unavailable
  // when the worker has stopped.
  absl::Status Watch(uint64_t id, std::string_view peer_address);

  // Stops watching `id` (a session closed normally). No callback for `id`
  // comes after this returns. NotFound when `id` is not watched (or its
  // callback has already run).
  absl::Status Unwatch(uint64_t id);

  // Peers being watched.
  size_t size() const;

 private:
  struct Watched;
  static void OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status);
  absl::Time OnTick(absl::Time now) override;
  void OnStop() override;
  void CloseAll();

  UcxWorker& worker_;  // must outlive this monitor
  FailureCallback on_failure_;

  // Progress thread only. Each Watched stays at one address (UCX holds it
  // as its error handler's argument) until its endpoint is closed.
  absl::flat_hash_map<uint64_t, std::unique_ptr<Watched>> watched_;
  bool stopped_ = false;
};

}  // namespace kvdepot

#endif  // KVDEPOT_TRANSPORT_PEER_MONITOR_H_
