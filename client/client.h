// libkvdepot: the C++ client of kvdepotd.
//
//   kvdepot::ClientOptions options;
//   options.server = "127.0.0.1:50551";
//   auto client = kvdepot::Client::Connect(options);
//   (*client)->Put("llama3-8b/bf16/tp0", {{key, parent, bytes}});
//   auto hits = (*client)->Lookup("llama3-8b/bf16/tp0", keys, /*prefix=*/true,
//                                 /*pin=*/true);
//   auto blocks = (*client)->Get("llama3-8b/bf16/tp0", keys);
//
// Blocks move over the UCX data plane when the daemon has one and the
// caller's buffers are registered (RegisterBuffer; GetIntoAsync /
// PutFromAsync), otherwise over the gRPC byte path (Write/Read streams in
// 1 MiB chunks). Every block read is checked against its XXH3-64 before it
// is reported as read. A session
// is opened on first need (pinning) and kept alive by a background thread
// (KeepAlive at a third of the lease); if the daemon forgets it (restart,
// expiry), the next call that needs one opens a new one.
//
// Errors are absl::Status with the daemon's gRPC code (see the .proto), or
// UNAVAILABLE / DEADLINE_EXCEEDED when the daemon cannot be reached in time.
// Thread-safe: one Client may be shared by many threads.
#ifndef KVDEPOT_CLIENT_CLIENT_H_
#define KVDEPOT_CLIENT_CLIENT_H_

#include <grpcpp/channel.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"

namespace kvdepot {

class UcxContext;
class UcxRequests;
namespace internal {
class CorruptReports;  // client.cc
}  // namespace internal

struct ClientOptions {
  std::string server = "127.0.0.1:50551";
  // Deadline of each RPC (a stream's deadline covers the whole stream).
  // Positive and finite (Connect checks).
  absl::Duration rpc_timeout = absl::Seconds(30);
  // Session lease to ask for; zero means the daemon's default, which also
  // bounds it. Connect refuses a negative one, and one under 1 ms or over
  // 2^32 - 1 ms (what OpenSessionRequest.lease_ms holds) that is not zero.
  absl::Duration lease = absl::ZeroDuration();
  std::string client_name = "libkvdepot";
  // kUcx: open sessions with a UCX worker, so that blocks in registered
  // buffers move over UCX; when UCX cannot start or the daemon cannot reach
  // the worker, the client uses gRPC (data_plane_status() says why).
  enum class Transport { kUcx, kGrpc };
  Transport transport = Transport::kUcx;
  // UCX settings for the client's context (names as UCX_* variables, with or
  // without the prefix), e.g. {"TLS", "tcp"}. Unless they (or the
  // environment's UCX_NET_DEVICES) name NET_DEVICES, the client's UCX
  // listens only on the devices it reaches `server` by (UcxDevicesToReach:
  // a daemon on loopback, `lo`; one at an address of this host, that device;
  // one on another host, the device the route to it leaves by; with `lo`
  // and RDMA devices in the last two): over TCP UCX serves reads and writes
  // of this process's memory to any peer that connects
  // (transport/net_devices.h). Where none can be told (no route, a name
  // that does not resolve), UCX's default: every device.
  std::map<std::string, std::string> ucx = {{"TCP_TX_SEG_SIZE", "512k"},
                                            {"TCP_RX_SEG_SIZE", "512k"}};
  // After a session got no UCX endpoint for a reason that may pass (the
  // daemon's wire-ups backed up or the worker not answering in time:
  // UNAVAILABLE, DEADLINE_EXCEEDED; UCX out of resources on either side;
  // anything but a refusal for who or how this client is:
  // INVALID_ARGUMENT, FAILED_PRECONDITION, PERMISSION_DENIED,
  // UNIMPLEMENTED), sessions go without UCX for this long, doubling on each
  // refusal up to 10 minutes; then the next transfer opens a new session
  // that asks again (its predecessor left to its lease, unless it holds
  // pins of Lookup(pin=true), which keep it).
  absl::Duration ucx_retry_interval = absl::Seconds(30);
  // Limit for one UCX transfer batch (the daemon may have a lower one; the
  // client asks for at most rpc_timeout / 2, so that the daemon's transfers
  // end well before the client stops waiting for them; zero: that alone).
  absl::Duration transfer_timeout = absl::Seconds(10);
  // Send the block-moving requests of GetIntoAsync / PutFromAsync to the
  // daemon as UCX active messages when it offers that (a session with a
  // UCX endpoint, OpenSessionResponse.ucx_request_address), instead of one
  // gRPC call each: the same request and reply, for a fraction of the CPU
  // per call. Falls back to gRPC calls when the connection cannot be made
  // or fails (for the rest of that session; requests pending on it end
  // UNAVAILABLE). A request waits at most min(rpc_timeout,
  // min(transfer_timeout, rpc_timeout / 2) + 5 s) for its reply.
  bool ucx_requests = true;
  // Hash every put here, also blocks in AllocateBuffer memory that a daemon
  // on this host copies itself (and hashes as it copies, so by default this
  // client does not). Costs a pass over the bytes; catches a buffer changed
  // while its put is in flight.
  bool always_checksum_puts = false;
  // With ucx_requests, send the blocks of a PutFromAsync with its request,
  // as UCX rendezvous data, when the daemon takes that (OpenSessionResponse.
  // ucx_data_requests): the daemon receives the bytes straight into the
  // slots it reserved instead of reading this client's buffers with gets
  // (which UCX 1.13 emulates with messages over TCP, a copy on each side).
  // Not for blocks a daemon on this host copies in place (AllocateBuffer).
  // Off by default: on loopback TCP here it moved 1.0-1.5x the bytes/s of
  // the gets at 1 client but 0.8-1.0x at 4 (tools/results/
  // compare_put_protocols_tcp.json; the kernel's copy from cold client
  // memory costs what UCX's copy into a warm buffer saved). Measure on your
  // fabric: tools/compare_requests.sh --compare put-protocol.
  // One exception to TransferOp's "nothing is read once ready": such a put
  // that ends without the daemon's answer (its wait passed) is ready while
  // UCX may still be sending from its buffers. Bytes changed meanwhile reach
  // the daemon with the checksum of the old ones and are refused
  // (DATA_LOSS), so nothing wrong is stored; the memory must stay valid
  // (as registered memory must anyway, and FreeBuffer keeps it).
  bool ucx_data_requests = false;
};

// The UCX settings a Client with `options` gives its UCX context: options.ucx,
// and unless they (or UCX_NET_DEVICES) name NET_DEVICES, the network devices
// it reaches options.server by (transport/net_devices.h).
std::map<std::string, std::string> ClientUcxSettings(const ClientOptions& options);

struct BlockInfo {
  bool found = false;
  v1::Tier tier = v1::TIER_UNSPECIFIED;
  uint64_t size = 0;
  uint64_t checksum = 0;
};

struct LookupReply {
  std::vector<BlockInfo> entries;  // one per key asked
  uint32_t prefix_hits = 0;
  uint64_t pin_id = 0;  // 0 when nothing was pinned
};

struct BlockToPut {
  absl::string_view key;
  absl::string_view parent;  // empty for a chain's first block
  absl::string_view bytes;
};

enum class PutResult { kStored, kAlreadyExists };

struct Block {
  std::string key;
  std::string bytes;
  uint64_t checksum = 0;
};

// The outcome of one batch of GetIntoAsync / PutFromAsync: poll or wait,
// then read one status per block. A status that is not OK is a miss for the
// caller ("degrade to miss"): NOT_FOUND for a block that is not stored,
// otherwise why the block could not be moved (the daemon is unreachable,
// the transfer failed or timed out, ABORTED when the daemon no longer has
// the client's session -- a restart, an expired lease: nothing was said of
// the key, and the next call opens a new session -- DATA_LOSS for
// bytes that did not match their checksum). Every get (GetIntoAsync, GetInto,
// Get) tells the daemon of a block it received not matching its checksum
// (ReportCorrupt, without waiting; best effort): the daemon hashes its copy
// again and drops it if bad (once no reader pins it, within about a second), so
// that later gets are served from NVMe or miss and the next put stores it
// again. After a failed get the destination may hold partial bytes: use only
// the blocks whose status is OK. For puts, OK means stored (ALREADY_EXISTS
// counts as stored and is reported as OK).
//
// Once an op is ready its buffers are the caller's again: nothing more is
// written into a get's, nor read from a put's, on its behalf (see
// RegisterBuffer and AllocateBuffer for how, and for the cases left: a get
// that failed over RDMA is one). So
// an op may be ready only some time after it failed: one over AllocateBuffer
// memory that ended without the daemon's answer, up to about
// min(transfer_timeout, rpc_timeout / 2) + 1 s after it was made.
//
// Thread-safe; copies share the same batch. The Client that made an op must
// outlive it until it is ready.
class TransferOp {
 public:
  struct State;
  explicit TransferOp(std::shared_ptr<State> state);

  bool IsReady() const;
  void Wait() const;
  // Waits until ready or `deadline`; returns IsReady(). A get's checksum
  // checks run on a waiting caller's thread when there is one (then it may
  // return a little past `deadline`, ready).
  bool WaitUntil(absl::Time deadline) const;
  // REQUIRES: IsReady().
  const std::vector<absl::Status>& statuses() const;
  // REQUIRES: IsReady(). Number of leading blocks that are OK.
  size_t ok_prefix() const;
  // REQUIRES: IsReady(). For a put: block i was stored before (its status
  // is OK; nothing was stored).
  bool already_stored(size_t i) const;
  // REQUIRES: IsReady(). "ucx" or "grpc": the path the blocks took.
  const char* transport() const;

 private:
  std::shared_ptr<State> state_;
};

// Converts a gRPC status to an absl::Status with the same code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

class Client {
 public:
  // Creates the channel; no RPC is made (use Health to check the daemon).
  // InvalidArgument for an empty server, or an rpc_timeout or lease out of
  // range (see ClientOptions).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const ClientOptions& options);
  // Stops the keep-alive thread, cancels the calls of GetIntoAsync /
  // PutFromAsync still in flight and waits for their callbacks, closes the
  // session, if any (waiting at most min(2 s, rpc_timeout / 2) for the
  // daemon), and stops the UCX workers (each within its close timeout,
  // 1 s), which ends every op still pending (failed): within about one
  // rpc_timeout plus a few seconds however the daemon behaves (a stopped
  // daemon, rpc_timeout 3 s: 1.5 s to 3.5 s), and gives a report of a
  // corrupt block still in flight up to min(1 s, rpc_timeout) more. Ops still
  // waiting for their copy deadline (AllocateBuffer) are reported as the last
  // step, once the memory of their buffers is freed.
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // OK when the daemon's grpc.health.v1 service reports SERVING;
  // UNAVAILABLE when it reports NOT_SERVING or cannot be reached.
  absl::Status Health();

  // Opens a session if none is open and starts keeping it alive. One
  // caller opens it; those that come meanwhile wait for its outcome (at
  // most rpc_timeout each: DEADLINE_EXCEEDED then) and get its error when
  // it fails, rather than each trying again in turn.
  absl::StatusOr<uint64_t> EnsureSession();
  // Closes the session (releasing its pins and open reservations); waits at
  // most min(2 s, rpc_timeout) for the daemon.
  absl::Status CloseSession();

  // Looks up `keys`; see LookupRequest in the .proto. With `pin`, a session
  // is opened if needed; release the pin with Unpin. A pinning lookup that
  // ends without the daemon's answer (DEADLINE_EXCEEDED, UNAVAILABLE...)
  // may have pinned its blocks under an id this client never learns: the
  // session is then dropped (no longer kept alive, its lease ends those
  // pins) and the next call opens another.
  absl::StatusOr<LookupReply> Lookup(absl::string_view ns,
                                     absl::Span<const absl::string_view> keys,
                                     bool prefix, bool pin);
  // Releases a pin in the session it was taken in, which need not be the
  // current one: a failed get replaces the session (its worker is fenced)
  // while the daemon keeps the old one, and its pins, until it ends.
  absl::Status Unpin(uint64_t pin_id);

  // Stores blocks (put-if-absent): over UCX (PutFromAsync) when every
  // block's bytes lie in registered memory, else over one Write stream. Each
  // block's checksum is computed here. Returns one result per block.
  absl::StatusOr<std::vector<PutResult>> Put(absl::string_view ns,
                                             absl::Span<const BlockToPut> blocks);
  // Reads blocks over one Read stream, verifying each checksum (DATA_LOSS on a
  // mismatch). NOT_FOUND at the first key that is not stored.
  absl::StatusOr<std::vector<Block>> Get(absl::string_view ns,
                                         absl::Span<const absl::string_view> keys);

  // Reads blocks straight into caller-owned buffers, without the per-block
  // strings Get allocates; over UCX (GetIntoAsync) when every buffer lies in
  // registered memory. dst[i] receives the block of keys[i] and must be
  // exactly that block's size. Returns one flag per key: true when dst[i] was
  // filled, false when the key is not stored (a miss: dst[i] is left
  // untouched, never zero-filled). The blocks are pinned (a session is opened
  // if needed) between the lookup and the read so that none is evicted in
  // between; the pin is released before returning. Keys may repeat.
  //
  // REQUIRES: keys.size() == dst.size(); the buffers do not overlap and stay
  // valid, and are not accessed by others, until the call returns.
  // Returns InvalidArgument if the counts differ or a stored block's size is
  // not dst[i].size() -- over gRPC checked before any buffer is written, so
  // then nothing is written; over UCX the other blocks may have been.
  // DATA_LOSS if a block fails its checksum; the buffers of the blocks not
  // yet verified are then unspecified. Other errors (the daemon is
  // unreachable, a deadline) likewise leave the buffers unspecified.
  // GetIntoAsync reports each key on its own instead.
  absl::StatusOr<std::vector<bool>> GetInto(
      absl::string_view ns, absl::Span<const absl::string_view> keys,
      absl::Span<const absl::Span<char>> dst);

  // ---- UCX data plane ----------------------------------------------------

  // Registers [base, base + size) for transfers: host memory only (the
  // client checks the blocks it gets on the CPU; InvalidArgument for memory
  // UCX reports as device memory, while a UCX without GPU support cannot
  // tell, so never pass a device pointer). GPU caches are staged through
  // page-locked host buffers (gpu/, kvdepot.kvshim). Blocks whose buffers lie
  // inside registered memory move over UCX. The memory must stay valid until
  // the client is destroyed. FailedPrecondition when the client has no UCX
  // (data_plane_status() says why); InvalidArgument for a null base or zero
  // size; UCX's error when registration fails.
  //
  // With a daemon on this host over shared memory, prefer AllocateBuffer
  // (the daemon copies into it itself, a pass cheaper). Into other
  // registered memory UCX 1.13 moves blocks with messages that this
  // client's worker copies in, and cannot take back what it queued when a
  // transfer fails on its way (transport/README, caveat 2). So when a get
  // fails that way (a timeout, a lost connection), the client fences that
  // worker (it is never progressed again) before it reports the failure,
  // and opens its next session on a new one: once an op is ready, nothing
  // more is written into its buffers. Not over RDMA (verbs devices in
  // ClientOptions::ucx NET_DEVICES, which the default settings may pick):
  // there the daemon's puts land in registered memory without this
  // worker, and a fence does not stop those of a get that failed on its
  // way, so after a failed get over RDMA treat the buffers it named as
  // unusable until the session ends (transport/README, caveat 2).
  // Untested here: the machines this was built on have no RDMA.
  //
  // A range inside memory registered or allocated already (IsRegistered) is
  // not registered again: OK, and nothing changes (its blocks move through
  // that buffer, which must outlive them: a second registration of part of
  // an AllocateBuffer buffer would outlive the buffer's FreeBuffer).
  absl::Status RegisterBuffer(void* base, size_t size);
  // True when [base, base + size) lies inside one buffer of RegisterBuffer
  // or AllocateBuffer that FreeBuffer has not freed.
  bool IsRegistered(const void* base, size_t size);
  // Allocates `size` bytes through UCX, registered as RegisterBuffer does,
  // and returns them; they live until FreeBuffer, or the client, frees
  // them. UCX places them in shared memory where it can, so a daemon on
  // this host maps them and copies blocks into and out of them itself,
  // hashing each as it lands:
  // neither side then makes a second pass over the bytes to check them
  // (see always_checksum_puts). Every page of it exists when it returns
  // (the call takes time in proportion to `size`), so no transfer into it
  // takes page faults on the progress thread. Errors as RegisterBuffer.
  //
  // The daemon's copies into and out of such a buffer need no fence, but
  // an op can end without the daemon's answer (its wait passed, the request
  // connection failed, the session was closed or replaced, another get's
  // failure fenced the worker, the gRPC call failed) while the daemon has
  // not yet run its request, or is copying. Each request names a copy
  // deadline (deadline_unix_us: min(transfer_timeout, rpc_timeout / 2)
  // after the call): the daemon starts no copy after it and checks it again
  // before each MiB of one. So such an op is made ready only once that
  // deadline plus 1 s has passed (a timer does it; no caller's thread
  // waits for it): until then IsReady is false and WaitUntil returns false
  // at its own deadline, and its statuses then say why it failed. Left: a
  // daemon frozen (SIGSTOP, swapped out) for longer than that 1 s between
  // its check of the deadline and the end of the MiB it then copies may
  // still write that part of the MiB into a get's buffer, or read it from
  // a put's source (a put whose block then completes is stored with those
  // bytes and, unless always_checksum_puts, the daemon's checksum of them),
  // after the op was reported. For a put, always_checksum_puts closes that
  // case (the bytes no longer match the client's checksum).
  absl::StatusOr<absl::Span<char>> AllocateBuffer(size_t size);
  // Unregisters and frees a buffer of AllocateBuffer (`buffer` as it
  // returned it), unless a transfer may still reach it: when an op over it
  // ended without the daemon's answer, or with a block that may still be on
  // its way, while this client's UCX worker moved its bytes (not copied in
  // place by a daemon on this host; the daemon may still read a put's
  // source through the worker), it is kept, unused, until the client goes.
  // NotFound when `buffer` is no such buffer, or was freed already.
  // REQUIRES: every op whose buffers lie in it is ready, no call using it
  // is in progress, and nothing touches the memory afterwards.
  //
  // The daemon keeps the buffer's registration in a session it was used in
  // until that session ends (there is no RPC to drop one; it counts towards
  // the daemon's limit of buffers per session), and a daemon on this host
  // keeps the shared memory it mapped for it mapped until then: the memory
  // leaves this process at once, the host only with the session.
  absl::Status FreeBuffer(absl::Span<char> buffer);

  // Reads blocks straight into `dst` (dst[i] receives keys[i] and must be
  // exactly its size). Over UCX when every dst lies in registered memory and
  // the session has a UCX endpoint: one round trip in which the daemon looks
  // the keys up, pins the hits, writes them into dst and unpins; each block
  // is then verified against its checksum here (or was, as it landed, by a
  // daemon on this host that copied it into AllocateBuffer memory itself).
  // Otherwise the gRPC path (lookup with pin, Read stream), done before this
  // returns. With `prefix` the daemon stops at the first miss. Over UCX this
  // returns once the request is on its way; it blocks on the daemon only to
  // open a session when none is open, or to register a buffer with the
  // session at its first use. The gRPC path, and those, run on the calling
  // thread, each call bounded by rpc_timeout. When the daemon does not
  // answer them in time (UNAVAILABLE, DEADLINE_EXCEEDED), the op fails at
  // once (a miss) rather than trying the gRPC path as well, and callers
  // that wait for the same session or registration get its outcome: no
  // caller queues behind the others. Each waits about one rpc_timeout per
  // step it takes itself: the caller that opens a session up to about two
  // (OpenSession, once more without UCX when the daemon refuses its worker)
  // plus the request connection's 5 s; one that waits for others' session
  // and registrations up to two; one that registers buffers one
  // rpc_timeout per buffer.
  // REQUIRES: keys.size() == dst.size(); dst stays valid and untouched
  // until the op is ready.
  TransferOp GetIntoAsync(absl::string_view ns,
                          absl::Span<const absl::string_view> keys,
                          absl::Span<const absl::Span<char>> dst,
                          bool prefix = false);
  // Stores blocks from caller memory: over UCX (the daemon reserves, reads
  // the bytes from the caller's registered memory, verifies and commits, in
  // one round trip) when every block's bytes lie in registered memory;
  // otherwise over a Write stream, done before this returns (blocking as
  // GetIntoAsync's gRPC path does). REQUIRES: the
  // bytes stay valid and unchanged until the op is ready.
  TransferOp PutFromAsync(absl::string_view ns,
                          absl::Span<const BlockToPut> blocks);

  // OK when sessions get a UCX endpoint; otherwise why blocks take the gRPC
  // path (the client asked for gRPC, UCX could not start, the daemon has no
  // data plane or could not reach this client's worker).
  absl::Status data_plane_status();

  absl::StatusOr<v1::EvictResponse> Evict(absl::string_view ns,
                                          absl::Span<const absl::string_view> keys,
                                          bool all);
  absl::StatusOr<v1::StatsResponse> Stats();
  absl::StatusOr<v1::ListNamespacesResponse> ListNamespaces();

  // The raw stub, for tools and tests that need an RPC this class does not
  // wrap. Calls made through it get no deadline unless the caller sets one.
  v1::KvDepot::Stub& stub() { return *stub_; }
  const ClientOptions& options() const { return options_; }

 private:
  explicit Client(const ClientOptions& options);
  void PrepareContext(grpc::ClientContext* ctx) const;
  void KeepAliveLoop();
  // A finished call's status, as FromGrpcStatus, noted first (NoteRpc).
  absl::Status FromRpc(const grpc::Status& status);
  // Wakes the watch thread when a call found no connection (UNAVAILABLE or
  // a deadline, the channel not READY), or when a call succeeded while
  // pins are owed (owed_unpins_).
  void NoteRpc(const grpc::Status& status);
  // The watch thread. While the channel is down after a failed call it
  // keeps asking it to connect and polls it (gRPC 1.51 completes a
  // connection attempt only when some thread polls: with every call
  // failing at once, none did, and its backup poller runs every 5 s, so a
  // restarted daemon was reached ~10 s late). Once the daemon answers
  // again it has the keep-alive thread renew the session and release the
  // owed pins at once, not a third of a lease later.
  void WatchLoop();
  // The gRPC byte path of Put and GetInto.
  absl::StatusOr<std::vector<PutResult>> PutGrpc(absl::string_view ns,
                                                 absl::Span<const BlockToPut> blocks);
  // With `prefix`, only the blocks before the first miss are read (a miss
  // leaves its buffer, and every one after it, untouched).
  absl::StatusOr<std::vector<bool>> GetIntoGrpc(
      absl::string_view ns, absl::Span<const absl::string_view> keys,
      absl::Span<const absl::Span<char>> dst, bool prefix = false);
  // The same, with a status per key: OK (its buffer holds the verified
  // block), NotFound (a miss), InvalidArgument (its buffer's size is not
  // the block's: not read), or what stopped the stream at or before it
  // (DataLoss for a block failing its checksum; the stream's error for the
  // blocks it did not deliver). With `all_or_nothing` a wrong size fails the
  // whole call before any buffer is written (GetInto's contract over gRPC).
  // Errors of the call itself: bad arguments, or the lookup failing.
  absl::StatusOr<std::vector<absl::Status>> GetIntoGrpcPerKey(
      absl::string_view ns, absl::Span<const absl::string_view> keys,
      absl::Span<const absl::Span<char>> dst, bool prefix, bool all_or_nothing);
  // GetIntoAsync; `all_or_nothing` as for GetIntoGrpcPerKey on the gRPC path.
  TransferOp GetIntoAsyncImpl(absl::string_view ns,
                              absl::Span<const absl::string_view> keys,
                              absl::Span<const absl::Span<char>> dst, bool prefix,
                              bool all_or_nothing);
  // GetInto's Read stream: fills dst[i] for every entry `found` marks found
  // whose status is still OK, and sets the status of each that does not
  // arrive verified (see GetIntoGrpcPerKey). Adds {key, checksum} of a
  // block that arrived not matching its checksum to `corrupt`.
  void ReadInto(absl::string_view ns, absl::Span<const absl::string_view> keys,
                absl::Span<const absl::Span<char>> dst,
                const LookupReply& found, std::vector<absl::Status>& statuses,
                std::vector<std::pair<std::string, uint64_t>>& corrupt);

  struct Link;
  struct Ucx;
  struct Timers;
  struct Calls;
  // The session for a UCX transfer and the daemon's ids of the buffers
  // holding `ranges` (registering them with the daemon as needed). NotFound
  // when a range is not in registered memory.
  struct UcxTarget {
    uint64_t session = 0;
    std::shared_ptr<Link> link;  // the worker the session's endpoint goes to
    std::vector<v1::BufferRange> ranges;
    // Per range: the daemon copies it in place (copied_in_place).
    std::vector<bool> in_place;
    // Per range: the index of its buffer in ucx_->buffers.
    std::vector<size_t> buffers;
  };
  // `*unreachable` says whether an error is the daemon not answering in
  // time (then the caller fails the op instead of trying gRPC).
  absl::StatusOr<UcxTarget> PrepareUcx(absl::Span<const absl::Span<const char>> ranges,
                                       bool* unreachable);
  // PrepareUcx's registration of ucx_->buffers[i] for each i in `wanted`
  // with `session`: sets (*ids)[i] to {the daemon's id, copied in place}.
  // Registers the buffers nobody registers in that session now (one
  // RegisterBuffer RPC each, outside ucx_->mu); waits for the outcome of
  // those another caller registers (until rpc_timeout from the call), whose
  // failure is this caller's too.
  absl::Status RegisterInSession(
      uint64_t session, absl::Span<const size_t> wanted,
      absl::flat_hash_map<size_t, std::pair<uint32_t, bool>>* ids,
      bool* unreachable);
  // The daemon no longer knows `session` (or its endpoint): forget it so
  // that the next call opens a new one.
  void DropSession(uint64_t session);
  // `session` is to be used no more while the daemon still holds it: the
  // next call opens a new one, the keep-alive no longer renews it (its
  // lease ends it, with what it holds), and the calls in flight in it still
  // get their answers (unlike DropSession, which ends its UCX requests).
  void AbandonSession(uint64_t session);
  // A session without UCX whose refusal may have passed (ucx_retry_at_) is
  // abandoned, so that the next call asks again; not one holding pins the
  // caller took (Lookup(pin=true)), which would end with its lease.
  void MaybeRetryUcx();
  // Whether `st`, of a call to the daemon, means it is not answering (so
  // that no other path is tried): a passed deadline, or UNAVAILABLE while
  // the channel is not up.
  bool DaemonNotAnswering(const absl::Status& st) const;
  void RememberPin(uint64_t pin_id, uint64_t session);
  // The session `pin_id` was taken in (pin_sessions_), else the current one.
  uint64_t PinSessionLocked(uint64_t pin_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unpin's RPC: `pin_id` of `session`, within `timeout`.
  absl::Status UnpinRpc(uint64_t session, uint64_t pin_id, absl::Duration timeout);
  // Releases a pin this library took for itself (GetInto over gRPC): one
  // that cannot be released now (the daemon unreachable) is owed, and the
  // keep-alive thread retries it, since the caller never saw its id and the
  // renewed session would hold it for the client's whole life.
  void ReleaseOwnPin(uint64_t pin_id);
  // The owing part of ReleaseOwnPin, without trying first (kMaxOwedUnpins
  // at most; beyond them the session's lease ends the pin).
  void OweUnpin(uint64_t pin_id);
  // The keep-alive thread's retry of owed_unpins_ (REQUIRES mu_, released
  // during the RPCs).
  void RetryOwedUnpins(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the daemon (ReportCorrupt) that the blocks {key, checksum} of
  // `ns` this client received did not match their checksums, without
  // waiting for its answer (see internal::CorruptReports).
  void ReportCorrupt(
      absl::string_view ns,
      std::vector<std::pair<std::string, uint64_t>> blocks) const;
  // Ends the requests over UCX of `session` (pending ones: Unavailable).
  void DisconnectRequests(uint64_t session);
  // Sets late_access on ucx_->buffers[i] for each i in `buffers`: a transfer
  // may still reach them, so FreeBuffer keeps them. Called by an op's
  // callback before the op can be ready.
  void MarkLateAccess(absl::Span<const size_t> buffers);

  // A new worker, and the request path on it unless options_ say no.
  absl::StatusOr<std::shared_ptr<Link>> NewLink(UcxContext& context) const;
  // The current link when `session` was opened on it; otherwise null.
  std::shared_ptr<Link> LinkOf(uint64_t session);
  // Whether `link` was fenced (ReplaceLink) since an op took it as its
  // session's: its worker is never progressed again.
  bool Fenced(const Link& link);
  // For a get that failed in a way that may leave the daemon's writes for
  // it in flight: retires `link` (the next session gets a new one), drops
  // `session`, and fences the link's worker; `then` runs once it will
  // never be progressed again (UcxWorker::Fence).
  void ReplaceLink(Link& link, uint64_t session, absl::AnyInvocable<void() &&> then);
  // Destroys the retired links that are done with (their threads have
  // ended, nothing else holds them). Never on a progress thread.
  void ReapLinks();
  // The transfer timeout a request gives the daemon:
  // min(transfer_timeout, rpc_timeout / 2).
  absl::Duration DaemonTransferTimeout() const;
  // DaemonTransferTimeout in milliseconds (at least 1).
  uint32_t TransferTimeoutMs() const;
  // Now + DaemonTransferTimeout: no copy a daemon on this host makes itself
  // into or out of our buffers starts later (the request's
  // deadline_unix_us), whenever the request reaches it.
  absl::Time CopyDeadline() const;
  // How long a request over UCX waits for its reply.
  absl::Duration UcxRequestTimeout() const;
  // EnsureSession's one try, by the one caller opening (opening_): the
  // session, or 0 when the UCX link it was opened on was retired meanwhile
  // and it was closed again (never when `last_try`).
  absl::StatusOr<uint64_t> OpenSessionOnce(bool last_try);
  // CloseSession's RPC for session `id`, waiting at most `timeout`.
  absl::Status CloseSessionRpc(uint64_t id, absl::Duration timeout);
  // A ready op with every block failing with `status`.
  static TransferOp FailedOp(size_t n, const absl::Status& status);
  // When an op that ended may be made ready: at once (InfinitePast) when
  // the daemon `answered` or copies none of its blocks itself (`in_place`,
  // per block); otherwise once no copy of the daemon's can still be
  // running, kLateCopySlack past the op's `copy_deadline`.
  static absl::Time PublishAfter(bool answered, const std::vector<bool>& in_place,
                                 absl::Time copy_deadline);
  // Runs `publish` now when `at` has come, else on `timers` at `at`.
  static void PublishAt(Timers& timers, absl::Time at,
                        absl::AnyInvocable<void() &&> publish);

  const ClientOptions options_;
  // Publishes ops at their copy deadline (AllocateBuffer); shared with the
  // callbacks that schedule on it. Stopped last by the destructor.
  const std::shared_ptr<Timers> timers_;
  // The gRPC calls of GetIntoAsync / PutFromAsync in flight, whose
  // callbacks use this object: the destructor cancels them and waits.
  const std::shared_ptr<Calls> calls_;
  std::unique_ptr<Ucx> ucx_;  // null without UCX
  absl::Status ucx_status_ ABSL_GUARDED_BY(mu_);
  // When a session without UCX (refused for a reason that may pass) gives
  // way to one that asks again (MaybeRetryUcx), and the wait after the next
  // refusal.
  absl::Time ucx_retry_at_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Duration ucx_retry_wait_ ABSL_GUARDED_BY(mu_);
  // Lookups with pin in flight (their pins not yet in pin_sessions_).
  int pinning_lookups_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvDepot::Stub> stub_;
  // Reports of corrupt blocks; shared with the gets that find them.
  std::shared_ptr<internal::CorruptReports> reports_;

  // Session opening: one caller at a time opens (its RPCs outside any
  // lock); others wait for its outcome.
  absl::Mutex open_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  bool opening_ ABSL_GUARDED_BY(open_mu_) = false;  // a try in progress
  uint64_t open_tries_ ABSL_GUARDED_BY(open_mu_) = 0;  // started
  uint64_t open_done_ ABSL_GUARDED_BY(open_mu_) = 0;   // the last one ended
  absl::Status open_status_ ABSL_GUARDED_BY(open_mu_);  // how it ended
  absl::Mutex mu_;
  uint64_t session_id_ ABSL_GUARDED_BY(mu_) = 0;
  // The session each pin of Lookup was taken in, until its Unpin (pin ids
  // are unique in a daemon). At most kMaxRememberedPins: past that, the
  // pins of sessions other than the current one are forgotten (their
  // Unpin then names the current session, as an unknown pin does).
  absl::flat_hash_map<uint64_t, uint64_t> pin_sessions_ ABSL_GUARDED_BY(mu_);
  uint64_t pins_pruned_for_ ABSL_GUARDED_BY(mu_) = 0;  // session of the last prune
  // Pins of ReleaseOwnPin still to release, as {pin, session}; at most
  // kMaxOwedUnpins (past that, the session's lease ends them at the latest
  // once the daemon is unreachable for longer than a lease).
  std::vector<std::pair<uint64_t, uint64_t>> owed_unpins_ ABSL_GUARDED_BY(mu_);
  absl::Duration lease_ ABSL_GUARDED_BY(mu_) = absl::Seconds(30);
  // When a session was last dropped for having registered as many buffers
  // as the daemon allows (RegisterInSession).
  absl::Time buffers_rotated_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // The keep-alive RPC in flight, cancelled by the destructor.
  grpc::ClientContext* keepalive_ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool keepalive_now_ ABSL_GUARDED_BY(mu_) = false;  // renew without waiting
  std::atomic<bool> owes_unpins_{false};  // owed_unpins_ is not empty
  std::thread keepalive_;

  // WatchLoop's wake-ups. A leaf: nothing else is taken while it is held.
  absl::Mutex watch_mu_;
  bool watch_stop_ ABSL_GUARDED_BY(watch_mu_) = false;
  bool watch_disconnected_ ABSL_GUARDED_BY(watch_mu_) = false;
  absl::Time watch_failed_at_ ABSL_GUARDED_BY(watch_mu_);  // the last such call
  bool watch_answered_ ABSL_GUARDED_BY(watch_mu_) = false;  // pins owed
  std::thread watch_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_CLIENT_CLIENT_H_
