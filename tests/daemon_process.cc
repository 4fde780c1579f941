#include "tests/daemon_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <regex>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvdepot::testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Waits for `pid` up to `timeout`; returns the exit code or -1 on timeout.
int WaitFor(pid_t pid, absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
      return -1;
    }
    if (absl::Now() > deadline) return -1;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

pid_t Spawn(const std::vector<std::string>& argv, const std::string& stderr_path) {
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 2);
      dup2(fd, 1);
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

// The directories MakeTempDir made in this process, removed when it exits
// unless a test failed (then kept, and named, for a look at the daemon's
// log and data). A function-local static made after gtest's UnitTest (which
// InitGoogleTest makes first), so it goes before it.
class TempDirs {
 public:
  static TempDirs& Get() {
    static TempDirs dirs;
    return dirs;
  }
  void Add(std::string dir) {
    std::lock_guard<std::mutex> lock(mu_);
    dirs_.push_back(std::move(dir));
  }
  ~TempDirs() {
    if (::testing::UnitTest::GetInstance()->Failed()) {
      for (const std::string& dir : dirs_) {
        std::fprintf(stderr, "kept for the failed test(s): %s\n", dir.c_str());
      }
      return;
    }
    std::error_code ignored;
    for (const std::string& dir : dirs_) std::filesystem::remove_all(dir, ignored);
  }

 private:
  TempDirs() = default;
  std::mutex mu_;
  std::vector<std::string> dirs_;
};

}  // namespace

// KVDEPOT_DAEMON names another kvdepotd to test (as for the Python tests).
std::string DaemonBinary() {
  const char* other = std::getenv("KVDEPOT_DAEMON");
  return other != nullptr && *other != '\0' ? other : KVDEPOT_DAEMON_BIN;
}
std::string CtlBinary() { return KVDEPOT_CTL_BIN; }

std::string MakeTempDir(const std::string& prefix) {
  static std::atomic<int> counter{0};
  std::string dir = absl::StrCat(::testing::TempDir(), "/", prefix, "-", getpid(),
                                 "-", counter++);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  TempDirs::Get().Add(dir);
  return dir;
}

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(
    std::vector<std::string> extra_args, std::string data_dir, std::string listen) {
  std::unique_ptr<DaemonProcess> d(new DaemonProcess());
  std::string work = MakeTempDir("kvdepotd");
  d->data_dir_ = data_dir.empty() ? work + "/data" : data_dir;
  d->log_path_ = work + "/kvdepotd.log";
  std::vector<std::string> argv = {DaemonBinary(), "--listen",   listen,
                                   "--metrics-listen", "127.0.0.1:0",
                                   "--data-dir",     d->data_dir_, "--hugepages",
                                   "off"};
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  d->pid_ = Spawn(argv, d->log_path_);
  if (d->pid_ < 0) return absl::InternalError("fork failed");
  static const std::regex kListening(
      R"(listening on (\S+); metrics on (\S+);)");
  absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    std::string log = ReadFile(d->log_path_);
    std::smatch m;
    if (std::regex_search(log, m, kListening)) {
      d->address_ = m[1];
      d->metrics_address_ = m[2];
      return d;
    }
    if (!d->Running()) {
      return absl::InternalError(absl::StrCat("kvdepotd exited with ", d->exit_code_,
                                              " before listening:\n", log));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("kvdepotd did not start:\n", ReadFile(d->log_path_)));
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0 && !exited_) {
    kill(pid_, SIGKILL);
    WaitFor(pid_, absl::Seconds(10));
  }
}

std::string DaemonProcess::Log() const { return ReadFile(log_path_); }

bool DaemonProcess::Running() {
  if (exited_) return false;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == pid_) {
    exited_ = true;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return false;
  }
  return true;
}

absl::StatusOr<int> DaemonProcess::Stop(int sig, absl::Duration timeout) {
  if (!Running()) return exit_code_;
  kill(pid_, sig);
  int code = WaitFor(pid_, timeout);
  if (code < 0) return absl::DeadlineExceededError("kvdepotd did not exit in time");
  exited_ = true;
  exit_code_ = code;
  return code;
}

CommandResult RunCommand(const std::string& command_line) {
  std::string dir = MakeTempDir("cmd");
  std::string out = dir + "/out", err = dir + "/err";
  std::string full = absl::StrCat(command_line, " >", out, " 2>", err);
  int status = std::system(full.c_str());
  CommandResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = ReadFile(out);
  r.err = ReadFile(err);
  return r;
}

CommandResult RunCtl(const std::string& address, const std::string& args) {
  return RunCommand(absl::StrCat(CtlBinary(), " --server ", address, " ", args));
}

std::string ScrapeMetrics(const DaemonProcess& d) {
  CommandResult r =
      RunCommand(absl::StrCat("curl -sf http://", d.metrics_address(), "/metrics"));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return r.out;
}

double MetricValue(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, series + " ")) {
      double v = 0;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
    }
  }
  return -1;
}

int RunAndWait(const std::vector<std::string>& argv, std::string* err,
               absl::Duration timeout) {
  std::string path = MakeTempDir("run") + "/stderr";
  pid_t pid = Spawn(argv, path);
  int code = WaitFor(pid, timeout);
  if (code < 0) {
    kill(pid, SIGKILL);
    WaitFor(pid, absl::Seconds(5));
  }
  if (err) *err += ReadFile(path);
  return code;
}

bool PollUntil(absl::FunctionRef<bool()> done, absl::Duration limit,
               absl::Duration every) {
  for (const absl::Time end = absl::Now() + limit;; absl::SleepFor(every)) {
    if (done()) return true;
    if (absl::Now() >= end) return false;
  }
}

}  // namespace kvdepot::testing
