#include "transport/request_message.h"

#include <cstring>

namespace kvdepot {
namespace {

constexpr uint32_t kMagic = 0x6b766431;  // "kvd1"
// 2: replies name their session.
constexpr uint16_t kVersion = 2;
constexpr uint16_t kRequestKind = 1;
constexpr uint16_t kReplyKind = 2;

// magic, version, kind, then two 64-bit and one 16-bit (request) or
// 64-bit, 32-bit and 64-bit (reply) fields.
constexpr size_t kPrefixSize = 4 + 2 + 2;
constexpr size_t kRequestSize = kPrefixSize + 2 + 8 + 8;
constexpr size_t kReplySize = kPrefixSize + 8 + 4 + 8;

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

template <typename T>
T Get(absl::string_view bytes, size_t& off) {
  T v;
  std::memcpy(&v, bytes.data() + off, sizeof(v));
  off += sizeof(v);
  return v;
}

std::string Prefix(uint16_t kind) {
  std::string out;
  Put(out, kMagic);
  Put(out, kVersion);
  Put(out, kind);
  return out;
}

bool HasPrefix(absl::string_view bytes, uint16_t kind, size_t size) {
  if (bytes.size() != size) return false;
  size_t off = 0;
  return Get<uint32_t>(bytes, off) == kMagic &&
         Get<uint16_t>(bytes, off) == kVersion &&
         Get<uint16_t>(bytes, off) == kind;
}

}  // namespace

std::string EncodeRequestHeader(const RequestHeader& header) {
  std::string out = Prefix(kRequestKind);
  Put(out, static_cast<uint16_t>(header.method));
  Put(out, header.request_id);
  Put(out, header.session_id);
  return out;
}

std::optional<RequestHeader> DecodeRequestHeader(absl::string_view bytes) {
  if (!HasPrefix(bytes, kRequestKind, kRequestSize)) return std::nullopt;
  size_t off = kPrefixSize;
  const uint16_t method = Get<uint16_t>(bytes, off);
  if (method != static_cast<uint16_t>(RequestMethod::kPushBlocks) &&
      method != static_cast<uint16_t>(RequestMethod::kPullBlocks)) {
    return std::nullopt;
  }
  RequestHeader h;
  h.method = static_cast<RequestMethod>(method);
  h.request_id = Get<uint64_t>(bytes, off);
  h.session_id = Get<uint64_t>(bytes, off);
  return h;
}

std::string EncodeDataRequestHeader(const RequestHeader& header,
                                    absl::string_view body) {
  std::string out = EncodeRequestHeader(header);
  out.append(body.data(), body.size());
  return out;
}

std::optional<DataRequestHeader> DecodeDataRequestHeader(absl::string_view bytes) {
  if (bytes.size() < kRequestSize) return std::nullopt;
  std::optional<RequestHeader> h = DecodeRequestHeader(bytes.substr(0, kRequestSize));
  if (!h) return std::nullopt;
  return DataRequestHeader{*h, bytes.substr(kRequestSize)};
}

std::string EncodeReplyHeader(const ReplyHeader& header) {
  std::string out = Prefix(kReplyKind);
  Put(out, header.request_id);
  Put(out, static_cast<uint32_t>(header.code));
  Put(out, header.session_id);
  return out;
}

std::optional<ReplyHeader> DecodeReplyHeader(absl::string_view bytes) {
  if (!HasPrefix(bytes, kReplyKind, kReplySize)) return std::nullopt;
  size_t off = kPrefixSize;
  ReplyHeader h;
  h.request_id = Get<uint64_t>(bytes, off);
  const uint32_t code = Get<uint32_t>(bytes, off);
  // Codes past the last one gRPC defines are not codes.
  if (code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return std::nullopt;
  }
  h.code = static_cast<absl::StatusCode>(code);
  h.session_id = Get<uint64_t>(bytes, off);
  return h;
}

}  // namespace kvdepot
