#include "transport/request_message.h"

#include <gtest/gtest.h>

#include <string>

namespace kvdepot {
namespace {

TEST(RequestMessageTest, RequestHeaderRoundTrips) {
  RequestHeader h;
  h.method = RequestMethod::kPullBlocks;
  h.request_id = 0x0102030405060708ULL;
  h.session_id = 0xfffffffffffffff0ULL;
  std::optional<RequestHeader> back = DecodeRequestHeader(EncodeRequestHeader(h));
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->method, RequestMethod::kPullBlocks);
  EXPECT_EQ(back->request_id, h.request_id);
  EXPECT_EQ(back->session_id, h.session_id);
}

TEST(RequestMessageTest, ReplyHeaderRoundTrips) {
  for (absl::StatusCode code : {absl::StatusCode::kOk, absl::StatusCode::kNotFound,
                                absl::StatusCode::kUnauthenticated}) {
    std::optional<ReplyHeader> back = DecodeReplyHeader(
        EncodeReplyHeader(ReplyHeader{42, code, 0xfedcba9876543210ULL}));
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(back->request_id, 42u);
    EXPECT_EQ(back->code, code);
    EXPECT_EQ(back->session_id, 0xfedcba9876543210ULL);
  }
}

TEST(RequestMessageTest, RefusesWhatIsNotAHeaderOfThisVersion) {
  const std::string request = EncodeRequestHeader(RequestHeader{});
  const std::string reply = EncodeReplyHeader(ReplyHeader{});
  EXPECT_FALSE(DecodeRequestHeader("").has_value());
  EXPECT_FALSE(DecodeRequestHeader(request.substr(0, request.size() - 1)).has_value());
  EXPECT_FALSE(DecodeRequestHeader(request + "x").has_value());
  // A reply is not a request, nor the other way round.
  EXPECT_FALSE(DecodeRequestHeader(reply).has_value());
  EXPECT_FALSE(DecodeReplyHeader(request).has_value());
  for (size_t byte = 0; byte < 8; ++byte) {  // magic, version, kind
    std::string bad = request;
    bad[byte] ^= 0x40;
    EXPECT_FALSE(DecodeRequestHeader(bad).has_value()) << "byte " << byte;
  }
  std::string unknown_method = request;
  unknown_method[8] = 9;
  EXPECT_FALSE(DecodeRequestHeader(unknown_method).has_value());
  std::string bad_code = reply;
  bad_code[reply.size() - 12] = 17;  // the code, past kUnauthenticated
  // A reply without its session (version 1's) is not one of this version.
  EXPECT_FALSE(DecodeReplyHeader(reply.substr(0, reply.size() - 8)).has_value());
  EXPECT_FALSE(DecodeReplyHeader(bad_code).has_value());
}

TEST(RequestMessageTest, DataRequestHeaderCarriesTheBodyAfterTheHeader) {
  RequestHeader h{RequestMethod::kPullBlocks, 7, 9};
  const std::string body("\0serialized\xff", 12);
  const std::string bytes = EncodeDataRequestHeader(h, body);
  std::optional<DataRequestHeader> back = DecodeDataRequestHeader(bytes);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->header.request_id, 7u);
  EXPECT_EQ(back->header.session_id, 9u);
  EXPECT_EQ(back->body, body);
  // An empty body is a header alone; fewer bytes, or a broken header, none.
  back = DecodeDataRequestHeader(EncodeRequestHeader(h));
  ASSERT_TRUE(back.has_value());
  EXPECT_TRUE(back->body.empty());
  const std::string header = EncodeRequestHeader(h);
  EXPECT_FALSE(DecodeDataRequestHeader(header.substr(0, header.size() - 1)));
  std::string bad = bytes;
  bad[0] ^= 1;
  EXPECT_FALSE(DecodeDataRequestHeader(bad));
  EXPECT_FALSE(DecodeDataRequestHeader(EncodeReplyHeader(ReplyHeader{}) + body));
}

}  // namespace
}  // namespace kvdepot
