#include "transport/ucx_address_sandbox.h"

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "transport/internal/peer_endpoint.h"
#include "transport/ucx_context.h"

extern char** environ;

namespace kvdepot {
namespace {

// A request: mode byte (1: peer error handling), the address's length
// (4 bytes, little-endian), the address. The answer: one byte.
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
bool TryEndpoint(ucp_worker_h worker, std::string_view address, bool peer) {
  absl::StatusOr<ucp_ep_h> ep = transport_internal::CreatePeerEndpoint(
      worker, address, peer ? &IgnoreError : nullptr, nullptr);
  if (!ep.ok()) return false;
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
  return true;
}

}  // namespace

std::vector<std::string> UcxAddressSandboxArgs(
    const std::string& executable, const std::map<std::string, std::string>& config) {
  std::vector<std::string> argv = {executable, kUcxAddressSandboxFlag};
  for (const auto& [name, value] : config) argv.push_back(absl::StrCat(name, "=", value));
  return argv;
}

UcxAddressSandbox::UcxAddressSandbox(std::vector<std::string> argv,
                                     absl::Duration timeout)
    : argv_(std::move(argv)), timeout_(timeout) {}

UcxAddressSandbox::~UcxAddressSandbox() {
  absl::MutexLock lock(&mu_);
  StopLocked(/*kill_first=*/true);
}

absl::Status UcxAddressSandbox::Start() {
  absl::MutexLock lock(&mu_);
  return pid_ > 0 ? absl::OkStatus() : StartLocked();
}

pid_t UcxAddressSandbox::pid() {
  absl::MutexLock lock(&mu_);
  return pid_;
}

absl::Status UcxAddressSandbox::StartLocked() {
  if (argv_.empty()) return absl::UnavailableError("no UCX address sandbox command");
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return absl::UnavailableError(
        absl::StrCat("UCX address sandbox: socketpair: ", std::strerror(errno)));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, sv[1], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, sv[1], STDOUT_FILENO);
  std::vector<char*> args;
  for (const std::string& a : argv_) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // Its crashes are expected: no UCX backtrace in kvdepotd's log for them
  // (Check says what happened).
  // UCX then installs no signal handlers there, and a crash ends it by its
  // signal.
  std::vector<std::string> env_strings = {"UCX_HANDLE_ERRORS=none", "UCX_ERROR_SIGNALS="};
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view var(*e);
    if (var.substr(0, 18) != "UCX_HANDLE_ERRORS=" && var.substr(0, 18) != "UCX_ERROR_SIGNALS=") {
      env_strings.push_back(*e);
    }
  }
  std::vector<char*> env;
  for (std::string& e : env_strings) env.push_back(e.data());
  env.push_back(nullptr);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, argv_[0].c_str(), &actions, nullptr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  close(sv[1]);
  if (rc != 0) {
    close(sv[0]);
    return absl::UnavailableError(absl::StrCat("UCX address sandbox: cannot start ",
                                               argv_[0], ": ", std::strerror(rc)));
  }
  pid_ = pid;
  sock_ = sv[0];
  return absl::OkStatus();
}

int UcxAddressSandbox::StopLocked(bool kill_first) {
  if (sock_ >= 0) close(sock_);  // a live sandbox exits at EOF
  sock_ = -1;
  int status = 0;
  if (pid_ > 0) {
    if (kill_first) kill(pid_, SIGKILL);
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
  pid_ = -1;
  return status;
}

absl::Status UcxAddressSandbox::Check(std::string_view address,
                                      bool peer_error_handling) {
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

  absl::MutexLock lock(&mu_);
  // A sandbox killed from outside (SIGKILL: the OOM killer, an operator)
  // is not this address's doing: one more try, on a fresh one.
  for (int attempt = 0;; ++attempt) {
    if (pid_ < 0) {
      if (absl::Status started = StartLocked(); !started.ok()) return started;
    }
    bool answered = false;
    char answer = 0;
    int ready = 0;
    if (WriteAll(sock_, request.data(), request.size())) {
      pollfd p = {sock_, POLLIN, 0};
      const absl::Time deadline = absl::Now() + timeout_;
      do {
        const int64_t ms = std::max<int64_t>(
            0, absl::ToInt64Milliseconds(
                   absl::Ceil(deadline - absl::Now(), absl::Milliseconds(1))));
        ready = poll(&p, 1, static_cast<int>(ms));
      } while (ready < 0 && errno == EINTR);
      answered = ready == 1 && ReadAll(sock_, &answer, 1) &&
                 (answer == kCreated || answer == kRefused);
    }
    if (answered) {
      if (answer == kCreated) return absl::OkStatus();
      return absl::InvalidArgumentError(
          "malformed UCX worker address: UCX cannot make an endpoint to it");
    }
    const bool timed_out = ready == 0;
    const int status = StopLocked(/*kill_first=*/timed_out);
    const bool killed_outside =
        !timed_out && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    if (killed_outside && attempt == 0) continue;
    if (!timed_out && WIFEXITED(status)) {  // it could not run UCX at all
      return absl::UnavailableError(absl::StrCat(
          "the UCX address sandbox (", argv_[0], ") exited with code ",
          WEXITSTATUS(status), " without an answer; see its messages in the log"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "malformed UCX worker address: UCX ",
        timed_out ? "did not finish with it" : "crashed on it",
        " (in a sandbox process)"));
  }
}

int RunUcxAddressSandbox(const std::vector<std::string>& args) {
  // Goes with kvdepotd.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() == 1) return 2;
  // Nothing of kvdepotd's but stdin, stdout and stderr: descriptors it
  // opened without close-on-exec (UCX's own pipes among them) would stay
  // open here, and a crash here must not touch them.
  if (close_range(3, ~0U, 0) != 0) {
    for (int fd = 3; fd < 1024; ++fd) close(fd);
  }
  // UCX logs to stdout: the answers go on a descriptor of their own, and
  // stdout to stderr (kvdepotd's log).
  const int answers = dup(STDOUT_FILENO);
  if (answers < 0 || dup2(STDERR_FILENO, STDOUT_FILENO) < 0) return 2;
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
  if (ucp_worker_create((*context)->handle(), &params, &worker) != UCS_OK) return 2;
  std::string address;
  for (;;) {
    char header[5];
    if (!ReadAll(STDIN_FILENO, header, sizeof header)) break;
    uint32_t n = 0;
    for (int i = 0; i < 4; ++i) n |= static_cast<uint32_t>(static_cast<uint8_t>(header[1 + i])) << (8 * i);
    if (n == 0 || n > kMaxUcxWorkerAddressBytes) break;
    address.resize(n);
    if (!ReadAll(STDIN_FILENO, address.data(), n)) break;
    const char answer = TryEndpoint(worker, address, header[0] == 1) ? kCreated : kRefused;
    if (!WriteAll(answers, &answer, 1)) break;
  }
  ucp_worker_destroy(worker);
  return 0;
}

}  // namespace kvdepot
