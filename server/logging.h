// The daemon's logger: text or JSON lines, to stderr or to a file that can be
// reopened (SIGHUP, after logrotate moved it away).
#ifndef KVDEPOT_SERVER_LOGGING_H_
#define KVDEPOT_SERVER_LOGGING_H_

#include <spdlog/spdlog.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
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

// Bounds the lines of log sites a client can set off at will (a failed
// request, a refused wire-up, a session opened): at most `burst` lines of
// one site per `window`; the ones past it are left out and counted, and
// the site's next line logged says how many (LeftOutNote). A client that
// loops on a bad request cannot fill the disk or drown the lines that
// matter. Thread-safe.
class LogLimiter {
 public:
  static constexpr int kDefaultBurst = 20;
  static constexpr absl::Duration kDefaultWindow = absl::Seconds(10);
  explicit LogLimiter(int burst = kDefaultBurst,
                      absl::Duration window = kDefaultWindow)
      : burst_(burst), window_(window) {}
  // Whether a line of `site` may be logged at `now`; when it may,
  // *left_out is the number of its lines left out since the last one
  // logged. Sites are the code's own names (a bounded set, never a
  // client's string): each keeps a few bytes for the limiter's life.
  bool Allow(absl::string_view site, uint64_t* left_out,
             absl::Time now = absl::Now());
  // The lines left out at sites whose window has ended (site, count), each
  // count returned once: for a periodic caller, so that the tail of a
  // flood that stopped is still told (a site's next line would carry it,
  // and a site may never log again).
  std::vector<std::pair<std::string, uint64_t>> TakeLeftOut(
      absl::Time now = absl::Now());

 private:
  struct Site {
    absl::Time window_start = absl::InfinitePast();
    int logged = 0;         // lines logged in the current window
    uint64_t left_out = 0;  // since the last line logged
  };
  const int burst_;
  const absl::Duration window_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Site> sites_ ABSL_GUARDED_BY(mu_);
};

// " (N more like it left out)" for N > 0, else "": the tail of a limited
// line.
std::string LeftOutNote(uint64_t left_out);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_LOGGING_H_
