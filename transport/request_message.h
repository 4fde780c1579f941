// The framing of kvdepot's request path over UCX active messages: a client
// sends the bytes of a PushBlocks / PullBlocks request (the .proto messages)
// to the daemon's worker, and the daemon answers on its endpoint to the
// client's worker, instead of one gRPC call per batch (a gRPC round trip
// costs more CPU than moving a 256 KiB block; see transport/README.md).
// Only the framing lives here; what a request means is the service's.
//
// Both headers are fixed-size, little-endian (x86-64 and aarch64 hosts),
// and start with a magic and a version so that a mismatched peer is
// refused instead of misread.
#ifndef KVDEPOT_TRANSPORT_REQUEST_MESSAGE_H_
#define KVDEPOT_TRANSPORT_REQUEST_MESSAGE_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

// Active-message ids (UcxWorker::SetMessageHandler).
inline constexpr uint16_t kRequestMessageId = 0x6b31;  // client -> daemon
inline constexpr uint16_t kReplyMessageId = 0x6b32;    // daemon -> client
// client -> daemon: a PullBlocks request whose blocks' bytes come with it as
// the message's rendezvous data (UCP_AM_SEND_FLAG_RNDV), so that the daemon
// receives them straight into the slots it reserved instead of reading the
// client's buffers. Its UCX header is EncodeDataRequestHeader's; its data the
// blocks' bytes, in the request's order, back to back. Answered with
// kReplyMessageId as any request.
inline constexpr uint16_t kDataRequestMessageId = 0x6b33;

// The methods a request may name.
enum class RequestMethod : uint16_t { kPushBlocks = 1, kPullBlocks = 2 };

// The largest request payload a daemon accepts (a request names keys and
// buffer places, never block bytes).
inline constexpr size_t kMaxRequestPayload = size_t{4} << 20;

struct RequestHeader {
  RequestMethod method = RequestMethod::kPushBlocks;
  uint64_t request_id = 0;  // the client's, echoed in the reply
  uint64_t session_id = 0;
};

struct ReplyHeader {
  uint64_t request_id = 0;
  // The request's status; when not OK the payload is its message,
  // otherwise the serialized response.
  absl::StatusCode code = absl::StatusCode::kOk;
  // The session the request named: a client takes a reply only for a
  // request of that session (its ids are its own, not the session's).
  uint64_t session_id = 0;
};

std::string EncodeRequestHeader(const RequestHeader& header);
// nullopt for bytes that are not a request header of this version or name
// an unknown method.
std::optional<RequestHeader> DecodeRequestHeader(absl::string_view bytes);

// kDataRequestMessageId's UCX header: the request header, then the
// serialized request (body).
std::string EncodeDataRequestHeader(const RequestHeader& header,
                                    absl::string_view body);
struct DataRequestHeader {
  RequestHeader header;
  absl::string_view body;  // into the decoded bytes
};
// nullopt as DecodeRequestHeader for its first bytes.
std::optional<DataRequestHeader> DecodeDataRequestHeader(absl::string_view bytes);

std::string EncodeReplyHeader(const ReplyHeader& header);
// nullopt for bytes that are not a reply header of this version.
std::optional<ReplyHeader> DecodeReplyHeader(absl::string_view bytes);

}  // namespace kvdepot

#endif  // KVDEPOT_TRANSPORT_REQUEST_MESSAGE_H_
