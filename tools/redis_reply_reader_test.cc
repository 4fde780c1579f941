#include "tools/redis_reply_reader.h"

#include <string>

#include <gtest/gtest.h>

namespace kvdepot {
namespace {

std::string Bulk(const std::string& value) {
  return "$" + std::to_string(value.size()) + "\r\n" + value + "\r\n";
}

// Feeds `stream` in pieces of `piece` bytes.
bool FeedInPieces(ReplyReader& reader, const std::string& stream, size_t piece) {
  for (size_t i = 0; i < stream.size(); i += piece) {
    if (!reader.Feed(stream.data() + i, std::min(piece, stream.size() - i))) return false;
  }
  return true;
}

TEST(RedisReplyReaderTest, KeysAreRedisBenchmarks) {
  EXPECT_EQ(RedisKey(0), "key:000000000000");
  EXPECT_EQ(RedisKey(1023), "key:000000001023");
}

TEST(RedisReplyReaderTest, ValuesCarryTheirKeyAtBothEnds) {
  const std::string v = MakeValue(7, 1000);
  ASSERT_EQ(v.size(), 1000u);
  EXPECT_EQ(v.substr(0, 32), ValueStamp(7, 1000));
  EXPECT_EQ(v.substr(968), ValueStamp(7, 1000));
  EXPECT_NE(ValueStamp(7, 1000), ValueStamp(8, 1000));
  EXPECT_NE(ValueStamp(7, 1000), ValueStamp(7, 1001));
  // Small values hold what fits.
  EXPECT_EQ(MakeValue(7, 40).substr(0, 32), ValueStamp(7, 40));
  EXPECT_EQ(MakeValue(7, 40).substr(32), ValueStamp(7, 40).substr(0, 8));
  EXPECT_EQ(MakeValue(7, 5), ValueStamp(7, 5).substr(0, 5));
}

TEST(RedisReplyReaderTest, ReadsPipelinedGetsInAnyPieces) {
  for (uint64_t size : {1u, 5u, 32u, 40u, 64u, 65u, 1000u, 70000u}) {
    std::string stream;
    for (uint64_t key : {3u, 9u, 3u}) stream += Bulk(MakeValue(key, size));
    for (size_t piece : {size_t{1}, size_t{7}, size_t{4096}, stream.size()}) {
      ReplyReader reader(ReplyReader::Kind::kGet, size);
      for (uint64_t key : {3u, 9u, 3u}) reader.Expect(key);
      ASSERT_TRUE(FeedInPieces(reader, stream, piece)) << reader.protocol_error();
      EXPECT_EQ(reader.good(), 3u) << "size " << size << " piece " << piece;
      EXPECT_EQ(reader.bad(), 0u) << reader.first_bad();
      EXPECT_EQ(reader.pending(), 0u);
    }
  }
}

TEST(RedisReplyReaderTest, AnotherKeysValueIsBad) {
  ReplyReader reader(ReplyReader::Kind::kGet, 1000);
  reader.Expect(3);
  reader.Expect(4);
  ASSERT_TRUE(FeedInPieces(reader, Bulk(MakeValue(3, 1000)) + Bulk(MakeValue(5, 1000)), 100));
  EXPECT_EQ(reader.good(), 1u);
  EXPECT_EQ(reader.bad(), 1u);
  EXPECT_NE(reader.first_bad().find("key:000000000004"), std::string::npos);
}

TEST(RedisReplyReaderTest, ACorruptTailIsBad) {
  std::string v = MakeValue(3, 1000);
  v[990] = '?';
  ReplyReader reader(ReplyReader::Kind::kGet, 1000);
  reader.Expect(3);
  ASSERT_TRUE(reader.Feed(Bulk(v).data(), Bulk(v).size()));
  EXPECT_EQ(reader.bad(), 1u);
}

TEST(RedisReplyReaderTest, WrongLengthNilAndErrorsAreBadButReadable) {
  ReplyReader reader(ReplyReader::Kind::kGet, 1000);
  for (uint64_t key = 0; key < 4; ++key) reader.Expect(key);
  const std::string stream = Bulk(MakeValue(0, 999)) + "$-1\r\n" +
                             "-ERR wrong kind\r\n" + Bulk(MakeValue(3, 1000));
  ASSERT_TRUE(FeedInPieces(reader, stream, 3)) << reader.protocol_error();
  EXPECT_EQ(reader.good(), 1u);
  EXPECT_EQ(reader.bad(), 3u);
  EXPECT_NE(reader.first_bad().find("999 bytes"), std::string::npos);
}

TEST(RedisReplyReaderTest, SetRepliesAreOk) {
  ReplyReader reader(ReplyReader::Kind::kSet, 1000);
  for (int i = 0; i < 3; ++i) reader.Expect(0);
  ASSERT_TRUE(FeedInPieces(reader, "+OK\r\n+OK\r\n-OOM no memory\r\n", 2));
  EXPECT_EQ(reader.good(), 2u);
  EXPECT_EQ(reader.bad(), 1u);
}

TEST(RedisReplyReaderTest, BrokenFramingIsAProtocolError) {
  {
    ReplyReader reader(ReplyReader::Kind::kGet, 10);
    reader.Expect(0);
    EXPECT_FALSE(reader.Feed("?what\r\n", 7));
  }
  {
    ReplyReader reader(ReplyReader::Kind::kGet, 10);
    reader.Expect(0);
    const std::string stream = "$10\r\n" + MakeValue(0, 10) + "XY";
    EXPECT_FALSE(reader.Feed(stream.data(), stream.size()));
  }
  {
    // More replies than requests.
    ReplyReader reader(ReplyReader::Kind::kSet, 10);
    reader.Expect(0);
    EXPECT_FALSE(reader.Feed("+OK\r\n+OK\r\n", 10));
  }
}

}  // namespace
}  // namespace kvdepot
