// FaultInjectionFileSystem: a rocksdb::FileSystem for tests that behaves like
// a full disk while a switch is on: creating a file and appending to one fail
// with IOStatus::NoSpace (what RocksDB's POSIX file system returns for
// ENOSPC). Another switch holds the creation of table and blob files (a
// flush, stopped mid-way), and a third only the next one (a compaction
// stopped mid-way while other flushes and compactions go on). Reads, and
// everything while the switch is off, go to the wrapped file system. It also
// counts reads of blob files (*.blob), so a test can prove that an operation
// never touched block bytes, and fails the next ones with EIO on request
// (FailNextBlobReads), and it can report any free space (SetFreeSpace). No test
// hook in production code is needed: the tier takes the Env built from it
// through NvmeTierOptions::env.
//
//   auto fs = std::make_shared<FaultInjectionFileSystem>();
//   std::unique_ptr<rocksdb::Env> env = rocksdb::NewCompositeEnv(fs);
//   options.env = env.get();
//   ...
//   fs->SetDiskFull(true);
//
// Thread-safe.
#ifndef KVDEPOT_STORAGE_FAULT_INJECTION_FS_H_
#define KVDEPOT_STORAGE_FAULT_INJECTION_FS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "rocksdb/file_system.h"

namespace kvdepot {

class FaultInjectionFileSystem : public rocksdb::FileSystemWrapper {
 public:
  explicit FaultInjectionFileSystem(
      const std::shared_ptr<rocksdb::FileSystem>& base =
          rocksdb::FileSystem::Default());

  const char* Name() const override { return "FaultInjectionFileSystem"; }

  // While true, file creation and writes fail with NoSpace.
  void SetDiskFull(bool full) { disk_full_.store(full); }
  bool disk_full() const { return disk_full_.load(); }
  // How many operations have failed because of the switch.
  uint64_t injected_errors() const { return injected_errors_.load(); }
  // Read calls on blob files since construction.
  uint64_t blob_reads() const { return blob_reads_.load(); }
  void CountBlobRead() { blob_reads_.fetch_add(1); }
  // The next `n` reads of blob files (Read or MultiRead calls, each counted
  // once, whoever makes them: a read of the tier, a scrub, a compaction)
  // fail with the I/O error RocksDB's POSIX file system gives for EIO
  // ("While pread offset ... len ...: <file>: Input/output error", as a bad
  // sector or a controller reset gives), then reads work again. A large `n`
  // is a device that keeps failing; 0 ends it.
  void FailNextBlobReads(int n) { blob_read_failures_.store(n); }
  // Whether this read is one of those (counts it).
  bool TakeBlobReadFailure() {
    int left = blob_read_failures_.load();
    while (left > 0 &&
           !blob_read_failures_.compare_exchange_weak(left, left - 1)) {
    }
    return left > 0;
  }
  // Blob files opened for direct reads (FileOptions::use_direct_reads).
  uint64_t direct_blob_opens() const { return direct_blob_opens_.load(); }
  // While true, opening a file for direct reads fails with InvalidArgument,
  // as open(O_DIRECT) does (EINVAL) on a file system without it.
  void SetRefuseDirectReads(bool refuse) { refuse_direct_reads_.store(refuse); }
  // GetFreeSpace reports `bytes` free (the base file system's figure again
  // after ClearFreeSpace). Nothing else changes: writes still succeed.
  void SetFreeSpace(uint64_t bytes) {
    limit_free_space_.store(false);
    free_space_.store(bytes);
    lowest_free_space_.store(bytes);
    fake_free_space_.store(true);
  }
  // SetFreeSpace(bytes), and the file system then holds only that much
  // more: appends take their bytes from it and fail with NoSpace (counted
  // in injected_errors) once it is short, and a deleted file gives its size
  // back, as on a file system of that much room. Until ClearFreeSpace or
  // SetFreeSpace.
  void LimitFreeSpace(uint64_t bytes) {
    SetFreeSpace(bytes);
    limit_free_space_.store(true);
  }
  // The least free space there was since LimitFreeSpace (or SetFreeSpace).
  uint64_t lowest_free_space() const { return lowest_free_space_.load(); }
  void ClearFreeSpace() {
    limit_free_space_.store(false);
    fake_free_space_.store(false);
  }
  rocksdb::IOStatus GetFreeSpace(const std::string& path,
                                 const rocksdb::IOOptions& options,
                                 uint64_t* diskfree,
                                 rocksdb::IODebugContext* dbg) override {
    if (fake_free_space_.load()) {
      *diskfree = free_space_.load();
      return rocksdb::IOStatus::OK();
    }
    return target()->GetFreeSpace(path, options, diskfree, dbg);
  }

  // While true, creating a table or blob file (what a flush or compaction
  // writes) waits until it is false again: a test holds a flush mid-way.
  void SetTableFilesHeld(bool held);
  // The next creation of a table or blob file (only that one) waits until
  // ReleaseNextTableFile.
  void HoldNextTableFile();
  void ReleaseNextTableFile();
  // Creations of table or blob files waiting on SetTableFilesHeld or
  // HoldNextTableFile now.
  int held_creations() const;

  // Returns NoSpace (and counts it) while the disk is "full", else OK.
  rocksdb::IOStatus MaybeFail(const std::string& what);
  // MaybeFail for an append of `bytes`, which under LimitFreeSpace also
  // takes them from the free space, or fails when it is short.
  rocksdb::IOStatus MaybeFailAppend(const std::string& what, uint64_t bytes);

  rocksdb::IOStatus DeleteFile(const std::string& fname,
                               const rocksdb::IOOptions& options,
                               rocksdb::IODebugContext* dbg) override;

  rocksdb::IOStatus NewRandomAccessFile(
      const std::string& fname, const rocksdb::FileOptions& options,
      std::unique_ptr<rocksdb::FSRandomAccessFile>* result,
      rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus NewWritableFile(
      const std::string& fname, const rocksdb::FileOptions& options,
      std::unique_ptr<rocksdb::FSWritableFile>* result,
      rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus ReopenWritableFile(
      const std::string& fname, const rocksdb::FileOptions& options,
      std::unique_ptr<rocksdb::FSWritableFile>* result,
      rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus ReuseWritableFile(
      const std::string& fname, const std::string& old_fname,
      const rocksdb::FileOptions& options,
      std::unique_ptr<rocksdb::FSWritableFile>* result,
      rocksdb::IODebugContext* dbg) override;

 private:
  // Fails while the disk is "full"; otherwise runs `open` (the wrapped file
  // system's call) and wraps the file it made so its appends can fail too.
  rocksdb::IOStatus OpenWritable(
      const std::string& fname, std::unique_ptr<rocksdb::FSWritableFile>* result,
      absl::FunctionRef<rocksdb::IOStatus(std::unique_ptr<rocksdb::FSWritableFile>*)>
          open);

  mutable absl::Mutex held_mu_;
  bool table_files_held_ ABSL_GUARDED_BY(held_mu_) = false;
  // HoldNextTableFile: armed, until a creation takes it; then that creation
  // waits while next_file_held_.
  bool hold_next_file_ ABSL_GUARDED_BY(held_mu_) = false;
  bool next_file_held_ ABSL_GUARDED_BY(held_mu_) = false;
  int held_creations_ ABSL_GUARDED_BY(held_mu_) = 0;
  std::atomic<bool> disk_full_{false};
  std::atomic<uint64_t> injected_errors_{0};
  std::atomic<uint64_t> blob_reads_{0};
  std::atomic<int> blob_read_failures_{0};
  std::atomic<uint64_t> direct_blob_opens_{0};
  std::atomic<bool> refuse_direct_reads_{false};
  std::atomic<bool> fake_free_space_{false};
  std::atomic<bool> limit_free_space_{false};
  std::atomic<uint64_t> free_space_{0};
  std::atomic<uint64_t> lowest_free_space_{0};
};

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_FAULT_INJECTION_FS_H_
