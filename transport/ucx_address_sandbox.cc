#include "transport/ucx_address_sandbox.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "storage/status_macros.h"
#include "transport/internal/peer_endpoint.h"
#include "transport/ucx_context.h"

extern char** environ;

namespace kvdepot {
namespace {

// Requests and answers go over kUcxAddressSandboxFd, a socket to kvdepotd
// set up at spawn time; the sandbox's stdout is kvdepotd's stderr, since
// UCX may print there as it loads, before main (and stdin is /dev/null).
// A request: mode byte (1: peer error handling), the address's length
// (4 bytes, little-endian), the address. The answer: kCreated, or kRefused
// followed by why: the absl::StatusCode of ucp_ep_create's error (one
// byte), its message's length (one byte) and the message (at most 255
// bytes).
constexpr char kReady = 'R';  // sent once, when its UCX is up
constexpr char kCreated = 'Y';
constexpr char kRefused = 'N';

bool WriteAll(int fd, const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, data, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    data += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Reads exactly n bytes; false at EOF or on an error.
bool ReadAll(int fd, char* data, size_t n) {
  while (n > 0) {
    ssize_t r = read(fd, data, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    data += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void IgnoreError(void*, ucp_ep_h, ucs_status_t) {}

// Creates an endpoint to `address` on `worker` and force-closes it.
// Returns ucp_ep_create's error, if any.
absl::Status TryEndpoint(ucp_worker_h worker, std::string_view address, bool peer) {
  absl::StatusOr<ucp_ep_h> ep = transport_internal::CreatePeerEndpoint(
      worker, address, peer ? &IgnoreError : nullptr, nullptr);
  if (!ep.ok()) return ep.status();
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t req = ucp_ep_close_nbx(*ep, &param);
  if (UCS_PTR_IS_PTR(req)) {
    // A forced close ends without the peer; bounded anyway.
    for (int i = 0; i < 100000 && ucp_request_check_status(req) == UCS_INPROGRESS;
         ++i) {
      ucp_worker_progress(worker);
    }
    if (ucp_request_check_status(req) == UCS_INPROGRESS) std::_Exit(3);
    ucp_request_free(req);
  }
  while (ucp_worker_progress(worker) != 0) {
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> UcxAddressSandboxArgs(
    const std::string& executable, const std::map<std::string, std::string>& config) {
  std::vector<std::string> argv = {executable, kUcxAddressSandboxFlag};
  for (const auto& [name, value] : config) argv.push_back(absl::StrCat(name, "=", value));
  return argv;
}

UcxAddressSandbox::UcxAddressSandbox(std::vector<std::string> argv,
                                     absl::Duration timeout,
                                     absl::Duration start_timeout)
    : argv_(std::move(argv)), timeout_(timeout), start_timeout_(start_timeout) {}

UcxAddressSandbox::~UcxAddressSandbox() {
  absl::MutexLock lock(&io_mu_);
  StopLocked();
}

bool UcxAddressSandbox::TakeTurn(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (!mu_.AwaitWithDeadline(absl::Condition(&idle_), deadline)) return false;
  idle_ = false;
  return true;
}

void UcxAddressSandbox::GiveTurn() {
  absl::MutexLock lock(&mu_);
  idle_ = true;
}

absl::Status UcxAddressSandbox::Start() {
  TakeTurn(absl::InfiniteFuture());  // true: waits as long as it takes
  absl::Cleanup give_turn = [this] { GiveTurn(); };
  absl::MutexLock lock(&io_mu_);
  return ReadyLocked(absl::InfiniteFuture());
}

namespace {

// Waits until `deadline` at the latest for one byte on `fd`: the byte, or
// nullopt (no byte in time, or EOF / an error: the sandbox has gone).
std::optional<char> ReadByte(int fd, absl::Time deadline, bool* timed_out) {
  pollfd p = {fd, POLLIN, 0};
  int ready = 0;
  do {
    const int64_t ms = std::max<int64_t>(
        0, absl::ToInt64Milliseconds(absl::Ceil(deadline - absl::Now(), absl::Milliseconds(1))));
    ready = poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
    // Past 2^30 ms (an infinite deadline) poll again.
  } while ((ready < 0 && errno == EINTR) ||
           (ready == 0 && absl::Now() < deadline));
  *timed_out = ready == 0;
  char c = 0;
  if (ready != 1 || !ReadAll(fd, &c, 1)) return std::nullopt;
  return c;
}

// What Check says for an address UCX refused in the sandbox with an error
// of absl::StatusCode `code` and message `why` (ucp_ep_create's).
absl::Status Refusal(int code, const std::string& why) {
  if (code == static_cast<int>(absl::StatusCode::kInvalidArgument)) {
    // UCX could not read it (UCS_ERR_INVALID_PARAM and the like).
    return absl::InvalidArgumentError(
        absl::StrCat("malformed UCX worker address: UCX cannot read it (", why, ")"));
  }
  // UCX read an address but made no endpoint to it: no transport of it
  // reachable from here ("Destination is unreachable": the two sides'
  // UCX_TLS or devices share none, or the address was cut short and names
  // fewer), or one it could not connect (a shared-memory segment this
  // user may not attach, ...). Not known to be malformed; Unavailable
  // naming UCX, which the client takes as a reason to use its gRPC path.
  return absl::UnavailableError(absl::StrCat(
      "UCX cannot make an endpoint to the client's worker address from "
      "kvdepotd (", why, ", in its UCX address sandbox)"));
}

// A check whose deadline came first (`what` kept the sandbox from
// answering): the client may use gRPC (its fallback takes any code naming
// UCX). DEADLINE_EXCEEDED, not UNAVAILABLE: it says nothing of whether a
// sandbox runs (another check may be replacing it), which the caller
// judges by UNAVAILABLE and pid() (DataPlane: "the sandbox failed").
absl::Status OutOfTime(const char* what) {
  return absl::DeadlineExceededError(absl::StrCat(
      "the UCX address sandbox did not answer by the check's deadline (", what,
      "): the client's UCX worker address is unchecked"));
}

}  // namespace

absl::Status UcxAddressSandbox::SpawnLocked() {
  if (argv_.empty()) return absl::UnavailableError("no UCX address sandbox command");
  // The sandbox's stdout goes to kvdepotd's log (its stderr), or nowhere
  // when kvdepotd has no stderr: never to kvdepotd's socket, which UCX
  // would otherwise write into as it loads.
  const bool have_stderr = fcntl(STDERR_FILENO, F_GETFD) >= 0;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return absl::UnavailableError(
        absl::StrCat("UCX address sandbox: socketpair: ", std::strerror(errno)));
  }
  if (sv[1] <= kUcxAddressSandboxFd) {
    // Moved above the descriptors set up below (dup2 onto itself would
    // keep close-on-exec; a standard one would be replaced).
    const int moved = fcntl(sv[1], F_DUPFD_CLOEXEC, kUcxAddressSandboxFd + 1);
    const int dup_errno = errno;
    close(sv[1]);
    if (moved < 0) {
      close(sv[0]);
      return absl::UnavailableError(
          absl::StrCat("UCX address sandbox: fcntl: ", std::strerror(dup_errno)));
    }
    sv[1] = moved;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, sv[1], kUcxAddressSandboxFd);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  if (have_stderr) {
    posix_spawn_file_actions_adddup2(&actions, STDERR_FILENO, STDOUT_FILENO);
  } else {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  }
  // Nothing else of kvdepotd's stays open there, from the start: descriptors
  // it opened without close-on-exec (UCX's own pipes, client sockets) would
  // otherwise outlive their closing in kvdepotd, and a crash there must
  // not touch them.
  posix_spawn_file_actions_addclosefrom_np(&actions, kUcxAddressSandboxFd + 1);
  // No signal blocked there, and the ones kvdepotd handles at their
  // defaults: the threads that spawn it may have them blocked.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT}) sigaddset(&defaults, sig);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> args;
  for (const std::string& a : argv_) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // Its crashes are expected: UCX installs no signal handlers there (no
  // backtrace in kvdepotd's log for them; Check says what happened), and a
  // crash ends it by its signal.
  std::vector<std::string> env_strings = {"UCX_HANDLE_ERRORS=none", "UCX_ERROR_SIGNALS="};
  // UCX's own line for each address it cannot reach (select.c "no active
  // messages transport", sock.c "connect() failed") would go to kvdepotd's
  // stderr once per client's try, past its log file and its rate limits,
  // and break its JSON lines; the check's answer says why already. An
  // operator's UCX_LOG_LEVEL (to debug UCX) is kept.
  bool log_level_set = false;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view var(*e);
    if (var.substr(0, 18) != "UCX_HANDLE_ERRORS=" && var.substr(0, 18) != "UCX_ERROR_SIGNALS=") {
      env_strings.push_back(*e);
    }
    if (var.substr(0, 14) == "UCX_LOG_LEVEL=") log_level_set = true;
  }
  if (!log_level_set) env_strings.push_back("UCX_LOG_LEVEL=fatal");
  std::vector<char*> env;
  for (std::string& e : env_strings) env.push_back(e.data());
  env.push_back(nullptr);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, argv_[0].c_str(), &actions, &attr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close(sv[1]);
  if (rc != 0) {
    close(sv[0]);
    return absl::UnavailableError(absl::StrCat("UCX address sandbox: cannot start ",
                                               argv_[0], ": ", std::strerror(rc)));
  }
  pid_ = pid;
  sock_ = sv[0];
  // Ready once its UCX is: a check's time starts after that.
  ready_by_ = absl::Now() + start_timeout_;
  answer_by_.reset();
  return absl::OkStatus();
}

int UcxAddressSandbox::StopLocked() {
  if (sock_ >= 0) close(sock_);
  sock_ = -1;
  int status = 0;
  if (const pid_t pid = pid_.load(); pid > 0) {
    kill(pid, SIGKILL);  // a live one (stuck, or answering nonsense) too
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  pid_ = -1;
  ready_by_ = absl::InfiniteFuture();
  answer_by_.reset();
  return status;
}

absl::Status UcxAddressSandbox::ReadyLocked(absl::Time deadline) {
  // At most twice round: a sandbox that went, or got stuck, on an address
  // given up on is replaced once.
  for (int round = 0; round < 2; ++round) {
    if (pid_.load() < 0) RETURN_IF_ERROR(SpawnLocked());
    if (ready_by_ != absl::InfiniteFuture()) {
      bool timed_out = false;
      const std::optional<char> ready =
          ReadByte(sock_, std::min(ready_by_, deadline), &timed_out);
      if (ready == kReady) {
        ready_by_ = absl::InfiniteFuture();
      } else if (timed_out && deadline < ready_by_) {
        return OutOfTime("it is still starting");  // it goes on starting
      } else {
        const int status = StopLocked();
        return absl::UnavailableError(absl::StrCat(
            "UCX address sandbox (", argv_[0], ") did not start: ",
            timed_out ? absl::StrCat("not ready in ",
                                     absl::FormatDuration(start_timeout_))
            : ready.has_value()
                ? absl::StrCat("it said 0x",
                               absl::Hex(static_cast<uint8_t>(*ready)),
                               " instead of that it is ready")
            : WIFEXITED(status)
                ? absl::StrCat("exited with code ", WEXITSTATUS(status),
                               " (its messages are in the log)")
                : absl::StrCat("killed by signal ", WTERMSIG(status))));
      }
    }
    if (!answer_by_.has_value()) return absl::OkStatus();
    // The answer to an address a check gave up on: dropped (that check has
    // returned), or, if it does not come, that sandbox replaced.
    const Answer stale = ReadAnswerLocked(deadline);
    if (stale.how == Read::kAnswer) {
      return absl::OkStatus();
    }
    if (stale.how == Read::kCallerDeadline && !stale.partial) {
      return OutOfTime("it is still on an earlier client's address");
    }
    // Stuck or gone on that address (not this one's doing), or out of step.
    StopLocked();
  }
  return absl::UnavailableError(
      "the UCX address sandbox went twice without an answer; see the log");
}

UcxAddressSandbox::Answer UcxAddressSandbox::ReadAnswerLocked(
    absl::Time deadline) {
  const absl::Time answer_by = *answer_by_;
  const absl::Time until = std::min(answer_by, deadline);
  // No byte by `until`: whose time ran out.
  auto timed_out_read = [&](bool partial) {
    return Answer{
        deadline < answer_by ? Read::kCallerDeadline : Read::kSandboxTimeout,
        absl::Status(), partial};
  };
  bool timed_out = false;
  const std::optional<char> first = ReadByte(sock_, until, &timed_out);
  if (!first.has_value()) {
    return timed_out ? timed_out_read(false)
                     : Answer{Read::kBroken, absl::Status()};
  }
  if (*first == kCreated) {
    answer_by_.reset();
    return Answer{Read::kAnswer, absl::OkStatus()};
  }
  if (*first != kRefused) return Answer{Read::kBroken, absl::Status(), true};
  // Why follows (the same write); cut short, it is no answer.
  const std::optional<char> code = ReadByte(sock_, until, &timed_out);
  const std::optional<char> length =
      code.has_value() ? ReadByte(sock_, until, &timed_out) : std::nullopt;
  std::string why;
  while (length.has_value() && why.size() < static_cast<uint8_t>(*length)) {
    const std::optional<char> c = ReadByte(sock_, until, &timed_out);
    if (!c.has_value()) break;
    why.push_back(*c);
  }
  if (length.has_value() && why.size() == static_cast<uint8_t>(*length)) {
    answer_by_.reset();
    return Answer{Read::kAnswer, Refusal(static_cast<uint8_t>(*code), why)};
  }
  return timed_out ? timed_out_read(true)
                   : Answer{Read::kBroken, absl::Status(), true};
}

absl::Status UcxAddressSandbox::Check(std::string_view address,
                                      bool peer_error_handling,
                                      absl::Time deadline) {
  if (address.empty()) return absl::InvalidArgumentError("empty UCX worker address");
  if (address.size() > kMaxUcxWorkerAddressBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX worker address of ", address.size(), " bytes (at most ",
                     kMaxUcxWorkerAddressBytes, ")"));
  }
  std::string request(5, '\0');
  request[0] = peer_error_handling ? 1 : 0;
  const uint32_t n = static_cast<uint32_t>(address.size());
  for (int i = 0; i < 4; ++i) request[1 + i] = static_cast<char>((n >> (8 * i)) & 0xff);
  request.append(address);

  if (!TakeTurn(deadline)) {
    return OutOfTime("other clients' addresses before it");
  }
  absl::Cleanup give_turn = [this] { GiveTurn(); };
  absl::MutexLock lock(&io_mu_);
  // A sandbox that went before it took the request, or was killed from
  // outside (SIGKILL: the OOM killer, an operator), is not this address's
  // doing: one more try, on a fresh one.
  for (int attempt = 0; attempt < 2; ++attempt) {
    RETURN_IF_ERROR(ReadyLocked(deadline));
    if (!WriteAll(sock_, request.data(), request.size())) {
      StopLocked();
      continue;
    }
    answer_by_ = absl::Now() + timeout_;
    const Answer answer = ReadAnswerLocked(deadline);
    switch (answer.how) {
      case Read::kAnswer:
        return answer.status;
      case Read::kCallerDeadline:
        // Its answer, when it comes, is the next check's to drop -- unless
        // part of it was read here, which leaves the connection out of step.
        if (answer.partial) StopLocked();
        return OutOfTime("it is still on this address");
      case Read::kSandboxTimeout:
        StopLocked();
        // Slow is not malformed: the client may use gRPC (its fallback
        // takes UNAVAILABLE naming UCX).
        return absl::UnavailableError(absl::StrCat(
            "UCX address sandbox took over ", absl::FormatDuration(timeout_),
            " on the client's UCX worker address"));
      case Read::kBroken:
        break;
    }
    const int status = StopLocked();
    if (WIFSIGNALED(status) && WTERMSIG(status) != SIGKILL) {
      return absl::InvalidArgumentError(absl::StrCat(
          "malformed UCX worker address: UCX crashed on it (signal ", WTERMSIG(status),
          ", in a sandbox process)"));
    }
    // Killed from outside, or it exited by itself: try once more.
  }
  return absl::UnavailableError(
      "the UCX address sandbox went twice without an answer; see the log");
}

int RunUcxAddressSandbox(const std::vector<std::string>& args) {
  // UcxAddressSandbox set up its descriptors: kUcxAddressSandboxFd its
  // connection to kvdepotd (requests and answers), stdout on its stderr,
  // stdin /dev/null, nothing else of kvdepotd's. The sandbox goes when
  // kvdepotd does: the connection then ends (the read below), whichever
  // thread of kvdepotd started it.
  const int conn = kUcxAddressSandboxFd;
  struct stat conn_stat;
  if (fstat(conn, &conn_stat) != 0 || !S_ISSOCK(conn_stat.st_mode)) {
    std::fprintf(stderr,
                 "%s: descriptor %d is not a connection to kvdepotd (this mode "
                 "is for kvdepotd's own use)\n",
                 kUcxAddressSandboxFlag, conn);
    return 2;
  }
  UcxContextOptions options;
  options.name = "kvdepotd-sandbox";
  for (const std::string& a : args) {
    std::pair<std::string, std::string> kv = absl::StrSplit(a, absl::MaxSplits('=', 1));
    if (kv.first.empty()) {
      std::fprintf(stderr, "%s: bad setting '%s'\n", kUcxAddressSandboxFlag, a.c_str());
      return 2;
    }
    options.config[kv.first] = kv.second;
  }
  absl::StatusOr<std::unique_ptr<UcxContext>> context = UcxContext::Create(options);
  if (!context.ok()) {
    std::fprintf(stderr, "%s: %s\n", kUcxAddressSandboxFlag,
                 context.status().ToString().c_str());
    return 2;
  }
  ucp_worker_params_t params = {};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  if (ucp_worker_create((*context)->handle(), &params, &worker) != UCS_OK) {
    std::fprintf(stderr, "%s: ucp_worker_create failed\n", kUcxAddressSandboxFlag);
    return 2;
  }
  if (!WriteAll(conn, &kReady, 1)) return 0;
  std::string address;
  for (;;) {
    char header[5];
    if (!ReadAll(conn, header, sizeof header)) break;
    uint32_t n = 0;
    for (int i = 0; i < 4; ++i) n |= static_cast<uint32_t>(static_cast<uint8_t>(header[1 + i])) << (8 * i);
    if (n == 0 || n > kMaxUcxWorkerAddressBytes) break;
    address.resize(n);
    if (!ReadAll(conn, address.data(), n)) break;
    const absl::Status tried = TryEndpoint(worker, address, header[0] == 1);
    std::string answer(1, kCreated);
    if (!tried.ok()) {
      const absl::string_view why = tried.message().substr(0, 255);
      answer = {kRefused, static_cast<char>(tried.code()), static_cast<char>(why.size())};
      answer.append(why.data(), why.size());
    }
    if (!WriteAll(conn, answer.data(), answer.size())) break;
  }
  ucp_worker_destroy(worker);
  return 0;
}

}  // namespace kvdepot
