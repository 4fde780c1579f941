// UcxEndpoint: a connection from a local UcxWorker to a peer's worker,
// for one-sided transfers into and out of the peer's registered memory
// (a client reading the daemon's arena), with peer-failure detection.
//
// Transfers go in batches: Get/Put post one ucp_get_nbx/ucp_put_nbx per
// transfer, a Put then a flush (ucp_ep_flush_nbx) or a fence, and return a
// TransferHandle with a status per transfer (a get's is OK once its bytes
// are here: no flush follows gets). Every batch has a deadline. A batch never
// hangs: when its deadline passes, or the peer fails, the endpoint is
// force-closed, which ends everything in flight on it with an error; the
// endpoint then stays failed (status() says why) and a new one must be
// connected.
//
// Thread-safe. The worker must outlive the endpoint.
#ifndef KVDEPOT_TRANSPORT_UCX_ENDPOINT_H_
#define KVDEPOT_TRANSPORT_UCX_ENDPOINT_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transport/memory_region.h"
#include "transport/transfer_handle.h"
#include "transport/ucx_worker.h"

namespace kvdepot {

namespace transport_internal {
class RkeySet;
class TransferBatch;
struct UnsentMessages;
}  // namespace transport_internal

// How an endpoint closes when a batch on it passes its deadline (see
// UcxEndpointOptions::deadline_close).
enum class DeadlineClose {
  // Force-closed: UCX drops what it still holds for the peer (with peer
  // error handling, nothing more of the batch goes out).
  kForce,
  // Closed in order: queued sends still go out if the peer takes them, and
  // the close ends once they have, or when the peer's connection fails.
  kOrderly,
};

struct UcxEndpointOptions {
  // Called once, on the progress thread, when the endpoint fails on its own
  // (the peer is gone, or a batch passed its deadline); not when it is
  // destroyed. Must not block, and must not destroy the endpoint.
  absl::AnyInvocable<void(const absl::Status&)> on_error;
  // UCP_ERR_HANDLING_MODE_PEER: UCX reports a dead peer (on_error, and
  // Unavailable for what is in flight). UCX 1.13's shared-memory transports
  // (posix, sysv) cannot do this, so with it they are not used; turn it off
  // for a co-located client that wants shared memory, and rely on deadlines
  // (and the server's PeerMonitor, over TCP) instead.
  bool peer_error_handling = true;
  // Connect waits this long for the peer to answer the connection.
  absl::Duration connect_timeout = absl::Seconds(5);
  // After the endpoint has failed, batches whose UCX requests are still
  // open this long after are ended anyway (TransferHandle::abandoned). With
  // peer error handling and a forced close UCX ends them itself, at once.
  absl::Duration abandon_after = absl::Seconds(1);
  // How the endpoint closes after a batch passed its deadline (the batch
  // ends DeadlineExceeded, and on_error follows, either way). kOrderly is
  // for a peer that may only be stalled, and needs peer error handling (else
  // a peer that never reads again keeps the close open until the worker
  // goes): a forced close of an endpoint whose sends such a peer has not
  // taken yet left UCX 1.13's TCP transport discarding it when the peer
  // continued and checked its own endpoint, and that crashed this process
  // in UCX (transport/README, caveat 8). The price: what the batch had
  // queued still reaches the peer if it continues (as over shared memory
  // in any case, caveat 2).
  DeadlineClose deadline_close = DeadlineClose::kForce;
  // Bytes of messages (SendMessage) UCX may hold for the peer, not yet
  // sent (each counted with its header and kMessageOverhead until UCX
  // reports it sent; a peer that never progresses takes none). A message
  // that would pass it, while others are still unsent, fails the endpoint
  // as a lost peer does (on_error, Unavailable; closed as deadline_close
  // says) and is dropped, so a peer that does not read cannot make this
  // process hold its messages without bound. 0: no bound.
  size_t max_unsent_message_bytes = 0;
};

// A region of the peer's memory, as the peer described it.
struct RemoteRegion {
  std::string packed_rkey;  // the peer's MemoryRegion::packed_rkey()
  // The peer's MemoryRegion::address() and size(). Transfers outside
  // [base, base + size) are refused here, before UCX sees them: over TCP and
  // shared memory UCX itself does not check remote addresses.
  uint64_t base = 0;
  uint64_t size = 0;
  // When set, the shared-memory segments the key names must belong to this
  // uid (the co-located peer's user): see internal/rkey_check.h.
  std::optional<uint32_t> owner_uid;
  // False for a peer on another host: the key's shared-memory parts are
  // dropped before UCX sees them (its segments are not here, and one that
  // names a segment here must not reach it); the rest of the key is used.
  bool shared_memory = true;
};

// One transfer: `size` bytes between the peer's `remote_addr` (inside
// region `region`) and the local buffer `local`.
struct Transfer {
  uint32_t region = 0;  // from AddRemoteRegion
  uint64_t remote_addr = 0;
  void* local = nullptr;
  size_t size = 0;
  // Optional: the registered region `local` lies in. Lets UCX skip its own
  // registration lookup; a transfer outside it is refused.
  const MemoryRegion* local_region = nullptr;
};

class UcxEndpoint : private UcxWorker::Resident {
 public:
  // Creates an endpoint on `worker` to the worker whose address()
  // `peer_address` is, and waits until the peer has answered (the UCX
  // wire-up is complete). Unavailable when no transport reaches the peer or
  // the peer failed; DeadlineExceeded when it did not answer within
  // connect_timeout (returned then, within a tenth of a second, whatever
  // abandon_after and deadline_close are); UCX's error when the address
  // cannot be used. The address must come from a trusted source (the
  // daemon's OpenSession reply): UCX does not validate it.
  static absl::StatusOr<std::unique_ptr<UcxEndpoint>> Connect(
      UcxWorker& worker, std::string_view peer_address,
      UcxEndpointOptions options = {});

  UcxEndpoint(const UcxEndpoint&) = delete;
  UcxEndpoint& operator=(const UcxEndpoint&) = delete;
  // Force-closes the endpoint: batches still in flight end with Cancelled.
  // Their handles stay valid. Work this endpoint queued on the worker (a
  // batch, a message) refers to it: off the progress thread the destructor
  // waits behind that work; on the progress thread, destroy it only from a
  // task queued after that work (UcxWorker::Post), never inside a UCX
  // callback or a Defer.
  ~UcxEndpoint() override;

  // Unpacks the peer's remote key for this endpoint and returns the id that
  // transfers name it by. InvalidArgument when base + size overflows or the
  // key is empty; UCX's error when it cannot unpack the key; the failure
  // when the endpoint has failed. Keys must come from a trusted peer: UCX
  // does not validate their contents.
  absl::StatusOr<uint32_t> AddRemoteRegion(const RemoteRegion& region);

  // Done by the caller's own copy instead of UCX: with `mapped`, each
  // transfer whose region this process maps (the peer's memory is a UCX
  // shared-memory segment, posix or sysv, that ucp_rkey_ptr attaches here)
  // is done on the calling thread, before Get/Put return, by
  // `mapped(i, peer)`, with `peer` the transfer's remote bytes as mapped
  // here; its status is the transfer's. The mapping stays valid while it
  // runs, even if the endpoint fails meanwhile (failing waits for it), so
  // it must not wait on the progress thread. The other transfers go
  // through UCX. Only with UCX versions whose key layouts are checked
  // (internal/rkey_check.h): there the segment is known to hold the region.
  using MappedCopy = absl::AnyInvocable<absl::Status(size_t i, char* peer)>;

  // Reads each transfer's remote bytes into its local buffer.
  // Never blocks: a batch that cannot be queued ends at once with
  // ResourceExhausted. Transfers that are malformed (null or unregistered
  // local buffer, zero size, unknown region, remote range outside the
  // region) end with InvalidArgument; the others proceed. A deadline in the
  // past ends the batch at once with DeadlineExceeded. REQUIRES: local
  // buffers stay valid and untouched until the handle is ready.
  // `each_got(i)`, when given, runs on the progress thread as transfer i's
  // bytes arrive through UCX (while they are likely still in cache), never
  // after the handle is ready (nor for a transfer done by `mapped`). It
  // must not block.
  TransferHandle Get(absl::Span<const Transfer> transfers, absl::Time deadline,
                     absl::AnyInvocable<void(size_t)> each_got = nullptr,
                     MappedCopy mapped = nullptr);

  // How a Put batch ends.
  enum class PutEnd {
    // OK once the flush that follows the batch has succeeded: the bytes
    // are then in the peer's memory.
    kFlushed,
    // OK once each put has completed here (UCX no longer needs the local
    // bytes) and a fence (ucp_worker_fence) follows the batch: the bytes
    // reach the peer's memory before anything sent later through this
    // endpoint's worker (SendMessage). For a peer that is told the bytes
    // are in by such a message: it saves the flush's round trip.
    kFenced,
  };

  // Writes each transfer's local bytes to the peer, as Get otherwise, and
  // ends as `end` says.
  TransferHandle Put(absl::Span<const Transfer> transfers, absl::Time deadline,
                     MappedCopy mapped = nullptr, PutEnd end = PutEnd::kFlushed);

  // Sends active message `id` (UcxWorker::SetMessageHandler on the peer's
  // worker) with `header` and `payload`, eagerly (never rendezvous, so the
  // peer gets it whole in its handler). Never blocks; the bytes are owned
  // until UCX is done with them. Messages on one endpoint arrive in order,
  // and after the transfers of batches that were ready before the send.
  // Not bounded by the worker's queue_capacity (UcxWorker::Post): callers
  // bound their messages (requests in flight), and
  // max_unsent_message_bytes bounds what the peer leaves unread.
  // Unavailable once the endpoint has failed. Delivery is not confirmed: a
  // reply, or the endpoint's failure (on_error), tells.
  absl::Status SendMessage(uint16_t id, std::string header, std::string payload);
  // Sends message `id` with `header`, and `data` as its rendezvous data
  // (UcxWorker::SetDataMessageHandler and Receive on the peer's side: the
  // peer places it, UCX moves it with zero copy where it can). `data` is
  // not copied: it must stay valid until `sent` runs, on the progress
  // thread, with OK once UCX is done with it or why the send failed
  // (Unavailable when the endpoint failed before it went). Unavailable,
  // and `sent` never runs, once the endpoint has failed or the worker
  // stops.
  absl::Status SendMessageWithData(uint16_t id, std::string header,
                                   absl::Span<const char> data,
                                   absl::AnyInvocable<void(const absl::Status&) &&> sent);
  // The same with the data in `pieces`, one after the other (the peer may
  // receive it into pieces of its own: UcxWorker::Receive).
  absl::Status SendMessageWithData(uint16_t id, std::string header,
                                   std::vector<absl::Span<const char>> pieces,
                                   absl::AnyInvocable<void(const absl::Status&) &&> sent);

  // Closes the endpoint now, without on_error; the object stays valid and
  // it is failed from then on (status() Cancelled): later batches end at
  // once Unavailable, and SendMessage is Unavailable, as after any failure
  // (callers take Unavailable as "this endpoint is gone"). Force (as the
  // destructor does): batches in flight end Cancelled, the connection is
  // reset. Graceful: UCX flushes what is in flight and disconnects in
  // order, so the peer sees an orderly close instead of a connection reset
  // (for a peer that is alive, e.g. a client whose session ended
  // normally).
  void Close(bool force = true);

  // Whether region `region`'s memory is mapped into this process, so that
  // Get/Put with a MappedCopy do its transfers by plain copies (until the
  // endpoint fails).
  bool mapped(uint32_t region) const;

  // OK while the endpoint is usable; otherwise why it failed.
  absl::Status status() const;

  // Progress thread only: whether `ep` (a UCP endpoint of this worker, e.g.
  // the reply endpoint of a message that arrived: UcxWorker::MessageSender::
  // endpoint) is this endpoint's own, i.e. the message came over this
  // connection. False once the endpoint has failed or closed.
  bool Owns(ucp_ep_h ep) const { return ep != nullptr && ep == ep_; }

 private:
  using Batch = transport_internal::TransferBatch;

  UcxEndpoint(UcxWorker& worker, UcxEndpointOptions options);
  absl::Status WaitConnected();

  TransferHandle Start(bool get, absl::Span<const Transfer> transfers,
                       absl::AnyInvocable<void(size_t)> each_got,
                       MappedCopy mapped, absl::Time deadline,
                       PutEnd end = PutEnd::kFlushed);
  // Progress thread only.
  void Post(const std::shared_ptr<Batch>& batch,
            const std::vector<Transfer>& transfers, PutEnd end);
  // Marks the endpoint failed (first call wins), ends the batches in
  // flight with `status`, force-closes the UCX endpoint, and calls
  // on_error when `notify`.
  void Fail(absl::Status status, bool from_ucx_callback, bool notify,
            bool force = true);
  static void OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status);
  absl::Time OnTick(absl::Time now) override;
  bool TickBeforeProgress() const override { return true; }
  void OnStop() override;

  UcxWorker& worker_;  // must outlive this endpoint

  // What UCX's error callback gets (OnPeerError): this endpoint, or null
  // once the UCP endpoint is closing in order (it may outlive this object
  // then; the worker keeps this until the close).
  struct ErrorTarget {
    UcxEndpoint* endpoint;
  };

  // Progress thread only.
  ucp_ep_h ep_ = nullptr;
  std::shared_ptr<ErrorTarget> error_target_;
  std::shared_ptr<transport_internal::RkeySet> rkeys_;
  std::vector<std::shared_ptr<Batch>> in_flight_;
  // SendMessage's messages UCX has not sent yet (shared with them: they may
  // end after this object, on an endpoint closing in order).
  std::shared_ptr<transport_internal::UnsentMessages> unsent_;
  UcxEndpointOptions options_;

  struct Bounds {
    uint64_t base;
    uint64_t size;
    // The region as mapped into this process (ucp_rkey_ptr), or null.
    // Cleared (under mapped_mu_ held for writing) when the endpoint fails.
    char* mapped;
  };
  // Held for reading while a MappedCopy runs, for writing while Fail
  // clears the mappings (before the keys that hold them can go).
  // Acquired before mu_.
  absl::Mutex mapped_mu_;
  mutable absl::Mutex mu_;
  std::vector<Bounds> regions_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot

#endif  // KVDEPOT_TRANSPORT_UCX_ENDPOINT_H_
