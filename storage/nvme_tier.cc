#include "storage/nvme_tier.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/node_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "rocksdb/convenience.h"
#include "rocksdb/db.h"
#include "rocksdb/env.h"
#include "rocksdb/listener.h"
#include "rocksdb/metadata.h"
#include "rocksdb/options.h"
#include "rocksdb/snapshot.h"
#include "rocksdb/write_batch.h"
#include "storage/block_key.h"
#include "storage/checksum.h"
#include "storage/internal/sync_point.h"
#include "storage/rocksdb_crc32c.h"
#include "storage/rocksdb_info_log.h"
#include "storage/rocksdb_status.h"
#include "storage/status_macros.h"

// On-disk layout (format 2).
//
// One column family (the default), three kinds of keys:
//   "kvdepot.nvme_tier.format" -> "2"
//   'm' + block id -> metadata record (small; always inline in the LSM)
//   'd' + block id -> the block's bytes (blob files from min_blob_size)
// A block id is one byte holding the namespace length, the namespace, then the
// key (the rest). Namespaces are at most kMaxNamespaceBytes (< 256) bytes, so
// the encoding is unambiguous and a (namespace, key) pair has exactly one id.
// The metadata record is fixed-width little endian:
//   u8 version (1) | u64 size | u64 checksum | u64 last_touch |
//   u32 read_count | u16 parent length | parent key bytes
//
// A block's two records are always written, and deleted, in one WriteBatch
// to one column family: they land in the same memtable, which a flush
// persists whole, so a crash leaves either both records or neither, with or
// without the WAL. (Format 1 kept them in two column families, which needed
// atomic_flush; RocksDB 7.8's atomic flush loses writes after recovering
// from a failed flush when several memtables are queued, and several
// memtables flushing in parallel are what lets the tier write at disk
// speed.) Blocks with only one record are nevertheless handled (dropped
// when met) in case the files were damaged or edited.
//
// Index invariants (all under mu_):
//  * Every entry of index_ is in one state. kStored: both records are in
//    RocksDB; the entry is in one recency list (leaves_ or inner_) and
//    counted in used_ and blocks_. kWriting: a Put is writing the records;
//    counted in used_ (a reservation), not listed, not visible. kDeleting: a
//    delete of the records is in flight; not counted, not listed, not visible.
//  * Prefix links. A stored entry with a parent is "linked": counted once
//    under its parent's id, in the parent's `children` when the parent is
//    stored, else in orphan_children_ (children often reach the tier before
//    their parent: DRAM evicts leaves first). A stored entry takes over its
//    orphan count when it becomes stored and hands its children back when it
//    stops being stored. Entries with no stored child are in leaves_, the
//    others in inner_; eviction takes the least recent leaf, so a chain goes
//    from its end toward its root and a cached prefix stays usable. A parent
//    whose last child goes enters leaves_ at the least recent end (its chain
//    has just aged out). inner_ is used only when there is no leaf (parent
//    cycles that a client made up), so eviction always makes progress.
//  * At most one writer per id: Put and Delete wait (Mutex::Await) until the
//    id is absent or kStored before they change it, so the RocksDB writes of
//    one id never race each other.
//  * A generation number, unique per entry, tells a reader whose RocksDB read
//    raced with a delete and a re-put of the same id that the entry it looked
//    up is gone, so it never drops the newer one.

namespace kvdepot {
namespace {

constexpr char kFormatKey[] = "kvdepot.nvme_tier.format";
constexpr char kFormatVersion[] = "2";
// Key prefixes of a block's two records.
constexpr char kMetaPrefix = 'm';
constexpr char kDataPrefix = 'd';
// Column families of format 1 (see the layout comment).
constexpr char kFormat1MetaFamily[] = "meta";
constexpr uint8_t kMetaRecordVersion = 1;
constexpr size_t kMetaFixedBytes = 1 + 8 + 8 + 8 + 4 + 2;
// Puts and deletes between two checks of the blob garbage ratio.
constexpr uint64_t kGcCheckInterval = 64;
// Most forced-GC passes one Compact makes (see Compact).
constexpr int kCompactPasses = 3;
// Most passes of a Compact that rewrites only the oldest fraction of the
// blob files at a time (too little free space for all of them at once).
constexpr int kMaxPartialCompactPasses = 20;
// The least fraction of the blob files such a pass rewrites: below it,
// Compact refuses (the file system is too full for it to help).
constexpr double kMinCompactFraction = 0.05;
// How long the write that starts DB::Resume waits for it (its flush of
// what the memtables hold), and the destructor (both at most until the
// resume counts as stuck, NvmeTierOptions::resume_stuck_after).
// RocksDB 7.8 can lose a flush it had scheduled when a background error
// stops it: the job returns without taking its request off the queue, no
// later one is counted for it, and DB::Resume then waits for that flush for
// good (nvme_tier_test AFlushRocksDbLostLeavesWritesOffWithoutAHang;
// RocksDB issue 15030 describes the same orphaned flush). Writes then stay
// off until the tier is reopened; at close, CancelAllBackgroundWork ends the
// wait, and what the memtables held is lost, as in a crash without the WAL.
constexpr absl::Duration kResumeWait = absl::Seconds(5);
// What ProbeRoom writes before a resume is tried.
constexpr size_t kProbeBytes = 1 << 20;
constexpr char kStuckSuffix[] =
    "; RocksDB's resume has not ended (RocksDB 7 can leave it waiting for a "
    "flush it never runs): writes stay off until kvdepotd restarts";
constexpr char kFatalSuffix[] =
    "; RocksDB calls the error fatal and no resume can end it: writes stay "
    "off until kvdepotd restarts";
constexpr char kCorruptTableSuffix[] =
    "; a table file of the NVMe tier is corrupt and every compaction of it "
    "fails: writes stay off, after a restart too, until the tier's directory "
    "is moved away (its blocks are lost; reads go on meanwhile, each "
    "verified)";
constexpr absl::Duration kShutdownResumeWait = absl::Seconds(10);
// How long MakeWritesDurable waits for puts in flight (see there).
constexpr absl::Duration kUnloggedWriteWait = absl::Seconds(10);
// After an automatic compaction met a corrupt blob (see ErrorListener), the
// maintenance thread scrubs the tier, at most once per this long (tier's
// clock): a corruption the scrub cannot drop would otherwise have every
// failing compaction start another scrub.
constexpr absl::Duration kAutoScrubInterval = absl::Minutes(10);
// Most block bytes one RocksDB MultiGet of MultiRead asks for (a larger
// block is read alone): RocksDB holds a heap copy of every value it
// returns until MultiRead has copied it out (see MultiRead).
constexpr uint64_t kMultiReadChunkBytes = uint64_t{32} << 20;
// Longest chain of stored ancestors walked when a block could close a cycle.
constexpr int kMaxChainWalk = 1 << 16;
// A block whose reads meet an I/O error (EIO) is dropped only when a second
// read of it fails too (see NvmeTierImpl::NoteUnreadable) -- and not even
// then while more than kUnreadableBurstBlocks distinct blocks have failed
// within kUnreadableBurstWindow (tier's clock): that is the device failing
// (a controller reset, a dying drive), not those blocks, and dropping
// would empty the tier of whatever it read meanwhile.
constexpr size_t kUnreadableBurstBlocks = 64;
constexpr absl::Duration kUnreadableBurstWindow = absl::Seconds(10);

static_assert(kMaxNamespaceBytes <= 255, "namespace length must fit a byte");
static_assert(kMaxKeyBytes <= 65535, "parent length must fit 16 bits");

void PutFixed(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) {
    out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  }
}

uint64_t GetFixed(const char* p, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) {
    value |= uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
  }
  return value;
}

std::string EncodeId(absl::string_view ns, absl::string_view key) {
  std::string id;
  id.reserve(1 + ns.size() + key.size());
  id.push_back(static_cast<char>(ns.size()));
  id.append(ns.data(), ns.size());
  id.append(key.data(), key.size());
  return id;
}

std::string MetaKey(absl::string_view id) {
  return absl::StrCat(absl::string_view(&kMetaPrefix, 1), id);
}
std::string DataKey(absl::string_view id) {
  return absl::StrCat(absl::string_view(&kDataPrefix, 1), id);
}

// Splits an id; false if it is not one EncodeId could have made.
bool DecodeId(absl::string_view id, absl::string_view* ns,
              absl::string_view* key) {
  if (id.empty()) return false;
  size_t ns_len = static_cast<unsigned char>(id[0]);
  if (id.size() < 1 + ns_len + 1) return false;
  *ns = id.substr(1, ns_len);
  *key = id.substr(1 + ns_len);
  return ValidateNamespace(*ns).ok() && ValidateKey(*key).ok();
}

struct MetaRecord {
  uint64_t size = 0;
  uint64_t checksum = 0;
  uint64_t last_touch = 0;
  uint32_t read_count = 0;
  std::string parent;
};

std::string EncodeMeta(uint64_t size, uint64_t checksum, uint64_t last_touch,
                       uint32_t read_count, absl::string_view parent) {
  std::string out;
  out.reserve(kMetaFixedBytes + parent.size());
  out.push_back(static_cast<char>(kMetaRecordVersion));
  PutFixed(&out, size, 8);
  PutFixed(&out, checksum, 8);
  PutFixed(&out, last_touch, 8);
  PutFixed(&out, read_count, 4);
  PutFixed(&out, parent.size(), 2);
  out.append(parent.data(), parent.size());
  return out;
}

bool DecodeMeta(absl::string_view in, MetaRecord* out) {
  if (in.size() < kMetaFixedBytes) return false;
  if (static_cast<uint8_t>(in[0]) != kMetaRecordVersion) return false;
  const char* p = in.data() + 1;
  out->size = GetFixed(p, 8);
  out->checksum = GetFixed(p + 8, 8);
  out->last_touch = GetFixed(p + 16, 8);
  out->read_count = static_cast<uint32_t>(GetFixed(p + 24, 4));
  size_t parent_len = GetFixed(p + 28, 2);
  if (in.size() != kMetaFixedBytes + parent_len) return false;
  out->parent.assign(in.data() + kMetaFixedBytes, parent_len);
  if (out->size == 0) return false;
  return out->parent.empty() || ValidateKey(out->parent).ok();
}

// What a block costs against the capacity: its bytes, its id under both
// column families, and its metadata record; at least `min_charge` (the
// block bound's share of the capacity, NvmeTierImpl::min_charge_), so that
// a tier full of tiny blocks holds no more than max_blocks of them.
uint64_t Charge(size_t id_bytes, size_t parent_bytes, uint64_t size,
                uint64_t min_charge) {
  return std::max<uint64_t>(
      size + 2 * id_bytes + kMetaFixedBytes + parent_bytes, min_charge);
}

// NvmeTierImpl::min_charge_ for `options` (whose block bound OpenNvmeTier
// checked is not 0).
uint64_t MinCharge(const NvmeTierOptions& options) {
  const uint64_t max_blocks = std::max<uint64_t>(
      NvmeTierMaxBlocks(options.capacity_bytes, options.max_blocks), 1);
  return options.capacity_bytes / max_blocks +
         (options.capacity_bytes % max_blocks != 0 ? 1 : 0);
}

// A read that failed with EIO: a bad sector -- or a device that fails
// for a while (a controller reset), so a read may pass when tried again.
bool IsIoError(const rocksdb::Status& s) {
  if (!s.IsIOError() || s.IsNoSpace() || s.IsIOFenced() || s.IsPathNotFound()) {
    return false;
  }
  return absl::StrContains(absl::AsciiStrToLower(s.ToString()),
                           "input/output error");
}

// A read that failed for the block's own bytes: its file gone, or EIO
// (IsIoError). Not an I/O error of the whole process or tier that passes
// (out of file descriptors or memory: RocksDB opens blob files lazily), a
// full disk or a tier shutting down: the block stays, and the read is
// Unavailable.
bool IsUnreadable(const rocksdb::Status& s) {
  return (s.IsIOError() && s.IsPathNotFound()) || IsIoError(s);
}

std::string IdToHex(absl::string_view id) {
  absl::string_view ns, key;
  if (!DecodeId(id, &ns, &key)) return KeyToHex(id);
  return absl::StrCat(ns, "/", KeyToHex(key));
}

// Learns when RocksDB stops writes after a background error (a flush that
// hit a full disk), and keeps RocksDB from resuming on its own (by default
// its SstFileManager polls the disk from its own thread every 5 s): the tier
// resumes on its own schedule, see NvmeTierImpl::EnsureWritable.
//
// A compaction that reads a corrupt blob (blob garbage collection
// relocating a blob whose bytes went bad on disk) fails with Corruption (one
// that cannot read it, a bad sector or the file gone, with an I/O error),
// which RocksDB would make a background error that no DB::Resume clears:
// the tier would take no write until restarted, and the next compaction
// would stop it again. Such an error is suppressed instead (RocksDB keeps
// the compaction's inputs and drops its output, so the database is as
// before, and reads verify every block anyway) and noted, so that the tier
// scrubs the bad block away (NvmeTierImpl::Compact, MaintenanceLoop): once
// its key is deleted, the next garbage collection no longer reads it.
//
// Not so a corrupt table file (a bad data or index block of an .sst, where
// small blocks and every key live): deleting its keys does not take the bad
// bytes out of the file, only a compaction would, and every compaction of
// that file fails. Suppressed, RocksDB would retry it for ever while
// level-0 files piled up, until it stopped writes with no error: every
// put, delete and flush of the tier would hang. So that corruption stops
// the tier's writes with a clear, fatal error (no resume clears it; reads
// go on, each verified): the directory must be moved away.
// Thread-safe (RocksDB calls it from its background threads).
class ErrorListener final : public rocksdb::EventListener {
 public:
  // `path`: the tier's directory, which RocksDB's messages name and which
  // is no evidence of what failed (a directory named "blobstore").
  explicit ErrorListener(std::string path) : path_(std::move(path)) {}

  void OnBackgroundError(rocksdb::BackgroundErrorReason reason,
                         rocksdb::Status* bg_error) override {
    if (bg_error->ok()) return;
    if (reason == rocksdb::BackgroundErrorReason::kCompaction &&
        (IsBlobCorruption(*bg_error) || IsBlobReadError(*bg_error))) {
      *bg_error = rocksdb::Status::OK();
      corruption_seen_.store(true, std::memory_order_release);
      return;
    }
    if (bg_error->IsCorruption()) {
      corrupt_table_.store(true, std::memory_order_release);
      fatal_.store(true, std::memory_order_release);
      Stop(bg_error->ToString());
      return;
    }
    // A fatal or unrecoverable error: no resume can succeed (RocksDB 7.8
    // after ENOSPC in parallel flushes: a flush's file deleted as obsolete,
    // then missing at every resume).
    if (bg_error->severity() >= rocksdb::Status::Severity::kFatalError) {
      fatal_.store(true, std::memory_order_release);
    }
    Stop(bg_error->ToString());
  }
  // Whether a Corruption names a blob (RocksDB 7.8's messages of a bad blob
  // all do: "Blob CRC mismatch", "Corrupted blob offset", "Key size mismatch
  // when reading blob", ...; a table file's, e.g. "block checksum mismatch
  // ... in .../000008.sst", do not).
  bool IsBlobCorruption(const rocksdb::Status& s) const {
    if (!s.IsCorruption()) return false;
    const std::string m = MessageWithoutPath(s);
    return absl::StrContains(m, "blob") && !absl::StrContains(m, ".sst");
  }
  // Whether an I/O error is a read of a blob file (its bytes on a bad
  // sector, or the file gone): like a corrupt blob, the scrub drops the
  // blocks it cannot read. Not a write (a compaction writing a new blob
  // file), which stops writes as any other.
  bool IsBlobReadError(const rocksdb::Status& s) const {
    if (!IsUnreadable(s)) return false;
    const std::string m = MessageWithoutPath(s);
    return absl::StrContains(m, ".blob") &&
           (s.IsPathNotFound() || absl::StrContains(m, "pread") ||
            absl::StrContains(m, "random read"));
  }
  // Whether a compaction met corruption since the last call.
  bool TakeCorruption() {
    return corruption_seen_.exchange(false, std::memory_order_acq_rel);
  }
  // The error's message, the tier's directory taken out, in lower case.
  std::string MessageWithoutPath(const rocksdb::Status& s) const {
    std::string m = s.ToString();
    if (!path_.empty()) m = absl::StrReplaceAll(m, {{path_, "<dir>"}});
    return absl::AsciiStrToLower(m);
  }
  void OnErrorRecoveryBegin(rocksdb::BackgroundErrorReason /*reason*/,
                            rocksdb::Status bg_error,
                            bool* auto_recovery) override {
    bg_error.PermitUncheckedError();
    *auto_recovery = false;
  }

  void Stop(std::string reason) {
    absl::MutexLock lock(&mu_);
    reason_ = std::move(reason);
    stopped_.store(true, std::memory_order_release);
  }
  void Clear() {
    fatal_.store(false, std::memory_order_release);
    stopped_.store(false, std::memory_order_release);
  }
  bool stopped() const { return stopped_.load(std::memory_order_acquire); }
  // Stopped by an error no resume can end: writes stay off until the
  // database is reopened.
  void MarkFatal() { fatal_.store(true, std::memory_order_release); }
  bool fatal() const { return fatal_.load(std::memory_order_acquire); }
  // Fatal because a table file is corrupt: a restart does not help either.
  bool corrupt_table() const {
    return corrupt_table_.load(std::memory_order_acquire);
  }
  // What follows reason() in the tier's write error once stopped for good.
  const char* FatalSuffix() const {
    return corrupt_table() ? kCorruptTableSuffix : kFatalSuffix;
  }
  std::string reason() const {
    absl::MutexLock lock(&mu_);
    return reason_;
  }

 private:
  const std::string path_;
  std::atomic<bool> stopped_{false};
  std::atomic<bool> fatal_{false};
  std::atomic<bool> corrupt_table_{false};
  std::atomic<bool> corruption_seen_{false};
  mutable absl::Mutex mu_;
  std::string reason_ ABSL_GUARDED_BY(mu_);
};

class NvmeTierImpl final : public NvmeTier {
 public:
  NvmeTierImpl(const NvmeTierOptions& options, Clock* clock)
      : options_(options),
        min_charge_(MinCharge(options)),
        clock_(clock),
        listener_(std::make_shared<ErrorListener>(options.path)) {
    write_options_.disableWAL = !options_.use_wal;
  }
  ~NvmeTierImpl() override;

  // Opens the database and rebuilds the index. Called once, before any other
  // method.
  absl::Status Init();

  absl::StatusOr<NvmePutOutcome> Put(absl::string_view ns,
                                     absl::string_view key,
                                     absl::string_view parent,
                                     absl::string_view bytes,
                                     uint64_t checksum) override;
  bool Contains(absl::string_view ns, absl::string_view key) override;
  absl::StatusOr<NvmeBlockMeta> Meta(absl::string_view ns,
                                     absl::string_view key) override;
  absl::Status Read(absl::string_view ns, absl::string_view key,
                    absl::Span<char> dest) override;
  std::vector<absl::Status> MultiRead(
      absl::string_view ns,
      absl::Span<const NvmeReadRequest> requests) override;
  absl::Status Delete(absl::string_view ns, absl::string_view key) override;
  void ForEachBlock(
      absl::FunctionRef<void(const NvmeBlockView&)> fn) override;
  NvmeTierStats Stats() override;
  absl::StatusOr<NvmeVerifyReport> Verify(
      std::function<bool()> cancelled = nullptr) override;
  absl::Status Compact(std::function<bool()> cancelled) override;
  void StopMaintenance() override;
  absl::Status Flush() override;
  absl::Status MakeWritesDurable() override;
  const NvmeTierOptions& options() const override { return options_; }

 private:
  enum class State : uint8_t { kWriting, kStored, kDeleting };
  struct Entry;
  // A recency list: head is the most recent.
  struct List {
    Entry* head = nullptr;
    Entry* tail = nullptr;
  };
  struct Entry {
    const std::string* id = nullptr;  // the index_ key holding this entry
    Entry* more_recent = nullptr;     // list neighbours (kStored only)
    Entry* less_recent = nullptr;
    List* list = nullptr;             // leaves_ or inner_ while kStored
    std::string parent;
    uint32_t children = 0;  // stored entries linked under this one's id
    bool linked = false;    // counted under the parent's id (see invariants)
    uint64_t size = 0;
    uint64_t checksum = 0;
    uint64_t charge = 0;
    uint64_t generation = 0;
    uint64_t last_touch = 0;  // tick_ of the last read or write
    uint32_t read_count = 0;
    State state = State::kWriting;
    bool dirty = false;  // read_count/last_touch newer than the record
    // A read of it failed with an I/O error (twice: it was tried again),
    // and none has succeeded since: the next such failure drops it (see
    // NoteUnreadable).
    bool suspect = false;
  };
  // node_hash_map: entries and their keys never move, so Entry pointers (the
  // LRU list) and Entry::id stay valid until the entry is erased.
  using Index = absl::node_hash_map<std::string, Entry>;
  // An entry taken out of service whose records are being deleted.
  struct Retired {
    std::string id;
    uint64_t generation = 0;
  };
  // A read planned under the lock and done outside it.
  struct PlannedRead {
    size_t request;
    std::string id;
    uint64_t generation;
    uint64_t size;
    uint64_t checksum;
  };
  enum class DropReason { kCorrupt, kMissing };
  // What NoteUnreadable did with the block.
  enum class UnreadableOutcome {
    kGone,     // not stored any more, or stored anew (another generation)
    kKept,     // its first failure: kept, marked suspect
    kHeld,     // a suspect failing again, kept for the burst bound
    kDropped,  // a suspect failing again: dropped
  };
  struct SettledArg {
    const Index* index;
    const std::string* id;
  };

  static bool IdSettled(SettledArg* arg);
  // Blocks until `id` is absent or stored (no put or delete in flight).
  void WaitSettled(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  static void PushFront(List& list, Entry* e);
  static void PushBack(List& list, Entry* e);
  static void Unlist(Entry* e);
  // The stored entry named `id`, or nullptr.
  Entry* StoredLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The id of e's parent; empty for a root (or a block naming itself).
  std::string ParentIdLocked(const Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes `e` (state already kStored) part of the prefix links and lists it,
  // at the most recent end or, without `recent`, the least recent end.
  void LinkLocked(Entry* e, bool recent) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether linking `e` (which may have adopted children) under parent_id
  // would close a cycle of parent links (a client can name any parent).
  bool ClosesCycleLocked(const Entry* e, const std::string& parent_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Undoes LinkLocked (the entry is leaving the kStored state).
  void UnlinkLocked(Entry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The next block to evict: the least recent leaf, else the least recent
  // inner block; nullptr when nothing is stored.
  Entry* VictimLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return leaves_.tail != nullptr ? leaves_.tail : inner_.tail;
  }
  // Makes a stored entry the most recently used.
  void TouchLocked(Entry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Once no put or delete of `id` is under way (WaitSettled): whether it is
  // stored, touched (recency) if so.
  bool TouchIfStoredLocked(const std::string& id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kStored -> kDeleting: unlisted, uncounted, invisible.
  Retired RetireLocked(Entry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Undoes RetireLocked for entries whose delete failed. `retired` is in the
  // order they were taken from the LRU tail; they go back there.
  void RestoreLocked(absl::Span<const Retired> retired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erases retired entries once their delete has been attempted.
  void EraseRetiredLocked(absl::Span<const Retired> retired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes read counts and recency of stored entries to their records.
  absl::Status PersistDirtyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Deletes the records of `retired` in one batch; with `durable`, through
  // the WAL (Delete), else with write_options_ (evictions, drops).
  absl::Status DeleteRecords(absl::Span<const Retired> retired,
                             bool durable = false);
  // Deletes the records, then erases the entries (whatever the outcome: a
  // dropped block is never served again by this process).
  void DeleteAndErase(absl::Span<const Retired> retired);
  // Whether the snapshot (or the present) that `ro` reads holds a valid
  // metadata record for `id`. A failed read counts as one: Verify deletes
  // nothing on a doubt.
  bool HasMetaAt(const rocksdb::ReadOptions& ro, const std::string& id);
  // Takes a block whose read failed out of service, if `generation` is still
  // the stored one. Returns true if it did.
  bool DropBlock(const std::string& id, uint64_t generation,
                 DropReason reason);
  // A read of `id` failed with an I/O error (IsIoError), tried twice. The
  // first such failure only marks the block suspect; a suspect is dropped
  // (counted in integrity_errors), unless more than kUnreadableBurstBlocks
  // distinct blocks failed within kUnreadableBurstWindow: then it is kept
  // (the device is failing, see kUnreadableBurstBlocks). Does nothing to a
  // block whose generation is not `generation` (replaced meanwhile).
  UnreadableOutcome NoteUnreadable(const std::string& id, uint64_t generation);
  // Forgets the failures older than kUnreadableBurstWindow; whether more
  // than kUnreadableBurstBlocks distinct blocks failed within it.
  bool UnreadableBurstLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Verifies what a RocksDB read of `read` returned and copies it to `dest`.
  absl::Status FinishRead(const PlannedRead& read, const rocksdb::Status& s,
                          const rocksdb::Slice& value, absl::Span<char> dest);
  // OK when RocksDB accepts writes; otherwise starts DB::Resume at most
  // once per resume_interval (on resume_thread_) and waits up to
  // kResumeWait for it, and returns Unavailable while it has not
  // succeeded. Never waits longer: see kResumeWait.
  absl::Status EnsureWritable();
  // The options' environment, else RocksDB's default.
  rocksdb::Env* Env() const {
    return options_.env != nullptr ? options_.env : rocksdb::Env::Default();
  }
  // Writes and syncs kProbeBytes to a file in the tier's directory, then
  // deletes it: OK when there was room for it.
  absl::Status ProbeRoom();
  // Unavailable when a put of `bytes` would leave the file system less
  // than min_free_bytes_ free (NvmeTierOptions::min_free_bytes); notes the
  // free space for Stats.
  absl::Status CheckFreeSpace(uint64_t bytes);
  // What the memtables hold and puts past CheckFreeSpace not yet in them:
  // bytes their flushes will write.
  uint64_t UnflushedBytes();
  // The blob garbage collection age cutoff a compaction pass may use for
  // the room the file system has: 1 (all blob files) when every live byte
  // fits beside the old files, else one that rewrites only the oldest blob
  // files whose live blobs fit. FailedPrecondition when not even one blob
  // file (or kMinCompactFraction of them) fits.
  // `tables_fit` is set when a pass that rewrites only the tables (no blob
  // garbage collection) fits.
  absl::StatusOr<double> CompactFraction(bool* tables_fit);
  std::string ShortOfSpaceMessage(uint64_t free) const;
  // Whether a resume has run past resume_stuck_after.
  bool ResumeStuckLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(resume_mu_);
  // Starts DB::Resume on resume_thread_ unless it runs already.
  void StartResumeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(resume_mu_);
  // Waits up to `timeout` for a running resume to end; true when none runs.
  bool AwaitResumeLocked(absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(resume_mu_);
  // Notes a failed write (stats, and resumption if RocksDB stopped).
  void NoteWriteFailure(const rocksdb::Status& s);
  absl::Status EvictOverCapacity();
  // DB::Flush, then waits until no flush is queued or running.
  absl::Status FlushAndWait();
  // Turns blob garbage collection on or off by the garbage ratio of the blob
  // files (hysteresis between the options' two ratios). Cheap; called every
  // kGcCheckInterval writes.
  void AdjustBlobGc();
  // Notes that a write without the WAL has landed in a memtable (call it
  // after the write): the flush timer starts counting its age.
  void NoteUnflushedWrite();
  // A put without the WAL in flight (unlogged_writes_): its ticket (0 with
  // the WAL), given back to EndUnloggedWrite.
  uint64_t BeginUnloggedWrite();
  void EndUnloggedWrite(uint64_t ticket);
  // Flushes the memtables when the oldest unflushed write is
  // max_unflushed_age old (see MaintenanceLoop). Any thread, no lock held.
  void FlushIfDue() {
    FlushUnflushed(options_.max_unflushed_age).IgnoreError();
  }
  // Flushes the memtables if writes made without the WAL are waiting, the
  // oldest at least `min_age` old. OK when none are (or with the WAL).
  absl::Status FlushUnflushed(absl::Duration min_age);
  // The maintenance thread (maintenance_): every tick, flushes the
  // memtables when the oldest unflushed write is max_unflushed_age old,
  // and scrubs the tier (Verify) when an automatic compaction met a corrupt
  // block (at most every kAutoScrubInterval). Ends on stop_maintenance_.
  void MaintenanceLoop();

  // Constant after Init.
  const NvmeTierOptions options_;
  // The least a block is charged: capacity_bytes / max_blocks, rounded up
  // (see Charge).
  const uint64_t min_charge_;
  Clock* const clock_;
  const std::shared_ptr<ErrorListener> listener_;
  rocksdb::WriteOptions write_options_;
  std::unique_ptr<rocksdb::DB> db_;
  // The database's info log (<path>/LOG), for the tier's own warnings.
  std::shared_ptr<rocksdb::Logger> info_log_;

  // The age of what only the memtables hold (NvmeTierOptions::
  // max_unflushed_age). A leaf lock: nothing is locked under it.
  absl::Mutex flush_mu_;
  // The tickets of the puts without the WAL between BeginUnloggedWrite and
  // EndUnloggedWrite, and the last ticket given.
  std::set<uint64_t> unlogged_writes_ ABSL_GUARDED_BY(flush_mu_);
  uint64_t last_unlogged_ticket_ ABSL_GUARDED_BY(flush_mu_) = 0;
  // When the oldest write not known to be flushed landed; InfiniteFuture()
  // when there is none.
  absl::Time unflushed_since_ ABSL_GUARDED_BY(flush_mu_) =
      absl::InfiniteFuture();
  bool stop_maintenance_ ABSL_GUARDED_BY(flush_mu_) = false;
  absl::Time next_auto_scrub_ ABSL_GUARDED_BY(flush_mu_) =
      absl::InfinitePast();
  std::thread maintenance_;  // started by Init, joined by the destructor
  // Set by the destructor: a scrub of the maintenance thread stops early.
  std::atomic<bool> closing_{false};

  mutable absl::Mutex resume_mu_;
  absl::Time next_resume_ ABSL_GUARDED_BY(resume_mu_) = absl::InfinitePast();
  // DB::Resume runs here: it flushes, which may take long -- or never end
  // (kResumeWait) -- and no caller may wait on that.
  std::thread resume_thread_ ABSL_GUARDED_BY(resume_mu_);
  bool resuming_ ABSL_GUARDED_BY(resume_mu_) = false;
  absl::Time resume_started_ ABSL_GUARDED_BY(resume_mu_);  // real time
  rocksdb::Status last_resume_ ABSL_GUARDED_BY(resume_mu_);
  // NvmeTierOptions::min_free_bytes, its default resolved (Init).
  uint64_t min_free_bytes_ = 0;
  std::atomic<uint64_t> puts_in_flight_bytes_{0};  // see UnflushedBytes
  std::atomic<uint64_t> read_retries_{0};  // NvmeTierStats::read_retries
  // What the last put's CheckFreeSpace found.
  std::atomic<uint64_t> free_bytes_{0};
  std::atomic<bool> short_of_space_{false};
  std::atomic<uint64_t> refused_bytes_{0};  // the block it was short for

  mutable absl::Mutex mu_;
  Index index_ ABSL_GUARDED_BY(mu_);
  List leaves_ ABSL_GUARDED_BY(mu_);  // stored, no stored child
  List inner_ ABSL_GUARDED_BY(mu_);   // stored, with stored children
  // Parent id -> linked stored children while that parent is not stored.
  absl::flat_hash_map<std::string, uint32_t> orphan_children_
      ABSL_GUARDED_BY(mu_);
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t blocks_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t puts_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t write_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t write_errors_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t writes_since_gc_check_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> blob_gc_active_{false};
  uint64_t reads_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t read_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t integrity_errors_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t orphans_dropped_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t evicted_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Blocks whose reads failed with an I/O error within the last
  // kUnreadableBurstWindow, each once (its last failure), oldest first; at
  // most kUnreadableBurstBlocks + 1 of them (enough to tell a burst).
  std::deque<std::pair<std::string, absl::Time>> recent_unreadable_
      ABSL_GUARDED_BY(mu_);
  bool unreadable_burst_ ABSL_GUARDED_BY(mu_) = false;  // logged as begun
  uint64_t unreadable_kept_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t unreadable_drops_held_ ABSL_GUARDED_BY(mu_) = 0;
};

// ---------------------------------------------------------------------------
// Open, close.

namespace {

// NvmeTierOptions::min_free_bytes' default: twice the memtables' budget
// plus 64 MiB, but at most a twentieth of the file system under `dir` (a
// small one, as tests mount, would otherwise take no block at all).
uint64_t DefaultMinFreeBytes(const NvmeTierOptions& o, const std::string& dir) {
  uint64_t want =
      2 * o.write_buffer_size *
          static_cast<uint64_t>(std::max(o.max_write_buffer_number, 1)) +
      (uint64_t{64} << 20);
  struct statvfs fs;
  if (statvfs(dir.c_str(), &fs) == 0) {
    want = std::min<uint64_t>(
        want, static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize / 20);
  }
  return want;
}

// RocksDB opens a file for direct reads only when it first reads it, so on
// a file system that refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE
// and network file systems) the tier would open and then fail every read.
// Asked once, through `env` as RocksDB would: a 4 KiB probe file in `dir`
// written, then read back with direct reads into an aligned buffer. A
// refusal (EINVAL, which RocksDB reports as an I/O error saying "Invalid
// argument") is InvalidArgument, the setting's fault; other failures keep
// their own code (FromRocksStatus).
absl::Status CheckDirectReads(rocksdb::Env* env, const std::string& dir) {
  const std::string probe = dir + "/DIRECT_READ_PROBE";
  constexpr size_t kProbeBytes = 4096;
  const std::string bytes(kProbeBytes, 'k');
  // Written, or (a full disk must not stop a tier with blocks from opening)
  // RocksDB's CURRENT of an existing tier read instead; a new tier on a
  // full disk fails later anyway.
  std::string target = probe;
  {
    std::unique_ptr<rocksdb::WritableFile> file;
    rocksdb::Status st =
        env->NewWritableFile(probe, &file, rocksdb::EnvOptions());
    if (st.ok()) st = file->Append(bytes);
    if (st.ok()) st = file->Close();
    if (!st.ok()) {
      file.reset();
      env->DeleteFile(probe).PermitUncheckedError();
      target = dir + "/CURRENT";
      if (!env->FileExists(target).ok()) return absl::OkStatus();
    }
  }
  rocksdb::EnvOptions direct;
  direct.use_direct_reads = true;
  std::unique_ptr<rocksdb::RandomAccessFile> reader;
  rocksdb::Status st = env->NewRandomAccessFile(target, &reader, direct);
  bool same = true;
  if (st.ok()) {
    const size_t align =
        std::max<size_t>(reader->GetRequiredBufferAlignment(), 512);
    std::unique_ptr<char, decltype(&std::free)> buf(
        static_cast<char*>(std::aligned_alloc(align, kProbeBytes)), &std::free);
    if (buf == nullptr)
      return absl::ResourceExhaustedError("NVMe tier: no memory to probe");
    rocksdb::Slice got;
    st = reader->Read(0, kProbeBytes, &got, buf.get());
    if (target == probe) same = st.ok() && got == rocksdb::Slice(bytes);
  }
  reader.reset();
  if (target == probe) env->DeleteFile(probe).PermitUncheckedError();
  const bool refused = st.IsInvalidArgument() || st.IsNotSupported() ||
                       absl::StrContains(st.ToString(), "Invalid argument") ||
                       (st.ok() && !same);
  if (refused) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVMe tier: the file system of ", dir,
                     " does not take direct reads (O_DIRECT: ",
                     st.ok() ? "a probe read back other bytes" : st.ToString(),
                     "); turn nvme_direct_reads off"));
  }
  return FromRocksStatus(st,
                         absl::StrCat("NVMe tier: direct read of ", target));
}

}  // namespace

absl::Status NvmeTierImpl::Init() {
  rocksdb::Env* env = Env();

  // RocksDB creates only the last directory of the path.
  for (size_t pos = options_.path.find('/', 1); pos != std::string::npos;
       pos = options_.path.find('/', pos + 1)) {
    std::string dir = options_.path.substr(0, pos);
    RETURN_IF_ERROR(FromRocksStatus(
        env->CreateDirIfMissing(dir),
        absl::StrCat("NVMe tier: cannot create directory ", dir)));
  }

  rocksdb::Options db_options;
  db_options.env = env;
  db_options.create_if_missing = true;
  db_options.max_background_jobs = options_.max_background_jobs;
  // Half the jobs flush: several memtables flushing in parallel are what
  // keeps demotion at disk speed (one flush writes one blob file at a time).
  db_options.max_background_flushes = std::max(1, options_.max_background_jobs / 2);
  db_options.max_background_compactions =
      std::max(1, options_.max_background_jobs - db_options.max_background_flushes);
  db_options.listeners.push_back(listener_);
  // RocksDB's own logger aborts the process once a LOG write has failed (a
  // full disk): see rocksdb_info_log.h.
  RETURN_IF_ERROR(FromRocksStatus(
      env->CreateDirIfMissing(options_.path),
      absl::StrCat("NVMe tier: cannot create directory ", options_.path)));
  info_log_ =
      std::make_shared<RocksInfoLog>(options_.path + "/LOG", size_t{16} << 20);
  db_options.info_log = info_log_;
  min_free_bytes_ = options_.min_free_bytes != 0
                        ? options_.min_free_bytes
                        : DefaultMinFreeBytes(options_, options_.path);
  if (options_.direct_reads)
    RETURN_IF_ERROR(CheckDirectReads(env, options_.path));
  db_options.use_direct_reads = options_.direct_reads;
  db_options.use_direct_io_for_flush_and_compaction = options_.direct_writes;
  if (options_.direct_writes) db_options.writable_file_max_buffer_size = 8 << 20;
  db_options.write_buffer_size = options_.write_buffer_size;
  db_options.max_write_buffer_number = options_.max_write_buffer_number;
  // When flushes fall behind, RocksDB slows writers to this rate before it
  // stops them; its default (16 MiB/s) turns a short backlog into seconds of
  // crawling demotion. Slow down only to about what one flush writes.
  db_options.delayed_write_rate = uint64_t{256} << 20;
  db_options.compression = options_.compression ? rocksdb::kLZ4Compression
                                                : rocksdb::kNoCompression;
  db_options.enable_blob_files = true;
  db_options.min_blob_size = options_.min_blob_size;
  db_options.blob_file_size = options_.blob_file_size;
  db_options.blob_compression_type = db_options.compression;
  // Evicted blocks are the oldest, so the oldest blob files fill with
  // garbage first: collect them during compaction, and force compactions
  // that reclaim them once half of them is garbage. Off until there is
  // garbage to collect (see AdjustBlobGc): relocating live blocks while the
  // tier fills only multiplies its writes.
  db_options.enable_blob_garbage_collection = false;
  db_options.blob_garbage_collection_age_cutoff = 0.25;
  db_options.blob_garbage_collection_force_threshold = 0.5;

  // A format-1 tier (three column families) cannot be opened as one.
  std::vector<std::string> families;
  if (rocksdb::DB::ListColumnFamilies(db_options, options_.path, &families)
          .ok() &&
      std::find(families.begin(), families.end(), kFormat1MetaFamily) !=
          families.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "NVMe tier at ", options_.path, " has format '1'; this build reads "
        "format ", kFormatVersion, ". It is a cache: move the directory away "
        "(or delete it) and the tier refills as blocks are demoted"));
  }
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(db_options, options_.path, &raw);
  RETURN_IF_ERROR(FromRocksStatus(
      s, absl::StrCat("NVMe tier: cannot open RocksDB at ", options_.path)));
  db_.reset(raw);

  std::string format;
  s = db_->Get(rocksdb::ReadOptions(), kFormatKey, &format);
  if (s.IsNotFound()) {
    s = db_->Put(write_options_, kFormatKey, kFormatVersion);
  } else if (s.ok() && format != kFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("NVMe tier at ", options_.path, " has format '", format,
                     "'; this build reads format ", kFormatVersion));
  }
  RETURN_IF_ERROR(FromRocksStatus(
      s, absl::StrCat("NVMe tier: format record at ", options_.path)));

  // Rebuild the index from the metadata records alone: no blob is read.
  std::vector<Retired> malformed;
  std::vector<Entry*> entries;
  {
    absl::MutexLock lock(&mu_);
    rocksdb::ReadOptions ro;
    ro.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro));
    const std::string first(1, kMetaPrefix);
    for (it->Seek(first); it->Valid() && it->key().starts_with(first);
         it->Next()) {
      absl::string_view id(it->key().data() + 1, it->key().size() - 1);
      absl::string_view ns, key;
      MetaRecord record;
      if (!DecodeId(id, &ns, &key) ||
          !DecodeMeta(absl::string_view(it->value().data(),
                                        it->value().size()),
                      &record)) {
        // Cannot be served; delete it below with its bytes, if any.
        auto [pos, inserted] = index_.try_emplace(std::string(id));
        pos->second.id = &pos->first;
        pos->second.state = State::kDeleting;
        pos->second.generation = next_generation_++;
        malformed.push_back({pos->first, pos->second.generation});
        ++integrity_errors_;
        continue;
      }
      auto [pos, inserted] = index_.try_emplace(std::string(id));
      Entry& e = pos->second;
      e.id = &pos->first;
      e.size = record.size;
      e.checksum = record.checksum;
      e.read_count = record.read_count;
      e.last_touch = record.last_touch;
      e.charge =
          Charge(id.size(), record.parent.size(), record.size, min_charge_);
      e.parent = std::move(record.parent);
      e.generation = next_generation_++;
      // Stored (and linked) below, oldest first; until then not visible to
      // the linking of others.
      e.state = State::kWriting;
      used_ += e.charge;
      ++blocks_;
      tick_ = std::max(tick_, e.last_touch);
      entries.push_back(&e);
    }
    RETURN_IF_ERROR(FromRocksStatus(
        it->status(),
        absl::StrCat("NVMe tier: reading metadata at ", options_.path)));
    // Oldest first, each pushed to the front: the newest ends at the head.
    std::sort(entries.begin(), entries.end(),
              [](const Entry* a, const Entry* b) {
                return a->last_touch < b->last_touch;
              });
    for (Entry* e : entries) {
      e->state = State::kStored;
      LinkLocked(e, /*recent=*/true);
    }
  }
  DeleteAndErase(malformed);
  RETURN_IF_ERROR(EvictOverCapacity());
  maintenance_ = std::thread([this] { MaintenanceLoop(); });
  return absl::OkStatus();
}

void NvmeTierImpl::NoteUnflushedWrite() {
  if (options_.use_wal) return;
  absl::MutexLock lock(&flush_mu_);
  if (unflushed_since_ == absl::InfiniteFuture()) {
    unflushed_since_ = clock_->Now();
  }
}

uint64_t NvmeTierImpl::BeginUnloggedWrite() {
  if (options_.use_wal) return 0;
  absl::MutexLock lock(&flush_mu_);
  const uint64_t ticket = ++last_unlogged_ticket_;
  unlogged_writes_.insert(ticket);
  return ticket;
}

void NvmeTierImpl::EndUnloggedWrite(uint64_t ticket) {
  if (options_.use_wal) return;
  absl::MutexLock lock(&flush_mu_);
  unlogged_writes_.erase(ticket);
}

void NvmeTierImpl::MaintenanceLoop() {
  const absl::Duration tick =
      std::clamp(options_.max_unflushed_age / 4, absl::Milliseconds(10),
                 absl::Seconds(1));
  flush_mu_.Lock();
  while (true) {
    flush_mu_.AwaitWithTimeout(absl::Condition(&stop_maintenance_), tick);
    if (stop_maintenance_) break;
    const absl::Time now = clock_->Now();
    // Not once StopMaintenance ran: the scrub would end at once, and the
    // corruption it was for would be taken as dealt with.
    const bool scrub = now >= next_auto_scrub_ && !closing_.load() &&
                       listener_->TakeCorruption();
    if (scrub) next_auto_scrub_ = now + kAutoScrubInterval;
    flush_mu_.Unlock();
    // The scrub flushes what is due as it goes (it may read for minutes).
    if (scrub) Verify().IgnoreError();  // counted in the stats; retried if need be
    FlushIfDue();
    flush_mu_.Lock();
  }
  flush_mu_.Unlock();
}

absl::Status NvmeTierImpl::FlushUnflushed(absl::Duration min_age) {
  // The flush timer is looked at (no arg).
  internal::TestSyncPoint("NvmeTier::FlushIfDue");
  absl::Time since;
  {
    absl::MutexLock lock(&flush_mu_);
    // Nothing unflushed (InfiniteFuture), or not old enough yet (or the
    // timer off: with the WAL, or an infinite max age).
    if (options_.use_wal || unflushed_since_ == absl::InfiniteFuture() ||
        clock_->Now() - unflushed_since_ < min_age) {
      return absl::OkStatus();
    }
    // A stopped database cannot flush: its resume flushes what the
    // memtables hold.
    if (listener_->stopped()) {
      return absl::UnavailableError(
          absl::StrCat("NVMe tier takes no writes: ", listener_->reason()));
    }
    // Writes that land from now on may miss this flush: they count anew.
    // A write marks itself after it landed, so none goes uncounted.
    since = std::exchange(unflushed_since_, absl::InfiniteFuture());
  }
  rocksdb::FlushOptions flush;  // waits for the flush
  flush.allow_write_stall = true;
  rocksdb::Status s = db_->Flush(flush);
  if (!s.ok()) {
    absl::MutexLock lock(&flush_mu_);
    unflushed_since_ = std::min(unflushed_since_, since);
  }
  return FromRocksStatus(s, "NVMe tier: flush");
}

absl::Status NvmeTierImpl::MakeWritesDurable() {
  {
    // A put in flight may have retired blocks (its capacity eviction) whose
    // delete is not written yet: the caller (an admin Evict) did not see
    // them, and a flush now would not hold their delete. Waits for those
    // puts, up to kUnloggedWriteWait (a put that takes longer is stuck in
    // RocksDB: what is flushed then is what has landed).
    // Only the puts begun before this call: later ones, however many
    // overlap, do not hold it up.
    absl::MutexLock lock(&flush_mu_);
    const uint64_t last = last_unlogged_ticket_;
    auto ended = [this, last]() ABSL_SHARED_LOCKS_REQUIRED(flush_mu_) {
      return unlogged_writes_.empty() || *unlogged_writes_.begin() > last;
    };
    if (!flush_mu_.AwaitWithTimeout(absl::Condition(&ended),
                                    kUnloggedWriteWait)) {
      return absl::UnavailableError(absl::StrCat(
          "NVMe tier: a put begun before this call has not ended in ",
          absl::FormatDuration(kUnloggedWriteWait),
          " (RocksDB stalled?): its evictions may not be durable yet"));
    }
  }
  return FlushUnflushed(absl::ZeroDuration());
}

absl::Status NvmeTierImpl::EvictOverCapacity() {
  std::vector<Retired> victims;
  uint64_t bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    while (used_ > options_.capacity_bytes) {
      Entry* victim = VictimLocked();
      if (victim == nullptr) break;
      bytes += victim->size;
      victims.push_back(RetireLocked(victim));
    }
  }
  if (victims.empty()) return absl::OkStatus();
  absl::Status s = DeleteRecords(victims);
  absl::MutexLock lock(&mu_);
  if (!s.ok()) {
    RestoreLocked(victims);
    return s;
  }
  EraseRetiredLocked(victims);
  evictions_ += victims.size();
  evicted_bytes_ += bytes;
  return absl::OkStatus();
}

NvmeTierImpl::~NvmeTierImpl() {
  if (maintenance_.joinable()) {
    closing_.store(true);
    {
      absl::MutexLock lock(&flush_mu_);
      stop_maintenance_ = true;
    }
    maintenance_.join();  // after the flush it runs, if any
  }
  if (db_ == nullptr) return;
  bool stuck;
  {
    // A stopped database cannot flush; give it one chance to resume, if
    // there is room for it (see EnsureWritable).
    absl::MutexLock lock(&resume_mu_);
    if (listener_->stopped() && !resuming_ && ProbeRoom().ok()) {
      StartResumeLocked();
    }
    const absl::Duration left =
        resuming_ ? options_.resume_stuck_after - (absl::Now() - resume_started_)
                  : absl::ZeroDuration();
    stuck = !AwaitResumeLocked(
        std::clamp(left, absl::ZeroDuration(), kShutdownResumeWait));
  }
  if (stuck) {
    // Unflushed blocks are lost; the database stops (which ends the
    // resume's wait) and closes.
    rocksdb::CancelAllBackgroundWork(db_.get(), /*wait=*/true);
  } else {
    {
      absl::MutexLock lock(&mu_);
      PersistDirtyLocked().IgnoreError();  // best effort: only counts/recency
    }
    FlushAndWait().IgnoreError();
  }
  std::thread resume;
  {
    absl::MutexLock lock(&resume_mu_);
    resume = std::move(resume_thread_);
  }
  if (resume.joinable()) resume.join();  // it takes resume_mu_ to end
  db_->Close().PermitUncheckedError();
}

// ---------------------------------------------------------------------------
// Index helpers.

bool NvmeTierImpl::IdSettled(SettledArg* arg)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {  // absl::Mutex calls it with mu_ held
  auto it = arg->index->find(*arg->id);
  return it == arg->index->end() || it->second.state == State::kStored;
}

bool NvmeTierImpl::TouchIfStoredLocked(const std::string& id) {
  WaitSettled(id);  // then `id` is absent or kStored
  auto it = index_.find(id);
  if (it == index_.end()) return false;
  TouchLocked(&it->second);
  return true;
}

void NvmeTierImpl::WaitSettled(const std::string& id) {
  SettledArg arg{&index_, &id};
  mu_.Await(absl::Condition(&IdSettled, &arg));
}

void NvmeTierImpl::PushFront(List& list, Entry* e) {
  e->list = &list;
  e->more_recent = nullptr;
  e->less_recent = list.head;
  if (list.head != nullptr) {
    list.head->more_recent = e;
  } else {
    list.tail = e;
  }
  list.head = e;
}

void NvmeTierImpl::PushBack(List& list, Entry* e) {
  e->list = &list;
  e->less_recent = nullptr;
  e->more_recent = list.tail;
  if (list.tail != nullptr) {
    list.tail->less_recent = e;
  } else {
    list.head = e;
  }
  list.tail = e;
}

void NvmeTierImpl::Unlist(Entry* e) {
  List* list = e->list;
  if (list == nullptr) return;
  if (e->more_recent != nullptr) {
    e->more_recent->less_recent = e->less_recent;
  } else {
    list->head = e->less_recent;
  }
  if (e->less_recent != nullptr) {
    e->less_recent->more_recent = e->more_recent;
  } else {
    list->tail = e->more_recent;
  }
  e->more_recent = e->less_recent = nullptr;
  e->list = nullptr;
}

NvmeTierImpl::Entry* NvmeTierImpl::StoredLocked(const std::string& id) {
  auto it = index_.find(id);
  if (it == index_.end() || it->second.state != State::kStored) return nullptr;
  return &it->second;
}

std::string NvmeTierImpl::ParentIdLocked(const Entry& e) {
  absl::string_view ns, key;
  if (e.parent.empty() || !DecodeId(*e.id, &ns, &key) || key == e.parent) {
    return std::string();
  }
  return EncodeId(ns, e.parent);
}

void NvmeTierImpl::LinkLocked(Entry* e, bool recent) {
  if (auto orphans = orphan_children_.find(*e->id);
      orphans != orphan_children_.end()) {
    e->children = orphans->second;
    orphan_children_.erase(orphans);
  }
  if (std::string parent_id = ParentIdLocked(*e);
      !parent_id.empty() && !ClosesCycleLocked(e, parent_id)) {
    e->linked = true;
    if (Entry* p = StoredLocked(parent_id)) {
      if (p->children++ == 0) {
        Unlist(p);
        PushFront(inner_, p);
      }
    } else {
      ++orphan_children_[parent_id];
    }
  }
  List& list = e->children == 0 ? leaves_ : inner_;
  recent ? PushFront(list, e) : PushBack(list, e);
}

bool NvmeTierImpl::ClosesCycleLocked(const Entry* e,
                                     const std::string& parent_id) {
  // Only an entry that has children can close a cycle, through its stored
  // ancestors. Chains are walked to a bound; a longer one is left unlinked.
  if (e->children == 0) return false;
  std::string id = parent_id;
  for (int steps = 0; steps < kMaxChainWalk; ++steps) {
    const Entry* a = StoredLocked(id);
    if (a == nullptr) return false;
    if (a == e) return true;
    if (!a->linked) return false;
    id = ParentIdLocked(*a);
  }
  return true;
}

void NvmeTierImpl::UnlinkLocked(Entry* e) {
  Unlist(e);
  if (e->linked) {
    e->linked = false;
    std::string parent_id = ParentIdLocked(*e);
    if (Entry* p = StoredLocked(parent_id); p != nullptr && p->children > 0) {
      if (--p->children == 0) {
        Unlist(p);
        PushBack(leaves_, p);
      }
    } else if (auto it = orphan_children_.find(parent_id);
               it != orphan_children_.end() && --it->second == 0) {
      orphan_children_.erase(it);
    }
  }
  if (e->children > 0) {
    orphan_children_[*e->id] += e->children;
    e->children = 0;
  }
}

void NvmeTierImpl::TouchLocked(Entry* e) {
  e->last_touch = ++tick_;
  e->dirty = true;
  if (e->list == nullptr || e->list->head == e) return;
  List& list = *e->list;
  Unlist(e);
  PushFront(list, e);
}

NvmeTierImpl::Retired NvmeTierImpl::RetireLocked(Entry* e) {
  UnlinkLocked(e);
  e->state = State::kDeleting;
  used_ -= e->charge;
  --blocks_;
  return Retired{*e->id, e->generation};
}

void NvmeTierImpl::RestoreLocked(absl::Span<const Retired> retired) {
  for (auto r = retired.rbegin(); r != retired.rend(); ++r) {
    auto it = index_.find(r->id);
    if (it == index_.end() || it->second.generation != r->generation ||
        it->second.state != State::kDeleting) {
      continue;
    }
    Entry& e = it->second;
    e.state = State::kStored;
    used_ += e.charge;
    ++blocks_;
    LinkLocked(&e, /*recent=*/false);
  }
}

void NvmeTierImpl::EraseRetiredLocked(absl::Span<const Retired> retired) {
  for (const Retired& r : retired) {
    auto it = index_.find(r.id);
    if (it != index_.end() && it->second.generation == r.generation &&
        it->second.state == State::kDeleting) {
      index_.erase(it);
    }
  }
}

absl::Status NvmeTierImpl::PersistDirtyLocked() {
  rocksdb::WriteBatch batch;
  std::vector<Entry*> written;
  for (auto& [id, e] : index_) {
    if (e.state != State::kStored || !e.dirty) continue;
    rocksdb::Status s = batch.Put(
        MetaKey(id),
        EncodeMeta(e.size, e.checksum, e.last_touch, e.read_count, e.parent));
    RETURN_IF_ERROR(FromRocksStatus(s, "NVMe tier: batching metadata"));
    written.push_back(&e);
  }
  if (written.empty()) return absl::OkStatus();
  // Written under mu_: no stored entry can be retired, so no delete of these
  // records can slip in between and be undone by this write.
  RETURN_IF_ERROR(FromRocksStatus(db_->Write(write_options_, &batch),
                                  "NVMe tier: persisting read counts"));
  for (Entry* e : written) e->dirty = false;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// RocksDB writes.

absl::Status NvmeTierImpl::DeleteRecords(absl::Span<const Retired> retired,
                                         bool durable) {
  rocksdb::WriteBatch batch;
  for (const Retired& r : retired) {
    rocksdb::Status s = batch.Delete(MetaKey(r.id));
    if (s.ok()) s = batch.Delete(DataKey(r.id));
    RETURN_IF_ERROR(FromRocksStatus(s, "NVMe tier: batching deletes"));
  }
  rocksdb::Status s =
      // Delete's are few (admin Evict) and must not come back after a
      // crash: RocksDB's default options write them through the WAL.
      db_->Write(durable ? rocksdb::WriteOptions() : write_options_, &batch);
  if (!s.ok()) {
    NoteWriteFailure(s);
  } else if (!durable) {
    NoteUnflushedWrite();
  }
  return FromRocksStatus(s, "NVMe tier: deleting blocks");
}

void NvmeTierImpl::DeleteAndErase(absl::Span<const Retired> retired) {
  if (retired.empty()) return;
  // On failure the records stay on disk until a later delete or restart,
  // where they are indexed and checked again; nothing serves them meanwhile.
  DeleteRecords(retired).IgnoreError();
  absl::MutexLock lock(&mu_);
  EraseRetiredLocked(retired);
}

bool NvmeTierImpl::HasMetaAt(const rocksdb::ReadOptions& ro,
                             const std::string& id) {
  std::string value;
  rocksdb::Status s = db_->Get(ro, MetaKey(id), &value);
  if (s.IsNotFound()) return false;
  MetaRecord record;
  return !s.ok() || DecodeMeta(value, &record);
}

void NvmeTierImpl::NoteWriteFailure(const rocksdb::Status& s) {
  {
    absl::MutexLock lock(&mu_);
    ++write_errors_;
  }
  // A failed write usually means RocksDB stopped (the listener knows); an
  // I/O error seen first here gets the same treatment.
  if (s.IsIOError() && !listener_->stopped()) listener_->Stop(s.ToString());
}

absl::Status NvmeTierImpl::EnsureWritable() {
  if (!listener_->stopped()) return absl::OkStatus();
  absl::MutexLock lock(&resume_mu_);
  if (!listener_->stopped()) return absl::OkStatus();
  const std::string stopped = absl::StrCat(
      "NVMe tier is not accepting writes after a RocksDB error (",
      listener_->reason(), ")");
  if (ResumeStuckLocked()) {
    return absl::UnavailableError(absl::StrCat(stopped, kStuckSuffix));
  }
  if (listener_->fatal()) {
    return absl::UnavailableError(
        absl::StrCat(stopped, listener_->FatalSuffix()));
  }
  if (resuming_) {
    return absl::UnavailableError(absl::StrCat(stopped, "; resuming"));
  }
  absl::Time now = clock_->Now();
  if (now < next_resume_) {
    return absl::UnavailableError(absl::StrCat(
        stopped, "; ",
        last_resume_.ok() ? std::string()
                          : absl::StrCat("resuming failed (",
                                         last_resume_.ToString(), "); "),
        "next retry in ", absl::FormatDuration(next_resume_ - now)));
  }
  next_resume_ = now + options_.resume_interval;
  // A resume that fails for want of room is not only useless: RocksDB 7.8
  // can lose a flush it scheduled at the end of one (see kResumeWait), and
  // then no later resume ends. So resume only once the file system has
  // min_free_bytes_ free (a resume flushes every memtable: a probe of
  // 1 MiB fitting said little) and a probe file fits.
  uint64_t free = 0;
  const uint64_t wanted = min_free_bytes_ + UnflushedBytes();
  if (Env()->GetFreeSpace(options_.path, &free).ok() && free < wanted) {
    return absl::UnavailableError(absl::StrCat(
        stopped, "; no room to resume yet (", free, " bytes free, ", wanted,
        " wanted: the reserve and what the memtables hold); next retry in ",
        absl::FormatDuration(options_.resume_interval)));
  }
  if (absl::Status room = ProbeRoom(); !room.ok()) {
    return absl::UnavailableError(absl::StrCat(
        stopped, "; no room to resume yet (", room.message(), "); next retry in ",
        absl::FormatDuration(options_.resume_interval)));
  }
  StartResumeLocked();
  if (!AwaitResumeLocked(std::min(kResumeWait, options_.resume_stuck_after))) {
    return absl::UnavailableError(absl::StrCat(stopped, "; resuming"));
  }
  if (!last_resume_.ok()) {
    return FromRocksStatus(last_resume_,
                           absl::StrCat(stopped, "; resuming failed"));
  }
  return absl::OkStatus();
}

uint64_t NvmeTierImpl::UnflushedBytes() {
  uint64_t memtables = 0;
  db_->GetIntProperty(rocksdb::DB::Properties::kCurSizeAllMemTables,
                      &memtables);
  return memtables + puts_in_flight_bytes_.load(std::memory_order_relaxed);
}

absl::Status NvmeTierImpl::CheckFreeSpace(uint64_t bytes) {
  uint64_t free = 0;
  // Unknown (a file system that does not say): RocksDB's own errors decide.
  if (!Env()->GetFreeSpace(options_.path, &free).ok()) return absl::OkStatus();
  // What the memtables hold takes room when they flush: six memtables of
  // blocks larger than write_buffer_size (or a small file system, where
  // the default reserve is a twentieth of it) would otherwise pass the
  // reserve, and RocksDB meet ENOSPC after all.
  const uint64_t unflushed = UnflushedBytes();
  const uint64_t wanted = min_free_bytes_ + unflushed;
  const bool short_now = free < wanted || free - wanted < bytes;
  free_bytes_.store(free, std::memory_order_relaxed);
  short_of_space_.store(short_now, std::memory_order_relaxed);
  if (!short_now) return absl::OkStatus();
  refused_bytes_.store(bytes, std::memory_order_relaxed);
  return absl::UnavailableError(ShortOfSpaceMessage(free));
}

std::string NvmeTierImpl::ShortOfSpaceMessage(uint64_t free) const {
  return absl::StrCat("the NVMe tier's file system is nearly full (", free,
                      " bytes free under ", options_.path,
                      "): the tier leaves ", min_free_bytes_,
                      " bytes free for RocksDB's flushes and compactions, "
                      "beyond what its memtables hold; free space there, or "
                      "lower nvme_capacity");
}

absl::Status NvmeTierImpl::ProbeRoom() {
  rocksdb::Env* env = Env();
  const std::string probe = options_.path + "/RESUME_PROBE";
  std::unique_ptr<rocksdb::WritableFile> file;
  rocksdb::Status s = env->NewWritableFile(probe, &file, rocksdb::EnvOptions());
  if (s.ok()) {
    const std::string chunk(64 << 10, '\0');
    for (size_t n = 0; s.ok() && n < kProbeBytes; n += chunk.size()) {
      s = file->Append(chunk);
    }
    if (s.ok()) s = file->Sync();
    rocksdb::Status closed = file->Close();
    if (s.ok()) s = closed;
  }
  env->DeleteFile(probe).PermitUncheckedError();
  return FromRocksStatus(s, "probe file");
}

bool NvmeTierImpl::ResumeStuckLocked() const {
  return resuming_ && absl::Now() - resume_started_ > options_.resume_stuck_after;
}

void NvmeTierImpl::StartResumeLocked() {
  if (resuming_) return;
  if (resume_thread_.joinable()) resume_thread_.join();  // ended already
  resuming_ = true;
  resume_started_ = absl::Now();
  resume_thread_ = std::thread([this] {
    rocksdb::Status s = db_->Resume();
    absl::MutexLock lock(&resume_mu_);
    if (s.ok()) listener_->Clear();
    if (s.severity() >= rocksdb::Status::Severity::kFatalError) {
      listener_->MarkFatal();
    }
    last_resume_ = s;
    resuming_ = false;
  });
}

bool NvmeTierImpl::AwaitResumeLocked(absl::Duration timeout) {
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(resume_mu_) {
    return !resuming_;
  };
  return resume_mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
}

absl::StatusOr<NvmePutOutcome> NvmeTierImpl::Put(absl::string_view ns,
                                                 absl::string_view key,
                                                 absl::string_view parent,
                                                 absl::string_view bytes,
                                                 uint64_t checksum) {
  RETURN_IF_ERROR(ValidateNamespace(ns));
  RETURN_IF_ERROR(ValidateKey(key));
  if (!parent.empty()) RETURN_IF_ERROR(ValidateKey(parent, "parent key"));
  if (bytes.empty()) return absl::InvalidArgumentError("block is empty");
  if (bytes.size() > options_.max_block_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("block is ", bytes.size(), " bytes; the NVMe tier limit "
                     "is ", options_.max_block_bytes));
  }
  std::string id = EncodeId(ns, key);
  const uint64_t charge =
      Charge(id.size(), parent.size(), bytes.size(), min_charge_);
  if (charge > options_.capacity_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("block of ", bytes.size(), " bytes can never fit the "
                     "NVMe tier's capacity of ", options_.capacity_bytes,
                     " bytes"));
  }
  // A block stored already (a promoted block leaving DRAM again) is
  // neither hashed nor refused for a disk that takes no writes: nothing is
  // to be written. Checked again below, under the same lock as the insert.
  {
    absl::MutexLock lock(&mu_);
    if (TouchIfStoredLocked(id)) return NvmePutOutcome::kAlreadyPresent;
  }
  if (BlockChecksum(bytes) != checksum) {
    return absl::InvalidArgumentError(
        absl::StrCat("checksum mismatch for block ", IdToHex(id),
                     ": the bytes do not hash to the given XXH3-64"));
  }
  absl::Status writable = EnsureWritable();
  if (writable.ok()) writable = CheckFreeSpace(bytes.size());
  if (!writable.ok()) {
    absl::MutexLock lock(&mu_);
    ++write_errors_;
    return writable;
  }
  // Counted as unflushed by other puts' checks until it is in a memtable
  // (or failed).
  puts_in_flight_bytes_.fetch_add(bytes.size(), std::memory_order_relaxed);
  absl::Cleanup put_landed = [this, n = bytes.size()] {
    puts_in_flight_bytes_.fetch_sub(n, std::memory_order_relaxed);
  };

  // From before it retires its victims (no longer listed: Meta, ForEach)
  // until its write is noted unflushed: MakeWritesDurable waits for it.
  const uint64_t unlogged_ticket = BeginUnloggedWrite();
  absl::Cleanup unlogged_write_ended = [this, unlogged_ticket] {
    EndUnloggedWrite(unlogged_ticket);
  };
  std::vector<Retired> victims;
  uint64_t victim_bytes = 0;
  // The index key of our kWriting entry. Only this call changes or erases
  // that entry, and node_hash_map keys never move, so the pointer stays valid
  // without the lock.
  const std::string* block_id = nullptr;
  std::string meta;
  {
    absl::MutexLock lock(&mu_);
    if (TouchIfStoredLocked(id)) return NvmePutOutcome::kAlreadyPresent;
    while (used_ + charge > options_.capacity_bytes) {
      Entry* victim = VictimLocked();
      if (victim == nullptr) break;
      victim_bytes += victim->size;
      victims.push_back(RetireLocked(victim));
    }
    if (used_ + charge > options_.capacity_bytes) {
      RestoreLocked(victims);
      return absl::ResourceExhaustedError(
          absl::StrCat("NVMe tier: puts in flight hold the space a block of ",
                       bytes.size(), " bytes needs"));
    }
    auto [pos, inserted] = index_.try_emplace(std::move(id));
    Entry& e = pos->second;
    e.id = block_id = &pos->first;
    e.parent = std::string(parent);
    e.size = bytes.size();
    e.checksum = checksum;
    e.charge = charge;
    e.generation = next_generation_++;
    e.last_touch = ++tick_;
    e.state = State::kWriting;
    used_ += charge;
    meta = EncodeMeta(e.size, e.checksum, e.last_touch, 0, parent);
  }

  // One batch: the victims disappear and the block appears together.
  rocksdb::WriteBatch batch;
  rocksdb::Status s;
  for (const Retired& v : victims) {
    if (s.ok()) s = batch.Delete(MetaKey(v.id));
    if (s.ok()) s = batch.Delete(DataKey(v.id));
  }
  if (s.ok()) s = batch.Put(MetaKey(*block_id), meta);
  if (s.ok()) {
    s = batch.Put(DataKey(*block_id),
                  rocksdb::Slice(bytes.data(), bytes.size()));
  }
  // The block is indexed (being written), its records not yet written.
  internal::TestSyncPoint("NvmeTier::Put:Writing");
  if (s.ok()) s = db_->Write(write_options_, &batch);
  if (s.ok()) {
    NoteUnflushedWrite();
  } else {
    NoteWriteFailure(s);
  }

  absl::ReleasableMutexLock lock(&mu_);
  auto it = index_.find(*block_id);
  Entry& e = it->second;
  if (!s.ok()) {
    absl::Status error = FromRocksStatus(
        s, absl::StrCat("NVMe tier: writing block ", IdToHex(*block_id)));
    used_ -= e.charge;
    index_.erase(it);
    RestoreLocked(victims);
    return error;
  }
  EraseRetiredLocked(victims);
  evictions_ += victims.size();
  evicted_bytes_ += victim_bytes;
  e.state = State::kStored;
  LinkLocked(&e, /*recent=*/true);
  ++blocks_;
  ++puts_;
  write_bytes_ += e.size;
  if (++writes_since_gc_check_ >= kGcCheckInterval) {
    writes_since_gc_check_ = 0;
    lock.Release();
    AdjustBlobGc();
  }
  return NvmePutOutcome::kStored;
}

void NvmeTierImpl::AdjustBlobGc() {
  uint64_t size = 0, garbage = 0;
  if (!db_->GetIntProperty(rocksdb::DB::Properties::kLiveBlobFileSize, &size) ||
      !db_->GetIntProperty(rocksdb::DB::Properties::kLiveBlobFileGarbageSize,
                           &garbage) ||
      size == 0) {
    return;
  }
  const double ratio = static_cast<double>(garbage) / static_cast<double>(size);
  const bool active = blob_gc_active_.load();
  bool want = active;
  if (!active && ratio > options_.gc_on_garbage_ratio) want = true;
  if (active && ratio < options_.gc_off_garbage_ratio) want = false;
  if (want == active) return;
  rocksdb::Status s = db_->SetOptions(
      {{"enable_blob_garbage_collection", want ? "true" : "false"}});
  if (s.ok()) blob_gc_active_.store(want);
}

absl::Status NvmeTierImpl::Delete(absl::string_view ns,
                                  absl::string_view key) {
  RETURN_IF_ERROR(ValidateNamespace(ns));
  RETURN_IF_ERROR(ValidateKey(key));
  std::string id = EncodeId(ns, key);
  Retired victim;
  {
    absl::MutexLock lock(&mu_);
    WaitSettled(id);
    auto it = index_.find(id);
    if (it == index_.end()) {
      return absl::NotFoundError(
          absl::StrCat("block ", IdToHex(id), " is not in the NVMe tier"));
    }
    victim = RetireLocked(&it->second);
  }
  absl::Status s = DeleteRecords({&victim, 1}, /*durable=*/true);
  absl::MutexLock lock(&mu_);
  EraseRetiredLocked({&victim, 1});
  return s;
}

// ---------------------------------------------------------------------------
// Lookups and reads.

bool NvmeTierImpl::Contains(absl::string_view ns, absl::string_view key) {
  if (!ValidateNamespace(ns).ok() || !ValidateKey(key).ok()) return false;
  std::string id = EncodeId(ns, key);
  absl::MutexLock lock(&mu_);
  return StoredLocked(id) != nullptr;
}

absl::StatusOr<NvmeBlockMeta> NvmeTierImpl::Meta(absl::string_view ns,
                                                 absl::string_view key) {
  RETURN_IF_ERROR(ValidateNamespace(ns));
  RETURN_IF_ERROR(ValidateKey(key));
  std::string id = EncodeId(ns, key);
  absl::MutexLock lock(&mu_);
  const Entry* e = StoredLocked(id);
  if (e == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("block ", IdToHex(id), " is not in the NVMe tier"));
  }
  NvmeBlockMeta meta;
  meta.size = e->size;
  meta.checksum = e->checksum;
  meta.parent = e->parent;
  meta.read_count = e->read_count;
  return meta;
}

void NvmeTierImpl::ForEachBlock(
    absl::FunctionRef<void(const NvmeBlockView&)> fn) {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, e] : index_) {
    if (e.state != State::kStored) continue;
    NvmeBlockView view;
    if (!DecodeId(id, &view.ns, &view.key)) continue;  // Init checked them
    view.parent = e.parent;
    view.size = e.size;
    view.checksum = e.checksum;
    view.read_count = e.read_count;
    fn(view);
  }
}

absl::Status NvmeTierImpl::Read(absl::string_view ns, absl::string_view key,
                                absl::Span<char> dest) {
  NvmeReadRequest request{key, dest};
  return std::move(MultiRead(ns, {&request, 1})[0]);
}

std::vector<absl::Status> NvmeTierImpl::MultiRead(
    absl::string_view ns, absl::Span<const NvmeReadRequest> requests) {
  std::vector<absl::Status> results(requests.size());
  if (absl::Status s = ValidateNamespace(ns); !s.ok()) {
    for (absl::Status& r : results) r = s;
    return results;
  }
  std::vector<PlannedRead> planned;
  planned.reserve(requests.size());
  // What the reads see: the database as it was while they were planned.
  // Taken under mu_, where every planned entry is kStored, so it holds their
  // records; a delete and re-put of one of them before the reads (other
  // bytes or size under the same key) does not change what they read, and
  // its bytes are never checked against the old checksum (a false
  // integrity error).
  std::unique_ptr<rocksdb::ManagedSnapshot> snapshot;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < requests.size(); ++i) {
      const NvmeReadRequest& request = requests[i];
      if (absl::Status s = ValidateKey(request.key); !s.ok()) {
        results[i] = s;
        continue;
      }
      std::string id = EncodeId(ns, request.key);
      Entry* stored = StoredLocked(id);
      if (stored == nullptr) {
        results[i] = absl::NotFoundError(
            absl::StrCat("block ", IdToHex(id), " is not in the NVMe tier"));
        continue;
      }
      Entry& e = *stored;
      if (request.dest.size() != e.size) {
        results[i] = absl::InvalidArgumentError(
            absl::StrCat("block ", IdToHex(id), " is ", e.size,
                         " bytes; the destination holds ",
                         request.dest.size()));
        continue;
      }
      TouchLocked(&e);
      planned.push_back({i, std::move(id), e.generation, e.size, e.checksum});
    }
    if (!planned.empty()) {
      snapshot = std::make_unique<rocksdb::ManagedSnapshot>(db_.get());
    }
  }
  if (planned.empty()) return results;
  // Planned, nothing read yet.
  internal::TestSyncPoint("NvmeTier::MultiRead:Planned");

  std::vector<std::string> data_keys;
  data_keys.reserve(planned.size());
  for (const PlannedRead& p : planned) data_keys.push_back(DataKey(p.id));
  std::vector<rocksdb::Slice> keys(data_keys.begin(), data_keys.end());
  std::vector<rocksdb::Status> statuses(planned.size());
  rocksdb::ReadOptions ro;  // verify_checksums: RocksDB's CRCs as well
  // Every chunk reads the one snapshot: the batch sees the database as it
  // was planned, whatever changes between chunks.
  ro.snapshot = snapshot->snapshot();
  // RocksDB copies each blob value onto the heap before it is copied into
  // `dest` (a DRAM slot, already counted): a MultiGet of the whole batch
  // would hold all of its bytes twice at once. Chunks of at most
  // kMultiReadChunkBytes (but at least one block) bound that copy; each
  // chunk's values are released before the next is read.
  for (size_t begin = 0; begin < planned.size();) {
    size_t end = begin + 1;
    uint64_t chunk_bytes = planned[begin].size;
    while (end < planned.size() &&
           chunk_bytes + planned[end].size <= kMultiReadChunkBytes) {
      chunk_bytes += planned[end++].size;
    }
    std::vector<rocksdb::PinnableSlice> values(end - begin);
    db_->MultiGet(ro, db_->DefaultColumnFamily(), end - begin, &keys[begin],
                  values.data(), &statuses[begin]);
    // An I/O error may pass (a controller reset, a retried sector): once
    // more, in the same snapshot, before FinishRead judges the block (see
    // NoteUnreadable). Not a blob file gone: that does not pass.
    for (size_t j = begin; j < end; ++j) {
      if (!IsIoError(statuses[j])) continue;
      rocksdb::ReadOptions again = ro;
      again.fill_cache = false;
      values[j - begin].Reset();
      statuses[j] = db_->Get(again, db_->DefaultColumnFamily(), keys[j],
                             &values[j - begin]);
      read_retries_.fetch_add(1, std::memory_order_relaxed);
    }
    for (size_t j = begin; j < end; ++j) {
      const PlannedRead& p = planned[j];
      const NvmeReadRequest& request = requests[p.request];
      results[p.request] =
          FinishRead(p, statuses[j], values[j - begin], request.dest);
      // The checksum FinishRead verified: the entry's as planned, which may
      // not be the one the caller saw in Meta before (a replaced block).
      if (results[p.request].ok() && request.checksum != nullptr) {
        *request.checksum = p.checksum;
      }
    }
    begin = end;
  }
  return results;
}

absl::Status NvmeTierImpl::FinishRead(const PlannedRead& read,
                                      const rocksdb::Status& s,
                                      const rocksdb::Slice& value,
                                      absl::Span<char> dest) {
  if (s.IsNotFound()) {
    // The read's snapshot was taken while the entry was stored: the
    // metadata outlived the bytes. Drop it (unless it went meanwhile).
    DropBlock(read.id, read.generation, DropReason::kMissing);
    return absl::NotFoundError(
        absl::StrCat("block ", IdToHex(read.id), " is not in the NVMe tier"));
  }
  if (s.IsCorruption()) {
    DropBlock(read.id, read.generation, DropReason::kCorrupt);
    return absl::DataLossError(
        absl::StrCat("NVMe tier: block ", IdToHex(read.id),
                     " is corrupt on disk (", s.ToString(), "); dropped"));
  }
  if (IsIoError(s)) {
    // EIO, twice (MultiRead tried again): a bad sector, or a device that
    // fails for a while (a controller reset). Dropped, a block is lost for
    // good; kept while it cannot be read, it costs a miss per read. So the
    // block is dropped only when a later read fails too (NoteUnreadable).
    if (NoteUnreadable(read.id, read.generation) ==
        UnreadableOutcome::kDropped) {
      return absl::DataLossError(absl::StrCat(
          "NVMe tier: block ", IdToHex(read.id), " could not be read, again (",
          s.ToString(), "); dropped"));
    }
    return absl::UnavailableError(absl::StrCat(
        "NVMe tier: block ", IdToHex(read.id), " could not be read (",
        s.ToString(), "); kept, and dropped if a later read fails too"));
  }
  if (IsUnreadable(s)) {
    // Its blob file gone: left indexed, the block would be found by every
    // lookup and missed by every read, and a put of it answered "stored
    // already", for good. It is dropped like a corrupt one.
    DropBlock(read.id, read.generation, DropReason::kCorrupt);
    return absl::DataLossError(
        absl::StrCat("NVMe tier: block ", IdToHex(read.id),
                     " could not be read (", s.ToString(), "); dropped"));
  }
  if (!s.ok()) {
    return FromRocksStatus(
        s, absl::StrCat("NVMe tier: reading block ", IdToHex(read.id)));
  }
  if (value.size() != read.size ||
      BlockChecksum(value.data(), value.size()) != read.checksum) {
    DropBlock(read.id, read.generation, DropReason::kCorrupt);
    return absl::DataLossError(absl::StrCat(
        "NVMe tier: block ", IdToHex(read.id),
        " does not match its XXH3-64 checksum (", value.size(), " bytes read, ",
        read.size, " expected); dropped"));
  }
  std::memcpy(dest.data(), value.data(), read.size);
  absl::MutexLock lock(&mu_);
  ++reads_;
  read_bytes_ += read.size;
  auto it = index_.find(read.id);
  if (it != index_.end() && it->second.generation == read.generation) {
    it->second.suspect = false;  // its last failure passed
    if (it->second.read_count < std::numeric_limits<uint32_t>::max()) {
      ++it->second.read_count;
      it->second.dirty = true;
    }
  }
  return absl::OkStatus();
}

bool NvmeTierImpl::UnreadableBurstLocked(absl::Time now) {
  while (!recent_unreadable_.empty() &&
         now - recent_unreadable_.front().second > kUnreadableBurstWindow) {
    recent_unreadable_.pop_front();
  }
  return recent_unreadable_.size() > kUnreadableBurstBlocks;
}

NvmeTierImpl::UnreadableOutcome NvmeTierImpl::NoteUnreadable(
    const std::string& id, uint64_t generation) {
  UnreadableOutcome outcome;
  Retired victim;
  bool burst_begins = false;
  {
    absl::MutexLock lock(&mu_);
    // Each block counts once, at its last failure. (A linear search, on
    // failures only, of at most kUnreadableBurstBlocks + 1 ids.)
    const absl::Time now = clock_->Now();
    auto seen =
        std::find_if(recent_unreadable_.begin(), recent_unreadable_.end(),
                     [&](const std::pair<std::string, absl::Time>& r) {
                       return r.first == id;
                     });
    if (seen != recent_unreadable_.end()) recent_unreadable_.erase(seen);
    recent_unreadable_.emplace_back(id, now);
    if (recent_unreadable_.size() > kUnreadableBurstBlocks + 1) {
      recent_unreadable_.pop_front();
    }
    const bool burst = UnreadableBurstLocked(now);
    burst_begins = burst && !unreadable_burst_;
    unreadable_burst_ = burst;
    auto it = index_.find(id);
    if (it == index_.end() || it->second.generation != generation ||
        it->second.state != State::kStored) {
      outcome = UnreadableOutcome::kGone;
    } else if (!it->second.suspect) {
      it->second.suspect = true;
      ++unreadable_kept_;
      outcome = UnreadableOutcome::kKept;
    } else if (burst) {
      ++unreadable_drops_held_;
      outcome = UnreadableOutcome::kHeld;
    } else {
      ++integrity_errors_;
      victim = RetireLocked(&it->second);
      outcome = UnreadableOutcome::kDropped;
    }
  }
  if (burst_begins) {
    rocksdb::Log(rocksdb::InfoLogLevel::WARN_LEVEL, info_log_,
                 "[kvdepot] NVMe tier: more than %zu blocks could not be read "
                 "(I/O error) within %s: the device is failing, not those "
                 "blocks; none is dropped for an I/O error until that stops",
                 kUnreadableBurstBlocks,
                 absl::FormatDuration(kUnreadableBurstWindow).c_str());
  }
  if (outcome == UnreadableOutcome::kDropped) DeleteAndErase({&victim, 1});
  return outcome;
}

bool NvmeTierImpl::DropBlock(const std::string& id, uint64_t generation,
                             DropReason reason) {
  Retired victim;
  {
    absl::MutexLock lock(&mu_);
    // Bad bytes count even if the block has gone meanwhile: they were read.
    if (reason == DropReason::kCorrupt) ++integrity_errors_;
    auto it = index_.find(id);
    if (it == index_.end() || it->second.generation != generation ||
        it->second.state != State::kStored) {
      return false;
    }
    if (reason == DropReason::kMissing) ++orphans_dropped_;
    victim = RetireLocked(&it->second);
  }
  DeleteAndErase({&victim, 1});
  return true;
}

// ---------------------------------------------------------------------------
// Maintenance.

NvmeTierStats NvmeTierImpl::Stats() {
  NvmeTierStats stats;
  {
    absl::MutexLock lock(&mu_);
    stats.used_bytes = used_;
    stats.blocks = blocks_;
    stats.puts = puts_;
    stats.write_bytes = write_bytes_;
    stats.write_errors = write_errors_;
    stats.reads = reads_;
    stats.read_bytes = read_bytes_;
    stats.integrity_errors = integrity_errors_;
    stats.orphans_dropped = orphans_dropped_;
    stats.evictions = evictions_;
    stats.evicted_bytes = evicted_bytes_;
    stats.unreadable_kept = unreadable_kept_;
    stats.unreadable_drops_held = unreadable_drops_held_;
    stats.read_error_burst = UnreadableBurstLocked(clock_->Now());
  }
  stats.capacity_bytes = options_.capacity_bytes;
  stats.writable = !listener_->stopped();
  if (!stats.writable) {
    absl::MutexLock lock(&resume_mu_);
    stats.write_error = listener_->reason();
    if (ResumeStuckLocked()) {
      absl::StrAppend(&stats.write_error, kStuckSuffix);
    } else if (listener_->fatal()) {
      absl::StrAppend(&stats.write_error, listener_->FatalSuffix());
    }
  } else if (short_of_space_.load(std::memory_order_relaxed) &&
             // Still? (Space may have been freed since, with no put.)
             !CheckFreeSpace(refused_bytes_.load(std::memory_order_relaxed))
                  .ok()) {
    stats.writable = false;
    stats.write_error =
        ShortOfSpaceMessage(free_bytes_.load(std::memory_order_relaxed));
  }
  stats.unflushed_bytes = UnflushedBytes();
  stats.read_retries = read_retries_.load(std::memory_order_relaxed);
  stats.blob_gc_active = blob_gc_active_.load();
  db_->GetIntProperty(rocksdb::DB::Properties::kLiveBlobFileGarbageSize,
                      &stats.blob_garbage_bytes);
  for (const std::string& property :
       {rocksdb::DB::Properties::kLiveSstFilesSize,
        rocksdb::DB::Properties::kLiveBlobFileSize}) {
    uint64_t value = 0;
    if (db_->GetIntProperty(property, &value)) stats.disk_bytes += value;
  }
  return stats;
}

absl::StatusOr<NvmeVerifyReport> NvmeTierImpl::Verify(
    std::function<bool()> cancelled) {
  // Stop at the next block: shutdown (StopMaintenance), or the caller gave up.
  auto stopping = [&] { return closing_.load() || (cancelled && cancelled()); };
  auto stopped = [&] {
    return closing_.load() ? absl::CancelledError("NVMe tier is closing")
                           : absl::CancelledError("scrub cancelled by its caller");
  };
  NvmeVerifyReport report;
  // Entries of a generation below this existed before the scan's snapshot;
  // each is either met by the scan or checked afterwards. Those being
  // written then (`writing`) are checked afterwards only: the snapshot may
  // hold other bytes under their id (an earlier block whose delete failed),
  // which are not theirs to be judged by. The snapshot is taken with the
  // limit, under mu_, so that no put lands between the two.
  uint64_t generation_limit;
  absl::flat_hash_set<uint64_t> writing;
  std::optional<rocksdb::ManagedSnapshot> scan_snapshot;
  {
    absl::MutexLock lock(&mu_);
    generation_limit = next_generation_;
    for (const auto& [id, e] : index_) {
      if (e.state == State::kWriting) writing.insert(e.generation);
    }
    scan_snapshot.emplace(db_.get());
  }
  internal::TestSyncPoint("NvmeTier::Verify:Snapshot");
  absl::flat_hash_set<uint64_t> seen;

  // One pass over the bytes of one snapshot. RocksDB's own blob CRCs are
  // off here so that a bad blob does not end the scan; the XXH3-64 check
  // below catches it.
  rocksdb::Status scan_status;
  {
    rocksdb::ReadOptions scan;
    scan.snapshot = scan_snapshot->snapshot();
    scan.verify_checksums = false;
    scan.fill_cache = false;
    rocksdb::ReadOptions meta_reads;
    meta_reads.snapshot = scan_snapshot->snapshot();
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(scan));
    report.snapshots = 1;
    uint64_t read_in_snapshot = 0;
    const std::string first(1, kDataPrefix);
    it->Seek(first);
    while (it->Valid() && it->key().starts_with(first) && !stopping()) {
      // A scrub may read for minutes, on the maintenance thread whose timer
      // flushes: demotions still reach the files within max_unflushed_age
      // (plus one block's read). Before every block, as a block may be
      // 256 MiB; FlushIfDue costs a lock and a clock read when nothing is
      // due.
      FlushIfDue();
      std::string id(it->key().data() + 1, it->key().size() - 1);
      rocksdb::Slice value = it->value();
      const uint64_t sum = BlockChecksum(value.data(), value.size());
      // The scan has read the bytes of `id` (arg: the std::string id).
      internal::TestSyncPoint("NvmeTier::Verify:Scanned", &id);
      // A block to drop. Dropped at once: its kDeleting entry makes a put
      // of its id wait (WaitSettled) until the delete has landed.
      std::optional<Retired> doomed;
      bool indexed = true;
      {
        absl::MutexLock lock(&mu_);
        auto found = index_.find(id);
        if (found == index_.end()) {
          indexed = false;
        } else if (found->second.state == State::kStored &&
                   found->second.generation < generation_limit &&
                   !writing.contains(found->second.generation)) {
          Entry& e = found->second;
          if (value.size() == e.size && sum == e.checksum) {
            seen.insert(e.generation);
            ++report.blocks_checked;
            report.bytes_checked += e.size;
          } else {
            doomed = RetireLocked(&e);
            ++integrity_errors_;
            ++report.corrupt_dropped;
          }
        }
        // Otherwise a put or delete of this id is in flight, or the block
        // is newer than the scan: leave it.
      }
      // Not in the index: bytes without metadata, or a block deleted (or
      // evicted) since the snapshot, which still shows its metadata record.
      // Only the first is an orphan.
      if (!indexed && !HasMetaAt(meta_reads, id)) {
        absl::MutexLock lock(&mu_);
        // A put of the id since then has overwritten the bytes: leave them.
        if (!index_.contains(id)) {
          auto [pos, inserted] = index_.try_emplace(std::move(id));
          pos->second.id = &pos->first;
          pos->second.state = State::kDeleting;
          pos->second.generation = next_generation_++;
          doomed = Retired{pos->first, pos->second.generation};
          ++orphans_dropped_;
          ++report.orphans_dropped;
        }
      }
      if (doomed.has_value()) DeleteAndErase({&*doomed, 1});
      read_in_snapshot += value.size();
      if (read_in_snapshot < options_.scrub_snapshot_bytes) {
        it->Next();
        continue;
      }
      // Go on in a fresh snapshot, from the least id after this one. What
      // is judged stays as above: blocks stored before the first snapshot
      // (generation_limit) and not being written then keep their bytes in
      // every later one until deleted, and a later put or delete of their
      // id changes their entry (state, generation) before the scan looks.
      // Orphans are judged against the metadata of the snapshot that
      // showed their bytes, as before.
      std::string next = it->key().ToString();
      next.push_back('\0');
      it.reset();
      scan_snapshot.emplace(db_.get());
      scan.snapshot = scan_snapshot->snapshot();
      meta_reads.snapshot = scan_snapshot->snapshot();
      it.reset(db_->NewIterator(scan));
      ++report.snapshots;
      read_in_snapshot = 0;
      it->Seek(next);
    }
    scan_status = it->status();
  }
  scan_snapshot.reset();
  // A block the scan could not read ends it; the blocks it did not reach
  // are read one by one below, and the unreadable ones dropped.
  if (!IsUnreadable(scan_status)) {
    RETURN_IF_ERROR(FromRocksStatus(scan_status, "NVMe tier: scrub stopped"));
  }
  if (stopping()) return stopped();

  // Stored blocks the scan did not meet: their bytes are missing, or they
  // were written after the scan's snapshot. Look again, in a snapshot taken
  // while each of them is stored: it holds their records (or shows their
  // bytes missing), never those of a block put under the same id since.
  std::vector<PlannedRead> unseen;
  std::unique_ptr<rocksdb::ManagedSnapshot> snapshot;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, e] : index_) {
      if (e.state == State::kStored && e.generation < generation_limit &&
          !seen.contains(e.generation)) {
        unseen.push_back({0, id, e.generation, e.size, e.checksum});
      }
    }
    if (!unseen.empty()) {
      snapshot = std::make_unique<rocksdb::ManagedSnapshot>(db_.get());
    }
  }
  rocksdb::ReadOptions ro;
  ro.fill_cache = false;
  if (snapshot != nullptr) ro.snapshot = snapshot->snapshot();
  for (const PlannedRead& p : unseen) {
    if (stopping()) return stopped();
    FlushIfDue();  // as in the scan
    rocksdb::PinnableSlice value;
    rocksdb::Status s =
        db_->Get(ro, db_->DefaultColumnFamily(), DataKey(p.id), &value);
    if (IsIoError(s)) {  // as a read (MultiRead, FinishRead)
      value.Reset();
      s = db_->Get(ro, db_->DefaultColumnFamily(), DataKey(p.id), &value);
      read_retries_.fetch_add(1, std::memory_order_relaxed);
    }
    if (IsIoError(s)) {
      // A scrub is a read like any other: during a controller reset it
      // must not drop every block it meets either.
      switch (NoteUnreadable(p.id, p.generation)) {
        case UnreadableOutcome::kDropped:
          ++report.corrupt_dropped;
          break;
        case UnreadableOutcome::kKept:
        case UnreadableOutcome::kHeld:
          ++report.unreadable_kept;
          break;
        case UnreadableOutcome::kGone:
          break;
      }
    } else if (s.IsNotFound()) {
      if (DropBlock(p.id, p.generation, DropReason::kMissing)) {
        ++report.missing_dropped;
      }
    } else if (s.IsCorruption() || IsUnreadable(s) ||
               (s.ok() &&
                (value.size() != p.size ||
                 BlockChecksum(value.data(), value.size()) != p.checksum))) {
      if (DropBlock(p.id, p.generation, DropReason::kCorrupt)) {
        ++report.corrupt_dropped;
      }
    } else if (s.ok()) {
      ++report.blocks_checked;
      report.bytes_checked += p.size;
    } else {
      return FromRocksStatus(s, "NVMe tier: scrub stopped");
    }
  }
  return report;
}

void NvmeTierImpl::StopMaintenance() {
  closing_.store(true);  // Verify's loops stop at the next block
  db_->DisableManualCompaction();  // CompactRange returns Incomplete
}

absl::StatusOr<double> NvmeTierImpl::CompactFraction(bool* tables_fit) {
  *tables_fit = true;
  uint64_t free = 0;
  // Unknown (a file system that does not say): RocksDB's errors decide.
  if (!Env()->GetFreeSpace(options_.path, &free).ok()) return 1.0;
  uint64_t sst = 0;
  db_->GetIntProperty(rocksdb::DB::Properties::kLiveSstFilesSize, &sst);
  // The live bytes of each blob file, oldest first: a pass with age cutoff
  // c rewrites those of the oldest floor(c x files) files, and the oldest
  // files may hold far more live blobs than the average (their blocks were
  // evicted or deleted less), so the cutoff is chosen by what those files
  // hold, not by the ratio of the totals.
  rocksdb::ColumnFamilyMetaData meta;
  db_->GetColumnFamilyMetaData(&meta);
  std::vector<std::pair<uint64_t, uint64_t>> files;  // number, live bytes
  files.reserve(meta.blob_files.size());
  uint64_t live_blobs = 0;
  for (const rocksdb::BlobMetaData& f : meta.blob_files) {
    const uint64_t live = f.total_blob_bytes > f.garbage_blob_bytes
                              ? f.total_blob_bytes - f.garbage_blob_bytes
                              : 0;
    files.emplace_back(f.blob_file_number, live);
    live_blobs += live;
  }
  std::sort(files.begin(), files.end());
  const uint64_t reserve = min_free_bytes_ + UnflushedBytes();
  const uint64_t room = free > reserve ? free - reserve : 0;
  if (room >= sst + live_blobs) return 1.0;
  *tables_fit = room >= sst;
  // Every pass rewrites the tables whole (bottommost compaction forced).
  // Beside them, the oldest files whose live blobs fit.
  size_t fit = 0;
  uint64_t fit_bytes = 0;
  while (fit < files.size() && sst + fit_bytes + files[fit].second <= room) {
    fit_bytes += files[fit++].second;
  }
  // The least that is worth a pass: one file, and kMinCompactFraction of
  // them (fewer would take more passes than a Compact makes).
  const size_t least = std::max<size_t>(
      1, static_cast<size_t>(std::ceil(kMinCompactFraction * files.size())));
  if (fit < least) {
    uint64_t least_bytes = 0;
    for (size_t i = 0; i < std::min(least, files.size()); ++i) {
      least_bytes += files[i].second;
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "NVMe tier: a compaction pass needs ", reserve + sst + least_bytes,
        " bytes free under ", options_.path, ", and ", free,
        " are free. It writes the live data it keeps beside the old files "
        "before those go: the tables (",
        sst, " bytes) and the live blobs of at least the oldest ", least,
        " of ", files.size(), " blob files (", least_bytes, " bytes; ",
        live_blobs, " in all), and it leaves the tier's reserve (", reserve,
        " bytes: min_free_bytes and what the memtables hold); free space "
        "there first, or lower nvme_capacity"));
  }
  // floor(c x files) == fit: half a file above fit, so that rounding does
  // not take one file fewer.
  return (static_cast<double>(fit) + 0.5) / static_cast<double>(files.size());
}

absl::Status NvmeTierImpl::Compact(std::function<bool()> cancelled) {
  if (closing_.load()) return absl::CancelledError("NVMe tier is closing");
  RETURN_IF_ERROR(EnsureWritable());
  // The caller's cancel, asked every 50 ms, stops RocksDB's manual
  // compaction between files (CompactRangeOptions::canceled).
  std::atomic<bool> caller_gone{false};
  absl::Notification compacted;
  std::thread watcher;
  if (cancelled) {
    watcher = std::thread([&] {
      while (
          !compacted.WaitForNotificationWithTimeout(absl::Milliseconds(50))) {
        if (cancelled()) {
          caller_gone.store(true);
          return;
        }
      }
    });
  }
  absl::Cleanup stop_watching = [&] {
    compacted.Notify();
    if (watcher.joinable()) watcher.join();
  };
  auto gone = [&] {
    return absl::CancelledError("NVMe tier: the compaction's caller gave up");
  };
  // CompactRange plans its levels when called; a flush's automatic
  // compaction still moving files down would hide them from it. So flush,
  // let background compactions settle, then compact everything.
  rocksdb::FlushOptions flush;
  flush.allow_write_stall = true;
  RETURN_IF_ERROR(FromRocksStatus(
      db_->Flush(flush),
      "NVMe tier: flush before compaction"));
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  for (;;) {
    uint64_t pending = 0, running = 0;
    db_->GetIntProperty(rocksdb::DB::Properties::kNumRunningCompactions,
                        &running);
    db_->GetIntProperty(rocksdb::DB::Properties::kCompactionPending,
                        &pending);
    if ((pending == 0 && running == 0) || absl::Now() > deadline ||
        closing_.load()) {
      break;
    }
    if (caller_gone.load()) return gone();
    absl::SleepFor(absl::Milliseconds(5));
  }
  rocksdb::CompactRangeOptions cro;
  // Beside RocksDB's own compactions, never instead of them: an exclusive
  // manual compaction first waits for the running ones and, until it ends,
  // lets no automatic one start, so flushes pile up level-0 files until
  // RocksDB stops every write (every put and delete of the tier) for as long
  // as this runs. (false is RocksDB 7's default; before 7 it was true.)
  cro.exclusive_manual_compaction = false;
  cro.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
  cro.blob_garbage_collection_policy =
      rocksdb::BlobGarbageCollectionPolicy::kForce;
  cro.blob_garbage_collection_age_cutoff = 1.0;
  cro.canceled = &caller_gone;
  // A forced-GC pass relocates every live blob, so afterwards no blob file
  // should hold garbage. Once in many hundred runs (RocksDB 7.8, CI's
  // loaded machine; nvme_tier_test CompactReclaimsSpaceOfDeletedBlocks) a
  // pass left what looked like one whole blob file, its live blob unmoved;
  // not reproduced since. Passes go on while garbage is left, a few at most:
  // each rewrites every live block.
  //
  // A pass that meets a corrupt block fails with Corruption, one that cannot
  // read a blob with an I/O error (and leaves the database as it was, see
  // ErrorListener): the tier scrubs, dropping what fails its checksum or
  // cannot be read (counted in integrity_errors), and compacts again, once;
  // the error if that fails too. A block that meets an I/O error is only
  // marked suspect by the scrub (NoteUnreadable: it may pass), so when the
  // scrub kept such blocks and the compaction fails again, a second scrub
  // drops those that still cannot be read, and the compaction runs once
  // more.
  int scrubs = 0;
  bool kept_unreadable = false;  // by the last scrub
  int passes = kCompactPasses;
  bool tables_only_done = false;  // see below
  for (int pass = 1;; ++pass) {
    if (closing_.load()) return absl::CancelledError("NVMe tier is closing");
    if (caller_gone.load()) return gone();
    // A forced-GC pass writes every live blob it relocates before the old
    // files go: with too little room for all of them it would fill the
    // file system (and stop the tier's writes). Then each pass rewrites
    // the oldest blob files that fit, freeing them for the next.
    bool tables_fit = false;
    absl::StatusOr<double> fraction = CompactFraction(&tables_fit);
    // RocksDB counts a deleted block's blob as garbage only once a
    // compaction has dropped its reference: after an evict of many blocks,
    // the blob files look live and the room short. So before refusing,
    // one pass without blob garbage collection (it rewrites only the
    // tables, for which there is room) merges the deletes, and the room is
    // judged again.
    const bool tables_only = !fraction.ok() && tables_fit && !tables_only_done;
    if (!fraction.ok() && !tables_only) return fraction.status();
    if (tables_only) {
      tables_only_done = true;
      cro.blob_garbage_collection_policy =
          rocksdb::BlobGarbageCollectionPolicy::kDisable;
    } else {
      cro.blob_garbage_collection_policy =
          rocksdb::BlobGarbageCollectionPolicy::kForce;
      cro.blob_garbage_collection_age_cutoff = *fraction;
      if (*fraction < 1.0) {
        passes = std::max(
            passes, std::min(kMaxPartialCompactPasses,
                             static_cast<int>(std::ceil(1.0 / *fraction)) + 1));
      }
    }
    rocksdb::Status s = db_->CompactRange(cro, nullptr, nullptr);
    if (s.IsIncomplete() && caller_gone.load()) return gone();
    if (s.IsIncomplete() && closing_.load()) {  // StopMaintenance
      return absl::CancelledError("NVMe tier is closing: compaction stopped");
    }
    // (Not a corrupt table file, which stopped writes: no scrub mends it.)
    if ((s.IsCorruption() || IsUnreadable(s)) && !listener_->stopped() &&
        (scrubs == 0 || (scrubs == 1 && kept_unreadable))) {
      ++scrubs;
      listener_->TakeCorruption();  // this one is being dealt with
      ASSIGN_OR_RETURN(const NvmeVerifyReport report, Verify());
      kept_unreadable = report.unreadable_kept > 0;
      continue;
    }
    RETURN_IF_ERROR(FromRocksStatus(s, "NVMe tier: compaction"));
    if (tables_only) continue;
    uint64_t garbage = 0;
    if (pass >= passes ||
        !db_->GetIntProperty(rocksdb::DB::Properties::kLiveBlobFileGarbageSize,
                             &garbage) ||
        garbage == 0) {
      return absl::OkStatus();
    }
  }
}

absl::Status NvmeTierImpl::Flush() {
  RETURN_IF_ERROR(EnsureWritable());
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(PersistDirtyLocked());
  }
  return FlushAndWait();
}

absl::Status NvmeTierImpl::FlushAndWait() {
  rocksdb::FlushOptions flush;
  flush.allow_write_stall = true;
  RETURN_IF_ERROR(FromRocksStatus(db_->Flush(flush), "NVMe tier: flush"));
  // DB::Flush can return while a background flush that already took the
  // memtable is still writing it (seen after resuming from a full disk with
  // RocksDB 7.8); closing then would drop that flush's output. Wait until no
  // memtable is left to flush.
  const absl::Time deadline = absl::Now() + absl::Minutes(2);
  while (true) {
    uint64_t immutable = 0, running = 0;
    db_->GetIntProperty(rocksdb::DB::Properties::kNumImmutableMemTable,
                        &immutable);
    db_->GetIntProperty(rocksdb::DB::Properties::kNumRunningFlushes, &running);
    if (immutable == 0 && running == 0) return absl::OkStatus();
    if (listener_->stopped()) {
      return absl::UnavailableError(absl::StrCat(
          "NVMe tier: flush failed: ", listener_->reason()));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          "NVMe tier: flush still running after 2 minutes");
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
}

}  // namespace

uint64_t NvmeTierMaxBlocks(uint64_t capacity_bytes, uint64_t max_blocks) {
  return max_blocks != 0 ? max_blocks : capacity_bytes / kNvmeDefaultBlockBytes;
}

absl::StatusOr<std::unique_ptr<NvmeTier>> OpenNvmeTier(
    const NvmeTierOptions& options, Clock* clock) {
  if (options.capacity_bytes == 0) {
    return absl::FailedPreconditionError(
        "NVMe tier is disabled (capacity 0); do not open it");
  }
  if (options.path.empty()) {
    return absl::InvalidArgumentError("NVMe tier path is empty");
  }
  if (options.max_background_jobs < 1) {
    return absl::InvalidArgumentError(
        "NVMe tier needs at least one background job");
  }
  if (options.resume_stuck_after <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("NVMe tier: resume_stuck_after must be > 0");
  }
  if (options.max_unflushed_age <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "NVMe tier: max_unflushed_age must be > 0");
  }
  if (options.scrub_snapshot_bytes == 0) {
    return absl::InvalidArgumentError(
        "NVMe tier: scrub_snapshot_bytes must be > 0");
  }
  if (NvmeTierMaxBlocks(options.capacity_bytes, options.max_blocks) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVMe tier: a capacity of ", options.capacity_bytes,
                     " bytes holds no block of the default bound (one per ",
                     kNvmeDefaultBlockBytes, " bytes): give max_blocks"));
  }
  // Referenced here so that every program that opens the tier links
  // rocksdb_crc32c.cc, whose CRC32C takes the place of librocksdb's.
  static_cast<void>(RocksCrc32cImplementation());
  auto tier = std::make_unique<NvmeTierImpl>(
      options, clock != nullptr ? clock : SystemClock());
  RETURN_IF_ERROR(tier->Init());
  return std::unique_ptr<NvmeTier>(std::move(tier));
}

}  // namespace kvdepot
