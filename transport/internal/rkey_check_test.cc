#include "transport/internal/rkey_check.h"

#include <fcntl.h>
#include <sys/ipc.h>
#include <sys/shm.h>
#include <unistd.h>

#include <cstdio>

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

constexpr uint64_t kShmOpenForStrip = uint64_t{1} << 62;

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
  EXPECT_TRUE(CheckPackedRkeyForLayouts(Key(1, 0, {""}), 0, 100, true).ok());
  EXPECT_TRUE(CheckPackedRkeyForLayouts(Key(0b1011, 0, {"", "ib-rkey!", ""}), 0, 100, true).ok());
  // Trailing bytes (system device and distances) are UCX's business.
  EXPECT_TRUE(CheckPackedRkeyForLayouts(Key(1, 0, {""}) + "xyz", 0, 100, true).ok());
}

// For a peer on another host: shared-memory keys go, the rest stays as it
// was (MD bits, order, trailing bytes).
TEST(RkeyCheckTest, StripsSharedMemoryKeysAndKeepsTheRest) {
  const std::string sysv = SysvKey(-5, 0x1000);  // no such segment
  const std::string posix = PosixKey(kShmOpenForStrip | 1, 0x1000, 4096);
  absl::StatusOr<std::string> stripped = StripSharedMemoryKeys(
      Key(0b11101, 0, {"", sysv, "ib-rkey!", posix}) + "tail");
  ASSERT_TRUE(stripped.ok()) << stripped.status();
  EXPECT_EQ(*stripped, Key(0b01001, 0, {"", "ib-rkey!"}) + "tail");
  // The stripped key passes where the original (a segment that does not
  // exist) would not.
  EXPECT_TRUE(CheckPackedRkey(*stripped, 0x1000, 4096, std::nullopt).ok());
  EXPECT_FALSE(CheckPackedRkey(Key(0b11101, 0, {"", sysv, "ib-rkey!", posix}),
                               0x1000, 4096, std::nullopt)
                   .ok());
  // Nothing to strip: unchanged; only shared memory: no MD left (refused
  // by the check); malformed: refused.
  EXPECT_EQ(*StripSharedMemoryKeys(Key(1, 0, {""})), Key(1, 0, {""}));
  absl::StatusOr<std::string> none = StripSharedMemoryKeys(Key(0b10, 0, {sysv}));
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(CheckPackedRkey(*none, 0x1000, 4096, std::nullopt).ok());
  EXPECT_FALSE(StripSharedMemoryKeys(Key(0b11, 0, {"ab"})).ok());
}

TEST(RkeyCheckTest, RefusesTransportKeysOfUnknownSize) {
  // A layout UCX 1.13 might fail to unpack, which crashes it.
  absl::Status st = CheckPackedRkeyForLayouts(Key(1, 0, {"abcd"}), 0, 1, true);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  // Not judged where the layouts are not known.
  EXPECT_TRUE(CheckPackedRkeyForLayouts(Key(1, 0, {"abcd"}), 0, 1, false).ok());
}

TEST(RkeyCheckTest, RefusesKeysThatDoNotParse) {
  EXPECT_FALSE(CheckPackedRkeyForLayouts("", 0, 1, true).ok());
  EXPECT_FALSE(CheckPackedRkeyForLayouts(std::string(8, '\x01'), 0, 1, true).ok());
  EXPECT_FALSE(CheckPackedRkeyForLayouts(Key(0, 0, {}), 0, 1, true).ok());      // no MD
  EXPECT_FALSE(CheckPackedRkeyForLayouts(Key(1, 200, {""}), 0, 1, true).ok());  // type
  // Two MD bits, one key.
  EXPECT_FALSE(CheckPackedRkeyForLayouts(Key(0b11, 0, {"ab"}), 0, 1, true).ok());
  // A size byte past the end.
  std::string long_size = Key(1, 0, {"abcd"});
  long_size[9] = 40;
  absl::Status st = CheckPackedRkeyForLayouts(long_size, 0, 1, false);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_NE(st.message().find("says 40 bytes"), std::string::npos) << st;
}

TEST(RkeyCheckTest, SystemVSegmentMustExistAndHoldTheRegion) {
  const int shmid = shmget(IPC_PRIVATE, 1 << 20, IPC_CREAT | 0600);
  if (shmid < 0) GTEST_SKIP() << "no System V shared memory here";
  const uint64_t address = 0x7f0000000000;
  const std::string key = Key(0b10, 0, {SysvKey(shmid, address)});
  EXPECT_TRUE(CheckPackedRkeyForLayouts(key, address, 1 << 20, true).ok());
  EXPECT_TRUE(CheckPackedRkeyForLayouts(key, address + 4096, 8192, true).ok());
  EXPECT_FALSE(CheckPackedRkeyForLayouts(key, address, (1 << 20) + 1, true).ok());
  EXPECT_FALSE(CheckPackedRkeyForLayouts(key, address - 1, 16, true).ok());
  EXPECT_FALSE(CheckPackedRkeyForLayouts(key, address + (1 << 20), 1, true).ok());
  // Layouts not assumed (another UCX version): only the structure.
  EXPECT_TRUE(CheckPackedRkeyForLayouts(key, 0, uint64_t{1} << 40, false).ok());
  ASSERT_EQ(shmctl(shmid, IPC_RMID, nullptr), 0);
  absl::Status gone = CheckPackedRkeyForLayouts(key, address, 4096, true);
  EXPECT_TRUE(absl::IsInvalidArgument(gone)) << gone;
  EXPECT_NE(gone.message().find("cannot be attached"), std::string::npos) << gone;
}

constexpr uint64_t kProcfs = uint64_t{1} << 63;
constexpr uint64_t kShmOpen = uint64_t{1} << 62;

// A file in /dev/shm named as UCX 1.13 names its POSIX segments.
struct ShmFile {
  explicit ShmFile(uint64_t id, size_t size) {
    char name[64];
    snprintf(name, sizeof name, "/dev/shm/ucx_shm_posix_%llx",
             static_cast<unsigned long long>(id));
    path = name;
    fd = open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(size)) != 0) {
      close(fd);
      fd = -1;
    }
  }
  ~ShmFile() {
    if (fd >= 0) close(fd);
    unlink(path.c_str());
  }
  std::string path;
  int fd = -1;
};

TEST(RkeyCheckTest, PosixSegmentMustBeAUcxSegmentHoldingTheRegion) {
  const uint64_t id = 0x5eed0000u + static_cast<uint64_t>(getpid() & 0xffff);
  ShmFile file(id, 1 << 20);
  if (file.fd < 0) GTEST_SKIP() << "cannot create files in /dev/shm";
  const uint64_t address = 0x7f0000000000;
  // Named by its /dev/shm id.
  const std::string by_name = Key(1, 0, {PosixKey(kShmOpen | id, address, 1 << 20)});
  EXPECT_TRUE(CheckPackedRkeyForLayouts(by_name, address, 1 << 20, true).ok());
  EXPECT_FALSE(CheckPackedRkeyForLayouts(by_name, address, 2 << 20, true).ok());
  EXPECT_FALSE(CheckPackedRkeyForLayouts(by_name, address - 4096, 4096, true).ok());
  EXPECT_FALSE(CheckPackedRkeyForLayouts(by_name, address + 8, UINT64_MAX - address, true).ok());
  // A key that claims more than the file holds.
  const std::string too_long = Key(1, 0, {PosixKey(kShmOpen | id, address, 2 << 20)});
  EXPECT_FALSE(CheckPackedRkeyForLayouts(too_long, address, 4096, true).ok());
  // Named by this process's descriptor of it (/proc/<pid>/fd/<fd>).
  const uint64_t procfs = kProcfs | kShmOpen | static_cast<uint64_t>(getpid()) |
                          (static_cast<uint64_t>(file.fd) << 30);
  EXPECT_TRUE(CheckPackedRkeyForLayouts(Key(1, 0, {PosixKey(procfs, address, 1 << 20)}),
                              address, 4096, true).ok());
  // A descriptor that is not a UCX segment (stdin, or a plain file): the
  // daemon would map it and write blocks into it.
  const uint64_t not_ucx = kProcfs | static_cast<uint64_t>(getpid());  // fd 0
  absl::Status st = CheckPackedRkeyForLayouts(Key(1, 0, {PosixKey(not_ucx, address, 4096)}),
                                    address, 4096, true);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  // A segment that is gone.
  const std::string gone = Key(1, 0, {PosixKey(kShmOpen | (id + 1), address, 4096)});
  EXPECT_FALSE(CheckPackedRkeyForLayouts(gone, address, 4096, true).ok());
  // Outside /dev/shm (UCX_POSIX_DIR elsewhere): not supported.
  EXPECT_FALSE(CheckPackedRkeyForLayouts(Key(1, 0, {PosixKey(77, address, 4096)}),
                               address, 4096, true).ok());
}

// With an owner, a segment must belong to that uid: a client may only have
// the daemon reach its own user's shared memory.
TEST(RkeyCheckTest, SegmentsMustBelongToTheClientsUser) {
  const uint32_t me = getuid();
  const uint64_t address = 0x7f0000000000;
  const int shmid = shmget(IPC_PRIVATE, 1 << 20, IPC_CREAT | 0600);
  if (shmid < 0) GTEST_SKIP() << "no System V shared memory here";
  const std::string sysv = Key(0b10, 0, {SysvKey(shmid, address)});
  EXPECT_TRUE(CheckPackedRkey(sysv, address, 4096, me).ok());
  EXPECT_TRUE(CheckPackedRkey(sysv, address, 4096, std::nullopt).ok());
  absl::Status other = CheckPackedRkey(sysv, address, 4096, me + 1);
  EXPECT_TRUE(absl::IsInvalidArgument(other)) << other;
  EXPECT_NE(other.message().find("belongs to uid"), std::string::npos) << other;
  ASSERT_EQ(shmctl(shmid, IPC_RMID, nullptr), 0);

  ShmFile file(0x0e0e0000u + static_cast<uint64_t>(getpid() & 0xffff), 1 << 20);
  if (file.fd < 0) GTEST_SKIP() << "cannot create files in /dev/shm";
  const uint64_t procfs = kProcfs | kShmOpen | static_cast<uint64_t>(getpid()) |
                          (static_cast<uint64_t>(file.fd) << 30);
  const std::string posix = Key(1, 0, {PosixKey(procfs, address, 1 << 20)});
  EXPECT_TRUE(CheckPackedRkey(posix, address, 4096, me).ok());
  other = CheckPackedRkey(posix, address, 4096, me + 1);
  EXPECT_TRUE(absl::IsInvalidArgument(other)) << other;
}

}  // namespace
}  // namespace kvdepot::transport_internal
