#include "storage/checksum.h"

#include <xxhash.h>

#include <random>
#include <string>

#include "absl/time/clock.h"
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
      // CopyWithChecksumUntil with a deadline far ahead: a plain copy.
      uint64_t (*until)(char*, const char*, size_t) = [](char* d, const char* s,
                                                         size_t len) {
        return CopyWithChecksumUntil(d, s, len, absl::InfiniteFuture()).value();
      };
      for (auto copy : {&CopyWithChecksum, &CopyToMemoryWithChecksum, until}) {
        SCOPED_TRACE(copy == &CopyWithChecksum ? "cached"
                     : copy == until           ? "until"
                                               : "to memory");
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

// Past its deadline, CopyWithChecksumUntil stops before the next MiB: at
// once when it has passed already, and mid-block when it passes during the
// copy (here: a deadline a copy of 64 MiB cannot meet, checked by what it
// left unwritten, not by time).
TEST(CopyWithChecksumTest, UntilStopsOnceItsDeadlinePassed) {
  // Both copies that take a deadline: into memory that is read again
  // (CopyWithChecksumUntil) and into the arena (CopyToMemoryWithChecksumUntil).
  for (auto copy : {&CopyWithChecksumUntil, &CopyToMemoryWithChecksumUntil}) {
    std::string src(64 << 20, 's');
    std::string dst(src.size(), 'd');
    // CopyToMemoryWithChecksumUntil counts its MiB from dst's first 64-byte
    // boundary.
    const size_t head = copy == &CopyWithChecksumUntil
                            ? 0
                            : (64 - reinterpret_cast<uintptr_t>(dst.data()) % 64) % 64;
    EXPECT_EQ(copy(dst.data(), src.data(), src.size(), absl::Now() - absl::Seconds(1)),
              std::nullopt);
    EXPECT_EQ(dst.find_first_not_of('d'), std::string::npos);  // nothing written
    EXPECT_EQ(copy(dst.data(), src.data(), 100, absl::InfinitePast()), std::nullopt);
    // Stopped part of the way: a prefix of whole MiB written, the rest not.
    const std::optional<uint64_t> sum =
        copy(dst.data(), src.data(), src.size(), absl::Now() + absl::Microseconds(1));
    if (!sum.has_value()) {
      const size_t written = dst.find('d');
      ASSERT_NE(written, std::string::npos);
      if (written > 0) {
        EXPECT_EQ((written - head) % (1 << 20), 0u) << written;
      }
      EXPECT_EQ(dst.find_first_not_of('d', written), std::string::npos);
    } else {
      // A machine fast enough to copy 64 MiB within the microsecond.
      EXPECT_EQ(*sum, XXH3_64bits(src.data(), src.size()));
    }
    // A deadline far ahead: the whole copy, and its checksum.
    std::string full(src.size(), 'd');
    EXPECT_EQ(copy(full.data(), src.data(), src.size(), absl::InfiniteFuture()),
              XXH3_64bits(src.data(), src.size()));
    EXPECT_EQ(full, src);
  }
}

}  // namespace
}  // namespace kvdepot
