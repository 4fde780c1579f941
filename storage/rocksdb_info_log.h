// RocksDB's info log (<nvme dir>/LOG) written by kvdepot instead of by
// RocksDB's own logger.
//
// Why: Debian's librocksdb (7.8) is built with assertions, and its logger
// asserts once a write to LOG has failed: on a full filesystem the first
// failed LOG line aborted kvdepotd -- while serving, at shutdown, and at
// every restart -- where a full disk must only stop the NVMe tier's writes.
// This logger writes each line with write(2) and drops what does not fit
// (counting it), never failing its caller.
//
// Lines: "YYYY/MM/DD-HH:MM:SS.uuuuuu TID message", as RocksDB's. When it
// is opened and when it passes `max_bytes` the file moves to LOG.old.1
// (LOG.old.1 to .2, .2 to .3, the oldest dropped), so the log takes at most
// 4 x max_bytes and the last starts' logs stay. A line that cannot be
// written is dropped (the next one tries again); a file that cannot be
// opened is tried again at most once a second.
//
// Thread-safe.
#ifndef KVDEPOT_STORAGE_ROCKSDB_INFO_LOG_H_
#define KVDEPOT_STORAGE_ROCKSDB_INFO_LOG_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "rocksdb/env.h"

namespace kvdepot {

class RocksInfoLog : public rocksdb::Logger {
 public:
  RocksInfoLog(std::string path, size_t max_bytes);
  ~RocksInfoLog() override;
  RocksInfoLog(const RocksInfoLog&) = delete;
  RocksInfoLog& operator=(const RocksInfoLog&) = delete;

  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override;
  size_t GetLogFileSize() const override;

  // Lines not written (no file, a failed write): for tests.
  uint64_t dropped_lines() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_ROCKSDB_INFO_LOG_H_
