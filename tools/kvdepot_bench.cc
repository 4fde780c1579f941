// kvdepot-bench: a load generator for kvdepotd's block API.
//
//   kvdepot-bench --server 127.0.0.1:50551 --op get|put|lookup
//                 [--transport ucx|grpc] [--block-size 256KiB] [--clients 4]
//                 [--duration 5 | --count 10000] [--keys N] [--batch N]
//                 [--depth N] [--ns bench] [--clear-ns] [--verify 64] [--json]
//
// Each client is a thread with its own kvdepot::Client (its own channel, so
// its own TCP connection). --transport ucx (the default) moves blocks over
// the UCX data plane: each client registers one buffer for its gets and one
// for its puts, and a call is one GetIntoAsync / PutFromAsync (one round
// trip; the daemon writes into / reads from the registered buffer), with
// up to --depth calls in flight per client (default 1: issue, wait, issue;
// with more, each call has its own part of the buffer and a new call is
// issued as soon as the oldest one is ready, as an engine overlapping its
// loads would). When the daemon has no data plane or cannot reach the
// client, it warns and falls back to grpc: Get / Put over the byte streams,
// one call at a time. The ops:
//   get     reads --batch (default 1) distinct random keys of the working set
//           per Get call and checks every block's size (the client library
//           already verifies its checksum). The working set (--keys blocks)
//           is stored first, untimed; keys already stored by an earlier run
//           are not sent again.
//   put     writes --batch (default 1) new blocks per Put call: unique keys
//           (run nonce + client id + counter) of --block-size bytes,
//           prepared once and stamped with their key before each call.
// Every block holds its own content: one pseudo-random body (seeded by the
// block size) with a stamp of its key at its start, middle and end. After
// the timed window, get and put runs read a sample of --verify blocks
// (default 64) back over each client's transport, into memory poisoned
// first, and compare them byte for byte: a block read under the wrong key,
// or a copy that never happened, fails the run (exit 1; "verify" in the
// JSON).
//   lookup  looks up --batch (default 64) random keys of the working set per
//           call; every key must be found. With --prefix, as a prefix
//           lookup (all of them must be the hit prefix); with --pin, the
//           hits are pinned (a session per client) and unpinned at once,
//           as a get would: an op is then the Lookup and its Unpin, two
//           round trips, and both the latencies and keys/s count the two.
// With --clear-ns, every unpinned block of the namespace is evicted first
// (untimed, before the working set is stored): a run then starts from an
// empty namespace, not from a DRAM tier filled by earlier put runs.
// An op is a block for get and put (a call moves --batch of them) and a call
// for lookup. A failed call (an error status, a wrong count or size, a lookup
// miss, a synchronous put answered "already exists") counts all its ops as
// errors and is left out of the latencies. (PutFromAsync, the UCX path,
// reports a block that already exists as stored; put keys carry a per-run
// nonce, so a put never meets an existing key.)
//
// Every call's latency is recorded (a vector per thread, merged at the end)
// and reported as p50/p99/p999 (nearest rank): latencies are per call, not
// per block. With --depth > 1 a call's latency runs from its issue to when
// the client sees it ready, after the calls issued before it. Throughput is ops over the wall time from the common start to
// the last client's end; GB/s is block size x ops / 1e9 for get and put
// (decimal GB) and 0 for lookup, where no block bytes move (it reports keys/s
// instead). calls/s is reported for every op.
//
// Output: one human-readable line on stdout; with --json, one JSON object on
// stdout and the human line on stderr (its last line). Exit codes: 0 when
// every op succeeded and every block read back matched, 1 when any failed,
// a block read back differed or the daemon cannot be reached, 2 for a usage
// error.
#include <malloc.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/cli_output.h"
#include "client/client.h"
#include "storage/process_tuning.h"
#include "storage/sizes.h"
#include "tools/bench_tally.h"

namespace kvdepot {
namespace {

// Latencies are taken from a monotonic clock (absl::Now follows the wall
// clock, which may be stepped while a run is in progress).
using SteadyClock = std::chrono::steady_clock;

// The working set's default size: about this many bytes, 1..1024 keys.
constexpr uint64_t kDefaultWorkingSetBytes = uint64_t{256} << 20;
// Most bytes stored by one Put call while pre-populating.
constexpr uint64_t kPopulateBatchBytes = uint64_t{64} << 20;
// Largest batch a Lookup, Get or Put may carry (the daemon's default
// max_batch_keys).
constexpr int kMaxLookupBatch = 1024;
// --batch defaults: keys per lookup call, blocks per get or put call.
constexpr int kDefaultLookupBatch = 64;
constexpr int kDefaultBlockBatch = 1;
// Error messages printed per client before going quiet.
constexpr int kMaxReportedErrors = 3;

enum class Op { kGet, kPut, kLookup };

struct BenchConfig {
  std::string server;
  std::string op_name;
  Op op = Op::kGet;
  uint64_t block_size = 0;
  int clients = 1;
  double duration_s = 0;  // > 0: bounded by time
  uint64_t count = 0;     // > 0: bounded by the total number of ops
  uint64_t keys = 0;      // working set (get, lookup)
  int batch = 0;          // keys (lookup) or blocks (get, put) per call
  int depth = 1;          // UCX get/put calls in flight per client
  std::string ns;
  bool clear_ns = false;  // evict the namespace before the run
  bool json = false;
  bool ucx = true;  // --transport ucx (may fall back to grpc)
  bool prefix = false;  // lookup: prefix lookups
  bool pin = false;     // lookup: pin the hits, then unpin (timed as one op)
  bool client_checksums = false;  // ClientOptions::always_checksum_puts
  bool ucx_requests = true;       // ClientOptions::ucx_requests
  bool ucx_data_requests = false;  // ClientOptions::ucx_data_requests
  uint64_t verify = 64;  // get/put: blocks read back after the run
};

// What one client thread measured. Ops are blocks for get and put, calls for
// lookup; latencies are per call.
using ClientResult = CallTally;

// A block size (kvdepot::ParseSize syntax: 262144, 256KiB, 2MiB, 1.5MiB,
// 64KB...) of 1 byte..4 GiB.
absl::StatusOr<uint64_t> ParseBlockSize(absl::string_view text) {
  absl::StatusOr<uint64_t> n = ParseSize(text);
  if (!n.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad size \"", text, "\" (examples: 65536, 64KiB, 2MiB, 16MiB)"));
  }
  if (*n < 1 || *n > (uint64_t{1} << 32)) {
    return absl::InvalidArgumentError(
        absl::StrCat("size \"", text, "\" is out of range (1 byte..4GiB)"));
  }
  return n;
}

// Key i of the working set. The block size is part of the key, so working
// sets of several sizes can share one namespace.
std::string WorkingSetKey(uint64_t block_size, uint64_t i) {
  return absl::StrCat("ws/", block_size, "/", i);
}

std::string RandomBytes(uint64_t size, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string bytes(size, '\0');
  for (uint64_t off = 0; off < size; off += sizeof(uint64_t)) {
    const uint64_t word = rng();
    const size_t n = std::min<uint64_t>(sizeof(word), size - off);
    std::copy_n(reinterpret_cast<const char*>(&word), n, &bytes[off]);
  }
  return bytes;
}

// Block content. Every block is one pseudo-random body, seeded by the block
// size alone (runs against one daemon then agree on a working set an earlier
// run stored), with a 16-byte stamp naming its key written at its start,
// middle and end. Two keys' blocks differ, so a block read under the wrong
// key, or put from the wrong buffer, fails a byte-for-byte comparison; the
// stamps at three places also catch a block assembled from the wrong parts.
// Working-set blocks are made before the clock starts; a put block is the
// body copied into its buffer once (before the clock) and stamped just
// before its call is issued (48 bytes written, outside the call's latency).
constexpr size_t kStampBytes = 16;
constexpr uint64_t kBodySeed = 0x626f64792f6b7664ULL;
// Written over a destination before a verifying read: a block that was
// never copied in keeps it, and fails the comparison.
constexpr char kPoison = static_cast<char>(0xa5);

uint64_t Mix64(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

struct Stamp {
  uint64_t words[2];
};
static_assert(sizeof(Stamp::words) == kStampBytes, "a stamp is kStampBytes");

// The stamp of working-set key i (WorkingSetKey(block_size, i)).
Stamp WorkingSetStamp(uint64_t block_size, uint64_t i) {
  return Stamp{{Mix64(i ^ 0x77732f6b65790000ULL), Mix64(block_size)}};
}

// The stamp of put key `counter` of client `id` in the run whose nonce
// hashes to `nonce_hash`.
Stamp PutStamp(uint64_t nonce_hash, int id, uint64_t counter) {
  return Stamp{{Mix64(counter ^ 0x7075742f00000000ULL),
                Mix64(nonce_hash ^ (static_cast<uint64_t>(id) << 32))}};
}

std::string BlockBody(uint64_t block_size) {
  return RandomBytes(block_size, kBodySeed ^ block_size);
}

// Where a stamp goes in a block of `size` bytes: its start, middle and end
// (overlapping, and cut short, in blocks under 48 bytes).
std::array<uint64_t, 3> StampOffsets(uint64_t size) {
  const uint64_t tail = size >= kStampBytes ? size - kStampBytes : 0;
  const uint64_t middle = std::min((size / 2) & ~uint64_t{7}, tail);
  return {0, middle, tail};
}

// Writes `stamp` at StampOffsets in `block`.
void ApplyStamp(const Stamp& stamp, char* block, uint64_t size) {
  for (const uint64_t off : StampOffsets(size)) {
    std::memcpy(block + off, stamp.words, std::min<uint64_t>(kStampBytes, size - off));
  }
}

// Whether `block` carries `stamp` where ApplyStamp writes it: the check
// of every block a get brings in the timed window (48 bytes compared; the
// whole block is compared in the read-back after it).
bool HasStamp(const Stamp& stamp, const char* block, uint64_t size) {
  for (const uint64_t off : StampOffsets(size)) {
    if (std::memcmp(block + off, stamp.words,
                    std::min<uint64_t>(kStampBytes, size - off)) != 0) {
      return false;
    }
  }
  return true;
}

// The bytes a block stamped with `stamp` must hold, into `*out`.
void ExpectedBlock(const std::string& body, const Stamp& stamp,
                   std::string* out) {
  out->assign(body);
  ApplyStamp(stamp, out->data(), out->size());
}

// With `*ucx`, also opens the client's UCX session; clears `*ucx` (with a
// warning) when blocks cannot move over UCX.
absl::StatusOr<std::unique_ptr<Client>> ConnectChecked(
    const BenchConfig& config, int id, bool* ucx) {
  ClientOptions options;
  options.server = config.server;
  options.always_checksum_puts = config.client_checksums;
  options.ucx_requests = config.ucx_requests;
  options.ucx_data_requests = config.ucx_data_requests;
  options.client_name = absl::StrCat("kvdepot-bench/", id);
  options.transport =
      *ucx ? ClientOptions::Transport::kUcx : ClientOptions::Transport::kGrpc;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  if (!client.ok()) return client.status();
  // Also opens the connection, so the first timed op does not pay for it.
  absl::Status health = (*client)->Health();
  if (!health.ok()) return health;
  if (*ucx) {
    absl::StatusOr<uint64_t> session = (*client)->EnsureSession();
    if (!session.ok()) return session.status();
    absl::Status data_plane = (*client)->data_plane_status();
    if (!data_plane.ok()) {
      std::fprintf(stderr,
                   "kvdepot-bench: warning: client %d falls back to grpc: %s\n",
                   id, data_plane.ToString().c_str());
      *ucx = false;
    }
  }
  return client;
}

// The first failed status of a ready op, or OK.
absl::Status FirstError(const TransferOp& op) {
  for (const absl::Status& s : op.statuses()) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Stores every key of the working set that the daemon does not hold yet,
// each with its own content (`body` stamped with its key's stamp). A key
// stored already is not checked here: the verification after the run reads
// a sample back and compares it.
absl::Status PopulateWorkingSet(Client& client, const BenchConfig& config,
                                const std::string& body) {
  const uint64_t per_put = std::clamp<uint64_t>(
      kPopulateBatchBytes / config.block_size, 1, kMaxLookupBatch);
  uint64_t stored = 0;
  for (uint64_t first = 0; first < config.keys; first += kMaxLookupBatch) {
    const uint64_t end =
        std::min<uint64_t>(config.keys, first + kMaxLookupBatch);
    std::vector<std::string> keys;
    for (uint64_t i = first; i < end; ++i) {
      keys.push_back(WorkingSetKey(config.block_size, i));
    }
    std::vector<absl::string_view> views(keys.begin(), keys.end());
    absl::StatusOr<LookupReply> found =
        client.Lookup(config.ns, views, /*prefix=*/false, /*pin=*/false);
    if (!found.ok()) return found.status();
    std::vector<uint64_t> missing;  // indexes into keys
    for (size_t i = 0; i < keys.size(); ++i) {
      const BlockInfo& e = found->entries[i];
      if (e.found && e.size == config.block_size) continue;
      if (e.found) {
        return absl::FailedPreconditionError(
            absl::StrCat("key ", keys[i], " is stored with ", e.size,
                         " bytes, not ", config.block_size));
      }
      missing.push_back(i);
    }
    std::vector<std::string> contents;
    std::vector<BlockToPut> blocks;
    for (size_t off = 0; off < missing.size(); off += per_put) {
      const size_t n = std::min<size_t>(per_put, missing.size() - off);
      contents.resize(n);
      blocks.resize(n);
      for (size_t j = 0; j < n; ++j) {
        const uint64_t i = missing[off + j];
        ExpectedBlock(body, WorkingSetStamp(config.block_size, first + i),
                      &contents[j]);
        blocks[j] = BlockToPut{keys[i], "", contents[j]};
      }
      absl::StatusOr<std::vector<PutResult>> put =
          client.Put(config.ns, absl::MakeConstSpan(blocks));
      if (!put.ok()) return put.status();
    }
    stored += missing.size();
  }
  if (stored > 0) {
    std::fprintf(stderr,
                 "kvdepot-bench: stored %llu of %llu working-set blocks\n",
                 static_cast<unsigned long long>(stored),
                 static_cast<unsigned long long>(config.keys));
  }
  return absl::OkStatus();
}

// What the read-back after the timed window found.
struct VerifyResult {
  uint64_t blocks = 0;    // blocks read back and compared
  uint64_t failures = 0;  // of them: missing, failed or with other bytes
  // Put keys not found (not in blocks): evicted since, as a put run that
  // writes more than the DRAM tier (and no NVMe tier) does by design.
  uint64_t evicted = 0;
};

// Runs one client's loop until the deadline or the shared op budget runs out.
// `claimed` counts ops taken from the budget by all clients (count mode).
class ClientLoop {
 public:
  // `client`, `config`, `run_nonce`, `body` and `claimed` must outlive the
  // loop.
  ClientLoop(int id, Client& client, bool ucx, const BenchConfig& config,
             const std::string& run_nonce, const std::string& body,
             std::atomic<uint64_t>& claimed)
      : id_(id),
        client_(client),
        ucx_(ucx),
        config_(config),
        run_nonce_(run_nonce),
        nonce_hash_(std::hash<std::string>()(run_nonce)),
        body_(body),
        claimed_(claimed),
        rng_(0x6b766465706f74ULL ^
             (static_cast<uint64_t>(id) * 0x9e3779b97f4a7c15ULL)) {}

  // Before the clock starts: the UCX buffer (AllocateBuffer makes all its
  // pages, which takes a while for large ones; done by every client while
  // others already ran, it slowed their first calls) and the put blocks:
  // over UCX the buffer's --depth x --batch blocks, over grpc --batch
  // blocks, each a copy of the body (DrawPutKeys stamps them).
  void Prepare() {
    if (ucx_ && config_.op != Op::kLookup) {
      ucx_buffer_ = client_.AllocateBuffer(config_.depth * config_.batch *
                                           config_.block_size);
      if (ucx_buffer_.ok() && config_.op == Op::kPut) {
        for (uint64_t off = 0; off < ucx_buffer_->size();
             off += config_.block_size) {
          std::copy(body_.begin(), body_.end(), ucx_buffer_->data() + off);
        }
      }
    } else if (config_.op == Op::kPut) {
      sync_put_blocks_.assign(config_.batch, body_);
    }
  }

  // After the timed window (every client's Run has returned): reads a
  // sample of about `sample` blocks back over this client's transport (over
  // UCX with GetIntoAsync into its registered buffer, poisoned first; over
  // grpc with Get), --batch per call, and compares each byte for byte with
  // the content it was given: for get, `sample` working-set keys spread
  // over the working set, from offset `slot` of `slots` (each client takes
  // its own); for put, the last `sample` keys this client put, the ones
  // most likely still stored (none when its run had errors: it failed
  // already); a put key not found is counted as evicted, not as a failure
  // (a run that writes more than the tiers hold evicts its first keys).
  // Prints the first few failures.
  VerifyResult Verify(uint64_t sample, uint64_t slot, uint64_t slots,
                      const ClientResult& run) {
    std::vector<std::string> keys;
    std::vector<Stamp> stamps;
    uint64_t last_index = 0;
    if (config_.op == Op::kGet) {
      // Indexes spread evenly over [0, keys): client `slot` of `slots`
      // takes every slots-th of slots x sample points.
      const uint64_t points = slots * sample;
      for (uint64_t j = 0; j < sample; ++j) {
        const uint64_t index = (j * slots + slot) * config_.keys / points;
        // Ascending: a repeat (more points than keys) follows its first.
        if (!keys.empty() && index == last_index) continue;
        last_index = index;
        keys.push_back(WorkingSetKey(config_.block_size, index));
        stamps.push_back(WorkingSetStamp(config_.block_size, index));
      }
    } else if (config_.op == Op::kPut && run.errors == 0 && counter_ > 0) {
      const uint64_t n = std::min<uint64_t>(sample, counter_);
      for (uint64_t j = 0; j < n; ++j) {
        const uint64_t counter = counter_ - n + j;
        keys.push_back(PutKey(counter));
        stamps.push_back(PutStamp(nonce_hash_, id_, counter));
      }
    }
    VerifyResult result;
    std::string expected;
    auto check = [&](size_t k, absl::Status st, absl::string_view got) {
      if (config_.op == Op::kPut && absl::IsNotFound(st)) {
        ++result.evicted;
        return;
      }
      ++result.blocks;
      if (st.ok()) {
        ExpectedBlock(body_, stamps[k], &expected);
        if (got.size() != expected.size()) {
          st = absl::DataLossError(
              absl::StrCat(got.size(), " bytes, expected ", expected.size()));
        } else if (got != expected) {
          uint64_t first = 0, differ = 0;
          for (size_t b = got.size(); b-- > 0;) {
            if (got[b] != expected[b]) {
              ++differ;
              first = b;
            }
          }
          st = absl::DataLossError(absl::StrCat(
              differ, " of ", got.size(),
              " bytes differ from what was stored under this key (first at "
              "offset ",
              first, ")"));
        }
      }
      if (st.ok()) return;
      if (result.failures < kMaxReportedErrors) {
        std::fprintf(stderr, "kvdepot-bench: verify: client %d: %s %s: %s\n",
                     id_, config_.op_name.c_str(), keys[k].c_str(),
                     st.ToString().c_str());
      }
      ++result.failures;
    };
    std::vector<absl::string_view> views(keys.begin(), keys.end());
    // A gRPC Get ends NOT_FOUND as a whole at its first miss: put keys
    // (some may be evicted) are read back one per call there.
    const size_t per_call =
        !ucx_ && config_.op == Op::kPut ? 1 : static_cast<size_t>(config_.batch);
    for (size_t off = 0; off < keys.size(); off += per_call) {
      const size_t n = std::min<size_t>(per_call, keys.size() - off);
      const auto call_keys = absl::MakeConstSpan(views).subspan(off, n);
      if (ucx_) {
        if (!ucx_buffer_.ok()) {
          for (size_t i = 0; i < n; ++i) {
            check(off + i, ucx_buffer_.status(), {});
          }
          continue;
        }
        std::vector<absl::Span<char>> spans;
        for (size_t i = 0; i < n; ++i) {
          char* p = ucx_buffer_->data() + i * config_.block_size;
          std::fill_n(p, config_.block_size, kPoison);
          spans.emplace_back(p, config_.block_size);
        }
        TransferOp op = client_.GetIntoAsync(config_.ns, call_keys, spans);
        op.Wait();
        for (size_t i = 0; i < n; ++i) {
          check(off + i, op.statuses()[i],
                absl::string_view(spans[i].data(), spans[i].size()));
        }
      } else {
        absl::StatusOr<std::vector<Block>> got =
            client_.Get(config_.ns, call_keys);
        for (size_t i = 0; i < n; ++i) {
          if (!got.ok()) {
            check(off + i, got.status(), {});
          } else if (got->size() != n) {
            check(off + i,
                  absl::DataLossError(absl::StrCat(
                      "get of ", n, " keys returned ", got->size(), " blocks")),
                  {});
          } else if ((*got)[i].key != keys[off + i]) {
            check(off + i,
                  absl::DataLossError(absl::StrCat(
                      "returned the block of key ", (*got)[i].key)),
                  {});
          } else {
            check(off + i, absl::OkStatus(), (*got)[i].bytes);
          }
        }
      }
    }
    return result;
  }

  ClientResult Run(SteadyClock::time_point deadline) {
    ClientResult result;
    const uint64_t calls_expected =
        config_.count > 0
            ? config_.count / OpsPerCall() / config_.clients + 1
            : uint64_t{1} << 16;
    result.latencies_us.reserve(calls_expected);
    if (config_.op == Op::kGet && config_.batch > 1) {
      perm_.resize(config_.keys);
      for (uint64_t i = 0; i < config_.keys; ++i) perm_[i] = i;
    }
    if (ucx_ && config_.op != Op::kLookup) {
      RunUcx(deadline, result);
    } else {
      RunSync(deadline, result);
    }
    return result;
  }

 private:
  // What one call takes from the --count budget: its blocks (get, put) or
  // itself (lookup).
  uint64_t OpsPerCall() const {
    return config_.op == Op::kLookup ? 1 : config_.batch;
  }

  // Blocks (get, put) or keys (lookup) in the next call; 0 when the run is
  // over. The last call of a --count run may carry fewer than --batch blocks,
  // so that exactly --count blocks move.
  size_t NextCall(SteadyClock::time_point deadline) {
    if (config_.count > 0) {
      const uint64_t before =
          claimed_.fetch_add(OpsPerCall(), std::memory_order_relaxed);
      if (before >= config_.count) return 0;
      if (config_.op == Op::kLookup) return config_.batch;
      return std::min<uint64_t>(config_.batch, config_.count - before);
    }
    return SteadyClock::now() >= deadline ? 0 : config_.batch;
  }

  // Fills keys[0, n) with random keys of the working set: distinct ones for
  // a get batch (perm_), possibly repeated ones otherwise (lookups).
  // `indexes`, when given, gets each key's working-set index.
  void DrawWorkingSetKeys(size_t n, std::vector<std::string>& keys,
                          std::vector<absl::string_view>& views,
                          std::vector<uint64_t>* indexes = nullptr) {
    std::uniform_int_distribution<uint64_t> pick(
        0, config_.keys > 0 ? config_.keys - 1 : 0);
    for (size_t i = 0; i < n; ++i) {
      uint64_t index;
      if (perm_.empty()) {
        index = pick(rng_);
      } else {
        // A partial Fisher-Yates shuffle of the working set's indexes.
        std::uniform_int_distribution<uint64_t> rest(i, perm_.size() - 1);
        std::swap(perm_[i], perm_[rest(rng_)]);
        index = perm_[i];
      }
      keys[i] = WorkingSetKey(config_.block_size, index);
      views[i] = keys[i];
      if (indexes != nullptr) (*indexes)[i] = index;
    }
  }

  // DataLoss for the first of `blocks` (got for working-set keys
  // `indexes`) that does not carry its key's stamp: another key's block,
  // or bytes that never came (the buffer held an earlier block).
  absl::Status CheckStamps(absl::Span<const absl::string_view> blocks,
                           const std::vector<uint64_t>& indexes,
                           const std::vector<std::string>& keys) const {
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (blocks[i].size() == config_.block_size &&
          !HasStamp(WorkingSetStamp(config_.block_size, indexes[i]),
                    blocks[i].data(), blocks[i].size())) {
        return absl::DataLossError(absl::StrCat(
            "get ", keys[i], ": the block does not carry its key's stamp"));
      }
    }
    return absl::OkStatus();
  }

  // Put key `counter` of this client.
  std::string PutKey(uint64_t counter) const {
    return absl::StrCat("put/", run_nonce_, "/", id_, "/", counter);
  }

  // Fills keys[0, n) and blocks[0, n) with new put keys over `bytes` (the
  // call's part of the UCX buffer; when empty, sync_put_blocks_), stamping
  // each block with its key's stamp (the only write to the put blocks in the
  // timed window: 3 x 16 bytes per block, before the call's clock starts).
  void DrawPutKeys(size_t n, std::vector<std::string>& keys,
                   std::vector<BlockToPut>& blocks,
                   absl::Span<const absl::Span<char>> bytes) {
    for (size_t i = 0; i < n; ++i) {
      const uint64_t counter = counter_++;
      keys[i] = PutKey(counter);
      char* block =
          bytes.empty() ? sync_put_blocks_[i].data() : bytes[i].data();
      ApplyStamp(PutStamp(nonce_hash_, id_, counter), block,
                 config_.block_size);
      blocks[i] = BlockToPut{keys[i], "",
                             absl::string_view(block, config_.block_size)};
    }
  }

  void Record(ClientResult& result, const absl::Status& st, uint64_t ops,
              SteadyClock::time_point t0, SteadyClock::time_point t1) {
    if (st.ok()) {
      result.ops += ops;
      ++result.calls;
      result.latencies_us.push_back(
          std::chrono::duration<double, std::micro>(t1 - t0).count());
      return;
    }
    if (result.errors < kMaxReportedErrors) {
      std::fprintf(stderr, "kvdepot-bench: client %d: %s\n", id_,
                   st.ToString().c_str());
    }
    result.errors += ops;
  }

  // UCX gets and puts: one registered buffer of --depth x --batch blocks
  // (gets land in it, puts come from it, filled with the body by Prepare);
  // up to --depth GetIntoAsync / PutFromAsync calls in flight, each on its
  // own --batch blocks of the buffer, issued in order and waited for oldest
  // first.
  void RunUcx(SteadyClock::time_point deadline, ClientResult& result) {
    const size_t depth = config_.depth;
    const uint64_t call_bytes = config_.batch * config_.block_size;
    absl::StatusOr<absl::Span<char>>& buffer = ucx_buffer_;
    if (!buffer.ok()) {
      std::fprintf(stderr, "kvdepot-bench: client %d: %s\n", id_,
                   buffer.status().ToString().c_str());
      result.errors = 1;
      return;
    }
    struct Call {
      std::vector<absl::Span<char>> spans;  // this call's part of the buffer
      std::vector<std::string> keys;
      std::vector<absl::string_view> views;
      std::vector<uint64_t> indexes;  // of the working-set keys (get)
      std::vector<BlockToPut> blocks;
      std::optional<TransferOp> op;
      SteadyClock::time_point t0;
      size_t n = 0;
    };
    std::vector<Call> calls(depth);
    for (size_t c = 0; c < depth; ++c) {
      Call& call = calls[c];
      call.keys.resize(config_.batch);
      call.views.resize(config_.batch);
      call.indexes.resize(config_.batch);
      call.blocks.resize(config_.batch);
      for (int i = 0; i < config_.batch; ++i) {
        char* p = buffer->data() + c * call_bytes + i * config_.block_size;
        call.spans.emplace_back(p, config_.block_size);
      }
    }
    // calls[next % depth] is the next to issue; [done, next) are in flight.
    uint64_t next = 0, done = 0;
    bool over = false;
    while (!over || done < next) {
      while (!over && next - done < depth) {
        Call& call = calls[next % depth];
        call.n = NextCall(deadline);
        if (call.n == 0) {
          over = true;
          break;
        }
        const auto spans = absl::MakeConstSpan(call.spans.data(), call.n);
        // Keys are formatted before the clock starts: only the call is timed.
        if (config_.op == Op::kGet) {
          DrawWorkingSetKeys(call.n, call.keys, call.views, &call.indexes);
          call.t0 = SteadyClock::now();
          call.op = client_.GetIntoAsync(
              config_.ns, absl::MakeConstSpan(call.views.data(), call.n), spans);
        } else {
          DrawPutKeys(call.n, call.keys, call.blocks, spans);
          call.t0 = SteadyClock::now();
          call.op = client_.PutFromAsync(
              config_.ns, absl::MakeConstSpan(call.blocks.data(), call.n));
        }
        ++next;
      }
      if (done == next) break;
      Call& oldest = calls[done % depth];
      oldest.op->Wait();
      const SteadyClock::time_point end = SteadyClock::now();
      absl::Status st = FirstError(*oldest.op);
      if (st.ok() && config_.op == Op::kGet) {
        std::vector<absl::string_view> got;
        for (size_t i = 0; i < oldest.n; ++i) {
          got.emplace_back(oldest.spans[i].data(), oldest.spans[i].size());
        }
        st = CheckStamps(got, oldest.indexes, oldest.keys);
      }
      Record(result, st, oldest.n, oldest.t0, end);
      oldest.op.reset();
      ++done;
    }
  }

  // gRPC gets and puts, and lookups: one call at a time.
  void RunSync(SteadyClock::time_point deadline, ClientResult& result) {
    std::vector<std::string> keys(config_.batch);
    std::vector<absl::string_view> views(config_.batch);
    std::vector<uint64_t> indexes(config_.batch);
    std::vector<BlockToPut> put_blocks(config_.batch);
    for (;;) {
      const size_t n = NextCall(deadline);
      if (n == 0) break;
      absl::Status st;
      SteadyClock::time_point t0;
      switch (config_.op) {
        case Op::kGet: {
          DrawWorkingSetKeys(n, keys, views, &indexes);
          t0 = SteadyClock::now();
          absl::StatusOr<std::vector<Block>> got =
              client_.Get(config_.ns, absl::MakeConstSpan(views.data(), n));
          if (!got.ok()) {
            st = got.status();
          } else if (got->size() != n) {
            st = absl::DataLossError(absl::StrCat("get of ", n, " keys returned ",
                                                  got->size(), " blocks"));
          } else {
            for (size_t i = 0; i < n; ++i) {
              if ((*got)[i].bytes.size() != config_.block_size) {
                st = absl::DataLossError(absl::StrCat(
                    "get ", keys[i], " returned ", (*got)[i].bytes.size(),
                    " bytes, expected ", config_.block_size));
                break;
              }
            }
            if (st.ok()) {
              std::vector<absl::string_view> blocks;
              for (const Block& b : *got) blocks.push_back(b.bytes);
              st = CheckStamps(blocks, indexes, keys);
            }
          }
          break;
        }
        case Op::kPut: {
          DrawPutKeys(n, keys, put_blocks, {});
          t0 = SteadyClock::now();
          absl::StatusOr<std::vector<PutResult>> put = client_.Put(
              config_.ns, absl::MakeConstSpan(put_blocks.data(), n));
          if (!put.ok()) {
            st = put.status();
          } else if (put->size() != n) {
            st = absl::DataLossError(absl::StrCat("put of ", n, " blocks returned ",
                                                  put->size(), " results"));
          } else {
            for (size_t i = 0; i < n; ++i) {
              if ((*put)[i] != PutResult::kStored) {
                st = absl::AlreadyExistsError(
                    absl::StrCat("put ", keys[i], " was not stored"));
                break;
              }
            }
          }
          break;
        }
        case Op::kLookup: {
          DrawWorkingSetKeys(n, keys, views);  // random, may repeat (no perm_)
          t0 = SteadyClock::now();
          absl::StatusOr<LookupReply> found =
              client_.Lookup(config_.ns, views, config_.prefix, config_.pin);
          if (!found.ok()) {
            st = found.status();
          } else {
            size_t hits = 0;
            for (const BlockInfo& e : found->entries) hits += e.found ? 1 : 0;
            if (hits != views.size() ||
                (config_.prefix && found->prefix_hits != hits)) {
              st = absl::NotFoundError(absl::StrCat(
                  "lookup found ", hits, " of ", views.size(), " keys"));
            }
            // Inside the timed op: keys/s is over the wall time, which the
            // unpin takes too, so the latencies must include it as well.
            if (found->pin_id != 0) {
              absl::Status unpinned = client_.Unpin(found->pin_id);
              if (st.ok()) st = unpinned;
            }
          }
          break;
        }
      }
      Record(result, st, config_.op == Op::kLookup ? 1 : n, t0,
             SteadyClock::now());
    }
  }

  const int id_;
  Client& client_;
  const bool ucx_;
  const BenchConfig& config_;
  const std::string& run_nonce_;
  const uint64_t nonce_hash_;  // of run_nonce_, in the put stamps
  const std::string& body_;    // every block's content before its stamp
  std::atomic<uint64_t>& claimed_;
  std::mt19937_64 rng_;
  // A get batch draws distinct keys: a permutation of the working set's
  // indexes, partially shuffled per call (batch > 1 only).
  std::vector<uint64_t> perm_;
  uint64_t counter_ = 0;  // put keys issued by this client
  // Prepare's buffer (gets land in it, puts come from it).
  absl::StatusOr<absl::Span<char>> ucx_buffer_ =
      absl::FailedPreconditionError("no UCX buffer: Prepare was not called");
  // Put blocks over grpc: one per position in a call (Prepare).
  std::vector<std::string> sync_put_blocks_;
};


int Run(const BenchConfig& config) {
  // Unique per run, so two put runs against one daemon never collide
  // (a put of an existing key is a no-op and would look fast).
  std::random_device entropy;
  const std::string run_nonce = absl::StrFormat(
      "%x%08x", static_cast<uint64_t>(absl::ToUnixMicros(absl::Now())),
      entropy());
  const std::string body = BlockBody(config.block_size);

  // Connect every client (and check the daemon) before the clock starts.
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<char> ucx_ok(config.clients, config.ucx);
  for (int i = 0; i < config.clients; ++i) {
    bool ucx = config.ucx;
    absl::StatusOr<std::unique_ptr<Client>> c =
        ConnectChecked(config, i, &ucx);
    ucx_ok[i] = ucx;
    if (!c.ok()) {
      std::fprintf(stderr, "kvdepot-bench: cannot reach %s: %s\n",
                   config.server.c_str(), c.status().ToString().c_str());
      return 1;
    }
    clients.push_back(*std::move(c));
  }
  if (config.clear_ns) {
    absl::StatusOr<v1::EvictResponse> evicted =
        clients[0]->Evict(config.ns, {}, /*all=*/true);
    if (!evicted.ok()) {
      std::fprintf(stderr, "kvdepot-bench: --clear-ns failed: %s\n",
                   evicted.status().ToString().c_str());
      return 1;
    }
    std::fprintf(stderr,
                 "kvdepot-bench: --clear-ns: evicted %llu blocks (%llu bytes) "
                 "of namespace %s, %llu pinned blocks kept\n",
                 static_cast<unsigned long long>(evicted->evicted_blocks()),
                 static_cast<unsigned long long>(evicted->evicted_bytes()),
                 config.ns.c_str(),
                 static_cast<unsigned long long>(evicted->pinned_blocks()));
  }
  if (config.op != Op::kPut) {
    absl::Status st = PopulateWorkingSet(*clients[0], config, body);
    if (!st.ok()) {
      std::fprintf(stderr,
                   "kvdepot-bench: storing the working set failed: %s\n",
                   st.ToString().c_str());
      return 1;
    }
  }

  std::atomic<uint64_t> claimed{0};
  std::vector<std::unique_ptr<ClientLoop>> loops;
  for (int i = 0; i < config.clients; ++i) {
    loops.push_back(std::make_unique<ClientLoop>(
        i, *clients[i], ucx_ok[i] != 0, config, run_nonce, body, claimed));
  }
  std::vector<ClientResult> results(config.clients);
  std::vector<SteadyClock::time_point> ends(config.clients);
  std::vector<std::thread> threads;
  absl::BlockingCounter ready(config.clients);
  absl::Notification go;
  SteadyClock::time_point start;
  SteadyClock::time_point deadline;
  for (int i = 0; i < config.clients; ++i) {
    threads.emplace_back([&, i] {
      loops[i]->Prepare();
      ready.DecrementCount();
      go.WaitForNotification();  // publishes `start` and `deadline`
      results[i] = loops[i]->Run(deadline);
      ends[i] = SteadyClock::now();
    });
  }
  ready.Wait();
  start = SteadyClock::now();
  deadline = start + std::chrono::duration_cast<SteadyClock::duration>(
                         std::chrono::duration<double>(config.duration_s));
  go.Notify();
  for (std::thread& t : threads) t.join();
  const SteadyClock::time_point end =
      *std::max_element(ends.begin(), ends.end());
  const double seconds = std::chrono::duration<double>(end - start).count();
  const bool moves_blocks = config.op != Op::kLookup;

  // After the timed window, one client at a time: a sample of the blocks
  // read back over each client's transport and compared byte for byte.
  VerifyResult verify;
  if (moves_blocks && config.verify > 0) {
    const uint64_t per_client =
        (config.verify + config.clients - 1) / config.clients;
    for (int i = 0; i < config.clients; ++i) {
      const VerifyResult r =
          loops[i]->Verify(per_client, i, config.clients, results[i]);
      verify.blocks += r.blocks;
      verify.failures += r.failures;
      verify.evicted += r.evicted;
    }
  }
  const char* verify_state = config.verify == 0 ? "off"
                             : verify.failures > 0 ? "failed"
                             : verify.blocks == 0  ? "none"
                                                   : "ok";
  if (verify.failures > 0) {
    std::fprintf(stderr,
                 "kvdepot-bench: verify FAILED: %llu of %llu blocks read back "
                 "after the run are missing or hold other bytes than were "
                 "stored under their keys (first ones above)%s\n",
                 static_cast<unsigned long long>(verify.failures),
                 static_cast<unsigned long long>(verify.blocks),
                 config.op == Op::kGet
                     ? "; a working set stored earlier with other bytes "
                       "(by another version of kvdepot-bench) fails too: "
                       "--clear-ns stores it again"
                     : "");
  }

  const TallySummary tally = Summarize(results);
  const uint64_t ops = tally.ops;
  const uint64_t calls = tally.calls;
  uint64_t errors = tally.errors;
  const double p50 = tally.p50_us;
  const double p99 = tally.p99_us;
  const double p999 = tally.p999_us;
  const double ops_per_sec =
      seconds > 0 ? static_cast<double>(ops) / seconds : 0;
  const double calls_per_sec =
      seconds > 0 ? static_cast<double>(calls) / seconds : 0;
  const double gb_per_sec =
      moves_blocks ? ops_per_sec * static_cast<double>(config.block_size) / 1e9
                   : 0;
  const double keys_per_sec = ops_per_sec * config.batch;

  const char* transport =
      std::count(ucx_ok.begin(), ucx_ok.end(), 1) == config.clients ? "ucx"
      : std::count(ucx_ok.begin(), ucx_ok.end(), 0) == config.clients
          ? "grpc"
          : "mixed";
  // Reported as run: gRPC clients and lookups make one call at a time.
  const int depth =
      config.op != Op::kLookup && std::string(transport) == "ucx" ? config.depth
                                                                   : 1;
  std::string human = absl::StrFormat(
      "%s %s over %s x%d clients batch %d depth %d: %u %s in %u calls in "
      "%.2f s, %.1f ops/s, %.1f calls/s",
      config.op_name, FormatSize(config.block_size), transport, config.clients,
      config.batch, depth, ops, moves_blocks ? "ops (blocks)" : "ops", calls, seconds,
      ops_per_sec, calls_per_sec);
  if (moves_blocks) {
    absl::StrAppendFormat(&human, ", %.3f GB/s", gb_per_sec);
  } else {
    absl::StrAppendFormat(&human, ", %.0f keys/s%s%s", keys_per_sec,
                          config.prefix ? ", prefix" : "",
                          config.pin ? ", pinned (an op: lookup + unpin)" : "");
  }
  absl::StrAppendFormat(
      &human,
      ", per call p50 %.1f us, p99 %.1f us, p999 %.1f us, %u errors, per "
      "client %u-%u ops",
      p50, p99, p999, errors, tally.min_thread_ops, tally.max_thread_ops);
  if (moves_blocks) {
    if (verify.failures > 0) {
      absl::StrAppendFormat(&human,
                            ", VERIFY FAILED: %u of %u blocks read back",
                            verify.failures, verify.blocks);
    } else if (verify.blocks > 0) {
      absl::StrAppendFormat(&human, ", %u blocks read back and verified",
                            verify.blocks);
    } else {
      absl::StrAppendFormat(&human, ", no block read back (%s)",
                            config.verify == 0 ? "--verify 0"
                                               : "none put without errors");
    }
  }
  if (config.json) {
    std::fprintf(stderr, "%s\n", human.c_str());
    std::string json = absl::StrFormat(
        "{\"tool\":\"kvdepot-bench\",\"op\":\"%s\",\"transport\":\"%s\","
        "\"block_size\":%u,"
        "\"clients\":%d,\"batch\":%d,\"depth\":%d,\"ops\":%u,"
        "\"ops_unit\":\"%s\",\"calls\":%u,\"seconds\":%.6f,"
        "\"ops_per_sec\":%.3f,\"calls_per_sec\":%.3f,\"gb_per_sec\":%.6f,"
        "\"latency_unit\":\"call\",\"p50_us\":%.3f,\"p99_us\":%.3f,"
        "\"p999_us\":%.3f,\"errors\":%u,\"min_client_ops\":%u,"
        "\"max_client_ops\":%u",
        config.op_name, transport, config.block_size, config.clients,
        config.batch, depth, ops, moves_blocks ? "block" : "call", calls, seconds, ops_per_sec,
        calls_per_sec, gb_per_sec, p50, p99, p999, errors,
        tally.min_thread_ops, tally.max_thread_ops);
    if (config.op != Op::kLookup && std::string(transport) == "ucx") {
      absl::StrAppendFormat(&json, ",\"requests\":\"%s\"",
                            config.ucx_requests ? "ucx" : "grpc");
      if (config.op == Op::kPut) {
        absl::StrAppendFormat(&json, ",\"put_protocol\":\"%s\"",
                              config.ucx_data_requests ? "send" : "pull");
      }
    }
    if (config.op != Op::kPut)
      absl::StrAppendFormat(&json, ",\"keys\":%u", config.keys);
    if (moves_blocks) {
      absl::StrAppendFormat(
          &json,
          ",\"verify\":\"%s\",\"verified_blocks\":%u,"
          "\"verify_failures\":%u,\"verify_evicted\":%u",
          verify_state, verify.blocks, verify.failures, verify.evicted);
    }
    if (config.op == Op::kLookup) {
      absl::StrAppendFormat(&json,
                            ",\"keys_per_sec\":%.3f,\"prefix\":%s,\"pin\":%s",
                            keys_per_sec, config.prefix ? "true" : "false",
                            config.pin ? "true" : "false");
      if (config.pin) {
        absl::StrAppendFormat(&json, ",\"op_is\":\"lookup + unpin\"");
      }
    }
    std::fprintf(Results(), "%s}\n", json.c_str());
  } else {
    std::fprintf(Results(), "%s\n", human.c_str());
  }
  if (std::fflush(Results()) != 0) {
    std::fprintf(stderr, "kvdepot-bench: cannot write to stdout\n");
    return 1;
  }
  return errors > 0 || verify.failures > 0 ? 1 : 0;
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) {
  using kvdepot::BenchConfig;
  // Results alone on stdout: UCX may log there (the compare scripts read
  // the JSON from it).
  kvdepot::SeparateResults();
  // As kvdepotd does (an engine would reuse its buffers the same way).
  kvdepot::TuneProcessForBlockIo();
  CLI::App app{"kvdepot-bench: load generator for kvdepotd (get, put, lookup)"};
  BenchConfig config;
  std::string block_size = "256KiB";
  config.ns = "bench";
  app.add_option("--server", config.server, "kvdepotd address HOST:PORT")
      ->required();
  app.add_option("--op", config.op_name, "get|put|lookup")
      ->required()
      ->check(CLI::IsMember({"get", "put", "lookup"}));
  app.add_option(
      "--block-size", block_size,
      "block size: 65536, 64KiB, 256KiB, 2MiB, 16MiB... (default 256KiB)");
  app.add_option("--clients", config.clients,
                 "client threads, one channel each (default 1)")
      ->check(CLI::Range(1, 1024));
  CLI::Option* duration = app.add_option("--duration", config.duration_s,
                                         "seconds to run (default 5)")
                              ->check(CLI::PositiveNumber);
  CLI::Option* count =
      app.add_option("--count", config.count,
                     "total ops over all clients (blocks for get/put, calls "
                     "for lookup)")
          ->check(CLI::PositiveNumber);
  duration->excludes(count);
  app.add_option(
         "--keys", config.keys,
         "working set of get/lookup (default: 256 MiB worth, 1..1024 keys)")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", config.batch,
                 "blocks per get/put call (default 1), keys per lookup call "
                 "(default 64); a get batch reads distinct keys")
      ->check(CLI::Range(1, kvdepot::kMaxLookupBatch));
  app.add_option("--depth", config.depth,
                 "get/put over ucx: calls in flight per client (default 1)")
      ->check(CLI::Range(1, 64));
  std::string transport = "ucx";
  app.add_option("--transport", transport,
                 "ucx (default; falls back to grpc with a warning) or grpc")
      ->check(CLI::IsMember({"ucx", "grpc"}));
  app.add_option("--ns", config.ns, "namespace (default bench)");
  app.add_flag("--clear-ns", config.clear_ns,
               "evict every unpinned block of --ns before the run (untimed)");
  app.add_flag("--prefix", config.prefix, "lookup: prefix lookups");
  app.add_flag("--pin", config.pin,
               "lookup: pin the hits and unpin them (an op, timed and counted, "
               "is the lookup and its unpin)");
  app.add_flag("--json", config.json, "print one JSON object on stdout");
  app.add_option("--verify", config.verify,
                 "get/put: blocks read back after the timed window (over the "
                 "same transport, into poisoned memory) and compared byte for "
                 "byte with what was stored; any difference fails the run "
                 "(default 64, 0: none)");
  std::string requests = "ucx";
  app.add_option("--requests", requests,
                 "get/put over ucx: send each call's request as a UCX active "
                 "message (ucx, the default, where the daemon offers it) or "
                 "as a gRPC call (grpc; ClientOptions::ucx_requests)")
      ->check(CLI::IsMember({"ucx", "grpc"}));
  std::string put_protocol = "pull";
  app.add_option("--put-protocol", put_protocol,
                 "put over ucx requests: the daemon reads the blocks from the "
                 "client's buffers (pull, the default), or the blocks' bytes go "
                 "with the request for the daemon to receive into its slots "
                 "(send, where the daemon takes it; ClientOptions::ucx_data_requests)")
      ->check(CLI::IsMember({"send", "pull"}));
  app.add_flag("--client-checksums", config.client_checksums,
               "put: hash every block in the client, also where a daemon on "
               "this host copies and hashes it (ClientOptions::always_checksum_puts)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }

  absl::StatusOr<uint64_t> size = kvdepot::ParseBlockSize(block_size);
  if (!size.ok()) {
    std::fprintf(stderr, "kvdepot-bench: --block-size: %s\n",
                 std::string(size.status().message()).c_str());
    return 2;
  }
  config.block_size = *size;
  config.ucx = transport == "ucx";
  config.ucx_requests = requests == "ucx";
  config.ucx_data_requests = put_protocol == "send";
  config.op = config.op_name == "get"   ? kvdepot::Op::kGet
              : config.op_name == "put" ? kvdepot::Op::kPut
                                        : kvdepot::Op::kLookup;
  if (config.count == 0 && config.duration_s <= 0) config.duration_s = 5;
  if (config.keys == 0) {
    config.keys = std::clamp<uint64_t>(
        kvdepot::kDefaultWorkingSetBytes / config.block_size, 1, 1024);
  }
  if (config.batch == 0) {
    config.batch = config.op == kvdepot::Op::kLookup
                       ? kvdepot::kDefaultLookupBatch
                       : kvdepot::kDefaultBlockBatch;
  }
  if (config.op == kvdepot::Op::kGet && config.batch > 1 &&
      static_cast<uint64_t>(config.batch) > config.keys) {
    std::fprintf(stderr,
                 "kvdepot-bench: --batch %d is larger than the working set "
                 "(--keys %llu); a get batch reads distinct keys\n",
                 config.batch, static_cast<unsigned long long>(config.keys));
    return 2;
  }
  return kvdepot::Run(config);
}
