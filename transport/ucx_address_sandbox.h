// UcxAddressSandbox: a peer's UCX worker address is tried in a separate
// process before this one's UCX sees it.
//
// UCX 1.13 unpacks a worker address without a length and trusts what it
// finds: ucp_ep_create with a truncated or altered address reads past it
// and crashed kvdepotd (a segfault in uct_tcp_ep_set_dest_addr for an
// address cut at 47 of its bytes; transport/README, caveat 9). Any client
// that can call OpenSession sends one. So kvdepotd first has a sandbox
// process -- itself, started with `--ucx-address-sandbox` and the same UCX
// settings -- create (and at once force-close) an endpoint to the address
// with the error handling kvdepotd will use. An address the sandbox did
// not survive, or that UCX refused there, is refused; the sandbox is
// started again for the next one.
//
// The sandbox is one long-lived process, so a check costs a socket round
// trip and an endpoint creation (a TCP connection to the peer is opened
// and closed: the peer sees one more connection from this host). It talks
// to kvdepotd over descriptor kUcxAddressSandboxFd, set up when it is
// spawned; its stdout is kvdepotd's stderr, because UCX may print there
// as it loads, before the sandbox's main runs.
//
// Thread-safe: checks run one at a time, each waiting its turn no longer
// than its deadline.
#ifndef KVDEPOT_TRANSPORT_UCX_ADDRESS_SANDBOX_H_
#define KVDEPOT_TRANSPORT_UCX_ADDRESS_SANDBOX_H_

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvdepot {

// The flag that makes kvdepotd run RunUcxAddressSandbox (first argument).
inline constexpr char kUcxAddressSandboxFlag[] = "--ucx-address-sandbox";
// Longest worker address a sandbox takes (UCX's are a few hundred bytes).
inline constexpr size_t kMaxUcxWorkerAddressBytes = 64 * 1024;
// The sandbox's descriptor for requests and answers: a socket to kvdepotd.
inline constexpr int kUcxAddressSandboxFd = 3;

class UcxAddressSandbox {
 public:
  // `argv`: the sandbox's command line, argv[0] its executable, e.g.
  // {"/proc/self/exe" resolved, kUcxAddressSandboxFlag, "TLS=tcp", ...}
  // (UcxAddressSandboxArgs). Nothing is started until the first Check.
  explicit UcxAddressSandbox(std::vector<std::string> argv,
                             absl::Duration timeout = absl::Seconds(5),
                             absl::Duration start_timeout = absl::Seconds(30));
  ~UcxAddressSandbox();  // kills the sandbox process
  UcxAddressSandbox(const UcxAddressSandbox&) = delete;
  UcxAddressSandbox& operator=(const UcxAddressSandbox&) = delete;

  // OK when UCX in the sandbox created an endpoint to `address` with
  // (`peer_error_handling`) or without peer error handling.
  // InvalidArgument ("malformed UCX worker address") when UCX could not
  // read the address there (its error maps to InvalidArgument), or the
  // sandbox died of a signal (not SIGKILL) on it. Unavailable, naming UCX
  // (a client then uses its gRPC path): UCX refused the address with
  // another error, naming it (no transport of it reachable from here --
  // also what an address cut short mostly reads as -- or a shared-memory
  // segment it may not attach); no sandbox starts (it must say it is ready
  // within start_timeout); one took longer than `timeout` on the address;
  // or sandboxes went twice without an answer (killed from outside, or
  // exiting by themselves). After the last three pid() is -1: a sandbox
  // that went is started again at the next check.
  //
  // Returns by `deadline` (give or take a scheduling delay) in any case:
  // DeadlineExceeded, naming UCX, when the answer has not come by then --
  // another check's turn lasted until then, the sandbox is still starting,
  // or it is still on this address or an earlier one. What such a check
  // leaves is not lost: the next check waits (within its own deadline) for
  // the sandbox to become ready, or reads and drops the answer still owed
  // to the address given up on, before it sends its own, so that no check
  // takes another's answer; start_timeout and `timeout` still count from
  // the start and from the request.
  absl::Status Check(std::string_view address, bool peer_error_handling,
                     absl::Time deadline = absl::InfiniteFuture());

  // Starts the sandbox process now rather than at the first Check, and
  // waits until it is ready (at most start_timeout).
  absl::Status Start();

  // The sandbox's process id, -1 when none runs (for tests). Does not wait
  // for a check in progress.
  pid_t pid() const { return pid_.load(); }

 private:
  // How reading the sandbox's answer to a request ended.
  enum class Read {
    kAnswer,          // whole: `status` is the check's result
    kCallerDeadline,  // none yet by the caller's deadline
    kSandboxTimeout,  // none within `timeout` of the request
    kBroken,          // the connection ended, or made no sense
  };
  struct Answer {
    Read how;
    absl::Status status;   // kAnswer only
    bool partial = false;  // some of it was read: the connection is out of step
  };

  // Waits (within `deadline`) for the turn to talk to the sandbox; false
  // when another check still has it then.
  bool TakeTurn(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  void GiveTurn() ABSL_LOCKS_EXCLUDED(mu_);
  // With the turn: a running sandbox, ready, that owes no answer -- started
  // when none runs, waited for while it starts, its answer to an address
  // given up on read and dropped. Unavailable when `deadline` comes first
  // (it stays as it is for the next check), or when no sandbox starts.
  absl::Status ReadyLocked(absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(io_mu_);
  // Spawns the sandbox process; it has until ready_by_ to say it is ready.
  absl::Status SpawnLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(io_mu_);
  // Reads the answer to the request sent last (due by *answer_by_), waiting
  // no later than `deadline`.
  Answer ReadAnswerLocked(absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(io_mu_);
  // Closes the connection, kills the sandbox (SIGKILL: a no-op for one
  // that has gone) and reaps it; returns its wait status.
  int StopLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(io_mu_);

  const std::vector<std::string> argv_;
  const absl::Duration timeout_;
  const absl::Duration start_timeout_;

  // Whose turn it is: held only to take or give it, so that a check
  // waiting for its turn can give up at its deadline.
  absl::Mutex mu_;
  bool idle_ ABSL_GUARDED_BY(mu_) = true;  // no check has the turn

  // The conversation with the sandbox: the turn's holder (and the
  // destructor) only, so never held long by anyone else.
  absl::Mutex io_mu_;
  int sock_ ABSL_GUARDED_BY(io_mu_) = -1;  // to and from the sandbox
  // Until it has said it is ready: by when it must (InfiniteFuture once
  // it has).
  absl::Time ready_by_ ABSL_GUARDED_BY(io_mu_) = absl::InfiniteFuture();
  // While an answer is owed (a request sent, its answer not yet read, as
  // when a check gave up on it): by when it must come.
  std::optional<absl::Time> answer_by_ ABSL_GUARDED_BY(io_mu_);
  // Written under io_mu_; -1 when none runs.
  std::atomic<pid_t> pid_{-1};
};

// The sandbox command line for `executable` and UCX settings `config` (as
// UcxContextOptions::config): executable, kUcxAddressSandboxFlag, then one
// "NAME=VALUE" per setting.
std::vector<std::string> UcxAddressSandboxArgs(
    const std::string& executable, const std::map<std::string, std::string>& config);

// The sandbox itself: `args` are what follows kUcxAddressSandboxFlag. Reads
// requests from and answers on kUcxAddressSandboxFd (as UcxAddressSandbox
// spawns it), returns the process's exit code when that connection ends
// (or at once, 2, for bad arguments, no such connection, or no UCX).
int RunUcxAddressSandbox(const std::vector<std::string>& args);

}  // namespace kvdepot

#endif  // KVDEPOT_TRANSPORT_UCX_ADDRESS_SANDBOX_H_
