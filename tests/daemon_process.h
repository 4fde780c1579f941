// DaemonProcess: a real kvdepotd started by a test on loopback port 0, with
// its own temporary data dir; the bound address is read from its startup log
// line. Also runs the real kvdepotctl for CLI tests.
//
// Not thread-safe; one per test.
#ifndef KVDEPOT_TESTS_DAEMON_PROCESS_H_
#define KVDEPOT_TESTS_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvdepot::testing {

// Paths of the binaries under test (set by CMake).
std::string DaemonBinary();
std::string CtlBinary();
// A fresh directory under the test's temp dir, removed when the test
// process exits, unless a test failed (then kept, and named on stderr).
std::string MakeTempDir(const std::string& prefix);

class DaemonProcess {
 public:
  // Starts kvdepotd with `--listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0
  // --data-dir DIR` plus `extra_args`, and waits until it is listening.
  // `data_dir` empty: a new temp dir. `listen` replaces 127.0.0.1:0 (to
  // restart a daemon on the port it had).
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(
      std::vector<std::string> extra_args = {}, std::string data_dir = "",
      std::string listen = "127.0.0.1:0");
  // Kills the daemon (SIGKILL) if still running.
  ~DaemonProcess();

  const std::string& address() const { return address_; }
  const std::string& metrics_address() const { return metrics_address_; }
  const std::string& data_dir() const { return data_dir_; }
  pid_t pid() const { return pid_; }
  std::string Log() const;

  // Sends `sig` and waits up to `timeout` for exit. Returns the exit code
  // (128 + signal number when killed by a signal), or DeadlineExceeded.
  absl::StatusOr<int> Stop(int sig, absl::Duration timeout = absl::Seconds(15));
  // True while the process has not exited.
  bool Running();

 private:
  DaemonProcess() = default;
  pid_t pid_ = -1;
  bool exited_ = false;
  int exit_code_ = 0;
  std::string address_, metrics_address_, data_dir_, log_path_;
};

// Runs a command line through /bin/sh, capturing stdout and stderr
// separately. Returns the exit code.
struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};
CommandResult RunCommand(const std::string& command_line);

// The daemon's /metrics page (curl); a failed scrape fails the test.
std::string ScrapeMetrics(const DaemonProcess& d);
// The value of one series in a /metrics page, written exactly as the
// exposition writes it (`name{labels}`), or -1 when absent.
double MetricValue(const std::string& text, const std::string& series);

// Runs kvdepotctl with `--server address` and `args` (already shell-quoted).
CommandResult RunCtl(const std::string& address, const std::string& args);

// Runs a command (argv form, no shell) and returns its exit code, waiting up
// to `timeout`; its stderr is appended to *err.
int RunAndWait(const std::vector<std::string>& argv, std::string* err,
               absl::Duration timeout = absl::Seconds(30));

// Calls `done` every `every` until it returns true (then true) or `limit`
// has passed (then false): for what a daemon does in its own time.
bool PollUntil(absl::FunctionRef<bool()> done,
               absl::Duration limit = absl::Seconds(10),
               absl::Duration every = absl::Milliseconds(20));

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_DAEMON_PROCESS_H_
