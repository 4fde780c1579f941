// The protocol state of the gRPC byte path, apart from gRPC's threading:
// WriteStream consumes WriteRequest messages into the store, ReadStream
// produces ReadResponse messages from it (in wire form, pointing at the
// block's DRAM bytes instead of copying them). The service's reactors drive them
// one message per event.
//
// Neither is thread-safe; each belongs to one call. Both release what they
// hold (an unfinished block's reservation, a pin) when destroyed, so a call
// that ends early for any reason loses or leaks nothing.
#ifndef KVDEPOT_SERVER_BYTE_STREAMS_H_
#define KVDEPOT_SERVER_BYTE_STREAMS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "storage/tiered_store.h"

namespace kvdepot {

inline constexpr size_t kMaxChunkBytes = 1 << 20;

class WriteStream {
 public:
  // `store` must outlive the stream; results are appended to `resp`.
  WriteStream(TieredStore& store, v1::WriteResponse* resp);
  ~WriteStream();
  WriteStream(const WriteStream&) = delete;
  WriteStream& operator=(const WriteStream&) = delete;

  // Applies one message: a header starts a block (reserving its space), data
  // fills it, and a complete block is published (standalone) or left in its
  // reservation slot. Any error ends the stream. With `would_wait` (a
  // caller that must not block): where a standalone block's reservation
  // would wait for room, sets *would_wait and applies nothing of `msg`
  // (call again without it, where waiting is fine).
  absl::Status Consume(const v1::WriteRequest& msg, bool* would_wait = nullptr);
  // The client half-closed: an unfinished block is an error.
  absl::Status End();
  // Releases an unfinished block's space now (also done on destruction).
  void Abort();
  // Block bytes accepted so far.
  uint64_t bytes_in() const { return bytes_in_; }
  // Whether the stream made progress since the last call: started or
  // completed a block, or received a sixteenth of the block in progress
  // (at least kProgressBytes) since. A client trickling a byte now and then
  // makes none, so the daemon's idle timeout (stream_idle_timeout) ends it:
  // a block finishes within 16 idle timeouts, or its space is released.
  bool TakeProgress();
  static constexpr uint64_t kProgressBytes = 64 << 10;

 private:
  struct Block;
  absl::Status ConsumeOne(const v1::WriteRequest& msg, bool* would_wait);
  absl::Status Start(const v1::WriteHeader& h, bool* would_wait);
  absl::Status Complete();
  // A block started or finished, or a share of one arrived (TakeProgress).
  void MarkProgress();

  TieredStore& store_;
  v1::WriteResponse* const resp_;
  std::unique_ptr<Block> cur_;
  uint64_t bytes_in_ = 0;
  bool progressed_ = false;
  uint64_t bytes_since_progress_ = 0;
};

// A pin on one block shared by everything that still points into its DRAM
// bytes (the stream, and each chunk gRPC has not finished sending); the last
// Unref releases the pin. Thread-safe.
class SharedPin {
 public:
  // Takes over `pin` (of kInternalSession) with one reference.
  SharedPin(TieredStore& store, PinId pin) : store_(store), pin_(pin) {}
  SharedPin(const SharedPin&) = delete;
  SharedPin& operator=(const SharedPin&) = delete;
  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref();
  // For a gRPC slice's destroy callback: `arg` is a SharedPin*.
  static void UnrefCallback(void* arg) { static_cast<SharedPin*>(arg)->Unref(); }

 private:
  ~SharedPin() = default;
  TieredStore& store_;
  const PinId pin_;
  std::atomic<int> refs_{1};
};

// One message of a Read stream, in wire form without copying the block:
// `prefix` holds the serialized ReadResponse fields before the bytes (the
// header, on a block's first chunk, then the data field's tag and length)
// and `data` points into the store's DRAM, kept valid by one reference on
// `pin` that the consumer owns and must Unref when done with `data`.
struct ReadChunk {
  std::string prefix;
  const char* data = nullptr;
  size_t size = 0;
  SharedPin* pin = nullptr;

  // The whole message, copied (for tests and non-zero-copy callers).
  std::string Serialize() const;
};

class ReadStream {
 public:
  // `store` and `req` must outlive the stream.
  ReadStream(TieredStore& store, const v1::ReadRequest& req)
      : store_(store), req_(req) {}
  ~ReadStream();
  ReadStream(const ReadStream&) = delete;
  ReadStream& operator=(const ReadStream&) = delete;

  // Checks the request (namespace, batch size).
  absl::Status Validate() const;
  // True when the next chunk starts a block that is not pinned yet. A server
  // calls PinNext then, so that a block only on NVMe is promoted off its
  // thread; Next would do it inline.
  bool NeedsPin() const { return pin_ == nullptr && key_ < req_.keys_size(); }
  // Pins the next block (see NeedsPin) and calls `done` with the outcome:
  // NotFound if it is not stored. `done` runs on this thread for a block in
  // DRAM, else on a promotion thread of the store.
  void PinNext(absl::AnyInvocable<void(absl::Status) &&> done);
  // Produces the next chunk (a block's first chunk carries its header) and
  // sets `*last` when it is the stream's final message. NotFound at the
  // first key that is not stored.
  absl::Status Next(ReadChunk* chunk, bool* last);
  uint64_t bytes_out() const { return bytes_out_; }
  // The keys looked up so far, one entry each, in order (the stream stops
  // at the first one not found, which is the last entry then): for the
  // lookup metrics, which count a Read's keys as lookups, as the store does.
  const LookupResult& lookups() const { return lookups_; }
  // Drops the stream's own reference on the block being sent (chunks still
  // in flight keep theirs). Also done on destruction.
  void ReleasePin();

 private:
  // Takes the pin of a one-key lookup of the next block.
  absl::Status Adopt(absl::StatusOr<LookupResult> r);

  TieredStore& store_;
  const v1::ReadRequest& req_;
  int key_ = 0;         // index of the block being sent
  uint64_t offset_ = 0;  // next byte of it to send
  LookupEntry entry_;
  SharedPin* pin_ = nullptr;  // the stream's reference on the current block
  uint64_t bytes_out_ = 0;
  LookupResult lookups_;  // entries only; no pin
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_BYTE_STREAMS_H_
