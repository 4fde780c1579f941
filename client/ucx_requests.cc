#include "client/ucx_requests.h"

#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "storage/internal/sync_point.h"
#include "storage/status_macros.h"

namespace kvdepot {
namespace {

// How often pending requests are checked against their deadlines.
constexpr absl::Duration kDeadlineCheck = absl::Milliseconds(50);

// The payload of a status a request ended with here, without the daemon's
// reply (Answered).
constexpr absl::string_view kUnansweredUrl = "kvdepot.UcxRequests/unanswered";

absl::Status MarkUnanswered(absl::Status status) {
  status.SetPayload(kUnansweredUrl, absl::Cord());
  return status;
}

}  // namespace

bool UcxRequests::Answered(const absl::Status& status) {
  return !status.GetPayload(kUnansweredUrl).has_value();
}

absl::Status UcxRequests::WithoutAnswerMark(absl::Status status) {
  status.ErasePayload(kUnansweredUrl);
  return status;
}

UcxRequests::UcxRequests(UcxWorker& worker) : worker_(worker) {}

absl::StatusOr<std::unique_ptr<UcxRequests>> UcxRequests::Create(UcxWorker& worker) {
  std::unique_ptr<UcxRequests> r(new UcxRequests(worker));
  UcxRequests* self = r.get();
  RETURN_IF_ERROR(worker.SetMessageHandler(
      kReplyMessageId, [self](absl::string_view header, absl::string_view payload,
                              const UcxWorker::MessageSender&) {
        self->OnReply(header, payload);
      }));
  RETURN_IF_ERROR(worker.Run([self] {
    self->worker_.AddResident(self);
    self->worker_.WakeAt(absl::Now() + kDeadlineCheck);
  }));
  return r;
}

UcxRequests::~UcxRequests() {
  // No reply handler or tick reaches this object after these.
  worker_
      .SetMessageHandler(kReplyMessageId,
                         [](absl::string_view, absl::string_view,
                            const UcxWorker::MessageSender&) {})
      .IgnoreError();
  worker_.Run([this] { worker_.RemoveResident(this); }).IgnoreError();
  std::unique_ptr<UcxEndpoint> endpoint;
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    endpoint = std::move(endpoint_);
  }
  EndWhere([](const Pending&) { return true; },
           absl::CancelledError("kvdepot client closed"));
  endpoint.reset();  // waits on the progress thread: outside mu_
}

absl::Status UcxRequests::Connect(uint64_t session, std::string_view address,
                                  absl::Duration timeout) {
  uint64_t connection;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return absl::CancelledError("kvdepot client closed");
    if (endpoint_ != nullptr && !failed_ && address_ == address &&
        connections_started_ == connection_) {
      session_ = session;  // the connection this worker keeps
      return absl::OkStatus();
    }
    connection = ++connections_started_;
  }
  UcxEndpointOptions options;
  options.connect_timeout = timeout;
  options.peer_error_handling = true;  // a dead daemon ends requests at once
  options.on_error = [this, connection](const absl::Status& why) {
    {
      absl::MutexLock lock(&mu_);
      if (connection_ == connection) failed_ = true;
    }
    EndWhere([connection](const Pending& p) { return p.connection == connection; },
             absl::UnavailableError(absl::StrCat(
                 "UCX connection to kvdepotd failed: ", why.message())));
  };
  absl::StatusOr<std::unique_ptr<UcxEndpoint>> endpoint =
      UcxEndpoint::Connect(worker_, address, std::move(options));
  absl::Status result = endpoint.status();
  // Arg: the new UcxEndpoint, not installed yet (null when it failed to
  // connect).
  internal::TestSyncPoint("UcxRequests::Connect:BeforeInstall",
                          endpoint.ok() ? endpoint->get() : nullptr);
  std::unique_ptr<UcxEndpoint> old;
  bool installed = false;
  {
    absl::MutexLock lock(&mu_);
    if (connections_started_ != connection || stopped_) {
      // Another Connect (or the destructor) came after this one: it wins.
      old = endpoint.ok() ? *std::move(endpoint) : nullptr;
    } else {
      installed = true;
      old = std::move(endpoint_);
      connection_ = connection;
      if (endpoint.ok()) {
        endpoint_ = *std::move(endpoint);
        address_ = std::string(address);
        session_ = session;
        // The endpoint may have failed since UcxEndpoint::Connect returned:
        // its on_error then found connection_ naming the connection it
        // replaces and set nothing, so its failure is taken here. One that
        // fails from here on finds connection_ == connection (its status
        // is set before on_error runs, which waits for mu_).
        result = endpoint_->status();
        failed_ = !result.ok();
      } else {
        address_.clear();
        session_ = 0;
        failed_ = true;
      }
    }
  }
  if (installed) {  // what went on the connection it replaced ends now
    EndWhere([connection](const Pending& p) { return p.connection != connection; },
             absl::UnavailableError("UCX connection to kvdepotd was replaced"));
  }
  Dispose(std::move(old));
  return result;
}

void UcxRequests::Disconnect(uint64_t session) {
  {
    absl::MutexLock lock(&mu_);
    if (session_ == session) session_ = 0;
  }
  EndWhere([session](const Pending& p) { return p.session == session; },
           absl::UnavailableError("the session's UCX requests were stopped"));
}

void UcxRequests::Dispose(std::unique_ptr<UcxEndpoint> endpoint) {
  if (endpoint == nullptr) return;
  if (!worker_.OnProgressThread()) {
    endpoint.reset();  // waits behind the work the endpoint queued
    return;
  }
  // Inside a UCX callback (a reply's, or this endpoint's own on_error),
  // with sends of this endpoint possibly still queued: it goes in a task
  // queued after them, outside any callback.
  auto holder = std::make_shared<std::unique_ptr<UcxEndpoint>>(std::move(endpoint));
  if (!worker_.Post([holder] { holder->reset(); }).ok()) {
    // Stopping: the worker runs what is queued, then OnStop; after that.
    worker_.Defer([holder] { holder->reset(); });
  }
}

bool UcxRequests::Serves(uint64_t session) const {
  absl::MutexLock lock(&mu_);
  return session != 0 && session_ == session && !failed_ && endpoint_ != nullptr;
}

size_t UcxRequests::pending() const {
  absl::MutexLock lock(&mu_);
  return pending_.size();
}

absl::Status UcxRequests::Send(uint64_t session, RequestMethod method,
                               std::string body, absl::Time deadline, Done done) {
  return SendRequest(session, method, std::move(body), nullptr, deadline,
                     std::move(done));
}

absl::Status UcxRequests::SendWithData(uint64_t session, RequestMethod method,
                                       std::string body,
                                       std::vector<absl::Span<const char>> data,
                                       absl::Time deadline, Done done) {
  return SendRequest(session, method, std::move(body), &data, deadline,
                     std::move(done));
}

absl::Status UcxRequests::SendRequest(uint64_t session, RequestMethod method,
                                      std::string body,
                                      std::vector<absl::Span<const char>>* data,
                                      absl::Time deadline, Done done) {
  absl::MutexLock lock(&mu_);
  if (stopped_ || session == 0 || session_ != session || failed_ ||
      endpoint_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("no UCX connection to kvdepotd for session ", session));
  }
  const uint64_t id = next_id_++;
  pending_.emplace(id, Pending{std::move(done), deadline, connection_, session});
  // Under mu_, so the endpoint cannot be replaced meanwhile: SendMessage
  // only queues work for the progress thread, which never holds what
  // SendMessage takes while it waits for mu_.
  const RequestHeader header{method, id, session};
  absl::Status sent =
      data == nullptr
          ? endpoint_->SendMessage(kRequestMessageId, EncodeRequestHeader(header),
                                   std::move(body))
          : endpoint_->SendMessageWithData(
                kDataRequestMessageId, EncodeDataRequestHeader(header, body),
                std::move(*data), [this, id](const absl::Status& st) {
                  if (st.ok()) return;
                  // Progress thread, no lock held.
                  EndOne(id, absl::UnavailableError(absl::StrCat(
                                 "sending the request's data failed: ",
                                 st.message())));
                });
  if (!sent.ok()) pending_.erase(id);
  return sent;
}

void UcxRequests::OnReply(absl::string_view header, absl::string_view payload) {
  std::optional<ReplyHeader> h = DecodeReplyHeader(header);
  if (!h) return;  // not a reply of ours
  Done done;
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(h->request_id);
    if (it == pending_.end()) return;  // ended already (deadline, failure)
    // A reply for a request of another session than this one's is not
    // its answer (the daemon names the session the request named): left
    // to its real answer or its deadline.
    if (it->second.session != h->session_id) return;
    done = std::move(it->second.done);
    pending_.erase(it);
  }
  if (h->code == absl::StatusCode::kOk) {
    std::move(done)(absl::OkStatus(), payload);
  } else {
    std::move(done)(absl::Status(h->code, payload), absl::string_view());
  }
}

absl::Time UcxRequests::OnTick(absl::Time now) {
  EndWhere([now](const Pending& p) { return p.deadline <= now; },
           absl::DeadlineExceededError(
               "kvdepotd did not answer the UCX request before its deadline"));
  return now + kDeadlineCheck;
}

void UcxRequests::OnStop() {
  EndWhere([](const Pending&) { return true; },
           absl::CancelledError("the client's UCX worker stopped (the client "
                                "closed, or a get that failed in flight "
                                "fenced it)"));
}

void UcxRequests::EndOne(uint64_t id, const absl::Status& status) {
  Done done;
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return;  // ended already
    done = std::move(it->second.done);
    pending_.erase(it);
  }
  std::move(done)(MarkUnanswered(status), absl::string_view());
}

template <typename Pred>
void UcxRequests::EndWhere(Pred which, const absl::Status& status) {
  std::vector<Done> ended;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (which(it->second)) {
        ended.push_back(std::move(it->second.done));
        pending_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  if (ended.empty()) return;
  const absl::Status unanswered = MarkUnanswered(status);
  for (Done& done : ended) std::move(done)(unanswered, absl::string_view());
}

}  // namespace kvdepot
