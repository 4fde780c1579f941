// Lifecycle of a real kvdepotd: startup errors, graceful shutdown, session
// leases enforced by the daemon itself.
#include <arpa/inet.h>
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "storage/checksum.h"
#include "storage/internal/sync_point.h"
#include "tests/daemon_process.h"
#include "tests/status_matchers.h"
#include "tests/test_dir.h"

namespace kvdepot {
namespace {

using testing::DaemonProcess;
using testing::MakeTempDir;
using testing::RunAndWait;

std::unique_ptr<Client> Connect(const std::string& addr) {
  ClientOptions o;
  o.server = addr;
  o.rpc_timeout = absl::Seconds(10);
  return std::move(Client::Connect(o)).value();
}

TEST(LifecycleTest, SigtermDrainsAndExitsZeroWithinTenSeconds) {
  auto d = DaemonProcess::Start();
  ASSERT_OK(d);
  auto client = Connect((*d)->address());
  ASSERT_OK(client->Health());
  std::string bytes(1 << 20, 'd');
  BlockToPut b{"k", "", bytes};
  ASSERT_OK(client->Put("ns", {&b, 1}));
  absl::Time start = absl::Now();
  auto rc = (*d)->Stop(SIGTERM, absl::Seconds(10));
  ASSERT_OK(rc);
  EXPECT_EQ(*rc, 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  std::string log = (*d)->Log();
  EXPECT_NE(log.find("received SIGTERM"), std::string::npos) << log;
  EXPECT_NE(log.find("kvdepotd stopped"), std::string::npos) << log;
  EXPECT_FALSE(client->Health().ok());
}

TEST(LifecycleTest, SigtermLetsAnInFlightWriteFinishAndRefusesNewCalls) {
  auto d = DaemonProcess::Start({"--dram-capacity", "64MiB"});
  ASSERT_OK(d);
  auto client = Connect((*d)->address());
  std::string bytes(2 << 20, 'i');
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = client->stub().Write(&ctx, &resp);
  v1::WriteRequest msg;
  msg.mutable_header()->set_namespace_("ns");
  msg.mutable_header()->set_key("in-flight");
  msg.mutable_header()->set_size(bytes.size());
  msg.mutable_header()->set_checksum(BlockChecksum(bytes));
  msg.set_data(bytes.substr(0, 1 << 20));
  ASSERT_TRUE(writer->Write(msg));
  // Make sure the daemon holds the half-written block before the signal.
  bool reserved = false;
  for (int i = 0; i < 200 && !reserved; ++i) {
    auto st = client->Stats();
    ASSERT_OK(st);
    reserved = st->reservations() == 1;
    if (!reserved) absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(reserved);
  ::kill((*d)->pid(), SIGTERM);
  // Wait until the daemon is draining (it says so), then finish the block.
  for (int i = 0; i < 100 && (*d)->Log().find("draining") == std::string::npos; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_NE((*d)->Log().find("draining"), std::string::npos);
  // A new call is refused while draining.
  BlockToPut b{"late", "", "bytes"};
  EXPECT_FALSE(Connect((*d)->address())->Put("ns", {&b, 1}).ok());
  v1::WriteRequest rest;
  rest.set_data(bytes.substr(1 << 20));
  ASSERT_TRUE(writer->Write(rest));
  writer->WritesDone();
  grpc::Status st = writer->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(resp.results_size(), 1);
  EXPECT_EQ(resp.results(0), v1::WRITE_STORED);
  auto rc = (*d)->Stop(SIGTERM, absl::Seconds(10));
  ASSERT_OK(rc);
  EXPECT_EQ(*rc, 0);
}

// Opens a session and reserves (BeginPut) one block of `size` bytes, key
// "reserved", in namespace "ns", leaving it uncommitted.
void ReserveAPut(Client& client, size_t size, v1::OpenSessionResponse* session,
                 v1::BeginPutResponse* reserved) {
  {
    grpc::ClientContext ctx;
    v1::OpenSessionRequest req;
    req.set_client_name("lifecycle");
    ASSERT_TRUE(client.stub().OpenSession(&ctx, req, session).ok());
  }
  grpc::ClientContext ctx;
  v1::BeginPutRequest req;
  req.set_session_id(session->session_id());
  req.set_namespace_("ns");
  v1::PutSpec* spec = req.add_blocks();
  spec->set_key("reserved");
  spec->set_size(size);
  ASSERT_TRUE(client.stub().BeginPut(&ctx, req, reserved).ok());
  ASSERT_NE(reserved->reservation_id(), 0u);
}

// A two-phase put reserved before SIGTERM is still the client's to finish:
// the drain waits for it (up to drain_timeout), its commit stores the block,
// and the block is there after a restart. Meanwhile an admin undrain cannot
// take puts back in.
TEST(LifecycleTest, SigtermLetsAReservedPutCommit) {
  auto d = DaemonProcess::Start({"--dram-capacity", "64MiB"});
  ASSERT_OK(d);
  auto client = Connect((*d)->address());
  const std::string data_dir = (*d)->data_dir();
  const std::string bytes(256 << 10, 'r');
  const uint64_t sum = BlockChecksum(bytes);

  v1::OpenSessionResponse session;
  v1::BeginPutResponse reserved;
  ASSERT_NO_FATAL_FAILURE(
      ReserveAPut(*client, bytes.size(), &session, &reserved));
  ::kill((*d)->pid(), SIGTERM);
  for (int i = 0; i < 100 && (*d)->Log().find("draining") == std::string::npos; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_NE((*d)->Log().find("draining"), std::string::npos);
  // The drain waits for the reservation: still running a second later.
  absl::SleepFor(absl::Seconds(1));
  ASSERT_TRUE((*d)->Running()) << "the drain did not wait for a reserved put";
  {
    grpc::ClientContext ctx;
    v1::SetDrainingRequest req;
    req.set_draining(false);
    v1::SetDrainingResponse resp;
    grpc::Status st = client->stub().SetDraining(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE)
        << "undrain during shutdown: " << st.error_message();
  }
  BlockToPut late{"late", "", "bytes"};
  EXPECT_FALSE(client->Put("ns", {&late, 1}).ok()) << "a put accepted while stopping";
  {
    grpc::ClientContext ctx;
    v1::WriteResponse resp;
    auto writer = client->stub().Write(&ctx, &resp);
    v1::WriteRequest msg;
    msg.mutable_header()->set_session_id(session.session_id());
    msg.mutable_header()->set_reservation_id(reserved.reservation_id());
    msg.mutable_header()->set_slot(0);
    msg.mutable_header()->set_size(bytes.size());
    msg.set_data(bytes);
    ASSERT_TRUE(writer->Write(msg));
    writer->WritesDone();
    grpc::Status st = writer->Finish();
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  {
    grpc::ClientContext ctx;
    v1::CommitPutRequest req;
    req.set_session_id(session.session_id());
    req.set_reservation_id(reserved.reservation_id());
    req.add_checksums(sum);
    v1::CommitPutResponse resp;
    grpc::Status st = client->stub().CommitPut(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(resp.results_size(), 1);
    EXPECT_EQ(resp.results(0), v1::COMMIT_STORED);
  }
  auto rc = (*d)->Stop(SIGTERM, absl::Seconds(10));
  ASSERT_OK(rc);
  EXPECT_EQ(*rc, 0);
  d->reset();

  auto again = DaemonProcess::Start({"--dram-capacity", "64MiB"}, data_dir);
  ASSERT_OK(again);
  absl::string_view key = "reserved";
  auto got = Connect((*again)->address())->Get("ns", {&key, 1});
  ASSERT_OK(got) << "the committed put was lost";
  ASSERT_EQ(got->size(), 1u);
  EXPECT_EQ((*got)[0].bytes, bytes);
}

// Once SIGTERM has come, new sessions and Read streams are refused
// UNAVAILABLE, while what was begun before (here a reserved put) may still
// finish: the drain waits for the streams in progress, and a read begun
// during it would keep it waiting until drain_timeout, then be cut short.
TEST(LifecycleTest, WhileStoppingNewSessionsAndReadsAreRefused) {
  auto d = DaemonProcess::Start({"--dram-capacity", "64MiB"});
  ASSERT_OK(d);
  auto client = Connect((*d)->address());
  BlockToPut stored{"stored", "", "bytes"};
  ASSERT_OK(client->Put("ns", {&stored, 1}));
  v1::OpenSessionResponse session;
  v1::BeginPutResponse reserved;
  ASSERT_NO_FATAL_FAILURE(ReserveAPut(*client, 4096, &session, &reserved));
  ::kill((*d)->pid(), SIGTERM);
  for (int i = 0; i < 100 && (*d)->Log().find("draining") == std::string::npos;
       ++i) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_NE((*d)->Log().find("draining"), std::string::npos);
  {
    grpc::ClientContext ctx;
    v1::ReadRequest req;
    req.set_namespace_("ns");
    req.add_keys("stored");
    auto reader = client->stub().Read(&ctx, req);
    v1::ReadResponse msg;
    int messages = 0;
    while (reader->Read(&msg)) ++messages;
    grpc::Status st = reader->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE)
        << st.error_message();
    EXPECT_EQ(messages, 0);
  }
  {
    grpc::ClientContext ctx;
    v1::OpenSessionRequest req;
    req.set_client_name("late");
    v1::OpenSessionResponse resp;
    grpc::Status st = client->stub().OpenSession(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE)
        << st.error_message();
  }
  // The session opened before goes on: its reservation can still be ended.
  {
    grpc::ClientContext ctx;
    v1::AbortPutRequest req;
    req.set_session_id(session.session_id());
    req.set_reservation_id(reserved.reservation_id());
    v1::AbortPutResponse resp;
    grpc::Status st = client->stub().AbortPut(&ctx, req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
  }
  auto rc = (*d)->Stop(SIGTERM, absl::Seconds(10));
  ASSERT_OK(rc);
  EXPECT_EQ(*rc, 0);
}

// Started from a shell with a low soft limit on open files (often 1024),
// kvdepotd raises it to the hard one: past it, gRPC stops accepting
// connections (a few hundred clients, each co-located UCX one taking about
// 10 descriptors), and says so when even the hard one is low.
TEST(LifecycleTest, TheOpenFileLimitIsRaisedToTheHardOne) {
  struct rlimit saved;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  if (saved.rlim_max <= 512) GTEST_SKIP() << "hard limit " << saved.rlim_max;
  struct rlimit low = saved;
  low.rlim_cur = 512;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  auto d = DaemonProcess::Start({"--dram-capacity", "16MiB"});  // inherits 512
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  ASSERT_OK(d);
  std::ifstream limits(absl::StrCat("/proc/", (*d)->pid(), "/limits"));
  std::string line, soft, hard;
  while (std::getline(limits, line)) {
    if (line.rfind("Max open files", 0) != 0) continue;
    std::vector<std::string> f =
        absl::StrSplit(line.substr(14), ' ', absl::SkipEmpty());
    ASSERT_GE(f.size(), 2u) << line;
    soft = f[0];
    hard = f[1];
  }
  EXPECT_EQ(soft, hard);
  EXPECT_EQ(soft, saved.rlim_max == RLIM_INFINITY
                      ? "unlimited"
                      : absl::StrCat(saved.rlim_max));
  const bool warned =
      (*d)->Log().find("open files limited to") != std::string::npos;
  EXPECT_EQ(warned, saved.rlim_max < 16384) << (*d)->Log();
}

// While a drain waits (here for a reserved put, up to a 60 s drain_timeout)
// a repeated SIGTERM is only answered (supervisors resend it while they
// wait), and SIGINT (Ctrl-C again) ends the process at once, as SIGKILL
// would, saying so.
TEST(LifecycleTest, ASecondSigintEndsAWaitingDrainAtOnce) {
  const std::string dir = testing::MakeTempDir("drain");
  std::ofstream(dir + "/kvdepot.yaml") << "drain_timeout: 60s\n";
  auto d = DaemonProcess::Start(
      {"--dram-capacity", "64MiB", "--config", dir + "/kvdepot.yaml"});
  ASSERT_OK(d);
  auto client = Connect((*d)->address());
  v1::OpenSessionResponse session;
  v1::BeginPutResponse reserved;
  ASSERT_NO_FATAL_FAILURE(ReserveAPut(*client, 4096, &session, &reserved));
  ::kill((*d)->pid(), SIGTERM);
  ASSERT_TRUE(testing::PollUntil([&] {
    return (*d)->Log().find("draining") != std::string::npos;
  })) << (*d)->Log();
  ::kill((*d)->pid(), SIGTERM);
  ASSERT_TRUE(testing::PollUntil([&] {
    return (*d)->Log().find("already shutting down") != std::string::npos;
  })) << (*d)->Log();
  ASSERT_TRUE((*d)->Running());
  auto rc = (*d)->Stop(SIGINT, absl::Seconds(20));  // the drain had 60 s left
  ASSERT_OK(rc) << (*d)->Log();
  EXPECT_EQ(*rc, 1);
  EXPECT_NE((*d)->Log().find("second signal during shutdown (SIGINT)"),
            std::string::npos)
      << (*d)->Log();
}

TEST(LifecycleTest, SecondDaemonOnTheSameDataDirFailsClearly) {
  auto first = DaemonProcess::Start();
  ASSERT_OK(first);
  std::string err;
  int rc = RunAndWait({testing::DaemonBinary(), "--listen", "127.0.0.1:0",
                       "--metrics-listen", "", "--data-dir", (*first)->data_dir()},
                      &err);
  EXPECT_EQ(rc, 1) << err;
  EXPECT_NE(err.find("in use by another kvdepotd"), std::string::npos) << err;
  EXPECT_TRUE((*first)->Running());
}

// gRPC would let a second server share the port (SO_REUSEPORT); a second
// kvdepotd on the same address must fail instead, and the first keep it.
TEST(LifecycleTest, SecondDaemonOnTheSameAddressFailsClearly) {
  auto first = DaemonProcess::Start();
  ASSERT_OK(first);
  for (const std::vector<std::string>& listen :
       {std::vector<std::string>{"--listen", (*first)->address(),
                                 "--metrics-listen", ""},
        std::vector<std::string>{"--listen", "127.0.0.1:0", "--metrics-listen",
                                 (*first)->metrics_address()}}) {
    std::vector<std::string> argv = {testing::DaemonBinary(), "--data-dir",
                                     MakeTempDir("second")};
    argv.insert(argv.end(), listen.begin(), listen.end());
    std::string err;
    int rc = RunAndWait(argv, &err);
    // The error names the address in use.
    const std::string& taken = listen[1] == "127.0.0.1:0" ? listen[3] : listen[1];
    EXPECT_EQ(rc, 1) << taken << ": " << err;
    EXPECT_NE(err.find(taken), std::string::npos) << err;
  }
  EXPECT_TRUE((*first)->Running());
  ClientOptions o;
  o.server = (*first)->address();
  auto client = Client::Connect(o);
  ASSERT_OK(client);
  EXPECT_OK((*client)->Health());
}

TEST(LifecycleTest, DataDirThatCannotBeCreatedFailsClearly) {
  std::string dir = MakeTempDir("notadir");
  std::ofstream(dir + "/file") << "x";
  std::string err;
  int rc = RunAndWait({testing::DaemonBinary(), "--listen", "127.0.0.1:0",
                       "--metrics-listen", "", "--data-dir", dir + "/file/data"},
                      &err);
  EXPECT_EQ(rc, 1) << err;
  EXPECT_NE(err.find("cannot create data dir"), std::string::npos) << err;
}

// A DRAM tier larger than the daemon's memory cgroup allows: a clear error
// and exit code 1 at start, not an OOM kill as the tier is prefaulted.
// Needs a memory cgroup it can create (v1, or v2 with the memory controller
// enabled for children); skipped where there is none.
TEST(LifecycleTest, ADramTierPastTheMemoryLimitIsRefusedAtStart) {
  std::ifstream self("/proc/self/cgroup");
  std::string line, cgroup_dir, limit_file;
  while (std::getline(self, line)) {
    std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    if (parts[1] == "memory") {  // v1
      cgroup_dir = "/sys/fs/cgroup/memory" + parts[2];
      limit_file = "memory.limit_in_bytes";
      break;
    }
    if (parts[0] == "0" && parts[1].empty() && cgroup_dir.empty()) {  // v2
      cgroup_dir = "/sys/fs/cgroup" + parts[2];
      limit_file = "memory.max";
    }
  }
  const std::string child = absl::StrCat(cgroup_dir, "/kvdepot-test-", getpid());
  if (cgroup_dir.empty() || mkdir(child.c_str(), 0755) != 0) {
    GTEST_SKIP() << "cannot create a memory cgroup under '" << cgroup_dir << "'";
  }
  std::ofstream(child + "/" + limit_file) << (uint64_t{512} << 20);
  std::string limit;
  std::getline(std::ifstream(child + "/" + limit_file), limit);
  if (limit != std::to_string(uint64_t{512} << 20)) {
    rmdir(child.c_str());
    GTEST_SKIP() << "no memory limit in " << child << " (" << limit << ")";
  }
  const std::string dir = MakeTempDir("cgroup");
  std::string err;
  // The shell moves itself into the cgroup, then becomes the daemon.
  int rc = RunAndWait(
      {"/bin/sh", "-c",
       absl::StrCat("echo $$ > ", child, "/cgroup.procs && exec ", testing::DaemonBinary(),
                    " --listen 127.0.0.1:0 --metrics-listen '' --nvme-capacity 0"
                    " --dram-capacity 1GiB --data-dir ",
                    dir)},
      &err, absl::Seconds(60));
  rmdir(child.c_str());
  EXPECT_EQ(rc, 1) << err;
  EXPECT_NE(err.find("does not fit this process's memory limit"), std::string::npos) << err;
}

// A data dir on a file system that went read-only (the usual reaction of
// ext4/xfs to a failing disk) after a daemon used it, and a new data dir
// there: a clear error and exit code 1, not a crash.
TEST(LifecycleTest, ReadOnlyDataDirFailsClearly) {
  std::string mnt = MakeTempDir("rofs");
  if (testing::RunCommand(absl::StrCat("mount -t tmpfs -o size=64m tmpfs ", mnt))
          .exit_code != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs here (not root?)";
  }
  struct Unmount {
    std::string dir;
    ~Unmount() { testing::RunCommand("umount -l " + dir); }
  } unmount{mnt};
  const std::string used = mnt + "/data";
  {
    auto d = DaemonProcess::Start({"--dram-capacity", "64MiB"}, used);
    ASSERT_OK(d);
    auto rc = (*d)->Stop(SIGTERM, absl::Seconds(10));
    ASSERT_OK(rc);
    ASSERT_EQ(*rc, 0);
  }
  ASSERT_EQ(testing::RunCommand("mount -o remount,ro " + mnt).exit_code, 0);
  for (const std::string& dir : {used, mnt + "/fresh"}) {
    std::string err;
    int rc = RunAndWait({testing::DaemonBinary(), "--listen", "127.0.0.1:0",
                         "--metrics-listen", "", "--data-dir", dir},
                        &err);
    EXPECT_EQ(rc, 1) << dir << ": " << err;
    EXPECT_NE(err.find("Read-only file system"), std::string::npos) << err;
    EXPECT_NE(err.find("cannot start"), std::string::npos) << err;
  }
}

// log_file + SIGHUP: logrotate moves the file, SIGHUP makes the daemon
// write to a new one; JSON lines with log_format: json.
TEST(LifecycleTest, SighupReopensTheLogFile) {
  const std::string dir = MakeTempDir("logs");
  const std::string log = dir + "/kvdepotd.log";
  std::ofstream(dir + "/k.yaml") << "log_file: " << log << "\nlog_format: json\n";
  // Started by hand: its startup line goes to the file, not to stderr.
  testing::CommandResult started = testing::RunCommand(absl::StrCat(
      testing::DaemonBinary(), " --config ", dir, "/k.yaml --listen 127.0.0.1:0",
      " --metrics-listen '' --hugepages off --dram-capacity 64MiB --data-dir ", dir,
      "/data > /dev/null 2>&1 & echo $!"));
  int pid = 0;
  ASSERT_TRUE(absl::SimpleAtoi(absl::StripAsciiWhitespace(started.out), &pid)) << started.out;
  auto slurp_until = [&](const std::string& want) {
    std::string text;
    testing::PollUntil(
        [&] {
          std::ifstream in(log);
          text.assign(std::istreambuf_iterator<char>(in),
                      std::istreambuf_iterator<char>());
          return text.find(want) != std::string::npos;
        },
        absl::Seconds(20), absl::Milliseconds(50));
    return text;
  };
  std::string text = slurp_until("listening on");
  EXPECT_NE(text.find(R"("level":"info","logger":"kvdepotd","msg":"kvdepotd )"),
            std::string::npos) << text;
  ASSERT_EQ(std::rename(log.c_str(), (log + ".1").c_str()), 0);
  ASSERT_EQ(kill(pid, SIGHUP), 0);
  text = slurp_until("log file reopened");
  EXPECT_NE(text.find("log file reopened"), std::string::npos) << text;
  // SIGHUP did not stop it; SIGTERM does, cleanly, and says so in the new file.
  ASSERT_EQ(kill(pid, 0), 0);
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  text = slurp_until("received SIGTERM");
  EXPECT_NE(text.find("received SIGTERM"), std::string::npos) << text;
  testing::PollUntil([&] { return kill(pid, 0) != 0; }, absl::Seconds(20),
                     absl::Milliseconds(50));
  if (kill(pid, 0) == 0) kill(pid, SIGKILL);
}

TEST(LifecycleTest, BadFlagsAndConfigAreUsageErrors) {
  std::string err;
  EXPECT_EQ(RunAndWait({testing::DaemonBinary(), "--dram-capacity", "lots"}, &err), 2);
  EXPECT_NE(err.find("--dram-capacity"), std::string::npos) << err;
  std::string dir = MakeTempDir("cfg");
  std::ofstream(dir + "/bad.yaml") << "dram_capacty: 1GiB\n";
  err.clear();
  EXPECT_EQ(RunAndWait({testing::DaemonBinary(), "--config", dir + "/bad.yaml"}, &err), 2);
  EXPECT_NE(err.find("unknown key 'dram_capacty'"), std::string::npos) << err;
}

TEST(LifecycleTest, ConfigFileIsReadAndFlagsOverrideIt) {
  std::string dir = MakeTempDir("cfg");
  std::ofstream(dir + "/kvdepot.yaml") << "dram_capacity: 16MiB\n"
                                          "listen: 127.0.0.1:1\n";
  auto d = DaemonProcess::Start({"--config", dir + "/kvdepot.yaml"});
  ASSERT_OK(d);  // --listen 127.0.0.1:0 from the harness overrides the file
  auto stats = Connect((*d)->address())->Stats();
  ASSERT_OK(stats);
  EXPECT_EQ(stats->dram().capacity_bytes(), 16u << 20);
}

// The admin calls (drain, quota, verify, compact) are taken only from root
// or kvdepotd's own user on its host (admin_peers: local, the default): a
// local user could drain the daemon. Other calls stay every client's; with
// admin_peers: any the admin calls are too.
TEST(LifecycleTest, AdminCallsAreTakenOnlyFromRootOrTheDaemonsUser) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a command as nobody";
  const std::string dir = MakeTempDir("admin");
  auto as_nobody = [](const DaemonProcess& d, const std::string& args) {
    testing::CommandResult r = testing::RunCommand(absl::StrCat(
        "setpriv --reuid 65534 --regid 65534 --clear-groups ",
        testing::CtlBinary(), " --server ", d.address(), " ", args));
    r.out += r.err;  // what it says, wherever
    return r;
  };
  if (testing::RunCommand("setpriv --reuid 65534 --regid 65534 --clear-groups "
                          "true")
          .exit_code != 0) {
    GTEST_SKIP() << "setpriv cannot run a command as nobody here";
  }
  {
    auto d = DaemonProcess::Start({"--dram-capacity", "64MiB"}, dir + "/local");
    ASSERT_OK(d);
    for (const char* admin :
         {"drain", "quota set --ns q 1MiB", "verify", "compact"}) {
      testing::CommandResult r = as_nobody(**d, admin);
      EXPECT_EQ(r.exit_code, 1) << admin << ": " << r.out;
      EXPECT_NE(r.out.find("PERMISSION_DENIED"), std::string::npos)
          << admin << ": " << r.out;
      EXPECT_NE(r.out.find("uid 65534"), std::string::npos) << r.out;
    }
    auto stats = Connect((*d)->address())->Stats();
    ASSERT_OK(stats);
    EXPECT_FALSE(stats->draining());
    // Not admin: nobody's health check and stats are answered.
    EXPECT_EQ(as_nobody(**d, "health").exit_code, 0);
    EXPECT_EQ(as_nobody(**d, "stats").exit_code, 0);
    // The daemon's own user (root here) may.
    testing::CommandResult mine = testing::RunCtl((*d)->address(), "drain");
    EXPECT_EQ(mine.exit_code, 0) << mine.err;
    EXPECT_TRUE(Connect((*d)->address())->Stats()->draining());
  }
  std::ofstream(dir + "/any.yaml") << "admin_peers: any\n";
  auto d = DaemonProcess::Start(
      {"--dram-capacity", "64MiB", "--config", dir + "/any.yaml"},
      dir + "/any");
  ASSERT_OK(d);
  testing::CommandResult r = as_nobody(**d, "drain");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_TRUE(Connect((*d)->address())->Stats()->draining());
}

// Sessions are counted per client host (max_sessions_per_peer): the
// daemon names a client's host by the address it connects from, so every
// local client counts against one bound, whatever its port.
TEST(LifecycleTest, SessionsAreBoundedPerClientHost) {
  const std::string dir = MakeTempDir("perpeer");
  std::ofstream(dir + "/kvdepot.yaml") << "max_sessions_per_peer: 2\n";
  auto d = DaemonProcess::Start(
      {"--dram-capacity", "64MiB", "--config", dir + "/kvdepot.yaml"},
      dir + "/data");
  ASSERT_OK(d);
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < 3; ++i) clients.push_back(Connect((*d)->address()));
  ASSERT_OK(clients[0]->EnsureSession().status());
  ASSERT_OK(clients[1]->EnsureSession().status());
  absl::Status third = clients[2]->EnsureSession().status();
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_NE(std::string(third.message()).find("max_sessions_per_peer"),
            std::string::npos)
      << third;
  clients[0].reset();  // closes its session
  EXPECT_OK(clients[2]->EnsureSession().status());
}

// The daemon takes a batch of max_batch_keys blocks with the longest keys
// and parents: gRPC's message limit follows the setting, so a batch the
// config allows is never refused as RESOURCE_EXHAUSTED ("no room") for its
// size (it was at 32 MiB: 65536 blocks of 256-byte keys and parents weigh
// 34 MB). Sent with an unknown session: the answer is that, not the size.
TEST(LifecycleTest, ABatchOfMaxBatchKeysLongKeysIsTaken) {
  std::string dir = MakeTempDir("cfg");
  std::ofstream(dir + "/kvdepot.yaml") << "max_batch_keys: 65536\n";
  auto d = DaemonProcess::Start({"--config", dir + "/kvdepot.yaml"});
  ASSERT_OK(d);
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  auto stub = v1::KvDepot::NewStub(grpc::CreateCustomChannel(
      (*d)->address(), grpc::InsecureChannelCredentials(), args));
  v1::BeginPutRequest req;
  req.set_session_id(987654321);
  req.set_namespace_("ns");
  for (int i = 0; i < 65536; ++i) {
    v1::PutSpec* spec = req.add_blocks();
    std::string key(256, 'k');
    std::memcpy(key.data(), &i, sizeof(i));
    spec->set_key(key);
    spec->set_parent_key(std::string(256, 'p'));
    spec->set_size(4096);
  }
  ASSERT_GT(req.ByteSizeLong(), size_t{32} << 20);
  grpc::ClientContext ctx;
  v1::BeginPutResponse resp;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::Status st = stub->BeginPut(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
}

TEST(LifecycleTest, DaemonExpiresSessionsThatStopKeepingAlive) {
  auto d = DaemonProcess::Start();
  ASSERT_OK(d);
  auto client = Connect((*d)->address());
  BlockToPut b{"k", "", "bytes"};
  ASSERT_OK(client->Put("ns", {&b, 1}));
  // A raw session with the shortest lease, never kept alive.
  grpc::ClientContext ctx;
  v1::OpenSessionRequest req;
  req.set_lease_ms(1000);
  v1::OpenSessionResponse resp;
  ASSERT_TRUE(client->stub().OpenSession(&ctx, req, &resp).ok());
  grpc::ClientContext ctx2;
  v1::LookupRequest lr;
  lr.set_session_id(resp.session_id());
  lr.set_namespace_("ns");
  lr.add_keys("k");
  lr.set_pin(true);
  v1::LookupResponse lresp;
  ASSERT_TRUE(client->stub().Lookup(&ctx2, lr, &lresp).ok());
  ASSERT_NE(lresp.pin_id(), 0u);
  auto st = client->Stats();
  ASSERT_OK(st);
  EXPECT_EQ(st->pins(), 1u);
  // The daemon's maintenance thread ends the session within about a second
  // of its lease; poll rather than assume a time.
  bool released = false;
  for (int i = 0; i < 100 && !released; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    st = client->Stats();
    ASSERT_OK(st);
    released = st->pins() == 0 && st->sessions() == 0;
  }
  EXPECT_TRUE(released);
  EXPECT_NE((*d)->Log().find("session(s) expired"), std::string::npos);
  // The block itself is untouched and now evictable.
  absl::string_view k = "k";
  auto ev = client->Evict("ns", {&k, 1}, false);
  ASSERT_OK(ev);
  EXPECT_EQ(ev->evicted_blocks(), 1u);
}

TEST(LifecycleTest, ClientKeepsItsSessionAliveAcrossLeases) {
  auto d = DaemonProcess::Start({"--session-lease", "1s"});
  ASSERT_OK(d);
  auto client = Connect((*d)->address());
  auto sid = client->EnsureSession();
  ASSERT_OK(sid);
  absl::SleepFor(absl::Milliseconds(2500));  // 2.5 leases
  auto again = client->EnsureSession();
  ASSERT_OK(again);
  EXPECT_EQ(*again, *sid);
  auto st = client->Stats();
  ASSERT_OK(st);
  EXPECT_EQ(st->sessions(), 1u);
}

// Stores `bytes` under "k" in "ns", then gets the block back over the
// gRPC byte path (a pinned lookup, a read, an unpin) with that first unpin
// failing (a connection lost and not yet back, stood in for by a sync
// point): the pin is owed. `unpins` counts the unpins for as long as the
// returned callback lives.
std::unique_ptr<internal::SyncPointCallback> GetWithItsUnpinFailing(
    Client& client, const std::string& bytes, std::atomic<int>* unpins) {
  BlockToPut b{"k", "", bytes};
  EXPECT_OK(client.Put("ns", {&b, 1}));
  auto failing = std::make_unique<internal::SyncPointCallback>(
      "Client::UnpinRpc", [unpins](void* arg) {
        if (unpins->fetch_add(1) == 0) {
          *static_cast<absl::Status*>(arg) = absl::UnavailableError("connection lost");
        }
      });
  std::string out(bytes.size(), '\0');
  absl::string_view k = "k";
  absl::Span<char> dst(out);
  auto got = client.GetInto("ns", {&k, 1}, {&dst, 1});
  EXPECT_OK(got);
  EXPECT_TRUE(got.ok() && (*got)[0]);
  EXPECT_EQ(out, bytes);
  return failing;
}

// A get over gRPC pins its blocks and unpins them after the read; when that
// unpin cannot reach the daemon (a connection lost and not yet back; stood
// in for here), the pin is owed and released by the keep-alive thread, in
// the same session: the caller never saw the pin's id, and the kept-alive
// session would otherwise hold the blocks for the client's whole life.
TEST(LifecycleTest, AGetWhoseUnpinFailedReleasesItsPinLater) {
  auto d = DaemonProcess::Start({"--session-lease", "3s"});
  ASSERT_OK(d);
  ClientOptions o;
  o.server = (*d)->address();
  o.transport = ClientOptions::Transport::kGrpc;
  auto client = std::move(Client::Connect(o)).value();
  auto sid = client->EnsureSession();
  ASSERT_OK(sid);
  std::atomic<int> unpins{0};
  auto failing = GetWithItsUnpinFailing(*client, std::string(4096, 'u'), &unpins);
  // The keep-alive thread (every second here) releases it; poll.
  bool released = false;
  for (int i = 0; i < 100 && !released; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    auto st = client->Stats();
    released = st.ok() && st->pins() == 0;
  }
  EXPECT_TRUE(released);
  EXPECT_GE(unpins.load(), 2);
  auto again = client->EnsureSession();
  ASSERT_OK(again);
  EXPECT_EQ(*again, *sid);  // released by the client, not by an expiry
}

// A pinning lookup whose answer is lost (a deadline, a connection reset
// after the daemon answered; stood in for by a sync point) leaves a pin
// the client never learns the id of. The client used to keep that session
// alive, so the pin held its block for the client's whole life (and such
// pins, piling up, reach the session's pin limit). It drops the session
// now: its lease ends the pin, and the next call opens another session.
TEST(LifecycleTest, APinningLookupWhoseAnswerIsLostLeavesNoPinForGood) {
  auto d = DaemonProcess::Start({"--session-lease", "1s"});
  ASSERT_OK(d);
  ClientOptions o;
  o.server = (*d)->address();
  o.transport = ClientOptions::Transport::kGrpc;
  auto client = std::move(Client::Connect(o)).value();
  BlockToPut b{"k", "", "bytes"};
  ASSERT_OK(client->Put("ns", {&b, 1}));
  auto sid = client->EnsureSession();
  ASSERT_OK(sid);
  absl::string_view k = "k";
  {
    internal::SyncPointCallback lost("Client::LookupAnswered", [](void* arg) {
      *static_cast<grpc::Status*>(arg) =
          grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "answer lost");
    });
    auto r = client->Lookup("ns", {&k, 1}, false, /*pin=*/true);
    EXPECT_TRUE(absl::IsDeadlineExceeded(r.status())) << r.status();
  }
  auto st = client->Stats();
  ASSERT_OK(st);
  EXPECT_EQ(st->pins(), 1u);  // the daemon did pin it
  // The client keeps calling (and keeping its sessions alive) meanwhile.
  bool released = false;
  for (int i = 0; i < 100 && !released; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    auto again = client->Lookup("ns", {&k, 1}, false, /*pin=*/true);
    ASSERT_OK(again);
    ASSERT_OK(client->Unpin(again->pin_id));
    st = client->Stats();
    released = st.ok() && st->pins() == 0;
  }
  EXPECT_TRUE(released);
  auto now = client->EnsureSession();
  ASSERT_OK(now);
  EXPECT_NE(*now, *sid);
  ASSERT_OK(client->Evict("ns", {&k, 1}, false));
}

TEST(LifecycleTest, ClientReopensItsSessionAfterADaemonRestart) {
  auto d = DaemonProcess::Start({"--dram-capacity", "64MiB"});
  ASSERT_OK(d);
  const std::string addr = (*d)->address();
  auto client = Connect(addr);
  BlockToPut b{"k", "", "bytes"};
  ASSERT_OK(client->Put("ns", {&b, 1}));
  absl::string_view k = "k";
  auto first = client->Lookup("ns", {&k, 1}, false, /*pin=*/true);
  ASSERT_OK(first);
  auto sid = client->EnsureSession();
  ASSERT_OK(sid);
  const std::string data_dir = (*d)->data_dir();
  ASSERT_OK((*d)->Stop(SIGKILL));
  // While it is down: an error, not a hang (the RPC deadline bounds it).
  EXPECT_FALSE(client->Lookup("ns", {&k, 1}, false, true).ok());
  // Restarted on the same port: DRAM contents are gone (a miss, not an
  // error), and the pinned lookup opens a new session by itself.
  auto again = DaemonProcess::Start({"--dram-capacity", "64MiB"}, data_dir, addr);
  ASSERT_OK(again);
  // Calls fail at once (a miss for an engine) until the client's next
  // connection attempt, a fraction of a second after the daemon listens.
  auto r = client->Lookup("ns", {&k, 1}, false, /*pin=*/true);
  for (int i = 0; i < 100 && absl::IsUnavailable(r.status()); ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    r = client->Lookup("ns", {&k, 1}, false, /*pin=*/true);
  }
  ASSERT_OK(r);
  EXPECT_FALSE(r->entries[0].found);
  auto sid2 = client->EnsureSession();
  ASSERT_OK(sid2);
  EXPECT_NE(*sid2, *sid);
  ASSERT_OK(client->Put("ns", {&b, 1}));
  r = client->Lookup("ns", {&k, 1}, false, true);
  ASSERT_OK(r);
  EXPECT_TRUE(r->entries[0].found);
  EXPECT_NE(r->pin_id, 0u);
}

// A client whose calls failed all the while its daemon was down (each at
// once: the connection refused) reaches the restarted daemon within
// gRPC's reconnect backoff (at most 2 s here), not at gRPC 1.51's 5 s
// backup poll: with every call failing fast no thread polled the channel,
// so a connection attempt begun before the restart was seen to fail only
// seconds later, and a shared client missed for ~10 s after each restart.
// A liveness bound, with room for a loaded machine: 9.5 s before the fix.
TEST(LifecycleTest, AClientReachesARestartedDaemonWithinItsReconnectBackoff) {
  auto d = DaemonProcess::Start({"--dram-capacity", "64MiB"});
  ASSERT_OK(d);
  const std::string addr = (*d)->address();
  ClientOptions o;
  o.server = addr;
  o.rpc_timeout = absl::Seconds(2);
  o.transport = ClientOptions::Transport::kGrpc;
  auto client = std::move(Client::Connect(o)).value();
  ASSERT_OK(client->Health());
  const std::string data_dir = (*d)->data_dir();
  ASSERT_OK((*d)->Stop(SIGKILL));
  for (int i = 0; i < 25; ++i) {  // an engine's calls while it is down
    EXPECT_FALSE(client->Health().ok());
    absl::SleepFor(absl::Milliseconds(20));
  }
  auto again = DaemonProcess::Start({"--dram-capacity", "64MiB"}, data_dir, addr);
  ASSERT_OK(again);  // it answers health checks from here on
  const absl::Time up = absl::Now();
  bool reached = false;
  while (!reached && absl::Now() - up < absl::Seconds(15)) {
    reached = client->Health().ok();
    if (!reached) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(reached);
  EXPECT_LT(absl::Now() - up, absl::Milliseconds(3500));
}

// A client with a session (its keep-alives fail every third of a lease)
// whose daemon stays down: after the first 30 s of fast retries it tries
// at gRPC's own backoff (up to 2 s apart), not ~10 times a second for as
// long as the outage lasts. A listener on the daemon's port that accepts
// and closes counts the attempts. 45 s.
TEST(LifecycleTest, AClientOfADaemonThatStaysDownRetriesAtGrpcsBackoff) {
  auto d = DaemonProcess::Start({"--dram-capacity", "64MiB"});
  ASSERT_OK(d);
  const std::string addr = (*d)->address();
  ClientOptions o;
  o.server = addr;
  o.rpc_timeout = absl::Seconds(1);
  o.transport = ClientOptions::Transport::kGrpc;
  o.lease = absl::Seconds(3);  // a keep-alive every second
  auto client = std::move(Client::Connect(o)).value();
  ASSERT_OK(client->EnsureSession());
  ASSERT_OK((*d)->Stop(SIGKILL));
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(addr.substr(addr.rfind(':') + 1), &port));
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  const int one = 1;
  setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0)
      << std::strerror(errno);
  ASSERT_EQ(listen(listener, 64), 0);
  const absl::Time down = absl::Now();
  std::vector<absl::Duration> attempts;  // since `down`
  while (absl::Now() - down < absl::Seconds(45)) {
    pollfd pfd{listener, POLLIN, 0};
    if (poll(&pfd, 1, 100) == 1) {
      const int c = accept(listener, nullptr, nullptr);
      if (c >= 0) {
        attempts.push_back(absl::Now() - down);
        close(c);
      }
    }
  }
  close(listener);
  int early = 0, late = 0;
  for (absl::Duration t : attempts) {
    if (t < absl::Seconds(10)) ++early;
    if (t >= absl::Seconds(35)) ++late;
  }
  EXPECT_GT(early, 0) << "no attempt while it was trying fast";
  EXPECT_GE(late, 1) << "it stopped trying";
  // gRPC's backoff of at most 2 s (+20% jitter): about 5 in 10 s; the fast
  // retries made ~40, and before this bound about 95.
  EXPECT_LE(late, 12) << late << " attempts in the last 10 s";
}

// A pin whose unpin failed is released as soon as the daemon answers a
// call again, not at the next keep-alive (a third of the lease: 20 s here).
TEST(LifecycleTest, AnOwedUnpinIsReleasedWhenTheDaemonAnswersAgain) {
  auto d = DaemonProcess::Start({"--session-lease", "60s"});
  ASSERT_OK(d);
  ClientOptions o;
  o.server = (*d)->address();
  o.transport = ClientOptions::Transport::kGrpc;
  o.lease = absl::Seconds(60);
  auto client = std::move(Client::Connect(o)).value();
  std::atomic<int> unpins{0};
  auto failing = GetWithItsUnpinFailing(*client, std::string(4096, 'o'), &unpins);
  const absl::Time failed = absl::Now();
  bool released = false;
  while (!released && absl::Now() - failed < absl::Seconds(30)) {
    auto st = client->Stats();  // answered: the pin is retried now
    ASSERT_OK(st);
    released = st->pins() == 0;
    if (!released) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(released);
  EXPECT_LT(absl::Now() - failed, absl::Seconds(10));
  EXPECT_GE(unpins.load(), 2);
}

// A daemon (64 MiB of DRAM) that cancels streams idle for a second.
absl::StatusOr<std::unique_ptr<DaemonProcess>> StartWithOneSecondStreamIdleTimeout() {
  std::string dir = MakeTempDir("cfg");
  std::ofstream(dir + "/kvdepot.yaml") << "stream_idle_timeout: 1s\n";
  return DaemonProcess::Start({"--config", dir + "/kvdepot.yaml",
                               "--dram-capacity", "64MiB"});
}

// The first Write message of an 8 MiB block `key` in namespace "ns".
v1::WriteRequest HeaderOf8MiBBlock(const std::string& key) {
  v1::WriteRequest msg;
  msg.mutable_header()->set_namespace_("ns");
  msg.mutable_header()->set_key(key);
  msg.mutable_header()->set_size(8 << 20);
  return msg;
}

TEST(LifecycleTest, StalledStreamIsCancelledAndReleasesItsSpace) {
  auto d = StartWithOneSecondStreamIdleTimeout();
  ASSERT_OK(d);
  auto client = Connect((*d)->address());
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = client->stub().Write(&ctx, &resp);
  v1::WriteRequest msg = HeaderOf8MiBBlock("stalled");
  msg.set_data(std::string(1 << 20, 's'));
  ASSERT_TRUE(writer->Write(msg));
  // The client stalls mid-block, holding an 8 MiB reservation.
  bool held = false, released = false;
  for (int i = 0; i < 100 && !released; ++i) {
    auto st = client->Stats();
    ASSERT_OK(st);
    if (st->reservations() == 1) held = true;
    released = held && st->reservations() == 0 && st->reserved_bytes() == 0;
    if (!released) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(held);
  EXPECT_TRUE(released);
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_NE((*d)->Log().find("idle for more than"), std::string::npos) << (*d)->Log();
  // Counted as the daemon's timeout, not as a client's cancellation.
  std::string text;
  EXPECT_TRUE(testing::PollUntil([&] {
    text = testing::ScrapeMetrics(**d);
    return testing::MetricValue(text,
                                "kvdepot_requests_total{code=\"DEADLINE_"
                                "EXCEEDED\",op=\"Write\"}") == 1;
  })) << text;
  EXPECT_EQ(
      testing::MetricValue(
          text, "kvdepot_requests_total{code=\"CANCELLED\",op=\"Write\"}"),
      -1)
      << text;
  EXPECT_OK(client->Health());
}

// A client whose host vanished without closing its connection (power loss,
// a partition: no FIN ever comes) is found by kvdepotd's keepalive pings
// (grpc_keepalive) and its connection closed. Here the "client" is a raw
// socket that opens an HTTP/2 connection and then never answers anything,
// as a dead host would. Before grpc_keepalive, gRPC kept such connections
// (and their buffers) for ever.
TEST(LifecycleTest, AConnectionWhosePeerStoppedAnsweringIsClosed) {
  std::string dir = MakeTempDir("cfg");
  std::ofstream(dir + "/kvdepot.yaml") << "grpc_keepalive: 1s\n";
  auto d = DaemonProcess::Start({"--config", dir + "/kvdepot.yaml",
                                 "--dram-capacity", "64MiB"});
  ASSERT_OK(d);
  const std::string& address = (*d)->address();
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port)) << address;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  // The client preface and an empty SETTINGS frame; nothing after, not even
  // the SETTINGS or PING acknowledgements.
  std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  preface.append("\x00\x00\x00\x04\x00\x00\x00\x00\x00", 9);
  ASSERT_EQ(write(fd, preface.data(), preface.size()),
            static_cast<ssize_t>(preface.size()));
  // Read (and drop) what the daemon sends until it closes the connection.
  bool closed = false;
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (!closed && absl::Now() < give_up) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;
    char buf[4096];
    const ssize_t n = read(fd, buf, sizeof(buf));
    closed = n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN);
  }
  close(fd);
  EXPECT_TRUE(closed) << "kvdepotd kept a connection whose peer never answered a ping";
  auto client = Connect(address);
  EXPECT_OK(client->Health());
}

// A client trickling a byte now and then makes no progress either: its
// stream is cancelled by the idle timeout all the same, and the space goes.
TEST(LifecycleTest, TricklingStreamIsCancelledAndReleasesItsSpace) {
  auto d = StartWithOneSecondStreamIdleTimeout();
  ASSERT_OK(d);
  auto client = Connect((*d)->address());
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = client->stub().Write(&ctx, &resp);
  v1::WriteRequest msg = HeaderOf8MiBBlock("trickle");
  msg.set_data("t");
  ASSERT_TRUE(writer->Write(msg));
  msg.clear_header();
  // A byte every 200 ms, well inside the idle timeout each time; bounded
  // at 30 s against a hang.
  bool cut = false;
  for (int i = 0; i < 150 && !cut; ++i) {
    absl::SleepFor(absl::Milliseconds(200));
    cut = !writer->Write(msg);
  }
  EXPECT_TRUE(cut);
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The reactor releases the space on a gRPC thread of its own: poll.
  bool released = false;
  for (int i = 0; i < 100 && !released; ++i) {
    auto st = client->Stats();
    ASSERT_OK(st);
    released = st->reservations() == 0 && st->reserved_bytes() == 0;
    if (!released) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(released);
}

TEST(LifecycleTest, RestartServesWhatWasPersistedToNvme) {
  auto d = DaemonProcess::Start({"--dram-capacity", "64MiB", "--nvme-capacity", "256MiB"});
  ASSERT_OK(d);
  const std::string data_dir = (*d)->data_dir();
  std::vector<std::string> keys, blocks;
  auto pinning = Connect((*d)->address());
  for (int i = 0; i < 20; ++i) {
    keys.push_back("warm-" + std::to_string(i));
    blocks.push_back(std::string(100000 + i, static_cast<char>('A' + i)));
    BlockToPut b{keys.back(), i ? absl::string_view(keys[i - 1]) : "", blocks.back()};
    ASSERT_OK(pinning->Put("ns", {&b, 1}));
  }
  // A client still holds a pin on the first half of the chain at SIGTERM
  // (an engine using that prefix): those blocks, and so their ancestors,
  // must be saved as well.
  std::vector<absl::string_view> first_half(keys.begin(), keys.begin() + 10);
  auto pinned = pinning->Lookup("ns", first_half, /*prefix=*/true, /*pin=*/true);
  ASSERT_OK(pinned);
  ASSERT_EQ(pinned->prefix_hits, 10u);
  auto rc = (*d)->Stop(SIGTERM);
  ASSERT_OK(rc);
  ASSERT_EQ(*rc, 0);
  EXPECT_NE((*d)->Log().find(
                "persisted 20 DRAM block(s) to NVMe; it holds 20 block(s) now"),
            std::string::npos)
      << (*d)->Log();

  auto again = DaemonProcess::Start({"--dram-capacity", "64MiB", "--nvme-capacity", "256MiB"},
                                    data_dir);
  ASSERT_OK(again);
  EXPECT_NE((*again)->Log().find("holding 20 blocks"), std::string::npos) << (*again)->Log();
  auto client = Connect((*again)->address());
  std::vector<absl::string_view> views(keys.begin(), keys.end());
  auto look = client->Lookup("ns", views, /*prefix=*/true, /*pin=*/false);
  ASSERT_OK(look);
  EXPECT_EQ(look->prefix_hits, 20u);
  EXPECT_EQ(look->entries[0].tier, v1::TIER_NVME);
  auto got = client->Get("ns", views);  // promotes into DRAM, checksums verified
  ASSERT_OK(got);
  for (int i = 0; i < 20; ++i) EXPECT_EQ((*got)[i].bytes, blocks[i]) << i;
  auto st = client->Stats();
  ASSERT_OK(st);
  EXPECT_EQ(st->promotions(), 20u);
  EXPECT_EQ(st->nvme().blocks(), 20u);
  EXPECT_EQ(st->integrity_errors(), 0u);
}

// nvme_direct_reads: a restarted daemon reads its NVMe blocks with O_DIRECT
// and serves them byte for byte (the tier's own test proves the files are
// opened so).
TEST(LifecycleTest, NvmeDirectReadsServeWhatWasPersisted) {
  auto d = DaemonProcess::Start(
      {"--dram-capacity", "64MiB", "--nvme-capacity", "256MiB"});
  ASSERT_OK(d);
  const std::string data_dir = (*d)->data_dir();
  if (!testing::DirectIoWorks(data_dir)) {
    GTEST_SKIP() << "the file system of " << data_dir << " refuses O_DIRECT";
  }
  std::vector<std::string> keys, blocks;
  auto writer = Connect((*d)->address());
  for (int i = 0; i < 8; ++i) {
    keys.push_back("direct-" + std::to_string(i));
    blocks.push_back(
        std::string(200000 + 4097 * i, static_cast<char>('a' + i)));
    BlockToPut b{keys.back(), i ? absl::string_view(keys[i - 1]) : "",
                 blocks.back()};
    ASSERT_OK(writer->Put("ns", {&b, 1}));
  }
  writer.reset();
  auto rc = (*d)->Stop(SIGTERM);
  ASSERT_OK(rc);
  ASSERT_EQ(*rc, 0);

  const std::string config = data_dir + "/direct-reads.yaml";
  std::ofstream(config) << "nvme_direct_reads: true\n";
  auto again = DaemonProcess::Start({"--config", config, "--dram-capacity",
                                     "64MiB", "--nvme-capacity", "256MiB"},
                                    data_dir);
  ASSERT_OK(again);
  EXPECT_NE((*again)->Log().find("holding 8 blocks (O_DIRECT reads"),
            std::string::npos)
      << (*again)->Log();
  auto client = Connect((*again)->address());
  std::vector<absl::string_view> views(keys.begin(), keys.end());
  auto got = client->Get("ns", views);
  ASSERT_OK(got);
  ASSERT_EQ(got->size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i)
    EXPECT_EQ((*got)[i].bytes, blocks[i]) << i;
  auto st = client->Stats();
  ASSERT_OK(st);
  EXPECT_EQ(st->promotions(), 8u);
  EXPECT_EQ(st->integrity_errors(), 0u);
}

TEST(LifecycleTest, MetricsEndpointServesPrometheusText) {
  auto d = DaemonProcess::Start();
  ASSERT_OK(d);
  auto client = Connect((*d)->address());
  absl::string_view k = "k";
  BlockToPut b{"stored", "", "bytes"};  // the namespace exists: it has a label
  ASSERT_OK(client->Put("ns", {&b, 1}));
  ASSERT_OK(client->Lookup("ns", {&k, 1}, false, false));
  auto r = testing::RunCommand(
      absl::StrCat("curl -sf http://", (*d)->metrics_address(), "/metrics"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("kvdepot_requests_total{code=\"OK\",op=\"Lookup\"} 1"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find(
                "kvdepot_lookup_keys_total{namespace=\"ns\",result=\"miss\",tier=\"none\"} 1"),
            std::string::npos);
  EXPECT_NE(r.out.find("kvdepot_build_info{"), std::string::npos);
}

}  // namespace
}  // namespace kvdepot
