#include "transport/ucx_endpoint.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "storage/status_macros.h"
#include "transport/internal/peer_endpoint.h"
#include "transport/internal/rkey_check.h"
#include "transport/internal/send_message.h"
#include "transport/internal/transfer_batch.h"
#include "transport/internal/ucs_status.h"

namespace kvdepot {
namespace transport_internal {

// The remote keys unpacked on one endpoint, shared with the batches that
// use them: UCX requests in flight still refer to their key, so the keys go
// only when the endpoint and every such batch are done. Destroyed on the
// progress thread (the last holder lets go there).
class RkeySet {
 public:
  RkeySet() = default;
  RkeySet(const RkeySet&) = delete;
  RkeySet& operator=(const RkeySet&) = delete;
  ~RkeySet() { Destroy(); }
  // Destroys the keys now (they need their worker, not their endpoint).
  void Destroy() {
    for (ucp_rkey_h key : keys) ucp_rkey_destroy(key);
    keys.clear();
  }
  std::vector<ucp_rkey_h> keys;
};

}  // namespace transport_internal

namespace {

// How long past connect_timeout Connect waits for the wire-up's flush to
// end on its own (OnTick ends it at the deadline when UCX lets it go)
// before it gives up on it.
constexpr absl::Duration kConnectedGrace = absl::Milliseconds(100);

}  // namespace

using transport_internal::CreatePeerEndpoint;
using transport_internal::RkeySet;
using transport_internal::UcsToStatus;

UcxEndpoint::UcxEndpoint(UcxWorker& worker, UcxEndpointOptions options)
    : worker_(worker),
      unsent_(std::make_shared<transport_internal::UnsentMessages>()),
      options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<UcxEndpoint>> UcxEndpoint::Connect(
    UcxWorker& worker, std::string_view peer_address,
    UcxEndpointOptions options) {
  std::unique_ptr<UcxEndpoint> endpoint(
      new UcxEndpoint(worker, std::move(options)));
  UcxEndpoint* e = endpoint.get();
  absl::Status status;
  absl::Status run = worker.Run([e, &worker, peer_address, &status] {
    e->error_target_ = std::make_shared<ErrorTarget>(ErrorTarget{e});
    absl::StatusOr<ucp_ep_h> ep = CreatePeerEndpoint(
        worker.handle(), peer_address,
        e->options_.peer_error_handling ? &UcxEndpoint::OnPeerError : nullptr,
        e->error_target_.get());
    if (!ep.ok()) {
      status = ep.status();
      return;
    }
    e->ep_ = *ep;
    e->rkeys_ = std::make_shared<RkeySet>();
    worker.AddResident(e);
  });
  if (!run.ok()) return run;
  if (!status.ok()) return status;
  RETURN_IF_ERROR(endpoint->WaitConnected());
  return endpoint;
}

absl::Status UcxEndpoint::WaitConnected() {
  // An empty batch's flush completes once the wire-up has: the peer has
  // answered. (It also keeps a client that exits at once from leaving the
  // peer half-way through the handshake.)
  auto batch = std::make_shared<Batch>(Batch::Op::kGet, 0,
                                       absl::Now() + options_.connect_timeout);
  absl::Status run = worker_.Run([this, batch] {
    if (ep_ == nullptr) {
      batch->Seal(nullptr);
      return;
    }
    ucp_request_param_t param = batch->Param(0);
    batch->Posted(0, ucp_ep_flush_nbx(ep_, &param));
    batch->Seal(rkeys_);
    if (!batch->finished()) {
      in_flight_.push_back(batch);
      worker_.WakeAt(batch->deadline());
    }
  });
  RETURN_IF_ERROR(run);
  TransferHandle handle(batch);
  // Waited for until its deadline only (and a little after, so that
  // OnTick can end it first). Past the deadline OnTick fails the
  // endpoint, but that need not end the flush: an orderly close
  // (DeadlineClose::kOrderly) leaves it open until the peer answers, and
  // without peer error handling UCX 1.13 keeps it even after a forced
  // one; the batch would then end only abandon_after later, and a caller
  // that must fall back in time (OpenSession) would miss its own
  // deadline. The batch outlives the endpoint for UCX's sake (its self
  // reference, Fail's abandon timer), so the caller may destroy the
  // endpoint at once.
  if (!handle.WaitUntil(batch->deadline() + kConnectedGrace)) {
    // Failed here unless OnTick did already, closed as a batch past its
    // deadline closes it (not by force when deadline_close says in order:
    // the destructor, which follows, would force-close it otherwise).
    worker_
        .Run([this] {
          Fail(absl::DeadlineExceededError(
                   "UCX peer did not answer within connect_timeout"),
               /*from_ucx_callback=*/false, /*notify=*/false,
               /*force=*/options_.deadline_close == DeadlineClose::kForce);
        })
        .IgnoreError();  // stopped: OnStop has closed it
    return absl::DeadlineExceededError(
        "UCX peer did not answer within connect_timeout");
  }
  if (!status().ok() && absl::Now() >= batch->deadline()) {
    return absl::DeadlineExceededError(
        "UCX peer did not answer within connect_timeout");
  }
  RETURN_IF_ERROR(status());
  if (!batch->flush_status().ok()) {
    return absl::UnavailableError(absl::StrCat(
        "UCX peer did not answer: ", batch->flush_status().message()));
  }
  return absl::OkStatus();
}

UcxEndpoint::~UcxEndpoint() {
  // When the worker has stopped, OnStop has released everything already.
  worker_
      .Run([this] {
        Fail(absl::CancelledError("UCX endpoint closed"),
             /*from_ucx_callback=*/false, /*notify=*/false);
        worker_.RemoveResident(this);
      })
      .IgnoreError();
}

void UcxEndpoint::Close(bool force) {
  worker_
      .Run([this, force] {
        Fail(absl::CancelledError("UCX endpoint closed"),
             /*from_ucx_callback=*/false, /*notify=*/false, force);
      })
      .IgnoreError();
}

bool UcxEndpoint::mapped(uint32_t region) const {
  absl::MutexLock lock(&mu_);
  return region < regions_.size() && regions_[region].mapped != nullptr;
}

absl::Status UcxEndpoint::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

absl::StatusOr<uint32_t> UcxEndpoint::AddRemoteRegion(
    const RemoteRegion& region) {
  if (region.packed_rkey.empty()) {
    return absl::InvalidArgumentError("empty remote key");
  }
  if (region.size > std::numeric_limits<uint64_t>::max() - region.base) {
    return absl::InvalidArgumentError("remote region base + size overflows");
  }
  std::string packed = region.packed_rkey;
  if (!region.shared_memory) {
    ASSIGN_OR_RETURN(packed, transport_internal::StripSharedMemoryKeys(packed));
  }
  // UCX trusts packed keys; a bad one can crash it (internal/rkey_check.h).
  if (absl::Status key = transport_internal::CheckPackedRkey(
          packed, region.base, region.size, region.owner_uid);
      !key.ok()) {
    return key;
  }
  absl::StatusOr<uint32_t> result;
  absl::Status run = worker_.Run([this, &region, &packed, &result] {
    if (ep_ == nullptr) {
      result = status();
      return;
    }
    ucp_rkey_h rkey = nullptr;
    ucs_status_t st =
        ucp_ep_rkey_unpack(ep_, packed.data(), &rkey);
    if (st != UCS_OK) {
      result = UcsToStatus(st, "ucp_ep_rkey_unpack");
      return;
    }
    rkeys_->keys.push_back(rkey);
    // Memory the peer has in a shared-memory segment is attached here by
    // the unpack; plain copies can then reach it. Only where the key's
    // segment is known to hold the whole region.
    void* mapped = nullptr;
    if (!transport_internal::KnownRkeyLayouts() ||
        ucp_rkey_ptr(rkey, region.base, &mapped) != UCS_OK) {
      mapped = nullptr;
    }
    absl::MutexLock lock(&mu_);
    regions_.push_back(
        Bounds{region.base, region.size, static_cast<char*>(mapped)});
    result = static_cast<uint32_t>(regions_.size() - 1);
  });
  if (!run.ok()) return run;
  return result;
}

TransferHandle UcxEndpoint::Get(absl::Span<const Transfer> transfers,
                                absl::Time deadline,
                                absl::AnyInvocable<void(size_t)> each_got,
                                MappedCopy mapped) {
  return Start(/*get=*/true, transfers, std::move(each_got), std::move(mapped),
               deadline);
}

TransferHandle UcxEndpoint::Put(absl::Span<const Transfer> transfers,
                                absl::Time deadline, MappedCopy mapped,
                                PutEnd end) {
  return Start(/*get=*/false, transfers, nullptr, std::move(mapped), deadline,
               end);
}

TransferHandle UcxEndpoint::Start(bool get,
                                  absl::Span<const Transfer> transfers,
                                  absl::AnyInvocable<void(size_t)> each_got,
                                  MappedCopy mapped, absl::Time deadline,
                                  PutEnd end) {
  auto batch = std::make_shared<Batch>(get ? Batch::Op::kGet : Batch::Op::kPut,
                                       transfers.size(), deadline);
  if (each_got) batch->SetEachGot(std::move(each_got));
  TransferHandle handle(batch);
  // Refuses every transfer not refused yet and publishes the batch; used
  // when nothing will be posted.
  auto end_all = [&batch, &transfers](const absl::Status& why) {
    for (size_t i = 0; i < transfers.size(); ++i) {
      if (!batch->refused(i)) batch->Refuse(i, why);
    }
    batch->Seal(nullptr);
  };

  // Transfers to be done by `mapped`: the peer's bytes as mapped here.
  std::vector<char*> peer(mapped ? transfers.size() : 0, nullptr);
  // Held until the mapped copies are done: Fail waits for them before the
  // mappings can go.
  std::optional<absl::ReaderMutexLock> mapping;
  if (mapped) mapping.emplace(&mapped_mu_);
  size_t accepted = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!status_.ok()) {
      end_all(absl::UnavailableError(
          absl::StrCat("UCX endpoint has failed: ", status_.message())));
      return handle;
    }
    for (size_t i = 0; i < transfers.size(); ++i) {
      const Transfer& t = transfers[i];
      std::string problem;
      if (t.local == nullptr || t.size == 0) {
        problem = "null local buffer or zero size";
      } else if (t.region >= regions_.size()) {
        problem = absl::StrCat("unknown remote region ", t.region);
      } else if (const Bounds& b = regions_[t.region];
                 t.remote_addr < b.base || t.size > b.size ||
                 t.remote_addr - b.base > b.size - t.size) {
        problem = absl::StrCat("remote range [", t.remote_addr, ", +", t.size,
                               ") is outside region ", t.region);
      } else if (t.local_region != nullptr &&
                 !t.local_region->Contains(t.local, t.size)) {
        problem = "local buffer is outside its registered region";
      } else if (mapped && b.mapped != nullptr) {
        peer[i] = b.mapped + (t.remote_addr - b.base);
        continue;
      }
      if (problem.empty()) {
        ++accepted;
      } else {
        batch->Refuse(i, absl::InvalidArgumentError(
                             absl::StrCat("transfer ", i, ": ", problem)));
      }
    }
  }
  if (mapped) {
    // Each copy only before the deadline: a peer that stopped waiting
    // then owns its buffer again, and must find no bytes landing in it.
    for (size_t i = 0; i < peer.size(); ++i) {
      if (peer[i] == nullptr) continue;
      batch->Refuse(i, deadline <= absl::Now()
                           ? absl::DeadlineExceededError(
                                 "transfer batch deadline passed before this "
                                 "block's copy started")
                           : mapped(i, peer[i]));
    }
    mapping.reset();
  }
  if (accepted == 0) {
    batch->Seal(nullptr);
    return handle;
  }
  if (deadline <= absl::Now()) {
    end_all(absl::DeadlineExceededError(
        "transfer batch deadline passed before it started"));
    return handle;
  }
  std::vector<Transfer> copy(transfers.begin(), transfers.end());
  absl::Status queued = worker_.Submit(
      [this, batch, copy = std::move(copy), end] { Post(batch, copy, end); });
  if (!queued.ok()) end_all(queued);
  return handle;
}

void UcxEndpoint::Post(const std::shared_ptr<Batch>& batch,
                       const std::vector<Transfer>& transfers, PutEnd end) {
  in_flight_.erase(
      std::remove_if(in_flight_.begin(), in_flight_.end(),
                     [](const auto& b) { return b->finished(); }),
      in_flight_.end());
  if (ep_ == nullptr) {
    // Failed while the batch waited in the queue.
    batch->RefuseRest(absl::UnavailableError(
        absl::StrCat("UCX endpoint has failed: ", status().message())));
    return;
  }
  if (batch->deadline() <= absl::Now()) {
    // Its deadline passed while it waited in the queue (this thread was
    // stalled or busy): its caller may have given up on it and handed the
    // memory on, so nothing of it is posted. Nothing was sent either, so
    // the endpoint stays up.
    batch->RefuseRest(absl::DeadlineExceededError(
        "UCX transfer batch passed its deadline before "
        "it was posted (the progress thread was stalled "
        "or busy)"));
    return;
  }
  bool posted = false;
  for (size_t i = 0; i < transfers.size(); ++i) {
    if (batch->refused(i)) continue;
    const Transfer& t = transfers[i];
    ucp_request_param_t param = batch->Param(i);
    if (t.local_region != nullptr) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = t.local_region->handle();
    }
    ucp_rkey_h rkey = rkeys_->keys[t.region];
    ucs_status_ptr_t result =
        batch->op() == Batch::Op::kGet
            ? ucp_get_nbx(ep_, t.local, t.size, t.remote_addr, rkey, &param)
            : ucp_put_nbx(ep_, t.local, t.size, t.remote_addr, rkey, &param);
    batch->Posted(i, result);
    posted = true;
  }
  if (posted) {
    if (batch->op() == Batch::Op::kGet) {
      // A get is complete once its bytes are here: a flush would add
      // nothing but, over TCP (where UCX emulates RMA with messages), a
      // request and an answer per batch (put b1 x4 over TCP: +18%).
      batch->Posted(transfers.size(), UCS_STATUS_PTR(UCS_OK));  // no flush
    } else if (end == PutEnd::kFenced && ucp_worker_fence(worker_.handle()) == UCS_OK) {
      batch->Posted(transfers.size(), UCS_STATUS_PTR(UCS_OK));  // no flush
    } else {
      ucp_request_param_t param = batch->Param(transfers.size());
      batch->Posted(transfers.size(), ucp_ep_flush_nbx(ep_, &param));
    }
  }
  batch->Seal(rkeys_);
  if (!batch->finished()) {
    in_flight_.push_back(batch);
    worker_.WakeAt(batch->deadline());
  }
}

absl::Status UcxEndpoint::SendMessage(uint16_t id, std::string header,
                                      std::string payload) {
  if (absl::Status st = status(); !st.ok()) {
    return absl::UnavailableError(
        absl::StrCat("UCX endpoint has failed: ", st.message()));
  }
  return worker_.Post(
      [this, id, header = std::move(header), payload = std::move(payload)]() mutable {
        if (ep_ == nullptr) return;  // failed meanwhile; on_error tells
        const size_t cap = options_.max_unsent_message_bytes;
        if (!unsent_->Admits(cap, transport_internal::MessageWeight(
                                      header.size(), payload.size()))) {
          // The peer takes nothing (stopped, or never progresses): it is
          // treated as lost rather than held for without bound.
          return Fail(
              absl::UnavailableError(absl::StrCat(
                  "UCX endpoint closed: the peer has not taken ",
                  unsent_->count, " messages (", unsent_->bytes,
                  " bytes; at most ", cap, " may wait)")),
              /*from_ucx_callback=*/false, /*notify=*/true,
              /*force=*/options_.deadline_close == DeadlineClose::kForce);
        }
        transport_internal::PostMessage(ep_, id, std::move(header),
                                        std::move(payload), unsent_);
      });
}

absl::Status UcxEndpoint::SendMessageWithData(
    uint16_t id, std::string header, absl::Span<const char> data,
    absl::AnyInvocable<void(const absl::Status&) &&> sent) {
  return SendMessageWithData(id, std::move(header),
                             std::vector<absl::Span<const char>>{data},
                             std::move(sent));
}

absl::Status UcxEndpoint::SendMessageWithData(
    uint16_t id, std::string header, std::vector<absl::Span<const char>> data,
    absl::AnyInvocable<void(const absl::Status&) &&> sent) {
  if (absl::Status st = status(); !st.ok()) {
    return absl::UnavailableError(
        absl::StrCat("UCX endpoint has failed: ", st.message()));
  }
  return worker_.Post([this, id, header = std::move(header), data = std::move(data),
                       sent = std::move(sent)]() mutable {
    if (ep_ == nullptr) {  // failed meanwhile
      return std::move(sent)(absl::UnavailableError("UCX endpoint has failed"));
    }
    transport_internal::PostDataMessage(
        ep_, id, std::move(header), std::move(data),
        [sent = std::move(sent)](ucs_status_t st) mutable {
          std::move(sent)(st == UCS_OK ? absl::OkStatus()
                                       : transport_internal::UcsToStatus(
                                             st, "ucp_am_send_nbx (rendezvous)"));
        });
  });
}

void UcxEndpoint::Fail(absl::Status status, bool from_ucx_callback,
                       bool notify, bool force) {
  {
    absl::MutexLock lock(&mu_);
    if (!status_.ok()) return;
    status_ = status;
  }
  {
    // No copy into the peer's mapped memory runs past this point, and none
    // starts (status_ has failed): the keys holding the mappings may go.
    absl::WriterMutexLock mapping(&mapped_mu_);
    absl::MutexLock lock(&mu_);
    for (Bounds& b : regions_) b.mapped = nullptr;
  }
  const absl::Time abandon_at = absl::Now() + options_.abandon_after;
  for (const auto& batch : in_flight_) {
    batch->Abort(status);
    if (!batch->finished()) {
      UcxWorker* worker = &worker_;
      worker_.RunAt(abandon_at, [batch, worker,
                                 keys = std::weak_ptr<RkeySet>(rkeys_)] {
        batch->Abandon();
        if (batch->finished()) return;
        // Released when UCX ends its requests, or when the worker goes
        // and they with it. The keys (held by the batch: their mappings
        // of the peer's memory) go just before the worker, which they need.
        worker->AtDestroy(
            batch,
            [keys] {
              if (std::shared_ptr<RkeySet> k = keys.lock()) k->Destroy();
            },
            [batch = std::weak_ptr<Batch>(batch)] {
              if (std::shared_ptr<Batch> b = batch.lock()) b->WorkerDestroyed();
            });
      });
    }
  }
  if (ucp_ep_h ep = ep_; ep != nullptr) {
    ep_ = nullptr;
    // Force: the peer may be gone, and nothing in flight may linger. UCX
    // ends the requests still in flight, and their batches finish.
    if (from_ucx_callback) {
      UcxWorker* worker = &worker_;
      worker_.Defer([worker, ep] { worker->CloseEndpoint(ep, /*force=*/true); });
    } else if (force) {
      worker_.CloseEndpoint(ep, /*force=*/true);
    } else {
      // Open until its flush ends, maybe past this object: UCX's error
      // callback then reaches nothing (this endpoint has failed already).
      error_target_->endpoint = nullptr;
      worker_.CloseEndpoint(ep, /*force=*/false, error_target_);
    }
  }
  rkeys_.reset();
  if (notify && options_.on_error) options_.on_error(status);
}

void UcxEndpoint::OnPeerError(void* arg, ucp_ep_h /*ep*/,
                              ucs_status_t status) {
  UcxEndpoint* endpoint = static_cast<ErrorTarget*>(arg)->endpoint;
  if (endpoint == nullptr) return;  // closing in order: the flush fails too
  endpoint->Fail(
      absl::UnavailableError(absl::StrCat("UCX endpoint to the peer failed: ",
                                          ucs_status_string(status))),
      /*from_ucx_callback=*/true, /*notify=*/true);
}

absl::Time UcxEndpoint::OnTick(absl::Time now) {
  absl::Time next = absl::InfiniteFuture();
  bool expired = false;
  for (const auto& batch : in_flight_) {
    if (batch->finished()) continue;
    if (batch->deadline() <= now) {
      batch->Abort(absl::DeadlineExceededError(
          "transfer batch passed its deadline"));
      expired = true;
    } else {
      next = std::min(next, batch->deadline());
    }
  }
  if (expired) {
    Fail(absl::UnavailableError(
             "UCX endpoint closed: a transfer batch on it passed its deadline"),
         /*from_ucx_callback=*/false, /*notify=*/true,
         /*force=*/options_.deadline_close == DeadlineClose::kForce);
    return absl::InfiniteFuture();
  }
  return next;
}

void UcxEndpoint::OnStop() {
  Fail(absl::CancelledError("UCX worker stopped"),
       /*from_ucx_callback=*/false, /*notify=*/false);
}

}  // namespace kvdepot
