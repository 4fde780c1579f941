// The daemon's logger: text or JSON lines, to stderr or to a file that can be
// reopened (SIGHUP, after logrotate moved it away).
#ifndef KVDEPOT_SERVER_LOGGING_H_
#define KVDEPOT_SERVER_LOGGING_H_

#include <spdlog/spdlog.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvdepot {

struct LogOptions {
  std::string level = "info";  // trace, debug, info, warn, error, off
  std::string format = "text";  // text, json (one object per line)
  std::string file;             // empty: stderr
};

struct Logger {
  std::shared_ptr<spdlog::logger> logger;
  // Reopens the log file (a no-op for stderr). Thread-safe; lines logged
  // meanwhile go to the old or the new file, none is lost or torn. When the
  // path cannot be opened (its directory gone, no permission), the old file
  // stays in use and the error is returned.
  std::function<absl::Status()> reopen;
};

// InvalidArgument for an unknown level or format; PermissionDenied when the
// file cannot be opened for appending.
absl::StatusOr<Logger> MakeLogger(const std::string& name, const LogOptions& options);

// Says when a condition that is checked over and over (the NVMe tier taking
// no writes, every second) is worth a log line: when it starts, ends or
// changes, and every `remind` while it lasts. Its message may carry numbers
// that move while the condition stays (a free byte count): a change in
// them alone is no change. Not thread-safe (one loop's).
class ConditionLog {
 public:
  explicit ConditionLog(absl::Duration remind) : remind_(remind) {}
  // Whether to log `message` (empty: the condition does not hold) at `now`.
  bool ShouldLog(absl::string_view message, absl::Time now);

 private:
  absl::Duration remind_;
  std::string shape_;  // the message last logged, digits left out
  absl::Time logged_ = absl::InfinitePast();
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_LOGGING_H_
