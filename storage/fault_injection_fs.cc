#include "storage/fault_injection_fs.h"

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
    rocksdb::IOStatus s = fs_->MaybeFail(name_);
    return s.ok() ? target()->Append(data, options, dbg) : s;
  }
  rocksdb::IOStatus Append(const rocksdb::Slice& data,
                           const rocksdb::IOOptions& options,
                           const rocksdb::DataVerificationInfo& info,
                           rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = fs_->MaybeFail(name_);
    return s.ok() ? target()->Append(data, options, info, dbg) : s;
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data,
                                     uint64_t offset,
                                     const rocksdb::IOOptions& options,
                                     rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = fs_->MaybeFail(name_);
    return s.ok() ? target()->PositionedAppend(data, offset, options, dbg) : s;
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data,
                                     uint64_t offset,
                                     const rocksdb::IOOptions& options,
                                     const rocksdb::DataVerificationInfo& info,
                                     rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = fs_->MaybeFail(name_);
    return s.ok() ? target()->PositionedAppend(data, offset, options, info,
                                               dbg)
                  : s;
  }

 private:
  FaultInjectionFileSystem* const fs_;  // outlives its files
  const std::string name_;
};

// Counts the reads of a blob file.
class BlobReadCountingFile final
    : public rocksdb::FSRandomAccessFileOwnerWrapper {
 public:
  BlobReadCountingFile(std::unique_ptr<rocksdb::FSRandomAccessFile> file,
                       FaultInjectionFileSystem* fs)
      : FSRandomAccessFileOwnerWrapper(std::move(file)), fs_(fs) {}

  rocksdb::IOStatus Read(uint64_t offset, size_t n,
                         const rocksdb::IOOptions& options,
                         rocksdb::Slice* result, char* scratch,
                         rocksdb::IODebugContext* dbg) const override {
    fs_->CountBlobRead();
    if (fs_->TakeBlobReadFailure()) {
      return rocksdb::IOStatus::IOError(
          "While reading a blob file: Input/output error");
    }
    return target()->Read(offset, n, options, result, scratch, dbg);
  }
  rocksdb::IOStatus MultiRead(rocksdb::FSReadRequest* reqs, size_t num_reqs,
                              const rocksdb::IOOptions& options,
                              rocksdb::IODebugContext* dbg) override {
    fs_->CountBlobRead();
    if (fs_->TakeBlobReadFailure()) {
      const rocksdb::IOStatus eio = rocksdb::IOStatus::IOError(
          "While reading a blob file: Input/output error");
      for (size_t i = 0; i < num_reqs; ++i) reqs[i].status = eio;
      return eio;
    }
    return target()->MultiRead(reqs, num_reqs, options, dbg);
  }

 private:
  FaultInjectionFileSystem* const fs_;  // outlives its files
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
    *result = std::make_unique<BlobReadCountingFile>(std::move(file), this);
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
