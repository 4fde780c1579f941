#include "storage/rocksdb_crc32c.h"

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"

// librocksdb's declaration; in this process it resolves to kvdepot's.
namespace rocksdb {
namespace crc32c {
uint32_t Extend(uint32_t init_crc, const char* data, size_t n);
}  // namespace crc32c
}  // namespace rocksdb

namespace kvdepot {
namespace {

uint32_t Crc(const std::string& s) {
  return rocksdb::crc32c::Extend(0, s.data(), s.size());
}

#if defined(__x86_64__)
TEST(RocksCrc32cTest, TakesLibRocksdbsPlaceOnThisCpu) {
  if (!__builtin_cpu_supports("sse4.2")) GTEST_SKIP() << "no SSE4.2 here";
  if (getenv("KVDEPOT_ROCKSDB_CRC32C") != nullptr) {
    GTEST_SKIP() << "KVDEPOT_ROCKSDB_CRC32C is set";
  }
  // Fails when the link did not export kvdepot's Extend, so librocksdb would
  // still run its own.
  EXPECT_EQ(RocksCrc32cImplementation(), "crc32 instruction (SSE4.2)");
  ASSERT_NE(LibRocksdbCrc32cExtend(), nullptr);
  EXPECT_NE(reinterpret_cast<void*>(LibRocksdbCrc32cExtend()),
            reinterpret_cast<void*>(&rocksdb::crc32c::Extend));
}
#endif

// RFC 3720 (iSCSI) B.4 vectors and the usual check value.
TEST(RocksCrc32cTest, KnownVectors) {
  EXPECT_EQ(Crc("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending(32, '\0');
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<char>(i);
  EXPECT_EQ(Crc(ascending), 0x46DD794Eu);
  EXPECT_EQ(Crc(""), 0u);
}

TEST(RocksCrc32cTest, SameAsLibRocksdbsForEveryLengthAndAlignment) {
  Crc32cExtendFn theirs = LibRocksdbCrc32cExtend();
  if (theirs == nullptr) GTEST_SKIP() << "librocksdb's Extend is not reachable";
  std::mt19937_64 rng(7);
  std::vector<char> buf(300000);
  for (char& c : buf) c = static_cast<char>(rng());
  for (size_t offset = 0; offset < 9; ++offset) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9},
                     size_t{63}, size_t{4096}, size_t{3 * 4096 - 1},
                     size_t{3 * 4096}, size_t{3 * 4096 + 8}, size_t{262144 + 13}}) {
      for (uint32_t init : {0u, 0xDEADBEEFu}) {
        ASSERT_EQ(rocksdb::crc32c::Extend(init, buf.data() + offset, n),
                  theirs(init, buf.data() + offset, n))
            << "offset " << offset << " length " << n << " init " << init;
      }
    }
  }
}

TEST(RocksCrc32cTest, ExtendChainsLikeOneCall) {
  std::string a = "kvdepot blocks ", b = "on NVMe, checksummed by RocksDB";
  EXPECT_EQ(rocksdb::crc32c::Extend(Crc(a), b.data(), b.size()), Crc(a + b));
}

// RocksDB itself, writing and verifying blob records and SST blocks with
// this CRC: a reopened database reads back every value, with checksum
// verification on.
TEST(RocksCrc32cTest, RocksDbWritesAndVerifiesWithIt) {
  const std::string path = ::testing::TempDir() + "/rocksdb_crc32c_test_db";
  rocksdb::Options options;
  options.create_if_missing = true;
  options.enable_blob_files = true;
  options.min_blob_size = 4096;
  ASSERT_TRUE(rocksdb::DestroyDB(path, options).ok());
  const std::string value(64 * 1024, 'v');
  {
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(options, path, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    for (int i = 0; i < 50; ++i) {
      ASSERT_TRUE(db->Put({}, "k" + std::to_string(i), value + std::to_string(i)).ok());
    }
    ASSERT_TRUE(db->Flush({}).ok());
  }
  rocksdb::DB* raw = nullptr;
  ASSERT_TRUE(rocksdb::DB::Open(options, path, &raw).ok());
  std::unique_ptr<rocksdb::DB> db(raw);
  rocksdb::ReadOptions ro;
  ro.verify_checksums = true;
  for (int i = 0; i < 50; ++i) {
    std::string got;
    ASSERT_TRUE(db->Get(ro, "k" + std::to_string(i), &got).ok()) << i;
    EXPECT_EQ(got, value + std::to_string(i));
  }
  db.reset();
  EXPECT_TRUE(rocksdb::DestroyDB(path, options).ok());
}

}  // namespace
}  // namespace kvdepot
