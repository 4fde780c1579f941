// TransferHandle: the result of one batch of one-sided transfers
// (UcxEndpoint::Get / Put), in the manner of rocksdb's SecondaryCacheResultHandle:
// poll IsReady, or Wait, then read each transfer's status.
//
// Thread-safe. Copies share the same batch.
#ifndef KVDEPOT_TRANSPORT_TRANSFER_HANDLE_H_
#define KVDEPOT_TRANSPORT_TRANSFER_HANDLE_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvdepot {

namespace transport_internal {
class TransferBatch;
}  // namespace transport_internal

class TransferHandle {
 public:
  explicit TransferHandle(
      std::shared_ptr<transport_internal::TransferBatch> batch);

  // True once every transfer of the batch has ended: at the latest shortly
  // after its deadline (plus UcxEndpointOptions::abandon_after), or when
  // its endpoint or worker is closed. From then on UCX no longer touches
  // the batch's local buffers, unless abandoned().
  bool IsReady() const;

  // REQUIRES: IsReady(). True when the batch was ended while UCX still held
  // some of its requests (an endpoint without peer error handling, whose
  // peer stopped answering: UCX 1.13 does not end such requests when the
  // endpoint is closed; or one that closes in order after a deadline,
  // DeadlineClose::kOrderly, until the peer takes them). Their transfers report errors, but a late answer
  // from the peer could still write into a Get's local buffer: do not reuse
  // those buffers until the worker has been destroyed, or OnReleased.
  bool abandoned() const;

  // Calls `done` once UCX holds no request of the batch, so that nothing
  // reads or writes its local buffers any more: when it becomes ready, for
  // a batch that is not abandoned; for an abandoned one, when the peer's
  // late answers have ended its last request, or when the worker is
  // destroyed (UcxWorker::Stop) and its requests with it -- until then,
  // perhaps long (a peer that is gone, on a worker that lives on).
  // Runs at once, on the calling thread, when that is so already; otherwise
  // on the worker's progress thread, or on the thread that destroys the
  // worker; it must not block.
  void OnReleased(absl::AnyInvocable<void() &&> done) const;

  // Calls `done` once IsReady(): at once, on the calling thread, when it
  // already is; otherwise on the worker's progress thread, where it must
  // not block (hand longer work to another thread). Callbacks run in the
  // order they were added.
  void OnReady(absl::AnyInvocable<void() &&> done) const;

  // Blocks until IsReady().
  void Wait() const;

  // Blocks until IsReady() or `deadline`; returns IsReady().
  bool WaitUntil(absl::Time deadline) const;

  // The number of transfers in the batch.
  size_t size() const;

  // REQUIRES: IsReady(). The status of transfer i, in submission order: OK
  // when its bytes arrived (Get) or reached the peer's memory (Put);
  // InvalidArgument when it was refused before reaching UCX;
  // DeadlineExceeded when the batch's deadline passed first; Unavailable
  // when the endpoint failed (the peer is gone) or was already failed, or
  // when UCX failed the transfer itself (any other UCS error: its bytes
  // may have moved in part);
  // ResourceExhausted when the worker's queue was full; Cancelled when the
  // endpoint or worker was closed under it.
  const absl::Status& status(size_t i) const;
  const std::vector<absl::Status>& statuses() const;

  // REQUIRES: IsReady(). OK when every transfer is OK, else the first error.
  absl::Status overall_status() const;

 private:
  std::shared_ptr<transport_internal::TransferBatch> batch_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_TRANSPORT_TRANSFER_HANDLE_H_
