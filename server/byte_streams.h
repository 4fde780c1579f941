// The protocol state of the gRPC byte path, apart from gRPC's threading:
// WriteStream consumes WriteRequest messages into the store, ReadStream
// produces ReadResponse messages from it. The service's reactors drive them
// one message per event.
//
// Neither is thread-safe; each belongs to one call. Both release what they
// hold (an unfinished block's reservation, a pin) when destroyed, so a call
// that ends early for any reason loses or leaks nothing.
#ifndef KVDEPOT_SERVER_BYTE_STREAMS_H_
#define KVDEPOT_SERVER_BYTE_STREAMS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

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
  // reservation slot. Any error ends the stream.
  absl::Status Consume(const v1::WriteRequest& msg);
  // The client half-closed: an unfinished block is an error.
  absl::Status End();
  // Releases an unfinished block's space now (also done on destruction).
  void Abort();
  // Block bytes accepted so far.
  uint64_t bytes_in() const { return bytes_in_; }

 private:
  struct Block;
  absl::Status Start(const v1::WriteHeader& h);
  absl::Status Complete();

  TieredStore& store_;
  v1::WriteResponse* const resp_;
  std::unique_ptr<Block> cur_;
  uint64_t bytes_in_ = 0;
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
  // Fills `msg` with the next chunk (the first chunk of a block carries its
  // header) and sets `*last` when it is the stream's final message. NotFound
  // at the first key that is not stored.
  absl::Status Next(v1::ReadResponse* msg, bool* last);
  uint64_t bytes_out() const { return bytes_out_; }
  // Releases the pin on the block being sent (also done on destruction).
  void ReleasePin();

 private:
  TieredStore& store_;
  const v1::ReadRequest& req_;
  int key_ = 0;         // index of the block being sent
  uint64_t offset_ = 0;  // next byte of it to send
  LookupEntry entry_;
  PinId pin_ = 0;  // pin on the block being sent (0: none)
  uint64_t bytes_out_ = 0;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_BYTE_STREAMS_H_
