// A kvdepotd for the end-to-end tests of the UCX data plane, over one of
// the loopback transports of ucx_test::TransportConfig ("tcp" or "shm").
#ifndef KVDEPOT_TESTS_UCX_DAEMON_H_
#define KVDEPOT_TESTS_UCX_DAEMON_H_

#include <stdlib.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/daemon_process.h"
#include "transport/ucx_test_util.h"

namespace kvdepot::testing {

// Puts the UCX settings of `transport` into this process's environment,
// where the daemons it starts and its clients (ClientOptions::ucx cleared)
// read them; UnsetUcxEnvironment takes them out again.
inline void SetUcxEnvironment(const std::string& transport) {
  for (const auto& [name, value] : ucx_test::TransportConfig(transport)) {
    setenv(absl::StrCat("UCX_", name).c_str(), value.c_str(), 1);
  }
}
inline void UnsetUcxEnvironment(const std::string& transport) {
  for (const auto& [name, value] : ucx_test::TransportConfig(transport)) {
    unsetenv(absl::StrCat("UCX_", name).c_str());
  }
}

// SetUcxEnvironment(transport), then a daemon with `args` (by default a
// 256 MiB DRAM tier) whose UCX data plane is on (FailedPrecondition, with
// its log, if not).
inline absl::StatusOr<std::unique_ptr<DaemonProcess>> StartUcxDaemon(
    const std::string& transport,
    const std::vector<std::string>& args = {"--dram-capacity", "256MiB"}) {
  SetUcxEnvironment(transport);
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(args);
  if (!d.ok()) return d.status();
  if (!absl::StrContains((*d)->Log(), "UCX data plane on")) {
    return absl::FailedPreconditionError(
        absl::StrCat("the daemon's UCX data plane is off:\n", (*d)->Log()));
  }
  return d;
}

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_UCX_DAEMON_H_
