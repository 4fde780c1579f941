#include "transport/internal/rkey_check.h"

#include <sys/ipc.h>
#include <sys/shm.h>

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvdepot::transport_internal {
namespace {

template <typename T>
void Append(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// A packed key: MD bitmap, memory type, then (size, bytes) per MD bit.
std::string Key(uint64_t md_map, uint8_t mem_type,
                const std::vector<std::string>& tl_keys) {
  std::string s;
  Append(s, md_map);
  Append(s, mem_type);
  for (const std::string& k : tl_keys) {
    Append(s, static_cast<uint8_t>(k.size()));
    s += k;
  }
  return s;
}

std::string SysvKey(int32_t shmid, uint64_t address) {
  std::string s;
  Append(s, shmid);
  Append(s, address);
  return s;
}

std::string PosixKey(uint64_t id, uint64_t address, uint64_t length) {
  std::string s;
  Append(s, id);
  Append(s, address);
  Append(s, length);
  return s;
}

TEST(RkeyCheckTest, ParsesWellFormedKeys) {
  EXPECT_TRUE(CheckPackedRkey(Key(1, 0, {""}), 0, 100, true).ok());
  EXPECT_TRUE(CheckPackedRkey(Key(0b1011, 0, {"", "abcd", ""}), 0, 100, true).ok());
  // Trailing bytes (system device and distances) are UCX's business.
  EXPECT_TRUE(CheckPackedRkey(Key(1, 0, {""}) + "xyz", 0, 100, true).ok());
}

TEST(RkeyCheckTest, RefusesKeysThatDoNotParse) {
  EXPECT_FALSE(CheckPackedRkey("", 0, 1, true).ok());
  EXPECT_FALSE(CheckPackedRkey(std::string(8, '\x01'), 0, 1, true).ok());
  EXPECT_FALSE(CheckPackedRkey(Key(0, 0, {}), 0, 1, true).ok());      // no MD
  EXPECT_FALSE(CheckPackedRkey(Key(1, 200, {""}), 0, 1, true).ok());  // type
  // Two MD bits, one key.
  EXPECT_FALSE(CheckPackedRkey(Key(0b11, 0, {"ab"}), 0, 1, true).ok());
  // A size byte past the end.
  std::string long_size = Key(1, 0, {"abcd"});
  long_size[9] = 40;
  absl::Status st = CheckPackedRkey(long_size, 0, 1, false);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_NE(st.message().find("says 40 bytes"), std::string::npos) << st;
}

TEST(RkeyCheckTest, SystemVSegmentMustExistAndHoldTheRegion) {
  const int shmid = shmget(IPC_PRIVATE, 1 << 20, IPC_CREAT | 0600);
  if (shmid < 0) GTEST_SKIP() << "no System V shared memory here";
  const uint64_t address = 0x7f0000000000;
  const std::string key = Key(0b10, 0, {SysvKey(shmid, address)});
  EXPECT_TRUE(CheckPackedRkey(key, address, 1 << 20, true).ok());
  EXPECT_TRUE(CheckPackedRkey(key, address + 4096, 8192, true).ok());
  EXPECT_FALSE(CheckPackedRkey(key, address, (1 << 20) + 1, true).ok());
  EXPECT_FALSE(CheckPackedRkey(key, address - 1, 16, true).ok());
  EXPECT_FALSE(CheckPackedRkey(key, address + (1 << 20), 1, true).ok());
  // Layouts not assumed (another UCX version): only the structure.
  EXPECT_TRUE(CheckPackedRkey(key, 0, uint64_t{1} << 40, false).ok());
  ASSERT_EQ(shmctl(shmid, IPC_RMID, nullptr), 0);
  absl::Status gone = CheckPackedRkey(key, address, 4096, true);
  EXPECT_TRUE(absl::IsInvalidArgument(gone)) << gone;
  EXPECT_NE(gone.message().find("cannot be attached"), std::string::npos) << gone;
}

TEST(RkeyCheckTest, PosixSegmentMustHoldTheRegion) {
  const uint64_t address = 0x7f0000000000;
  const std::string key = Key(1, 0, {PosixKey(77, address, 1 << 20)});
  EXPECT_TRUE(CheckPackedRkey(key, address, 1 << 20, true).ok());
  EXPECT_FALSE(CheckPackedRkey(key, address, 2 << 20, true).ok());
  EXPECT_FALSE(CheckPackedRkey(key, address - 4096, 4096, true).ok());
  // No overflow in the arithmetic.
  EXPECT_FALSE(CheckPackedRkey(key, address + 8, UINT64_MAX - address, true).ok());
}

}  // namespace
}  // namespace kvdepot::transport_internal
