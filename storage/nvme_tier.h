// NvmeTier: the NVMe tier of the storage engine. Blocks live in a RocksDB
// database on local flash: each block is a small metadata record in the LSM
// (size, XXH3-64 checksum, parent key, read count, recency) and its bytes
// under a second key whose value goes to a blob file (integrated BlobDB) when
// it is min_blob_size bytes or more. Both records are written in one
// WriteBatch, so a block appears and disappears atomically, and existence and
// metadata checks never read the bytes.
//
// An in-memory index of every stored block answers Contains/Meta without
// touching RocksDB and orders blocks for eviction. It is rebuilt from the
// metadata records when the tier opens (warm restart: a reopened tier serves
// every block whose records were persisted, without reading any blob).
//
// Durability: block records are written without the WAL by default, so a
// crash may lose what the memtables hold. A timer of the tier bounds that to
// the last seconds of writes: it flushes the memtables once the oldest write
// in them is max_unflushed_age old (on the tier's clock). Delete goes
// through the WAL whatever use_wal says, so a deleted block never comes back
// after a crash. A clean shutdown (the destructor, or Flush) persists
// everything, except while the disk stays full: RocksDB then stops writing
// (see NvmeTierOptions::resume_interval) and cannot flush, so puts
// acknowledged since the last flush are lost at close, and blocks whose
// delete failed meanwhile (Delete's, evictions') come back after a reopen.
// Nor can the tier make room by itself then: its deletes are writes too.
// Room has to come from outside: space freed on the file system (writes
// resume by themselves), and a lower capacity_bytes (nvme_capacity) so that
// the tier does not fill it again.
// Integrity is never traded: every read verifies the block's XXH3-64, and a
// block whose bytes do not match is deleted, counted as an integrity error
// and reported as DataLoss. No path returns bytes that fail their checksum.
// A read that meets an I/O error (EIO) is another matter: the device may be
// failing for a while (a controller reset) rather than the block. The read
// is tried once more; a block that still cannot be read is kept (the read
// is Unavailable, a miss) and dropped only when a later read of it fails
// too -- and not even then while many blocks fail at once (more than 64
// within 10 s: the device, not the blocks; NvmeTierStats::read_error_burst).
//
// Capacity: the tier holds at most capacity_bytes of *charged* bytes (see
// NvmeTierStats::used_bytes) and evicts to make room for a new one. Eviction
// is prefix-aware: a block with a stored child (a block naming it as parent)
// goes only after its children, so chains are cut from their ends and cached
// prefixes stay usable; among the other blocks, the least recently read or
// written goes first. (A parent whose last child goes counts as least
// recently used: its chain has just aged out.) Admission is the engine's
// business.
//
// The tier runs one thread of its own, for the flushes above and for
// scrubbing after an automatic compaction met a corrupt block (see Compact).
//
// Thread-safe: every method may be called from any thread. Reads, puts and
// deletes do their RocksDB I/O outside the index lock, so they overlap; puts
// and deletes of the same key are serialized. Put blocks while RocksDB stalls
// writes (flushes behind): call it from background threads, as MultiRead.
//
// Memory: the index keeps, per block, its id (namespace + key), parent key
// and about 110 bytes of bookkeeping in a hash-map node, plus one small map
// entry per parent that is not stored but has stored children: about 200
// bytes of heap per block with short keys, up to about 350 with long keys
// and parents. It is rebuilt at every open, so
// the number of blocks is bounded (NvmeTierOptions::max_blocks), not only
// their bytes.
#ifndef KVDEPOT_STORAGE_NVME_TIER_H_
#define KVDEPOT_STORAGE_NVME_TIER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "storage/clock.h"

namespace rocksdb {
class Env;
}  // namespace rocksdb

namespace kvdepot {

// The block size NvmeTierOptions::max_blocks assumes by default (one block
// per 16 KiB of capacity). A real engine's KV block is at least that: a
// 16-token vLLM block of Llama-3-8B is 64 KiB per layer (2 MiB across
// layers). With the index's 200-350 bytes of heap per block (see Memory
// above), the bound keeps the index to about 1.2-2.1% of the capacity
// (100-175 MiB for 8 GiB).
inline constexpr uint64_t kNvmeDefaultBlockBytes = uint64_t{16} << 10;

struct NvmeTierOptions {
  // Directory of the tier's RocksDB database. Created (with its parents) if
  // missing. One tier per directory: RocksDB's LOCK file refuses a second
  // opener, in this process or another.
  std::string path;
  // Bound on NvmeTierStats::used_bytes. 0 means the tier is disabled:
  // OpenNvmeTier refuses with FailedPrecondition and touches no file, so the
  // caller decides not to open it.
  uint64_t capacity_bytes = uint64_t{8} << 30;
  // Most blocks the tier holds: a bound on the index's heap (see Memory
  // above), which grows with the number of blocks, not their bytes. Every
  // block is charged at least capacity_bytes / max_blocks (rounded up; see
  // NvmeTierStats::used_bytes), so eviction keeps the tier within it; blocks
  // whose charge is that or more are unaffected. 0 means the default,
  // capacity_bytes / kNvmeDefaultBlockBytes (NvmeTierMaxBlocks).
  uint64_t max_blocks = 0;
  // Largest block accepted by Put (InvalidArgument above it).
  uint64_t max_block_bytes = uint64_t{256} << 20;
  // Write block records through RocksDB's write-ahead log. Off by default: a
  // cache may lose its last seconds of writes on a crash (see
  // max_unflushed_age). Delete always writes through the WAL.
  bool use_wal = false;
  // Without the WAL, the longest a put (or an eviction's delete) stays only
  // in memtables: the tier's timer flushes them once the oldest unflushed
  // write is this old. It looks at the clock every quarter of this (at most
  // every second; a scrub on the tier's thread looks before every block it
  // reads), so a crash loses at most about max_unflushed_age plus one
  // second (plus the flush's time) of writes. InfiniteDuration() turns
  // the timer off (memtables are then flushed when full, by Flush, or at
  // close). Must be > 0. Unused with use_wal.
  absl::Duration max_unflushed_age = absl::Seconds(5);
  // Block values of at least this many bytes go to blob files; smaller ones
  // stay inline in the LSM.
  uint64_t min_blob_size = 4096;
  // Size at which RocksDB starts a new blob file.
  uint64_t blob_file_size = uint64_t{256} << 20;
  // Memtable size. Up to max_write_buffer_number of them are in memory, and
  // that much unflushed data is what a crash with use_wal == false can lose
  // (96 MiB by default).
  uint64_t write_buffer_size = uint64_t{16} << 20;
  // LZ4 for blob files and SSTs. Off by default: KV-cache tensors barely
  // compress and the CPU is better spent elsewhere.
  bool compression = false;
  // Memtables (one filling, the others flushing in parallel): with two, the
  // tier writes only as fast as one flush writes one blob file (about half
  // of what the disk takes, measured in tools/results/compare_fio.txt).
  int max_write_buffer_number = 6;
  // RocksDB flush and compaction threads (half of each).
  int max_background_jobs = 8;
  // Read blocks with O_DIRECT: no page-cache copy (less CPU per block, and
  // the page cache is left to the system), at the price of no read-ahead.
  // Measured (tools/results/compare_fio_2026-12-07.txt): about 0.8x the
  // GB/s of buffered reads from a cold cache, and a 5.5-6x lower p99. Open
  // fails (InvalidArgument) when path's file system refuses O_DIRECT:
  // otherwise every read would fail later.
  bool direct_reads = false;
  // Write blob and SST files with O_DIRECT in large buffered chunks
  // (flushes and compactions): the page cache is not filled with blocks
  // that were just demoted, and writeback does not stall the flush.
  bool direct_writes = false;
  // Blob garbage collection (relocating the live blocks of the oldest blob
  // files during compaction) runs only while the garbage in blob files is
  // above gc_on_garbage_ratio of their size, and stops below
  // gc_off_garbage_ratio: a tier that is filling, or whose evictions empty
  // whole blob files (the common case: eviction takes old blocks), does not
  // rewrite live data.
  double gc_on_garbage_ratio = 0.20;
  double gc_off_garbage_ratio = 0.05;
  // After RocksDB stops accepting writes (a full disk, an I/O error), writes
  // fail fast with Unavailable, and at most once per this interval a write
  // asks RocksDB to resume (on a thread of the tier's; that write waits for
  // it up to 5 s); the first resume that succeeds reopens the tier for
  // writing.
  absl::Duration resume_interval = absl::Seconds(1);
  // A resume still running after this long is taken for stuck (RocksDB 7
  // can lose a flush a background error interrupted, and its resume then
  // waits for it for good): writes fail with Unavailable saying so until
  // the tier is reopened, and closing does not wait for it.
  absl::Duration resume_stuck_after = absl::Seconds(60);
  // Free space the tier leaves on its file system: a put that would leave
  // less is refused (Unavailable, nothing written), so that RocksDB never
  // meets a full disk through the tier's own writes. RocksDB needs room to
  // flush its memtables and compact; after it has met ENOSPC (stopped
  // writes), its resume often never succeeds, even once space is back
  // (flushes in parallel lose their files: a restart is needed), and what
  // the memtables held is lost. What the memtables hold now (and puts in
  // flight), which their flushes will write, counts as used: a put is
  // refused when the free space less that is short of min_free_bytes plus
  // the block (memtables of blocks larger than write_buffer_size hold more
  // than the default reserve counts). 0 means the default: twice the
  // memtables' budget (write_buffer_size x max_write_buffer_number) plus
  // 64 MiB.
  uint64_t min_free_bytes = 0;
  // A scrub (Verify) reads the tier in one pass through a RocksDB snapshot,
  // which keeps on disk every blob file it can see: the space of blocks
  // deleted or evicted meanwhile does not return until the snapshot goes.
  // The scan takes a fresh snapshot after reading this many bytes, so that
  // a scrub of a large tier (hours at disk speed) does not hold back the
  // garbage collection of a whole run's evictions. Must be > 0.
  uint64_t scrub_snapshot_bytes = uint64_t{1} << 30;
  // RocksDB environment (file system, threads). nullptr means
  // rocksdb::Env::Default(). Borrowed: must outlive the tier. Tests pass a
  // fault-injecting one.
  rocksdb::Env* env = nullptr;
};

// What the tier knows about one stored block (a copy).
struct NvmeBlockMeta {
  uint64_t size = 0;      // bytes of the block
  uint64_t checksum = 0;  // XXH3-64 of the bytes
  std::string parent;     // parent key in the same namespace; empty for a root
  uint32_t read_count = 0;  // successful verified reads since it was stored
};

// One block as seen by NvmeTier::ForEachBlock. The views are valid only
// during the callback.
struct NvmeBlockView {
  absl::string_view ns;
  absl::string_view key;
  absl::string_view parent;
  uint64_t size = 0;
  uint64_t checksum = 0;
  uint32_t read_count = 0;
};

struct NvmeTierStats {
  // Charged bytes of stored blocks plus puts in flight. A block is charged
  // its size plus the bytes of its two RocksDB keys and its metadata record
  // (what the tier asked RocksDB to store), and at least capacity_bytes /
  // max_blocks (NvmeTierOptions::max_blocks). It is not the space on disk,
  // which also holds deleted blobs until blob garbage collection reclaims them
  // (see disk_bytes and Compact).
  uint64_t used_bytes = 0;
  uint64_t capacity_bytes = 0;
  uint64_t blocks = 0;
  // Live SST and blob files of the tier's database, as RocksDB reports them.
  uint64_t disk_bytes = 0;
  // Bytes of deleted blocks still in blob files, and whether blob garbage
  // collection is on now (see NvmeTierOptions::gc_on_garbage_ratio).
  uint64_t blob_garbage_bytes = 0;
  bool blob_gc_active = false;
  uint64_t puts = 0;         // blocks stored
  uint64_t write_bytes = 0;  // block bytes of those puts
  // Writes (puts, deletes) that failed because RocksDB could not or would
  // not write (disk full, I/O error, stopped after one).
  uint64_t write_errors = 0;
  uint64_t reads = 0;         // verified reads served
  uint64_t read_bytes = 0;
  // Reads (or scrubs) whose bytes failed their checksum, that RocksDB
  // reported corrupt, that found their blob file gone or met an I/O error
  // on a block that had failed so before (see unreadable_kept), and
  // metadata records found unreadable at open. Each such block is dropped.
  uint64_t integrity_errors = 0;
  // Blocks dropped because one of their two records was missing.
  uint64_t orphans_dropped = 0;
  uint64_t evictions = 0;  // blocks evicted to make room
  uint64_t evicted_bytes = 0;
  // False while RocksDB refuses writes after a background error (a full
  // disk); see NvmeTierOptions::resume_interval.
  bool writable = true;
  // Why, while not writable: RocksDB's error, and whether its resume is
  // stuck (NvmeTierOptions::resume_stuck_after) or cannot succeed (a fatal
  // error: writes stay off until kvdepotd restarts), or the file system's
  // free space under min_free_bytes. Empty when writable.
  std::string write_error;
  // Bytes the memtables hold (RocksDB's estimate, arena blocks included)
  // that their flushes will write to the file system.
  uint64_t unflushed_bytes = 0;
  // Reads (and scrub reads) that met an I/O error (EIO) and were tried once
  // more.
  uint64_t read_retries = 0;
  // Reads (and scrub reads) that failed with an I/O error on the retry too,
  // the first time for their block: the block was kept (the read was
  // Unavailable) and is dropped, counted in integrity_errors, if a later
  // read of it fails too (a successful one clears it).
  uint64_t unreadable_kept = 0;
  // Later failures of such blocks that dropped nothing because
  // read_error_burst was on.
  uint64_t unreadable_drops_held = 0;
  // More than 64 distinct blocks failed with I/O errors (on the retry too)
  // within the last 10 s (the tier's clock): the device is failing, not the
  // blocks, and no block is dropped for an I/O error meanwhile (the tier's
  // LOG says so when it begins).
  bool read_error_burst = false;
};

// What NvmeTier::Verify found.
struct NvmeVerifyReport {
  uint64_t blocks_checked = 0;  // blocks whose bytes were read and verified
  uint64_t bytes_checked = 0;
  // Failed their checksum (or size), or could not be read (their blob file
  // gone, or an I/O error that a read had met before: see
  // NvmeTierStats::unreadable_kept): dropped.
  uint64_t corrupt_dropped = 0;
  // Met an I/O error, on the retry too, for the first time: kept, marked
  // to be dropped if a later read (or scrub) fails too; or failed again
  // while NvmeTierStats::read_error_burst was on.
  uint64_t unreadable_kept = 0;
  uint64_t missing_dropped = 0;  // metadata without bytes: dropped
  uint64_t orphans_dropped = 0;  // bytes without metadata: deleted
  // RocksDB snapshots the scan read through (a fresh one after every
  // NvmeTierOptions::scrub_snapshot_bytes).
  uint64_t snapshots = 0;
};

// One block of a MultiRead.
struct NvmeReadRequest {
  absl::string_view key;
  absl::Span<char> dest;  // exactly the block's size
  // When set, receives on success the checksum the bytes were verified
  // against: the block's as stored when the read began. A caller that took
  // size and checksum from Meta earlier publishes this one, not Meta's: the
  // block may have been replaced meanwhile (deleted, then put again with
  // other bytes of the same size).
  uint64_t* checksum = nullptr;
};

enum class NvmePutOutcome {
  kStored,          // the block was written
  kAlreadyPresent,  // the key was already stored; nothing was written
};

class NvmeTier {
 public:
  NvmeTier() = default;
  NvmeTier(const NvmeTier&) = delete;
  NvmeTier& operator=(const NvmeTier&) = delete;
  // Persists read counts and recency, flushes the memtables (so every block
  // put so far survives a restart; not while the disk stays full, see
  // above) and closes the database. Errors are dropped; call Flush first to
  // see them.
  // REQUIRES: no call to this tier is in flight.
  virtual ~NvmeTier() = default;

  // Stores `bytes` as block `key` of namespace `ns`, unless the key is already
  // stored (put-if-absent: an existing block is never overwritten; it just
  // becomes the most recently used). `parent` is the previous block of the
  // key's chain, empty for a root; it need not be stored (yet). Evicts blocks
  // (see above) until the block fits. `checksum` is verified against `bytes` before anything is
  // written.
  // Returns InvalidArgument for a bad namespace, key or parent (see
  // block_key.h), empty bytes, more than max_block_bytes, or a checksum that
  // does not match; ResourceExhausted when the block can never fit (its
  // charge exceeds capacity_bytes) or puts in flight hold the space it needs;
  // Unavailable when RocksDB fails the write (disk full, I/O error) or is not
  // accepting writes after such a failure. On any error nothing was stored
  // and no block was evicted.
  virtual absl::StatusOr<NvmePutOutcome> Put(absl::string_view ns,
                                             absl::string_view key,
                                             absl::string_view parent,
                                             absl::string_view bytes,
                                             uint64_t checksum) = 0;

  // True if the block is stored (a put in flight is not yet). Reads no bytes
  // and does not change recency. False for a bad namespace or key.
  virtual bool Contains(absl::string_view ns, absl::string_view key) = 0;

  // The block's metadata, from memory. Does not change recency. NotFound if
  // absent; InvalidArgument for a bad namespace or key.
  virtual absl::StatusOr<NvmeBlockMeta> Meta(absl::string_view ns,
                                             absl::string_view key) = 0;

  // Reads the block into `dest` and verifies its checksum; on success the
  // block becomes the most recently used and its read count goes up.
  // REQUIRES: dest.size() is the block's size (see Meta).
  // Returns NotFound if absent (also when its bytes turn out to be missing:
  // the block is then dropped); InvalidArgument for a bad namespace or key or
  // a wrong dest size; DataLoss when the bytes fail their checksum, RocksDB
  // reports them corrupt, their blob file is gone, or they cannot be read
  // (EIO, tried twice) and a read of them failed so before: the block is
  // dropped and counted in integrity_errors; Unavailable for an EIO that is
  // the block's first (tried twice; the block stays, see
  // NvmeTierStats::unreadable_kept), an EIO while many blocks fail
  // (NvmeTierStats::read_error_burst; the block stays) and other errors (out
  // of file descriptors or memory: the block stays). On any error the
  // contents of `dest` are unspecified and must not be used.
  virtual absl::Status Read(absl::string_view ns, absl::string_view key,
                            absl::Span<char> dest) = 0;

  // Read() for several blocks of one namespace, all as of one moment (one
  // RocksDB snapshot), fetched with RocksDB MultiGets of at most 32 MiB of
  // blocks each (a larger block alone): RocksDB holds a heap copy of what
  // a MultiGet returns until it is copied to `dest`, so the heap holds a
  // chunk's bytes, never the batch's. Returns one status per request, in
  // order, with Read's meaning; for each one that succeeds, sets *checksum
  // when the request asks (see NvmeReadRequest). Meant for the engine's
  // background threads (it blocks on the disk).
  virtual std::vector<absl::Status> MultiRead(
      absl::string_view ns, absl::Span<const NvmeReadRequest> requests) = 0;

  // Deletes the block. NotFound if absent; InvalidArgument for a bad
  // namespace or key. Once this returns, the block is not served, even when
  // RocksDB failed to delete its records (the error is returned; such
  // records come back after a restart and are checked like any other). On
  // success the delete is in the WAL (with or without use_wal): the block
  // stays deleted after a crash of the process.
  virtual absl::Status Delete(absl::string_view ns, absl::string_view key) = 0;

  // Calls `fn` for every stored block (for the engine to rebuild its
  // accounting after a restart), in no particular order.
  // REQUIRES: `fn` does not call into this tier (the index lock is held).
  virtual void ForEachBlock(
      absl::FunctionRef<void(const NvmeBlockView&)> fn) = 0;

  virtual NvmeTierStats Stats() = 0;

  // Scrubs the tier: reads every stored block's bytes, verifies them against
  // their checksums, and drops blocks that fail or cannot be read (counted
  // in integrity_errors; an I/O error as in Read: the first marks the block,
  // the next drops it), blocks whose bytes are missing and bytes that have
  // no metadata. Other
  // calls may run meanwhile: blocks they delete, evict or put during the
  // scan are neither reported nor held up (a put of an id the scan drops
  // waits only for that delete). Returns what it found; Unavailable or DataLoss
  // when RocksDB cannot iterate the database (what was found until then has
  // been dropped already). Cancelled once `cancelled` returns true (asked
  // before each block: the caller gave up) or StopMaintenance ran.
  virtual absl::StatusOr<NvmeVerifyReport> Verify(
      std::function<bool()> cancelled = nullptr) = 0;

  // Compacts the database and garbage-collects every blob file, so that the
  // space of deleted and evicted blocks returns to the file system. Heavy:
  // rewrites live data. Runs beside RocksDB's own compactions, so puts and
  // deletes go on meanwhile. It writes the live blocks it relocates beside
  // the old files before those go, so it fits the room the file system has
  // (its free space less min_free_bytes and what the memtables hold): when
  // the tables and every live blob do not fit, each pass relocates only the
  // oldest blob files whose live blobs fit, over more passes (at most 20).
  // Returns FailedPrecondition, saying how many bytes a pass needs free and
  // how many are, when not even the oldest blob file (or a twentieth of
  // them) fits; before that, one pass that rewrites only the tables may have
  // run, to count the garbage of recent deletes (RocksDB counts a deleted
  // blob only once a compaction has dropped its reference), and no blob
  // file was written. A block whose bytes went bad on disk fails the
  // compaction that relocates it; the tier then scrubs (Verify: such blocks
  // are dropped and counted in integrity_errors) and compacts again. (An
  // automatic compaction that meets one does not stop writes either: the
  // tier scrubs in the background, at most every ten minutes.) Not so a
  // corrupt table file (small blocks and every key live in them): no scrub
  // mends it and every compaction of it fails, so it stops the tier's writes
  // for good with an error that says so (Stats().write_error; reads go on).
  // A blob the compaction cannot read (EIO, its file gone) is handled
  // likewise; when that scrub keeps blocks it met an I/O error on (their
  // first, see Read) and the compaction fails again, a second scrub drops
  // those that still fail, and the compaction runs once more. Unavailable on
  // another I/O error; when the compaction still fails after the scrubs,
  // its error (DataLoss for corruption that is not in a block's bytes).
  // `cancelled` (may be null), asked every 50 ms: once true (the caller
  // gave up), the compaction stops between files and Compact returns
  // Cancelled, so that it does not hold the one-at-a-time maintenance slot
  // for a caller that is gone.
  virtual absl::Status Compact(std::function<bool()> cancelled = nullptr) = 0;

  // For shutdown: cuts a Verify or Compact in progress short (they return
  // Cancelled; what a scrub dropped until then stays dropped, a compaction
  // stops between files) and refuses new ones with Cancelled. Puts, reads
  // and flushes go on. Thread-safe.
  virtual void StopMaintenance() = 0;

  // Persists read counts and recency and flushes the memtables: every block
  // stored before this call survives a crash after it returns.
  // Unavailable on an I/O error.
  virtual absl::Status Flush() = 0;

  // Makes every write made before this call durable: flushes the memtables
  // when writes made without the WAL (puts, and the deletes of the tier's
  // own evictions) wait for the flush timer; a no-op when none do (or with
  // the WAL). Puts begun before this call (whose evictions the caller may
  // not have seen listed) are waited for first, up to 10 s (Unavailable
  // then); later ones are not. An admin evict calls it before it answers,
  // so that blocks the tier evicted just before, which it no longer lists,
  // stay gone after a crash too. Unavailable when the database takes no
  // writes.
  virtual absl::Status MakeWritesDurable() = 0;

  virtual const NvmeTierOptions& options() const = 0;
};

// The bound NvmeTierOptions::max_blocks sets: `max_blocks`, or when 0,
// capacity_bytes / kNvmeDefaultBlockBytes (0 for a capacity under that:
// OpenNvmeTier refuses it).
uint64_t NvmeTierMaxBlocks(uint64_t capacity_bytes, uint64_t max_blocks);

// Opens (or creates) the tier at options.path and rebuilds its index from the
// metadata records; blocks over capacity_bytes (the capacity shrank since the
// last run) are evicted, least recently used first. `clock` paces write
// resumption after errors and measures the age of unflushed writes
// (max_unflushed_age); it must outlive the tier (nullptr means
// SystemClock()).
// Returns FailedPrecondition when capacity_bytes is 0 (the tier is disabled)
// or the directory holds a database of another format; InvalidArgument for
// an empty path, a max_unflushed_age or resume_stuck_after that is not
// positive, or a block bound (NvmeTierMaxBlocks) of 0; Unavailable when the
// directory cannot be created, opened or locked (e.g. read-only, or in use by
// another tier); DataLoss when RocksDB finds the database corrupt.
absl::StatusOr<std::unique_ptr<NvmeTier>> OpenNvmeTier(
    const NvmeTierOptions& options, Clock* clock);

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_NVME_TIER_H_
