#include "storage/rocksdb_info_log.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <ctime>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvdepot {

struct RocksInfoLog::State {
  State(std::string p, size_t max) : path(std::move(p)), max_bytes(max) {}

  // Opens `path` afresh, first moving the old file, if any, to LOG.old.1
  // (and older ones one step on, the oldest dropped). At most once a
  // second after a failed open.
  void OpenLocked(bool rotate) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const absl::Time now = absl::Now();
    if (fd < 0 && now < next_open) return;
    if (fd >= 0) ::close(fd);
    fd = -1;
    size = 0;
    int flags = O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC;
    // Only a file of ours is moved aside (never, say, a device or a link
    // named as the log): anything else is truncated instead, so that it
    // stays within max_bytes too.
    struct stat st;
    if (rotate && ::lstat(path.c_str(), &st) == 0) {
      bool moved = false;
      if (S_ISREG(st.st_mode)) {
        for (int g = kOldGenerations - 1; g >= 1; --g) {
          ::rename(Old(g).c_str(), Old(g + 1).c_str());  // may not exist
        }
        moved = ::rename(path.c_str(), Old(1).c_str()) == 0;
      }
      if (!moved) flags |= O_TRUNC;
    }
    fd = ::open(path.c_str(), flags, 0640);
    if (fd < 0) next_open = now + absl::Seconds(1);
  }
  std::string Old(int generation) const {
    return path + ".old." + std::to_string(generation);
  }

  static constexpr int kOldGenerations = 3;
  const std::string path;
  const size_t max_bytes;
  mutable absl::Mutex mu;
  int fd ABSL_GUARDED_BY(mu) = -1;
  size_t size ABSL_GUARDED_BY(mu) = 0;
  absl::Time next_open ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  uint64_t dropped ABSL_GUARDED_BY(mu) = 0;
};

RocksInfoLog::RocksInfoLog(std::string path, size_t max_bytes)
    : rocksdb::Logger(rocksdb::InfoLogLevel::INFO_LEVEL),
      state_(std::make_unique<State>(std::move(path), max_bytes)) {
  absl::MutexLock lock(&state_->mu);
  state_->OpenLocked(/*rotate=*/true);
}

RocksInfoLog::~RocksInfoLog() {
  absl::MutexLock lock(&state_->mu);
  if (state_->fd >= 0) ::close(state_->fd);
  state_->fd = -1;
}

void RocksInfoLog::Logv(const char* format, va_list ap) {
  char line[2048];
  struct timeval tv;
  gettimeofday(&tv, nullptr);
  struct tm t;
  localtime_r(&tv.tv_sec, &t);
  int n = std::snprintf(line, sizeof line,
                        "%04d/%02d/%02d-%02d:%02d:%02d.%06ld %lx ",
                        t.tm_year + 1900, t.tm_mon + 1, t.tm_mday, t.tm_hour,
                        t.tm_min, t.tm_sec, static_cast<long>(tv.tv_usec),
                        static_cast<unsigned long>(pthread_self()));
  if (n < 0) n = 0;
  std::string text(line, static_cast<size_t>(n));
  va_list copy;
  va_copy(copy, ap);
  const int body = std::vsnprintf(line, sizeof line, format, ap);
  if (body >= 0 && static_cast<size_t>(body) < sizeof line) {
    text.append(line, static_cast<size_t>(body));
  } else if (body > 0) {
    std::string long_line(static_cast<size_t>(body) + 1, '\0');
    std::vsnprintf(long_line.data(), long_line.size(), format, copy);
    long_line.resize(static_cast<size_t>(body));
    text += long_line;
  }
  va_end(copy);
  if (text.empty() || text.back() != '\n') text.push_back('\n');

  absl::MutexLock lock(&state_->mu);
  if (state_->fd < 0 || state_->size + text.size() > state_->max_bytes) {
    state_->OpenLocked(/*rotate=*/state_->fd >= 0);
  }
  if (state_->fd < 0) {
    ++state_->dropped;
    return;
  }
  const ssize_t written = ::write(state_->fd, text.data(), text.size());
  if (written == static_cast<ssize_t>(text.size())) {
    state_->size += text.size();
    return;
  }
  // ENOSPC and the like: this line is lost; the next one tries again (a
  // partial line is ended so that the next starts on its own).
  ++state_->dropped;
  if (written > 0) {
    state_->size += static_cast<size_t>(written);
    (void)!::write(state_->fd, "\n", 1);
  }
}

size_t RocksInfoLog::GetLogFileSize() const {
  absl::MutexLock lock(&state_->mu);
  return state_->size;
}

uint64_t RocksInfoLog::dropped_lines() const {
  absl::MutexLock lock(&state_->mu);
  return state_->dropped;
}

}  // namespace kvdepot
