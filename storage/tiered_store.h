// TieredStore: the storage engine behind every kvdepot operation. It decides
// admission, placement, pinning and eviction; the gRPC service is a thin
// adapter over it and never sees tiers. Today the store has a DRAM tier; the
// NVMe tier plugs in behind this same interface.
//
// Semantics (see DESIGN.md):
//  * A block is an immutable byte string under (namespace, key). A put of an
//    existing key is an idempotent no-op (put-if-absent).
//  * Sessions hold leases; pins and reservations belong to a session and are
//    released when it closes or expires. kInternalSession owns pins and
//    reservations of in-process callers (a gRPC stream handler), which must
//    release them themselves; it never expires.
//  * Readers never see a partial block: bytes are written into a reserved
//    slot and published by CommitPut after their checksum is verified.
//
// Thread-safe: every method may be called from any thread.
#ifndef KVDEPOT_STORAGE_TIERED_STORE_H_
#define KVDEPOT_STORAGE_TIERED_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "storage/clock.h"
#include "storage/dram_arena.h"

namespace rocksdb {
class Env;
}  // namespace rocksdb

namespace kvdepot {

using SessionId = uint64_t;
using PinId = uint64_t;
using ReservationId = uint64_t;

inline constexpr SessionId kInternalSession = 0;

enum class Tier : uint8_t { kNone = 0, kDram = 1, kNvme = 2 };
const char* TierName(Tier tier);  // "dram", "nvme", or "none"

struct StoreOptions {
  uint64_t dram_capacity = uint64_t{1} << 30;
  HugePageMode hugepages = HugePageMode::kAuto;
  // Touch all DRAM at start (see DramArena::Create).
  bool prefault_dram = false;
  // Largest block accepted (also bounded by the DRAM capacity).
  uint64_t max_block_bytes = uint64_t{256} << 20;
  // Most blocks each tier holds: a bound on the in-memory indexes' heap,
  // which grows with the number of blocks, not with their bytes (without
  // it, a flood of 1-byte blocks made the indexes several times the size of
  // the tiers). It is a least charge per block, so the capacity-driven
  // eviction enforces it: in DRAM every block's bytes take at least
  // dram_capacity / dram_max_blocks of the arena (rounded up to the arena's
  // size class: DramBlockFloor), on NVMe every block is charged at least
  // nvme_capacity / nvme_max_blocks against nvme_capacity
  // (NvmeTierOptions::max_blocks). Blocks that large or larger are
  // unaffected; block sizes reported to clients, namespace quotas and
  // namespace bytes stay the blocks' real sizes.
  // 0 derives the default: dram_capacity / 4 KiB and nvme_capacity / 16 KiB
  // (a real engine's KV block is at least that: a 16-token vLLM block of
  // Llama-3-8B is 64 KiB per layer, 2 MiB for all layers; smaller blocks
  // still work, each taking more of the tier than its size). Worst-case
  // index memory then: about 116 bytes of heap per DRAM block (BlockIndex,
  // as metadata_footprint_test measures it), ~2.8% of the arena, and
  // 200-350 per NVMe block (NvmeTier), ~1.2-2.1% of nvme_capacity. See
  // DramMaxBlocks and NvmeMaxBlocks; NewTieredStore refuses a bound of 0.
  uint64_t dram_max_blocks = 0;
  uint64_t nvme_max_blocks = 0;
  // Most keys in one Lookup, BeginPut, Read or Evict.
  uint32_t max_batch_keys = 1024;
  // Background eviction starts above high and stops below low (fractions of
  // the DRAM capacity). A put that does not fit evicts synchronously.
  double high_watermark = 0.95;
  double low_watermark = 0.90;
  absl::Duration default_lease = absl::Seconds(30);
  absl::Duration min_lease = absl::Seconds(1);
  absl::Duration max_lease = absl::Hours(1);
  // Unknown namespaces are created by their first put when true.
  bool create_namespaces = true;
  // Namespaces that exist at once. When a new one would pass it, the store
  // first forgets the namespaces left empty: no block in either tier, no
  // put, lookup or admin call in progress in them, and not an operator's
  // (SetQuota declared it, whatever the quota: those stay). Past it, a put
  // into a new namespace fails with ResourceExhausted.
  uint32_t max_namespaces = 4096;
  uint32_t max_sessions = 65536;
  // Sessions open at once from one peer (OpenSession's `peer`: kvdepotd
  // names a client's host by its address), so that one host's clients
  // leaking sessions (a reconnect loop that never closes them) cannot take
  // every session of the daemon from the others.
  uint32_t max_sessions_per_peer = 16384;
  // Block references one session's live pins may hold (a pinned Lookup of n
  // keys adds up to n); a pinned lookup that could pass it fails with
  // ResourceExhausted until the client unpins. Pinned lookups still in
  // flight (waiting for their promotions) count with their n keys.
  uint32_t max_pinned_blocks_per_session = 65536;
  // Block references all live pins may hold together, those of every
  // session and of in-process callers (kInternalSession), handed-over ones
  // included; pinned lookups in flight count as above. A pinned lookup that
  // could pass it fails with ResourceExhausted. Each reference costs about
  // 9 bytes of heap: the default bounds pins' references to about 150 MiB.
  uint32_t max_pinned_blocks = uint32_t{1} << 24;
  // Pins (pinned lookups answered and not yet released) one session may
  // hold, and all sessions and in-process callers together: each pin costs
  // about 150 bytes of heap beside its references, so pins of one block
  // each, bounded by max_pinned_blocks alone, could take 16 times what
  // that limit's comment says. A pinned lookup past either fails with
  // ResourceExhausted until pins are released (lookups in flight may pass
  // them by their number). In-process callers' pins (kInternalSession: a
  // gRPC Read stream's, one at a time) count in max_pins but are not
  // refused by it. The defaults bound pins to about 150 MiB.
  uint32_t max_pins_per_session = 16384;
  uint32_t max_pins = uint32_t{1} << 20;
  // Run a background thread that evicts down to the low watermark.
  bool background_eviction = true;

  // NVMe tier (storage/nvme_tier.h): RocksDB in nvme_path, bounded by
  // nvme_capacity bytes; 0 turns it off. Blocks the background evictor
  // takes out of DRAM are written there (demotion); a pinned lookup of a
  // block only there reads it back into DRAM first (promotion).
  std::string nvme_path;
  uint64_t nvme_capacity = 0;
  bool nvme_use_wal = false;
  // Without the WAL, blocks demoted to NVMe reach its files (survive a
  // crash) within about this long (NvmeTierOptions::max_unflushed_age).
  absl::Duration nvme_max_unflushed_age = absl::Seconds(5);
  // Read NVMe blocks with O_DIRECT (NvmeTierOptions::direct_reads).
  bool nvme_direct_reads = false;
  // Admission: 0 writes every block leaving DRAM to NVMe; N > 0 only those
  // looked up at least N times while in DRAM (spares flash endurance).
  uint32_t nvme_admit_min_reads = 0;
  uint64_t nvme_write_buffer_size = uint64_t{16} << 20;
  // The NVMe tier's RocksDB environment (NvmeTierOptions::env); null is
  // the default. Borrowed. Tests pass a fault-injecting one.
  rocksdb::Env* nvme_env = nullptr;
  // Threads that read NVMe blocks back into DRAM for pinned lookups.
  int promotion_threads = 2;
  // Blocks waiting to be promoted, across all lookups (a bound on the
  // promotion threads' queue, and so on the memory and the pins queued
  // lookups hold). Past it, a pinned lookup reports a block found only on
  // NVMe as a miss (StoreStats::promotions_shed): under more load than the
  // disk can read, clients recompute rather than wait in a growing queue.
  uint32_t max_queued_promotions = 16384;
};

struct SessionGrant {
  SessionId id;
  absl::Duration lease;
};
struct SessionRelease {
  uint32_t pins_released = 0;
  uint32_t reservations_aborted = 0;
};

struct LookupEntry {
  bool found = false;
  Tier tier = Tier::kNone;  // where the bytes are now
  uint64_t size = 0;
  uint64_t checksum = 0;
  uint64_t offset = 0;  // DRAM arena offset of the bytes (valid while pinned)
  // Found only on NVMe and read into DRAM by this (pinned) lookup: `tier`
  // says kDram, but the hit is the NVMe tier's (TierStats::hits counts it
  // there, and so should anyone counting hits by tier).
  bool promoted = false;
  // A miss of a pinned lookup for a block the NVMe tier holds, which could
  // not be read into DRAM now (no room: DRAM full of pinned or reserved
  // blocks; the promotion queue full; or its bytes failed their check).
  bool on_nvme = false;
};
struct LookupResult {
  std::vector<LookupEntry> entries;  // one per key asked
  uint32_t prefix_hits = 0;          // leading keys found
  PinId pin_id = 0;                  // 0 when nothing was pinned
  // The namespace exists (it has blocks, or was created or given a quota,
  // and was not forgotten since: see StoreOptions::max_namespaces): false
  // for lookups in names nothing was ever stored under.
  bool namespace_known = false;
};

struct PutSpec {
  absl::string_view key;
  absl::string_view parent;  // empty for a chain's first block
  uint64_t size = 0;
};
struct PutSlot {
  bool exists = false;  // already stored: nothing to write
  // With exists: the index of the earlier slot of the batch that names the
  // same key, or -1 (stored before the batch). Its bytes are that slot's, so
  // its outcome is too: a transfer or commit that fails for that slot fails
  // for this one (CommitPut answers kChecksumMismatch for both).
  int repeat_of = -1;
  uint64_t offset = 0;  // arena offset of the slot's bytes
  uint64_t size = 0;
};
struct Reservation {
  ReservationId id = 0;  // 0 when every key already exists
  std::vector<PutSlot> slots;
};
enum class CommitOutcome { kStored, kAlreadyExists, kChecksumMismatch };

// What DropCorruptDram found and did.
enum class CorruptDramCheck {
  kDropped,         // the DRAM copy was bad: dropped
  kKept,            // bad, but pinned or being demoted: hidden from lookups
                    // now, dropped once neither (RetryCorruptDrops)
  kDroppedAlready,  // as kDropped, found bad by an earlier call already
  kKeptAlready,     // as kKept, found bad by an earlier call already
  kNotCorrupt,      // not in DRAM, another block, or its bytes are good
};

struct EvictResult {
  uint64_t evicted_blocks = 0;
  uint64_t evicted_bytes = 0;
  std::vector<std::string> pinned_keys;
  uint64_t pinned_blocks = 0;
  uint64_t missing_keys = 0;
};

// What TieredStore::Inspect reports about one block.
struct BlockDetails {
  bool in_dram = false;
  bool in_nvme = false;
  uint64_t size = 0;
  uint64_t checksum = 0;
  uint32_t pins = 0;
  uint32_t cached_children = 0;
  absl::Duration age;  // since it entered DRAM; zero when not in DRAM
  uint32_t dram_reads = 0;
  uint32_t nvme_reads = 0;
  std::string parent;  // from the NVMe copy's record
};

struct TierStats {
  uint64_t used_bytes = 0;  // space taken by blocks, keys and reservations
  uint64_t capacity_bytes = 0;
  uint64_t blocks = 0;
  // Keys lookups answered as found in this tier: where the block was when
  // looked up (a block a pinned lookup promoted is an NVMe hit). The two
  // tiers' add up to StoreStats::lookup_hits.
  uint64_t hits = 0;
  uint64_t evictions = 0;        // to make room (capacity)
  uint64_t admin_evictions = 0;  // by Evict
};
struct NamespaceStats {
  std::string name;
  uint64_t blocks = 0;
  uint64_t bytes = 0;
  uint64_t lookups = 0;  // keys asked
  uint64_t hits = 0;
};
struct StoreStats {
  TierStats dram;
  TierStats nvme;  // all zero when the tier is off
  uint64_t demotions = 0;          // DRAM blocks written to NVMe
  uint64_t demotion_failures = 0;  // could not be written (disk full, ...)
  // Puts and promotions that waited the longest allowed (5 s) for the
  // evictor to make room in DRAM and then made room themselves (dropping
  // blocks) or failed: NVMe demotes too slowly for the write load.
  uint64_t room_wait_timeouts = 0;
  // DRAM blocks whose bytes no longer matched their checksum, counted once
  // each when first found: by a demotion (dropped, not written; not in
  // demotion_failures) or by DropCorruptDram (a reader found it).
  uint64_t dram_integrity_errors = 0;
  // DRAM copies dropped by DropCorruptDram (a reader found them bad).
  uint64_t dram_corrupt_evictions = 0;
  // Why the NVMe tier takes no writes now (NvmeTierStats::write_error);
  // empty when it does.
  std::string nvme_write_error;
  uint64_t demotions_skipped = 0;  // not admitted (read too rarely)
  // NVMe blocks read back into DRAM by pinned lookups. A prefix lookup's
  // promotion after its first miss counts too (it went to DRAM, where it
  // stays, unpinned), though the lookup does not answer it: a hit only
  // where counted in TierStats::hits.
  uint64_t promotions = 0;
  // NVMe blocks a pinned lookup reported as misses because
  // max_queued_promotions blocks were already waiting.
  uint64_t promotions_shed = 0;
  uint64_t sessions = 0;
  uint64_t pins = 0;           // live pins
  uint64_t pinned_blocks = 0;  // block references held by live pins
  uint64_t reservations = 0;
  // Of `reservations`, those of sessions (two-phase puts a client has yet
  // to commit or abort); the rest are in-process callers' (a Write stream
  // storing one block).
  uint64_t session_reservations = 0;
  uint64_t reserved_bytes = 0;
  uint64_t lookup_keys = 0;
  uint64_t lookup_hits = 0;
  uint64_t puts = 0;
  uint64_t put_bytes = 0;
  uint64_t integrity_errors = 0;  // NVMe blocks that failed their checksum
  uint64_t nvme_write_bytes = 0;  // block bytes written to the NVMe tier
  bool draining = false;
  std::vector<NamespaceStats> namespaces;
};

// Where the DRAM tier's bytes live (for the data plane and byte path).
struct DramRegion {
  char* base = nullptr;
  uint64_t size = 0;
};

// Write access to one reserved slot; see TieredStore::AcquireSlot. A slot
// has at most one live handle: its one writer.
class SlotHandle {
 public:
  virtual ~SlotHandle() = default;
  virtual absl::Span<char> bytes() const = 0;
  // The block the slot is for: its key and namespace (as BeginPut got
  // them), looked up when asked (not every writer needs them).
  virtual std::string key() const = 0;
  virtual std::string ns() const = 0;
  // Hashes the slot's bytes now, for a writer whose bytes have just landed
  // and are likely still in cache, and returns their checksum: CommitPut
  // with that checksum takes the slot without hashing it again (with any
  // other, it refuses the slot, also without hashing it again), unless a
  // later handle of the slot voided the hash (see AcquireSlot). REQUIRES:
  // the bytes are final (no more writes through this handle).
  virtual uint64_t Checksum() = 0;
  // Copies the slot's bytes from `src` (bytes().size() of them), hashing
  // them on the way (CopyToMemoryWithChecksum: what is hashed is what is
  // written, whatever happens to `src` meanwhile); then as Checksum().
  virtual uint64_t CopyIn(const char* src) = 0;
  // CopyIn that stops once `deadline` has passed (checked first and before
  // every MiB): nullopt then, and the slot is not verified (its commit
  // hashes it again, and fails unless the bytes happen to be right). For
  // a source in memory of another process that gives up at `deadline` and
  // may then reuse it (a co-located client's buffer).
  virtual std::optional<uint64_t> CopyInUntil(const char* src, absl::Time deadline) = 0;
};

// Receives the outcome of TieredStore::LookupAsync.
using LookupDone = absl::AnyInvocable<void(absl::StatusOr<LookupResult>) &&>;

class TieredStore {
 public:
  TieredStore() = default;
  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;
  virtual ~TieredStore() = default;

  // Opens a session; `lease` 0 means the default, others are clamped to
  // [min_lease, max_lease]. ResourceExhausted at max_sessions, or at
  // max_sessions_per_peer sessions open from `peer` (the client's host, as
  // the caller names it; empty: counted only against max_sessions).
  virtual absl::StatusOr<SessionGrant> OpenSession(
      absl::Duration lease, absl::string_view client_name,
      absl::string_view peer) = 0;
  absl::StatusOr<SessionGrant> OpenSession(absl::Duration lease,
                                           absl::string_view client_name) {
    return OpenSession(lease, client_name, absl::string_view());
  }
  // Renews the lease. NotFound if the session is unknown or expired.
  virtual absl::StatusOr<absl::Duration> KeepAlive(SessionId session) = 0;
  // NotFound if unknown; otherwise releases its pins and reservations.
  virtual absl::StatusOr<SessionRelease> CloseSession(SessionId session) = 0;
  // Ends every session whose lease has run out (called periodically).
  // Returns how many ended.
  virtual int ExpireSessions() = 0;
  // Ends every open session, as CloseSession does (for a shutdown, once no
  // request is in flight: PersistDram then saves the blocks their pins
  // kept). Returns how many ended.
  virtual int EndAllSessions() = 0;
  // True while `session` is open: not closed, and its lease has not run
  // out (an expired session is gone at once, before ExpireSessions ends it).
  virtual bool HasSession(SessionId session) = 0;
  // OK while reservation `id` of `session` is open (a slot written after
  // its reservation ended went to memory being freed): NotFound when the
  // session is gone (closed, or its lease ran out), InvalidArgument when the
  // reservation ended on its own (committed, aborted) or is unknown.
  virtual absl::Status CheckReservation(SessionId session, ReservationId id) = 0;

  // Looks up `keys` of namespace `ns`. With `prefix`, stops at the first miss.
  // With `pin`, pins the hits atomically with the lookup (REQUIRES a live
  // session or kInternalSession); a key named more than once is pinned once
  // (its entries all report that block). InvalidArgument for a bad
  // namespace or key or a batch over max_batch_keys; NotFound for an
  // unknown or expired session; ResourceExhausted when the session's pins
  // could pass max_pinned_blocks_per_session, or all pins max_pinned_blocks
  // (each counts the lookup's distinct keys). A block pinned 2^32 - 1 times
  // already is a miss of a pinned lookup.
  //
  // A pinned lookup of blocks found only on the NVMe tier reads them into
  // DRAM first (promotion), with one batched read; a block that cannot be
  // promoted (it fails its checksum, DRAM has no room, or its namespace's
  // quota has none left once the namespace's unpinned blocks are evicted:
  // see SetQuota; or max_queued_promotions blocks are waiting already) is a
  // miss. This call waits for that; servers use LookupAsync.
  absl::StatusOr<LookupResult> Lookup(SessionId session, absl::string_view ns,
                                      absl::Span<const absl::string_view> keys,
                                      bool prefix, bool pin);
  // Lookup that never blocks the caller on the disk: when a promotion is
  // needed, it runs on the store's promotion threads and `done` is called
  // there; otherwise `done` is called on the calling thread before
  // LookupAsync returns. `keys` need only live until LookupAsync returns.
  virtual void LookupAsync(SessionId session, absl::string_view ns,
                           absl::Span<const absl::string_view> keys,
                           bool prefix, bool pin, LookupDone done) = 0;
  // LookupAsync (not a prefix lookup) of keys that a lookup the statistics
  // counted already asked for (a Read of the blocks its Lookup found): the
  // same, but not counted again in the lookup and hit statistics (Stats'
  // lookup_keys, lookup_hits, tier hits, and the namespaces' lookups and
  // hits).
  virtual void RepeatLookupAsync(SessionId session, absl::string_view ns,
                                 absl::Span<const absl::string_view> keys,
                                 bool pin, LookupDone done) = 0;
  // InvalidArgument for an unknown pin or one of another session; NotFound
  // when the session itself is gone (its pins went with it). Returns the
  // number of blocks released.
  virtual absl::StatusOr<uint32_t> Unpin(SessionId session, PinId pin) = 0;
  // Hands `session`'s `pin` over to kInternalSession: it no longer ends
  // with the session, but its blocks still count against the session's
  // max_pinned_blocks_per_session until it is released (the session's
  // transfers hold it); the caller releases it with Unpin(kInternalSession,
  // pin). Errors as Unpin's.
  virtual absl::Status HandOverPin(SessionId session, PinId pin) = 0;

  // Reserves DRAM space for `blocks` (EXISTS for keys stored in either
  // tier: a block kept only on NVMe is stored, put-if-absent). Keys stored
  // already cost nothing: they are not charged to the quota, nothing is
  // evicted for them, and making room for the others never evicts them; a
  // batch of stored keys only is a no-op (no reservation, id 0) whatever its
  // size, and creates no namespace. Evicts as needed for the others;
  // ResourceExhausted when nothing evictable makes room (nothing is
  // reserved then, and an unknown namespace is not created). A batch that
  // no eviction could make room for (more than the free space and the
  // unpinned blocks' space together) fails before evicting anything; one
  // refused for fragmentation only (the space exists, but not in pieces
  // that fit) may still have evicted blocks: about as many bytes as it
  // needed, before it finds that blocks no eviction frees (pinned,
  // reserved) lie in every run of pages that could hold one of its blocks
  // (ResourceExhausted, "fragmented"; a batch being reserved or committed
  // meanwhile is not seen, and evicting then goes on). InvalidArgument for bad
  // keys, sizes (0 or above max_block_bytes) or batch size, and for a key
  // stored (in either tier) with another size than the batch names, or named
  // twice in the batch with two sizes (nothing is reserved then; a key named
  // twice with one size is put once, by its first slot: the later ones are
  // answered `exists` with `repeat_of`, and their commit gives the first
  // slot's outcome: kAlreadyExists once it is stored);
  // NotFound for an unknown or expired session (before anything else is
  // checked but the arguments: a client whose session is gone learns that,
  // and opens a new one, even while the store drains); FailedPrecondition
  // while draining.
  // With an NVMe tier and its evictor, a batch that does not fit now waits
  // (up to 5 s) for the evictor, and for pins and reservations to end,
  // before it charges the quota or drops anything; then ResourceExhausted.
  // The evictor demotes room for it, past the low watermark where the
  // batch needs more (a block larger than the room that leaves, or an
  // arena too fragmented for it); blocks are dropped instead only when
  // nothing is left to demote or the wait is over.
  // With `would_wait` (a caller that must not block): where making room
  // would wait (DRAM full, or the namespace at its quota, whose room is
  // made by demoting on the caller's thread; NVMe tier on), returns
  // Unavailable at once with
  // *would_wait set, having reserved nothing (a batch larger than the DRAM
  // tier: ResourceExhausted as above).
  virtual absl::StatusOr<Reservation> BeginPut(
      SessionId session, absl::string_view ns,
      absl::Span<const PutSpec> blocks, bool* would_wait = nullptr) = 0;
  // Writable bytes of one slot (the gRPC byte path fills slots through it).
  // A slot has one writer at a time: Aborted while another handle of the
  // same slot lives (a conflict: it may succeed once that handle goes). A
  // new handle voids any earlier hash of the slot (SlotHandle::Checksum,
  // CopyIn): bytes possibly rewritten after it are hashed again by
  // CommitPut, unless this handle hashes them. While the returned handle
  // lives, the slot's memory stays allocated even if the reservation is
  // aborted or its session expires (it is freed when the handle goes), and
  // CommitPut of the reservation fails with Aborted. InvalidArgument for an
  // unknown reservation or slot, or an EXISTS slot; NotFound when the
  // session is gone (its reservations went with it), as for CommitPut and
  // AbortPut.
  virtual absl::StatusOr<std::unique_ptr<SlotHandle>> AcquireSlot(
      SessionId session, ReservationId id, uint32_t slot) = 0;
  // Verifies and publishes every non-EXISTS slot; `checksums` has one entry
  // per block of the BeginPut. A slot whose key was stored meanwhile (in
  // DRAM, or already demoted to NVMe) is kAlreadyExists and not published.
  // The reservation ends either way (slots that fail are freed).
  // InvalidArgument for an unknown reservation or a wrong number of
  // checksums (the reservation then stays open); Aborted while a
  // SlotHandle of the reservation lives (a write in progress must finish
  // first: a conflict to retry, not a refusal of the put; the reservation
  // stays open); NotFound when the session is gone (its reservations went
  // with it).
  virtual absl::StatusOr<std::vector<CommitOutcome>> CommitPut(
      SessionId session, ReservationId id,
      absl::Span<const uint64_t> checksums) = 0;
  // Frees the reservation's slots. InvalidArgument for an unknown one;
  // NotFound when the session is gone (closed, or its lease ran out).
  virtual absl::Status AbortPut(SessionId session, ReservationId id) = 0;

  // Drops the DRAM copy of `key` of `ns` if it is still the block with
  // `checksum` and its bytes no longer match it: memory corruption a reader
  // found (the daemon's in-place copy to a client, or a client that
  // reported a block it read). The bytes are hashed here again, so a report
  // that is wrong (a fault on the way, a client's bug) drops nothing; that
  // copy alone goes, never a block stored under the key since. An NVMe
  // copy, if any, stays. A bad copy is marked corrupt at once: lookups miss
  // it from then on (a promotion cannot replace it before it goes). One
  // that is pinned (the reader's own pin, another reader's) or being
  // demoted is kept (kKept) and listed, at most kMaxCorruptKept (past that
  // the oldest goes unlisted, and leaves when evicted or demoted, unwritten);
  // RetryCorruptDrops drops it once it is neither. The *Already outcomes
  // are for a copy an earlier call found bad (the first is the one to count).
  // kNotCorrupt, and nothing dropped, when it is not in DRAM, is another
  // block (another checksum) or is not bad.
  virtual CorruptDramCheck DropCorruptDram(absl::string_view ns,
                                           absl::string_view key,
                                           uint64_t checksum) = 0;
  static constexpr size_t kMaxCorruptKept = 64;
  // Drops the bad DRAM copies DropCorruptDram kept that are no longer
  // pinned or being demoted (called periodically); forgets those gone.
  // Hashes nothing. Returns how many it dropped.
  virtual int RetryCorruptDrops() = 0;

  // Removes unpinned blocks: `keys`, or the whole namespace with `all`, from
  // both tiers. A block being demoted to NVMe is removed once it is there
  // (waiting up to 5 s; after that it is reported with the pinned ones); a
  // promotion of the namespace in flight finishes first (a block it pins
  // is reported pinned). A block is counted once, whichever tiers held it.
  // When the NVMe tier cannot make a delete durable (RocksDB stopped), the
  // other keys are still evicted and that error is the answer: the block
  // would come back after a restart.
  virtual absl::StatusOr<EvictResult> Evict(
      absl::string_view ns, absl::Span<const absl::string_view> keys,
      bool all) = 0;

  virtual StoreStats Stats() = 0;
  // NotFound when the block is in neither tier; InvalidArgument for a bad
  // namespace or key.
  virtual absl::StatusOr<BlockDetails> Inspect(absl::string_view ns,
                                               absl::string_view key) = 0;
  // A namespace's DRAM quota (0: none; the namespace is created if needed).
  // It bounds the bytes of the namespace's DRAM blocks plus those of its
  // open reservations (a reservation counts from BeginPut until its blocks
  // are published, or it ends) and of promotions in flight. BeginPut evicts
  // the namespace's least recently used unpinned blocks to stay within it,
  // for the blocks it does not have yet (demoting them to the NVMe tier
  // first when there is one, on the caller's thread, as the evictor would;
  // else dropping them), and fails with ResourceExhausted when that cannot
  // make room. A pinned Lookup's
  // promotion makes room the same way; a block it cannot make room for
  // stays on NVMe and is a miss of that lookup (as when DRAM is full).
  // Lowering the quota evicts nothing by itself: the next put or promotion
  // into the namespace does.
  virtual absl::Status SetQuota(absl::string_view ns, uint64_t max_bytes) = 0;
  // Takes back what SetQuota did: no quota, and no longer the operator's
  // (declared). An empty one (no block in either tier, nothing in
  // progress) is forgotten at once, so with create_namespaces off puts into
  // it are refused again; one with blocks, or in use at that moment, stays
  // (its blocks too) and is reclaimed like any other once empty, when the
  // table needs room (max_namespaces). With an NVMe tier this scans its
  // index for the namespace's blocks (an admin call). OK for a namespace
  // that does not exist.
  virtual absl::Status Undeclare(absl::string_view ns) = 0;
  // 0 when the namespace has none (or does not exist).
  virtual uint64_t Quota(absl::string_view ns) = 0;
  virtual std::vector<NamespaceStats> ListNamespaces() = 0;

  // Evicts down to the low watermark if above the high one. Returns the
  // number of blocks evicted. (The background thread calls this too.)
  virtual uint64_t RunEviction() = 0;
  // Refuses new reservations with FailedPrecondition from now on; existing
  // ones may still commit.
  virtual void SetDraining(bool draining) = 0;
  // Writes every unpinned DRAM block to the NVMe tier and flushes it (for a
  // clean shutdown, after EndAllSessions: a restarted store serves them)
  // that the admission policy admits (nvme_admit_min_reads: the others are
  // dropped, as the evictor would). Returns how many were written;
  // FailedPrecondition when there is no NVMe tier.
  virtual absl::StatusOr<uint64_t> PersistDram() = 0;

  // Scrubs the NVMe tier (see NvmeTier::Verify) / compacts it.
  // FailedPrecondition when there is no NVMe tier.
  struct VerifyReport {
    uint64_t blocks_checked = 0, bytes_checked = 0, corrupt_dropped = 0,
             missing_dropped = 0, orphans_dropped = 0;
  };
  // `cancelled`: see NvmeTier::Verify.
  virtual absl::StatusOr<VerifyReport> VerifyNvme(
      std::function<bool()> cancelled = nullptr) = 0;
  // `cancelled`: see NvmeTier::Compact.
  virtual absl::Status CompactNvme(
      std::function<bool()> cancelled = nullptr) = 0;
  // For shutdown: VerifyNvme and CompactNvme in progress end early and new
  // ones fail, with Cancelled (NvmeTier::StopMaintenance). A no-op without
  // an NVMe tier.
  virtual void StopNvmeMaintenance() = 0;

  virtual DramRegion dram_region() const = 0;
  virtual const StoreOptions& options() const = 0;
};

// The block size dram_max_blocks assumes by default (StoreOptions).
inline constexpr uint64_t kDramDefaultBlockBytes = uint64_t{4} << 10;

// The DRAM tier's block bound: options.dram_max_blocks, or when 0,
// dram_capacity / kDramDefaultBlockBytes.
uint64_t DramMaxBlocks(const StoreOptions& options);
// The NVMe tier's block bound: options.nvme_max_blocks, or when 0,
// nvme_capacity / kNvmeDefaultBlockBytes (NvmeTierMaxBlocks); 0 without an
// NVMe tier (nvme_capacity 0).
uint64_t NvmeMaxBlocks(const StoreOptions& options);
// The least arena space a DRAM block's bytes take: dram_capacity /
// DramMaxBlocks rounded up, then to its arena size class
// (DramArena::AllocationSize). REQUIRES: DramMaxBlocks(options) > 0.
uint64_t DramBlockFloor(const StoreOptions& options);

// Creates the store. `clock` must outlive it. InvalidArgument for
// inconsistent options (among them a block bound of 0: a dram_capacity
// under kDramDefaultBlockBytes, an nvme_capacity under
// kNvmeDefaultBlockBytes, with no explicit bound); ResourceExhausted when the
// DRAM tier cannot be mapped; the NVMe tier's errors when it cannot be opened
// (in use, not writable).
absl::StatusOr<std::unique_ptr<TieredStore>> NewTieredStore(
    const StoreOptions& options, Clock* clock);

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_TIERED_STORE_H_
