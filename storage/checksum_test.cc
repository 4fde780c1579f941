#include "storage/checksum.h"

#include <xxhash.h>

#include <random>
#include <string>

#include "gtest/gtest.h"

namespace kvdepot {
namespace {

// Checksums are stored with blocks on NVMe and compared by clients: whatever
// vector unit computes them, they must be XXH3-64 (seed 0), bit for bit.
TEST(BlockChecksumTest, IsXxh3SixtyFourAtEverySize) {
  EXPECT_EQ(BlockChecksum("", 0), 0x2D06800538D394C2ull);
  std::mt19937_64 rng(11);
  std::string buf(3 << 20, '\0');
  for (char& c : buf) c = static_cast<char>(rng());
  for (size_t n : {size_t{1}, size_t{16}, size_t{17}, size_t{128}, size_t{129},
                   size_t{240}, size_t{241}, size_t{1024}, size_t{4096},
                   size_t{65536 + 7}, size_t{262144}, size_t{3 << 20}}) {
    for (size_t offset : {size_t{0}, size_t{1}, size_t{5}}) {
      if (offset + n > buf.size()) continue;
      ASSERT_EQ(BlockChecksum(buf.data() + offset, n),
                XXH3_64bits(buf.data() + offset, n))
          << "length " << n << " offset " << offset;
    }
  }
}

TEST(BlockChecksumTest, OneFlippedBitChangesIt) {
  std::string block(262144, 'k');
  const uint64_t before = BlockChecksum(block);
  block[123456] ^= 0x10;
  EXPECT_NE(BlockChecksum(block), before);
}

// The copy is the source's bytes, and its checksum is theirs, at sizes
// around the piece size and XXH3's internal boundaries, from unaligned
// sources into unaligned destinations.
TEST(CopyWithChecksumTest, CopiesAndHashesWhatLanded) {
  std::mt19937_64 rng(5);
  std::string src((4 << 20) + 64, '\0');
  for (char& c : src) c = static_cast<char>(rng());
  for (size_t n : {size_t{0}, size_t{1}, size_t{240}, size_t{1023},
                   size_t{16384}, size_t{16385}, size_t{32768 - 1},
                   size_t{65536 + 7}, size_t{262144}, size_t{4 << 20}}) {
    for (size_t offset : {size_t{0}, size_t{3}, size_t{64}}) {
      for (auto copy : {&CopyWithChecksum, &CopyToMemoryWithChecksum}) {
        SCOPED_TRACE(copy == &CopyWithChecksum ? "cached" : "to memory");
        std::string dst(n + 72, '\x5a');
        const uint64_t sum = copy(dst.data() + offset, src.data() + offset, n);
        ASSERT_EQ(sum, XXH3_64bits(src.data() + offset, n))
            << "length " << n << " offset " << offset;
        ASSERT_EQ(dst.compare(offset, n, src, offset, n), 0) << "length " << n;
        // Nothing written before the start or past the end.
        ASSERT_EQ(dst.find_first_not_of('\x5a'), n == 0 ? std::string::npos : offset);
        ASSERT_EQ(dst.find_first_not_of('\x5a', offset + n), std::string::npos);
      }
    }
  }
}

}  // namespace
}  // namespace kvdepot
