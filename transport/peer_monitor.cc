#include "transport/peer_monitor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "transport/internal/peer_endpoint.h"

namespace kvdepot {

struct PeerMonitor::Watched {
  PeerMonitor* monitor;
  uint64_t id;
  ucp_ep_h ep;
};

PeerMonitor::PeerMonitor(UcxWorker& worker, FailureCallback on_failure)
    : worker_(worker), on_failure_(std::move(on_failure)) {
  // Registering cannot fail while the worker runs; a stopped worker leaves
  // the monitor inert (Watch reports Unavailable).
  worker_.Run([this] { worker_.AddResident(this); }).IgnoreError();
}

PeerMonitor::~PeerMonitor() {
  worker_
      .Run([this] {
        CloseAll();
        worker_.RemoveResident(this);
      })
      .IgnoreError();
}

absl::Status PeerMonitor::Watch(uint64_t id, std::string_view peer_address) {
  absl::Status status;
  absl::Status run = worker_.Run([this, id, peer_address, &status] {
    if (stopped_) {
      status = absl::UnavailableError("UCX worker stopped");
      return;
    }
    if (watched_.contains(id)) {
      status = absl::AlreadyExistsError(
          absl::StrCat("peer ", id, " is already watched"));
      return;
    }
    auto w = std::make_unique<Watched>(Watched{this, id, nullptr});
    absl::StatusOr<ucp_ep_h> ep = transport_internal::CreatePeerEndpoint(
        worker_.handle(), peer_address, &PeerMonitor::OnPeerError, w.get());
    if (!ep.ok()) {
      status = ep.status();
      return;
    }
    w->ep = *ep;
    watched_.emplace(id, std::move(w));
  });
  return run.ok() ? status : run;
}

absl::Status PeerMonitor::Unwatch(uint64_t id) {
  absl::Status status;
  absl::Status run = worker_.Run([this, id, &status] {
    auto it = watched_.find(id);
    if (it == watched_.end()) {
      status = absl::NotFoundError(absl::StrCat("peer ", id, " is not watched"));
      return;
    }
    worker_.CloseEndpoint(it->second->ep, /*force=*/true);
    watched_.erase(it);
  });
  return run.ok() ? status : run;
}

size_t PeerMonitor::size() const {
  size_t n = 0;
  worker_.Run([this, &n] { n = watched_.size(); }).IgnoreError();
  return n;
}

void PeerMonitor::OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  Watched* w = static_cast<Watched*>(arg);
  PeerMonitor* self = w->monitor;
  const uint64_t id = w->id;
  // UCX wants the failed endpoint closed, but not from inside its own
  // callback.
  UcxWorker* worker = &self->worker_;
  worker->Defer([worker, ep] { worker->CloseEndpoint(ep, /*force=*/true); });
  self->watched_.erase(id);  // frees *w
  if (self->on_failure_) {
    self->on_failure_(id, absl::UnavailableError(absl::StrCat(
                              "UCX peer failed: ", ucs_status_string(status))));
  }
}

absl::Time PeerMonitor::OnTick(absl::Time) { return absl::InfiniteFuture(); }

void PeerMonitor::OnStop() {
  CloseAll();
  stopped_ = true;
}

void PeerMonitor::CloseAll() {
  for (auto& [id, w] : watched_) worker_.CloseEndpoint(w->ep, /*force=*/true);
  watched_.clear();
}

}  // namespace kvdepot
