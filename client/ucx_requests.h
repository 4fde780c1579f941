// UcxRequests: the client side of kvdepot's request path over UCX active
// messages (transport/request_message.h). PushBlocks / PullBlocks requests
// go to the daemon worker that serves the session (OpenSessionResponse.
// ucx_request_address) over an endpoint of the client's worker; replies come
// back on the daemon's endpoint to that worker and are matched to their
// requests by id. Every request ends exactly once: with its reply, or with
// an error when the connection fails, is replaced, passes the request's
// deadline, or this object goes.
//
// Thread-safe. The worker must outlive this object.
#ifndef KVDEPOT_CLIENT_UCX_REQUESTS_H_
#define KVDEPOT_CLIENT_UCX_REQUESTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transport/request_message.h"
#include "transport/ucx_endpoint.h"
#include "transport/ucx_worker.h"

namespace kvdepot {

class UcxRequests : private UcxWorker::Resident {
 public:
  // Runs once, on the worker's progress thread (it must not block): the
  // reply's status, and with OK its body (the serialized response).
  using Done = absl::AnyInvocable<void(const absl::Status& status,
                                       absl::string_view body) &&>;

  // Takes the replies of `worker` (its handler of kReplyMessageId).
  static absl::StatusOr<std::unique_ptr<UcxRequests>> Create(UcxWorker& worker);
  UcxRequests(const UcxRequests&) = delete;
  UcxRequests& operator=(const UcxRequests&) = delete;
  // Ends every pending request with Cancelled and closes the connection.
  ~UcxRequests() override;

  // Sends the requests of `session` to the daemon worker at `address`.
  // A working connection to that address is kept (the session changes;
  // see below); otherwise connects and waits for the wire-up
  // (UcxEndpoint::Connect, with peer error handling, so a dead daemon ends
  // the requests at once), replacing an earlier connection, whose pending
  // requests end Unavailable. Errors as UcxEndpoint::Connect, or the new
  // connection's own when it failed before this returned (it is then
  // installed failed: Serves is false, and the next Connect to the
  // address connects anew).
  //
  // One connection per daemon worker for this worker's life: kvdepotd makes
  // one endpoint to this worker from its request worker, and this
  // connection pairs with it instead of being wired up anew
  // (DataPlane::RequestAddress), which only holds while each side makes
  // one.
  absl::Status Connect(uint64_t session, std::string_view address,
                       absl::Duration timeout);
  // Stops sending requests for `session` (Serves turns false); the
  // connection stays for the next session. Requests of `session` still
  // pending end Unavailable (the daemon drops the replies of a session it
  // ended). May be called from a Done.
  void Disconnect(uint64_t session);
  // Whether requests for `session` can be sent: the connection serves it and
  // has not failed.
  bool Serves(uint64_t session) const;

  // Sends a request for `session`. When it returns OK, `done` runs exactly
  // once: with the reply, or Unavailable (the connection failed or was
  // replaced), DeadlineExceeded at `deadline`, Cancelled when this object
  // goes. Otherwise nothing was sent and `done` never runs: Unavailable
  // when the connection does not serve `session` (any more),
  // ResourceExhausted when the worker's queue is full. Answered() tells the
  // daemon's reply from a request that ended without one.
  absl::Status Send(uint64_t session, RequestMethod method, std::string body,
                    absl::Time deadline, Done done);

  // Like Send, for a request that carries `data` (its pieces one after the
  // other) as rendezvous data (kDataRequestMessageId: the daemon receives
  // it into memory it picks).
  // `data` must stay valid until `done` runs: the daemon answers once it
  // has received the bytes, or without having read them. A send that fails
  // ends the request Unavailable.
  absl::Status SendWithData(uint64_t session, RequestMethod method,
                            std::string body,
                            std::vector<absl::Span<const char>> data,
                            absl::Time deadline, Done done);

  // Requests sent and not yet ended.
  size_t pending() const;

  // Whether `status`, as a Done got it, is the daemon's reply (an error it
  // answered included). False when the request ended here without one (the
  // connection failed or was replaced, Disconnect, its deadline, the worker
  // stopping, this object going): the daemon may then still run it, or be
  // running it. Such a status carries a payload that says so;
  // WithoutAnswerMark returns it without (for a status shown to callers).
  static bool Answered(const absl::Status& status);
  static absl::Status WithoutAnswerMark(absl::Status status);

 private:
  struct Pending {
    Done done;
    absl::Time deadline;
    uint64_t connection = 0;  // the connection it went on
    uint64_t session = 0;
  };
  explicit UcxRequests(UcxWorker& worker);

  // Destroys a replaced endpoint; on the progress thread (a Done that drops
  // the session) only after the current UCX callback.
  void Dispose(std::unique_ptr<UcxEndpoint> endpoint);
  // Progress thread.
  void OnReply(absl::string_view header, absl::string_view payload);
  absl::Time OnTick(absl::Time now) override;
  void OnStop() override;
  // Send and SendWithData (`data` null for Send).
  absl::Status SendRequest(uint64_t session, RequestMethod method,
                           std::string body,
                           std::vector<absl::Span<const char>>* data,
                           absl::Time deadline, Done done);
  // Ends pending request `id`, if it still is, with `status` marked
  // unanswered (outside mu_).
  void EndOne(uint64_t id, const absl::Status& status);
  // Ends the pending requests for which `which` is true with `status`
  // marked unanswered (outside mu_).
  template <typename Pred>
  void EndWhere(Pred which, const absl::Status& status);

  UcxWorker& worker_;

  mutable absl::Mutex mu_;
  std::unique_ptr<UcxEndpoint> endpoint_ ABSL_GUARDED_BY(mu_);
  std::string address_ ABSL_GUARDED_BY(mu_);  // endpoint_'s peer
  uint64_t session_ ABSL_GUARDED_BY(mu_) = 0;
  // Numbers the connections as Connect starts them; connection_ is the one
  // endpoint_ is (a pending request names the one it went on).
  uint64_t connections_started_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t connection_ ABSL_GUARDED_BY(mu_) = 0;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;  // the current connection
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvdepot

#endif  // KVDEPOT_CLIENT_UCX_REQUESTS_H_
