// UcxAddressSandbox over real UCX: ucx_test_peer runs the sandbox as
// kvdepotd does (started with kUcxAddressSandboxFlag).
#include "transport/ucx_address_sandbox.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "transport/ucx_context.h"
#include "transport/ucx_test_util.h"
#include "transport/ucx_worker.h"

namespace kvdepot {
namespace {

class UcxAddressSandboxTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    UcxContextOptions options;
    options.config = ucx_test::TransportConfig(GetParam());
    absl::StatusOr<std::unique_ptr<UcxContext>> context = UcxContext::Create(options);
    if (!context.ok()) {
      GTEST_SKIP() << "UCX cannot create a context here (" << context.status() << ")";
    }
    context_ = *std::move(context);
    absl::StatusOr<std::unique_ptr<UcxWorker>> worker = UcxWorker::Create(*context_);
    ASSERT_TRUE(worker.ok()) << worker.status();
    worker_ = *std::move(worker);
    sandbox_ = std::make_unique<UcxAddressSandbox>(UcxAddressSandboxArgs(
        KVDEPOT_UCX_TEST_PEER, ucx_test::TransportConfig(GetParam())));
  }

  std::unique_ptr<UcxContext> context_;
  std::unique_ptr<UcxWorker> worker_;  // the peer whose address is checked
  std::unique_ptr<UcxAddressSandbox> sandbox_;
};

TEST_P(UcxAddressSandboxTest, TakesARealAddressAndRefusesBrokenOnesWithoutDying) {
  const std::string address = worker_->address();
  EXPECT_EQ(sandbox_->pid(), -1) << "started before the first check";
  ASSERT_TRUE(sandbox_->Check(address, /*peer_error_handling=*/true).ok());
  ASSERT_TRUE(sandbox_->Check(address, /*peer_error_handling=*/false).ok());
  const pid_t first = sandbox_->pid();
  ASSERT_GT(first, 0);
  // Every truncation: each one is refused, or taken (a shorter address UCX
  // can read); some of them kill UCX (kvdepotd died at 31 bytes), which
  // the sandbox survives by starting another process. Refused as
  // malformed, or, most of them, as naming no transport UCX reaches from
  // here (Unavailable, which the client answers with its gRPC path).
  int refused = 0;
  int malformed = 0;
  for (size_t n = 1; n < address.size(); ++n) {
    absl::Status st = sandbox_->Check(address.substr(0, n), true);
    if (!st.ok()) {
      ++refused;
      if (absl::IsInvalidArgument(st)) {
        ++malformed;
        EXPECT_TRUE(absl::StrContains(st.message(), "malformed")) << n << ": " << st;
      } else {
        EXPECT_TRUE(absl::IsUnavailable(st)) << n << ": " << st;
        EXPECT_TRUE(absl::StrContains(st.message(), "UCX")) << n << ": " << st;
        EXPECT_FALSE(absl::StrContains(st.message(), "malformed")) << n << ": " << st;
      }
    }
  }
  EXPECT_GT(malformed, 0) << "no truncation crashed UCX or was unreadable";
  EXPECT_GT(refused, 0);
  EXPECT_NE(sandbox_->pid(), first) << "no truncation crashed the sandbox";
  // And it still answers.
  EXPECT_TRUE(sandbox_->Check(address, true).ok());
}

// UCX's own error line for each address it cannot use (one per client's
// try) would reach kvdepotd's stderr from the sandbox, past its log file
// and its rate limits; the check's answer says why already.
TEST_P(UcxAddressSandboxTest, UcxPrintsNoLinePerRefusedAddress) {
  const std::string address = worker_->address();
  char path[] = "/tmp/kvdepot-sandbox-stderr-XXXXXX";
  const int file = mkstemp(path);
  ASSERT_GE(file, 0);
  const int saved = dup(STDERR_FILENO);
  ASSERT_GE(saved, 0);
  fflush(stderr);
  ASSERT_EQ(dup2(file, STDERR_FILENO), STDERR_FILENO);  // the sandbox's too
  int refused = 0;
  for (size_t n = 1; n < address.size(); ++n) {
    if (!sandbox_->Check(address.substr(0, n), true).ok()) ++refused;
  }
  sandbox_.reset();  // nothing more of it to come
  fflush(stderr);
  dup2(saved, STDERR_FILENO);
  close(saved);
  std::string printed;
  char buf[4096];
  ssize_t got;
  lseek(file, 0, SEEK_SET);
  while ((got = read(file, buf, sizeof(buf))) > 0) printed.append(buf, got);
  close(file);
  unlink(path);
  EXPECT_GT(refused, 0);
  EXPECT_FALSE(absl::StrContains(printed, "UCX  ERROR")) << printed;
}

TEST_P(UcxAddressSandboxTest, ASandboxThatDiedBetweenChecksIsStartedAgain) {
  const std::string address = worker_->address();
  ASSERT_TRUE(sandbox_->Check(address, true).ok());
  const pid_t first = sandbox_->pid();
  ASSERT_EQ(kill(first, SIGKILL), 0);
  // Not blamed on the next address.
  EXPECT_TRUE(sandbox_->Check(address, true).ok());
  EXPECT_NE(sandbox_->pid(), first);
}

TEST_P(UcxAddressSandboxTest, ASlowSandboxIsUnavailableNotAMalformedAddress) {
  UcxAddressSandbox slow(UcxAddressSandboxArgs(KVDEPOT_UCX_TEST_PEER,
                                               ucx_test::TransportConfig(GetParam())),
                         /*timeout=*/absl::Milliseconds(300));
  const std::string address = worker_->address();
  ASSERT_TRUE(slow.Check(address, true).ok());
  const pid_t stuck = slow.pid();
  ASSERT_EQ(kill(stuck, SIGSTOP), 0);  // as a sandbox stuck inside UCX
  absl::Status st = slow.Check(address, true);
  EXPECT_TRUE(absl::IsUnavailable(st)) << st;  // the client may use gRPC
  EXPECT_NE(slow.pid(), stuck);
  EXPECT_TRUE(slow.Check(address, true).ok());  // on a fresh one
}

// A check given a deadline returns by it, however slow the sandbox (here
// stopped, as one stuck inside UCX, with a timeout of its own far longer):
// Unavailable, naming UCX, so that the client can still use gRPC in time.
// The sandbox is not replaced for it: the answer it owes is read and
// dropped by the next check, which gets its own answer, not that one.
TEST_P(UcxAddressSandboxTest,
       ACheckEndsByItsDeadlineAndTheNextGetsItsOwnAnswer) {
  UcxAddressSandbox slow(
      UcxAddressSandboxArgs(KVDEPOT_UCX_TEST_PEER,
                            ucx_test::TransportConfig(GetParam())),
      /*timeout=*/absl::Seconds(20));
  const std::string address = worker_->address();
  ASSERT_TRUE(slow.Check(address, true).ok());
  const pid_t stuck = slow.pid();
  ASSERT_EQ(kill(stuck, SIGSTOP), 0);
  const absl::Time start = absl::Now();
  // A sound address: its answer, owed, would pass the broken one below.
  absl::Status st = slow.Check(address, true, start + absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(absl::IsDeadlineExceeded(st)) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "UCX")) << st;
  // Its deadline, not the sandbox's 20 s; generous for a loaded machine.
  EXPECT_LT(took, absl::Seconds(3)) << st;
  EXPECT_EQ(slow.pid(), stuck) << "the sandbox was replaced";
  ASSERT_EQ(kill(stuck, SIGCONT), 0);
  EXPECT_FALSE(slow.Check(address.substr(0, 2), true).ok())
      << "a broken address got the answer owed to the sound one";
  EXPECT_TRUE(slow.Check(address, true).ok());
}

// Checks that wait for their turn behind a stuck one give up at their own
// deadlines too; the sandbox serves correctly once it continues.
TEST_P(UcxAddressSandboxTest, ConcurrentChecksEachEndByTheirOwnDeadline) {
  UcxAddressSandbox slow(
      UcxAddressSandboxArgs(KVDEPOT_UCX_TEST_PEER,
                            ucx_test::TransportConfig(GetParam())),
      /*timeout=*/absl::Seconds(20));
  const std::string address = worker_->address();
  ASSERT_TRUE(slow.Check(address, true).ok());
  const pid_t stuck = slow.pid();
  ASSERT_EQ(kill(stuck, SIGSTOP), 0);
  const absl::Time start = absl::Now();
  const absl::Duration waits[] = {absl::Milliseconds(300),
                                  absl::Milliseconds(600)};
  absl::Status status[2];
  absl::Duration took[2];
  {
    std::vector<std::thread> checks;
    for (int i = 0; i < 2; ++i) {
      checks.emplace_back([&, i] {
        status[i] = slow.Check(address, true, start + waits[i]);
        took[i] = absl::Now() - start;
      });
    }
    for (std::thread& t : checks) t.join();
  }
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE(i);
    EXPECT_TRUE(absl::IsDeadlineExceeded(status[i])) << status[i];
    EXPECT_TRUE(absl::StrContains(status[i].message(), "UCX")) << status[i];
    EXPECT_LT(took[i], waits[i] + absl::Milliseconds(2500)) << status[i];
  }
  EXPECT_EQ(slow.pid(), stuck) << "the sandbox was replaced";
  ASSERT_EQ(kill(stuck, SIGCONT), 0);
  EXPECT_FALSE(slow.Check(address.substr(0, 2), true).ok());
  EXPECT_TRUE(slow.Check(address, false).ok());
  EXPECT_TRUE(slow.Check(address, true).ok());
}

// A sandbox slow to start (here a shell that waits before it becomes the
// sandbox) does not hold a check past its deadline either, and is not
// killed for it: the next check finds it started.
TEST_P(UcxAddressSandboxTest, ACheckWhileTheSandboxStartsEndsByItsDeadline) {
  std::vector<std::string> argv = {"/bin/sh", "-c", "sleep 3; exec \"$@\"",
                                   "sh"};
  const std::vector<std::string> sandbox = UcxAddressSandboxArgs(
      KVDEPOT_UCX_TEST_PEER, ucx_test::TransportConfig(GetParam()));
  argv.insert(argv.end(), sandbox.begin(), sandbox.end());
  UcxAddressSandbox starting(argv);
  const std::string address = worker_->address();
  const absl::Time start = absl::Now();
  absl::Status st =
      starting.Check(address, true, start + absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(absl::IsDeadlineExceeded(st)) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "UCX")) << st;
  EXPECT_LT(took, absl::Milliseconds(2500)) << st;
  const pid_t first = starting.pid();
  EXPECT_GT(first, 0);
  EXPECT_TRUE(starting.Check(address, true).ok());
  EXPECT_EQ(starting.pid(), first) << "the starting sandbox was replaced";
}

TEST_P(UcxAddressSandboxTest, TheSandboxKeepsNoDescriptorOfItsParent) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);  // not close-on-exec: the sandbox inherits it
  const std::string inherited =
      std::filesystem::read_symlink(absl::StrCat("/proc/self/fd/", fds[1])).string();
  ASSERT_TRUE(sandbox_->Check(worker_->address(), true).ok());
  std::vector<std::string> open;
  for (const auto& fd : std::filesystem::directory_iterator(
           absl::StrCat("/proc/", sandbox_->pid(), "/fd"))) {
    std::error_code error;
    open.push_back(std::filesystem::read_symlink(fd.path(), error).string());
  }
  close(fds[0]);
  close(fds[1]);
  EXPECT_FALSE(open.empty());
  EXPECT_EQ(std::count(open.begin(), open.end(), inherited), 0)
      << inherited << " is open in the sandbox";
}

// A sandbox process that writes to its stdout before it answers: UCX does
// at load time, before main, under some settings or conditions ("UCX
// ERROR Failed to change page protection" under systemd's
// MemoryDenyWriteExecute; UCX_MEM_LOG_LEVEL=info below). That text is not
// an answer: when stdout was the answer channel, the sandbox was judged
// broken and every client went to gRPC.
TEST_P(UcxAddressSandboxTest, WhatTheSandboxPrintsOnStdoutIsNoAnswer) {
  const std::vector<std::string> sandbox = UcxAddressSandboxArgs(
      KVDEPOT_UCX_TEST_PEER, ucx_test::TransportConfig(GetParam()));
  // Plain text first (a shell that prints, then becomes the sandbox), then
  // UCX's memory hooks logging at load time.
  std::vector<std::string> chatty = {"/bin/sh", "-c",
                                     "echo 'UCX  ERROR not an answer'; exec \"$@\"",
                                     "sh"};
  chatty.insert(chatty.end(), sandbox.begin(), sandbox.end());
  std::vector<std::string> ucx_logs = {"/usr/bin/env", "UCX_MEM_LOG_LEVEL=info"};
  ucx_logs.insert(ucx_logs.end(), sandbox.begin(), sandbox.end());
  for (const std::vector<std::string>& argv : {chatty, ucx_logs}) {
    SCOPED_TRACE(argv[0]);
    UcxAddressSandbox printing(argv);
    const std::string address = worker_->address();
    EXPECT_TRUE(printing.Check(address, true).ok());
    const pid_t first = printing.pid();
    EXPECT_TRUE(printing.Check(address, false).ok());
    EXPECT_EQ(printing.pid(), first) << "the sandbox was started again";
    EXPECT_FALSE(printing.Check(address.substr(0, 2), true).ok());
  }
}

TEST_P(UcxAddressSandboxTest, RefusesEmptyAndOversizedAddressesUnread) {
  EXPECT_TRUE(absl::IsInvalidArgument(sandbox_->Check("", true)));
  EXPECT_TRUE(absl::IsInvalidArgument(
      sandbox_->Check(std::string(kMaxUcxWorkerAddressBytes + 1, 'a'), true)));
  EXPECT_EQ(sandbox_->pid(), -1);
}

TEST_P(UcxAddressSandboxTest, NoSandboxProcessIsUnavailable) {
  UcxAddressSandbox missing(
      UcxAddressSandboxArgs("/nonexistent/kvdepotd", ucx_test::TransportConfig(GetParam())));
  EXPECT_TRUE(absl::IsUnavailable(missing.Check(worker_->address(), true)));
  // A sandbox that cannot make a UCX context (a bad setting) exits at once:
  // no address is blamed for that.
  UcxAddressSandbox broken(UcxAddressSandboxArgs(KVDEPOT_UCX_TEST_PEER, {{"TLS", "nosuch"}}));
  absl::Status st = broken.Check(worker_->address(), true);
  EXPECT_TRUE(absl::IsUnavailable(st)) << st;
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxAddressSandboxTest, ::testing::Values("tcp", "shm"),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace kvdepot
