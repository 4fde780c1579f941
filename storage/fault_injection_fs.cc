#include "storage/fault_injection_fs.h"

#include <string>
#include <string_view>
#include <utility>

namespace kvdepot {
namespace {

// Forwards to the wrapped file, failing appends while the disk is "full".
class FaultInjectionWritableFile final
    : public rocksdb::FSWritableFileOwnerWrapper {
 public:
  FaultInjectionWritableFile(std::unique_ptr<rocksdb::FSWritableFile> file,
                             FaultInjectionFileSystem* fs, std::string name)
      : FSWritableFileOwnerWrapper(std::move(file)),
        fs_(fs),
        name_(std::move(name)) {}

  rocksdb::IOStatus Append(const rocksdb::Slice& data,
                           const rocksdb::IOOptions& options,
                           rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = fs_->MaybeFailAppend(name_, data.size());
    return s.ok() ? target()->Append(data, options, dbg) : s;
  }
  rocksdb::IOStatus Append(const rocksdb::Slice& data,
                           const rocksdb::IOOptions& options,
                           const rocksdb::DataVerificationInfo& info,
                           rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = fs_->MaybeFailAppend(name_, data.size());
    return s.ok() ? target()->Append(data, options, info, dbg) : s;
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data,
                                     uint64_t offset,
                                     const rocksdb::IOOptions& options,
                                     rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = fs_->MaybeFailAppend(name_, data.size());
    return s.ok() ? target()->PositionedAppend(data, offset, options, dbg) : s;
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data,
                                     uint64_t offset,
                                     const rocksdb::IOOptions& options,
                                     const rocksdb::DataVerificationInfo& info,
                                     rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = fs_->MaybeFailAppend(name_, data.size());
    return s.ok() ? target()->PositionedAppend(data, offset, options, info,
                                               dbg)
                  : s;
  }

 private:
  FaultInjectionFileSystem* const fs_;  // outlives its files
  const std::string name_;
};

// Counts the reads of a blob file, and fails those FailNextBlobReads asks
// for with the error RocksDB's POSIX file system gives for EIO.
class BlobReadCountingFile final
    : public rocksdb::FSRandomAccessFileOwnerWrapper {
 public:
  BlobReadCountingFile(std::unique_ptr<rocksdb::FSRandomAccessFile> file,
                       FaultInjectionFileSystem* fs, std::string name)
      : FSRandomAccessFileOwnerWrapper(std::move(file)),
        fs_(fs),
        name_(std::move(name)) {}

  rocksdb::IOStatus Read(uint64_t offset, size_t n,
                         const rocksdb::IOOptions& options,
                         rocksdb::Slice* result, char* scratch,
                         rocksdb::IODebugContext* dbg) const override {
    fs_->CountBlobRead();
    if (fs_->TakeBlobReadFailure()) return Eio(offset, n);
    return target()->Read(offset, n, options, result, scratch, dbg);
  }
  rocksdb::IOStatus MultiRead(rocksdb::FSReadRequest* reqs, size_t num_reqs,
                              const rocksdb::IOOptions& options,
                              rocksdb::IODebugContext* dbg) override {
    fs_->CountBlobRead();
    if (fs_->TakeBlobReadFailure()) {
      for (size_t i = 0; i < num_reqs; ++i) {
        reqs[i].status = Eio(reqs[i].offset, reqs[i].len);
      }
      return num_reqs > 0 ? reqs[0].status : Eio(0, 0);
    }
    return target()->MultiRead(reqs, num_reqs, options, dbg);
  }

 private:
  // As PosixRandomAccessFile::Read words it (IOError(context, file, EIO)).
  rocksdb::IOStatus Eio(uint64_t offset, size_t n) const {
    return rocksdb::IOStatus::IOError("While pread offset " +
                                          std::to_string(offset) + " len " +
                                          std::to_string(n),
                                      name_ + ": Input/output error");
  }

  FaultInjectionFileSystem* const fs_;  // outlives its files
  const std::string name_;
};

bool HasSuffix(const std::string& name, std::string_view suffix) {
  return name.size() >= suffix.size() &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool IsBlobFile(const std::string& name) { return HasSuffix(name, ".blob"); }
bool IsTableFile(const std::string& name) { return HasSuffix(name, ".sst"); }

}  // namespace

FaultInjectionFileSystem::FaultInjectionFileSystem(
    const std::shared_ptr<rocksdb::FileSystem>& base)
    : FileSystemWrapper(base) {}

void FaultInjectionFileSystem::SetTableFilesHeld(bool held) {
  absl::MutexLock lock(&held_mu_);
  table_files_held_ = held;
}

void FaultInjectionFileSystem::HoldNextTableFile() {
  absl::MutexLock lock(&held_mu_);
  hold_next_file_ = true;
  next_file_held_ = true;
}

void FaultInjectionFileSystem::ReleaseNextTableFile() {
  absl::MutexLock lock(&held_mu_);
  hold_next_file_ = false;
  next_file_held_ = false;
}

int FaultInjectionFileSystem::held_creations() const {
  absl::MutexLock lock(&held_mu_);
  return held_creations_;
}

rocksdb::IOStatus FaultInjectionFileSystem::MaybeFail(const std::string& what) {
  if (!disk_full_.load()) return rocksdb::IOStatus::OK();
  injected_errors_.fetch_add(1);
  return rocksdb::IOStatus::NoSpace(what, "injected: no space left on device");
}

rocksdb::IOStatus FaultInjectionFileSystem::MaybeFailAppend(
    const std::string& what, uint64_t bytes) {
  rocksdb::IOStatus s = MaybeFail(what);
  if (!s.ok() || !limit_free_space_.load()) return s;
  uint64_t free = free_space_.load();
  do {
    if (free < bytes) {
      injected_errors_.fetch_add(1);
      return rocksdb::IOStatus::NoSpace(
          what, "injected: no space left on device (LimitFreeSpace)");
    }
  } while (!free_space_.compare_exchange_weak(free, free - bytes));
  uint64_t lowest = lowest_free_space_.load();
  while (free - bytes < lowest &&
         !lowest_free_space_.compare_exchange_weak(lowest, free - bytes)) {
  }
  return s;
}

rocksdb::IOStatus FaultInjectionFileSystem::DeleteFile(
    const std::string& fname, const rocksdb::IOOptions& options,
    rocksdb::IODebugContext* dbg) {
  uint64_t size = 0;
  const bool sized = limit_free_space_.load() &&
                     target()->GetFileSize(fname, options, &size, dbg).ok();
  rocksdb::IOStatus s = target()->DeleteFile(fname, options, dbg);
  if (s.ok() && sized && limit_free_space_.load()) free_space_.fetch_add(size);
  return s;
}

rocksdb::IOStatus FaultInjectionFileSystem::NewRandomAccessFile(
    const std::string& fname, const rocksdb::FileOptions& options,
    std::unique_ptr<rocksdb::FSRandomAccessFile>* result,
    rocksdb::IODebugContext* dbg) {
  if (options.use_direct_reads && refuse_direct_reads_.load()) {
    return rocksdb::IOStatus::InvalidArgument(
        "While open a file for random read: " + fname + ": Invalid argument");
  }
  std::unique_ptr<rocksdb::FSRandomAccessFile> file;
  rocksdb::IOStatus s = target()->NewRandomAccessFile(fname, options, &file,
                                                      dbg);
  if (!s.ok()) return s;
  if (IsBlobFile(fname)) {
    if (options.use_direct_reads) direct_blob_opens_.fetch_add(1);
    *result =
        std::make_unique<BlobReadCountingFile>(std::move(file), this, fname);
  } else {
    *result = std::move(file);
  }
  return s;
}

rocksdb::IOStatus FaultInjectionFileSystem::OpenWritable(
    const std::string& fname, std::unique_ptr<rocksdb::FSWritableFile>* result,
    absl::FunctionRef<rocksdb::IOStatus(std::unique_ptr<rocksdb::FSWritableFile>*)>
        open) {
  if (IsBlobFile(fname) || IsTableFile(fname)) {
    absl::MutexLock lock(&held_mu_);
    ++held_creations_;
    if (std::exchange(hold_next_file_, false)) {
      held_mu_.Await(absl::Condition(
          +[](bool* held) { return !*held; }, &next_file_held_));
    }
    held_mu_.Await(absl::Condition(
        +[](bool* held) { return !*held; }, &table_files_held_));
    --held_creations_;
  }
  rocksdb::IOStatus s = MaybeFail(fname);
  if (!s.ok()) return s;
  std::unique_ptr<rocksdb::FSWritableFile> file;
  s = open(&file);
  if (s.ok()) {
    *result = std::make_unique<FaultInjectionWritableFile>(std::move(file),
                                                           this, fname);
  }
  return s;
}

rocksdb::IOStatus FaultInjectionFileSystem::NewWritableFile(
    const std::string& fname, const rocksdb::FileOptions& options,
    std::unique_ptr<rocksdb::FSWritableFile>* result,
    rocksdb::IODebugContext* dbg) {
  return OpenWritable(fname, result,
                      [&](std::unique_ptr<rocksdb::FSWritableFile>* file) {
                        return target()->NewWritableFile(fname, options, file, dbg);
                      });
}

rocksdb::IOStatus FaultInjectionFileSystem::ReopenWritableFile(
    const std::string& fname, const rocksdb::FileOptions& options,
    std::unique_ptr<rocksdb::FSWritableFile>* result,
    rocksdb::IODebugContext* dbg) {
  return OpenWritable(fname, result,
                      [&](std::unique_ptr<rocksdb::FSWritableFile>* file) {
                        return target()->ReopenWritableFile(fname, options, file, dbg);
                      });
}

rocksdb::IOStatus FaultInjectionFileSystem::ReuseWritableFile(
    const std::string& fname, const std::string& old_fname,
    const rocksdb::FileOptions& options,
    std::unique_ptr<rocksdb::FSWritableFile>* result,
    rocksdb::IODebugContext* dbg) {
  return OpenWritable(fname, result,
                      [&](std::unique_ptr<rocksdb::FSWritableFile>* file) {
                        return target()->ReuseWritableFile(fname, old_fname, options, file, dbg);
                      });
}

}  // namespace kvdepot
