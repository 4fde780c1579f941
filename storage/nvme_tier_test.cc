#include "storage/nvme_tier.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "rocksdb/db.h"
#include "rocksdb/env.h"
#include "storage/checksum.h"
#include "storage/fake_clock.h"
#include "storage/fault_injection_fs.h"
#include "storage/internal/sync_point.h"
#include "tests/status_matchers.h"
#include "tests/test_dir.h"

namespace kvdepot {
namespace {

namespace fs = std::filesystem;
using ::kvdepot::testing::StatusIs;
using ::testing::HasSubstr;
using Code = absl::StatusCode;

MATCHER_P(IsOkAndHolds, value, "is OK and holds a matching value") {
  if (!arg.ok()) {
    *result_listener << "whose status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(value, *arg, result_listener);
}

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;

// Deterministic, incompressible bytes: block `seed` always has the same ones,
// so any read can be checked against the key alone.
std::string Bytes(uint64_t seed, size_t size) {
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + size);
  std::string out(size, '\0');
  for (size_t i = 0; i < size; i += 8) {
    uint64_t v = rng();
    std::memcpy(&out[i], &v, std::min<size_t>(8, size - i));
  }
  return out;
}

// Fixed width, so every key has the same charge.
std::string Key(int i) { return absl::StrFormat("key-%04d", i); }

// What the tier charges for a block (see NvmeTierStats::used_bytes): the
// bytes, the id "<len><ns><key>" under two column families, and the
// 31-byte metadata record plus the parent key.
uint64_t Charge(absl::string_view ns, absl::string_view key, uint64_t size,
                size_t parent_bytes = 0) {
  return size + 2 * (1 + ns.size() + key.size()) + 31 + parent_bytes;
}

// A block bound (NvmeTierOptions::max_blocks) whose floor, 1 byte for a
// capacity up to 64 MiB, raises no block's charge: for tests of the charge
// itself, or of more blocks than the default bound allows (one per 16 KiB)
// in a small tier. TinyBlocksAreBoundedByMaxBlocks tests the bound.
constexpr uint64_t kNoFloor = 64 * kMiB;

class NvmeTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = absl::StrCat(::testing::TempDir(), "/nvme_tier_test/",
                        info->name());
    fs::remove_all(dir_);
    fault_fs_ = std::make_shared<FaultInjectionFileSystem>();
    env_ = rocksdb::NewCompositeEnv(fault_fs_);
    options_.path = dir_ + "/nvme";
    options_.capacity_bytes = 64 * kMiB;
    options_.write_buffer_size = 1 * kMiB;
    options_.blob_file_size = 4 * kMiB;
    options_.max_background_jobs = 2;
    options_.env = env_.get();
  }
  void TearDown() override {
    tier_.reset();
    fs::remove_all(dir_);
  }

  void Open() {
    tier_.reset();
    auto tier = OpenNvmeTier(options_, &clock_);
    ASSERT_OK(tier);
    tier_ = std::move(tier).value();
  }
  void Close() { tier_.reset(); }
  // Deletes records of the closed tier's database behind its back: `kind`
  // 'm' (metadata) or 'd' (bytes), then the id (format 2: namespace
  // length, namespace, key) of each of `keys` in namespace "ns".
  void DeleteRecords(char kind, const std::vector<std::string>& keys) {
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(
        rocksdb::DB::Open(rocksdb::Options(), options_.path, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    for (const std::string& key : keys) {
      ASSERT_TRUE(
          db->Delete({}, absl::StrCat(std::string(1, kind),
                                      std::string(1, '\x02'), "ns", key))
              .ok());
    }
    ASSERT_TRUE(db->Close().ok());
  }

  absl::StatusOr<NvmePutOutcome> Put(const std::string& key,
                                     const std::string& bytes,
                                     const std::string& parent = "",
                                     const std::string& ns = "ns") {
    return tier_->Put(ns, key, parent, bytes, BlockChecksum(bytes));
  }

  absl::StatusOr<std::string> Read(const std::string& key,
                                   const std::string& ns = "ns") {
    auto meta = tier_->Meta(ns, key);
    if (!meta.ok()) return meta.status();
    std::string out(meta->size, '\0');
    absl::Status s = tier_->Read(ns, key, absl::MakeSpan(out));
    if (!s.ok()) return s;
    return out;
  }

  // Reads the block and compares it with `expected` (without printing
  // kilobytes of bytes on a mismatch).
  ::testing::AssertionResult ReadsBack(const std::string& key,
                                       const std::string& expected,
                                       const std::string& ns = "ns") {
    auto got = Read(key, ns);
    if (!got.ok()) {
      return ::testing::AssertionFailure()
             << "reading " << ns << "/" << key << ": " << got.status();
    }
    if (*got != expected) {
      return ::testing::AssertionFailure()
             << ns << "/" << key << " read back " << got->size()
             << " bytes that differ from the " << expected.size()
             << " expected";
    }
    return ::testing::AssertionSuccess();
  }

  // For a Verify sync point: puts `key` on `thread` and waits for it, 10 s
  // at most (a bound against a hang only: the put takes milliseconds unless
  // it waits for the scan). True when the put ended meanwhile. The caller
  // joins `thread` once Verify has returned.
  bool PutBesideTheScan(std::thread& thread, absl::Notification& done,
                        const std::string& key, const std::string& bytes) {
    thread = std::thread([&, key, bytes] {
      EXPECT_OK(Put(key, bytes));
      done.Notify();
    });
    return done.WaitForNotificationWithTimeout(absl::Seconds(10));
  }

  // Copies the tier's directory `from` to `to` as it is now, while the tier
  // runs. A file that RocksDB deletes during the copy (an obsolete one,
  // after a flush or compaction) is left out, as a crash at that moment
  // may leave it out: fs::copy threw "No such file or directory" for it
  // (a clean-clone CI failure, 2026-12-07).
  // RocksDB's background work may flush or compact while the files are
  // copied: a MANIFEST copied after a compaction names a table file made
  // after the listing, an image no crash leaves (seen in CI: "cannot open
  // RocksDB ... 000008.ldb: No such file"). So the copy is taken again
  // until the directory did not change while it was copied.
  static void CopyCrashImage(const std::string& from, const std::string& to) {
    auto listing = [&from] {
      std::map<std::string, uintmax_t> files;  // name -> size
      std::error_code ec;
      for (const fs::directory_entry& e : fs::directory_iterator(from, ec)) {
        std::error_code size_ec;
        const uintmax_t size = e.file_size(size_ec);
        if (!size_ec) files[e.path().filename().string()] = size;
      }
      return files;
    };
    for (int attempt = 0; attempt < 100; ++attempt) {
      const std::map<std::string, uintmax_t> before = listing();
      fs::remove_all(to);
      fs::create_directories(to);
      for (const auto& [name, size] : before) {
        std::error_code ec;
        fs::copy_file(fs::path(from) / name, fs::path(to) / name, ec);
        if (ec && ec != std::errc::no_such_file_or_directory) {
          FAIL() << "copying " << name << ": " << ec.message();
        }
      }
      if (listing() == before) return;
      absl::SleepFor(absl::Milliseconds(10));
    }
    FAIL() << from << " kept changing while it was copied";
  }

  // Opens a copy of the tier's directory as it is now, as a process that
  // was killed now would leave it (its writes are in the page cache, which
  // outlives the process; what RocksDB holds in memory is lost).
  void OpenCrashImage() {
    const std::string image = options_.path + "-crash";
    CopyCrashImage(options_.path, image);
    Close();
    options_.path = image;
    Open();
  }

  // A scrub (Verify) checks `blocks` blocks and drops nothing.
  ::testing::AssertionResult ScrubsClean(uint64_t blocks) {
    absl::StatusOr<NvmeVerifyReport> report = tier_->Verify();
    if (!report.ok()) return ::testing::AssertionFailure() << report.status();
    const uint64_t dropped = report->orphans_dropped + report->missing_dropped +
                             report->corrupt_dropped;
    if (report->blocks_checked != blocks || dropped != 0) {
      return ::testing::AssertionFailure()
             << "scrub checked " << report->blocks_checked << " blocks (expected "
             << blocks << ") and dropped " << dropped;
    }
    return ::testing::AssertionSuccess();
  }

  // Stores blocks 0 .. n-1 of `size` bytes (in one blob file), then
  // reopens the tier with that file gone.
  void StoreBlocksAndRemoveTheirBlobFile(int n, size_t size) {
    Open();
    for (int i = 0; i < n; ++i) ASSERT_OK(Put(Key(i), Bytes(i, size)));
    ASSERT_OK(tier_->Flush());
    Close();
    const std::vector<std::string> blobs = BlobFiles();
    ASSERT_EQ(blobs.size(), 1u);
    ASSERT_TRUE(fs::remove(blobs[0]));
    Open();
  }

  std::vector<std::string> BlobFiles() const { return FilesEndingIn(".blob"); }
  std::vector<std::string> FilesEndingIn(const std::string& extension) const {
    std::vector<std::string> out;
    for (const auto& f : fs::directory_iterator(options_.path)) {
      if (f.path().extension() == extension) out.push_back(f.path().string());
    }
    return out;
  }

  // Flips one byte in the middle of `block`'s bytes in whichever blob file
  // (or, with ".sst", table file) holds them. REQUIRES: the tier is closed.
  void CorruptBlobBytes(const std::string& block,
                        const std::string& extension = ".blob") {
    const std::string probe = block.substr(block.size() / 2 - 16, 32);
    for (const std::string& path : FilesEndingIn(extension)) {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      std::string content((std::istreambuf_iterator<char>(f)),
                          std::istreambuf_iterator<char>());
      size_t pos = content.find(probe);
      if (pos == std::string::npos) continue;
      f.seekp(static_cast<std::streamoff>(pos + 16));
      char flipped = static_cast<char>(content[pos + 16] ^ 0x5a);
      f.write(&flipped, 1);
      ASSERT_TRUE(f.good());
      return;
    }
    FAIL() << "block bytes not found in any " << extension << " file";
  }

  std::string dir_;
  FakeClock clock_;
  std::shared_ptr<FaultInjectionFileSystem> fault_fs_;
  std::unique_ptr<rocksdb::Env> env_;
  NvmeTierOptions options_;
  std::unique_ptr<NvmeTier> tier_;
};

TEST_F(NvmeTierTest, RoundTripsSmallAndBlobBlocksAndIsPutIfAbsent) {
  options_.max_blocks = kNoFloor;  // used_bytes: the charges, as computed
  Open();
  const std::string small = Bytes(1, 100);        // stays in the LSM
  const std::string large = Bytes(2, 64 * kKiB);  // goes to a blob file
  EXPECT_THAT(Put("small", small), IsOkAndHolds(NvmePutOutcome::kStored));
  EXPECT_THAT(Put("large", large), IsOkAndHolds(NvmePutOutcome::kStored));
  EXPECT_TRUE(ReadsBack("small", small));
  EXPECT_TRUE(ReadsBack("large", large));

  // A second put of a stored key writes nothing, even with other bytes.
  const std::string other = Bytes(3, 64 * kKiB);
  EXPECT_THAT(Put("large", other),
              IsOkAndHolds(NvmePutOutcome::kAlreadyPresent));
  EXPECT_TRUE(ReadsBack("large", large));

  ASSERT_OK(tier_->Flush());  // the blob is on disk, not in the memtable
  EXPECT_TRUE(ReadsBack("large", large));
  EXPECT_FALSE(BlobFiles().empty());

  NvmeTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.blocks, 2u);
  EXPECT_EQ(stats.puts, 2u);
  EXPECT_EQ(stats.write_bytes, small.size() + large.size());
  EXPECT_EQ(stats.used_bytes,
            Charge("ns", "small", small.size()) +
                Charge("ns", "large", large.size()));
  EXPECT_EQ(stats.reads, 4u);
  EXPECT_EQ(stats.integrity_errors, 0u);
  EXPECT_GT(stats.disk_bytes, large.size());
  EXPECT_TRUE(stats.writable);

  // Below min_blob_size the bytes live in the LSM, above it in a blob file.
  Close();
  Open();
  const uint64_t blob_reads = fault_fs_->blob_reads();
  EXPECT_TRUE(ReadsBack("small", small));
  EXPECT_EQ(fault_fs_->blob_reads(), blob_reads);
  EXPECT_TRUE(ReadsBack("large", large));
  EXPECT_GT(fault_fs_->blob_reads(), blob_reads);
}

// nvme_direct_reads: blob files are opened with O_DIRECT and every block
// reads back exactly, LSM-resident and blob blocks alike, across a restart
// and through MultiRead and a scrub.
TEST_F(NvmeTierTest, DirectReadsReadBlobsWithODirect) {
  fs::create_directories(dir_);
  if (!::kvdepot::testing::DirectIoWorks(dir_)) {
    GTEST_SKIP() << "the file system of " << dir_ << " refuses O_DIRECT";
  }
  options_.direct_reads = true;
  Open();
  const std::string small = Bytes(1, 100);
  EXPECT_THAT(Put("small", small), IsOkAndHolds(NvmePutOutcome::kStored));
  for (int i = 0; i < 8; ++i) ASSERT_OK(Put(Key(i), Bytes(i, 64 * kKiB + i)));
  ASSERT_OK(tier_->Flush());
  Close();
  Open();
  const uint64_t opened = fault_fs_->direct_blob_opens();
  EXPECT_TRUE(ReadsBack("small", small));
  for (int i = 0; i < 8; ++i) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, 64 * kKiB + i))) << i;
  }
  EXPECT_GT(fault_fs_->direct_blob_opens(), opened);
  // A batch, which RocksDB may read with merged aligned requests.
  std::vector<std::string> keys;
  std::vector<std::string> bufs;
  for (int i = 7; i >= 0; --i) {
    keys.push_back(Key(i));
    bufs.emplace_back(64 * kKiB + i, '\0');
  }
  keys.push_back("small");
  bufs.emplace_back(small.size(), '\0');
  std::vector<NvmeReadRequest> reqs;
  for (size_t k = 0; k < keys.size(); ++k) {
    reqs.push_back(NvmeReadRequest{keys[k], absl::MakeSpan(bufs[k])});
  }
  std::vector<absl::Status> statuses =
      tier_->MultiRead("ns", absl::MakeSpan(reqs));
  ASSERT_EQ(statuses.size(), keys.size());
  for (size_t k = 0; k < keys.size(); ++k) {
    EXPECT_OK(statuses[k]) << keys[k];
    const int i = 7 - static_cast<int>(k);
    EXPECT_TRUE(bufs[k] == (k < 8 ? Bytes(i, 64 * kKiB + i) : small))
        << keys[k];
  }
  auto report = tier_->Verify();
  ASSERT_OK(report);
  EXPECT_EQ(report->blocks_checked, 9u);
  EXPECT_EQ(report->corrupt_dropped, 0u);
  EXPECT_EQ(tier_->Stats().integrity_errors, 0u);

  // Without the option the same files are read through the page cache.
  Close();
  options_.direct_reads = false;
  Open();
  const uint64_t direct = fault_fs_->direct_blob_opens();
  EXPECT_TRUE(ReadsBack(Key(3), Bytes(3, 64 * kKiB + 3)));
  EXPECT_EQ(fault_fs_->direct_blob_opens(), direct);
}

// A file system that refuses O_DIRECT is found at open, with a message
// naming the setting, rather than by every read failing afterwards.
TEST_F(NvmeTierTest, DirectReadsOnAFileSystemWithoutThemFailOpen) {
  options_.direct_reads = true;
  fault_fs_->SetRefuseDirectReads(true);
  auto tier = OpenNvmeTier(options_, &clock_);
  EXPECT_THAT(tier.status(), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(std::string(tier.status().message()),
              HasSubstr("nvme_direct_reads"));
  // Nothing was left behind, and buffered reads open the same directory.
  EXPECT_FALSE(fs::exists(options_.path + "/DIRECT_READ_PROBE"));
  options_.direct_reads = false;
  Open();
  ASSERT_OK(Put(Key(1), Bytes(1, 64 * kKiB)));
  EXPECT_TRUE(ReadsBack(Key(1), Bytes(1, 64 * kKiB)));
  Close();

  // On a full disk no probe file can be written: the tier's own CURRENT is
  // read instead, so the refusal is still found as such.
  fault_fs_->SetDiskFull(true);
  options_.direct_reads = true;
  tier = OpenNvmeTier(options_, &clock_);
  EXPECT_THAT(tier.status(), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(std::string(tier.status().message()),
              HasSubstr("nvme_direct_reads"));
  EXPECT_THAT(std::string(tier.status().message()), HasSubstr("CURRENT"));
  fault_fs_->SetDiskFull(false);
}

TEST_F(NvmeTierTest, KeysAreEncodedUnambiguouslyPerNamespace) {
  Open();
  // Same concatenation "abc", different (namespace, key) pairs.
  const std::string a = Bytes(1, 5000), b = Bytes(2, 5000);
  ASSERT_OK(Put("bc", a, "", "a"));
  ASSERT_OK(Put("c", b, "", "ab"));
  EXPECT_TRUE(ReadsBack("bc", a, "a"));
  EXPECT_TRUE(ReadsBack("c", b, "ab"));
  EXPECT_FALSE(tier_->Contains("a", "c"));
  EXPECT_FALSE(tier_->Contains("ab", "bc"));
  // Keys are opaque bytes, NULs included.
  const std::string binary_key("\0\x01\xff\0", 4);
  ASSERT_OK(Put(binary_key, a));
  EXPECT_TRUE(ReadsBack(binary_key, a));
  EXPECT_FALSE(tier_->Contains("ns", std::string("\0\x01\xff", 3)));
}

TEST_F(NvmeTierTest, MetadataAndExistenceNeverReadBlobs) {
  Open();
  for (int i = 0; i < 10; ++i) {
    ASSERT_OK(Put(Key(i), Bytes(i, 32 * kKiB), i == 0 ? "" : Key(i - 1)));
  }
  Close();
  Open();  // nothing cached: any blob access would show as a read
  const uint64_t before = fault_fs_->blob_reads();
  for (int i = 0; i < 10; ++i) {
    EXPECT_TRUE(tier_->Contains("ns", Key(i)));
    auto meta = tier_->Meta("ns", Key(i));
    ASSERT_OK(meta);
    EXPECT_EQ(meta->size, 32 * kKiB);
    EXPECT_EQ(meta->checksum, BlockChecksum(Bytes(i, 32 * kKiB)));
    EXPECT_EQ(meta->parent, i == 0 ? "" : Key(i - 1));
    EXPECT_EQ(meta->read_count, 0u);
  }
  EXPECT_FALSE(tier_->Contains("ns", Key(10)));
  EXPECT_THAT(tier_->Meta("ns", Key(10)), StatusIs(Code::kNotFound));
  int listed = 0;
  tier_->ForEachBlock([&](const NvmeBlockView&) { ++listed; });
  EXPECT_EQ(listed, 10);
  EXPECT_EQ(tier_->Stats().blocks, 10u);
  EXPECT_EQ(fault_fs_->blob_reads(), before);

  // A real read does touch the blob file (the counter works).
  EXPECT_TRUE(ReadsBack(Key(3), Bytes(3, 32 * kKiB)));
  EXPECT_GT(fault_fs_->blob_reads(), before);
}

TEST_F(NvmeTierTest, WarmRestartServesEveryBlockWithoutReadingBlobs) {
  Open();
  std::map<std::string, std::string> blocks;
  for (int i = 0; i < 60; ++i) {
    // Sizes on both sides of min_blob_size, two namespaces, chains.
    size_t size = (i % 3 == 0) ? 1000 + i : 16 * kKiB + i;
    std::string ns = i % 2 ? "model-a/tp0" : "model-b/tp1";
    ASSERT_OK(Put(Key(i), Bytes(i, size), i >= 2 ? Key(i - 2) : "", ns));
    blocks[ns + "|" + Key(i)] = Bytes(i, size);
  }
  EXPECT_TRUE(ReadsBack(Key(7), Bytes(7, 16 * kKiB + 7), "model-a/tp0"));
  EXPECT_TRUE(ReadsBack(Key(7), Bytes(7, 16 * kKiB + 7), "model-a/tp0"));
  const NvmeTierStats before = tier_->Stats();
  Close();

  const uint64_t blob_reads = fault_fs_->blob_reads();
  Open();
  EXPECT_EQ(fault_fs_->blob_reads(), blob_reads) << "Open read a blob";
  const NvmeTierStats after = tier_->Stats();
  EXPECT_EQ(after.blocks, 60u);
  EXPECT_EQ(after.used_bytes, before.used_bytes);

  std::map<std::string, std::string> listed;
  tier_->ForEachBlock([&](const NvmeBlockView& b) {
    listed[absl::StrCat(b.ns, "|", b.key)] = std::string(b.parent);
    EXPECT_EQ(b.checksum, BlockChecksum(blocks[absl::StrCat(b.ns, "|", b.key)]));
  });
  EXPECT_EQ(listed.size(), 60u);
  EXPECT_EQ(listed["model-b/tp1|" + Key(4)], Key(2));
  EXPECT_EQ(listed["model-a/tp0|" + Key(1)], "");

  for (int i = 0; i < 60; ++i) {
    std::string ns = i % 2 ? "model-a/tp0" : "model-b/tp1";
    EXPECT_TRUE(ReadsBack(Key(i), blocks[ns + "|" + Key(i)], ns))
        << i;
  }
  // Read counts survived the restart (2 reads before, 1 since).
  EXPECT_EQ(tier_->Meta("model-a/tp0", Key(7))->read_count, 3u);
}

TEST_F(NvmeTierTest, DeleteIsImmediateAndDurable) {
  options_.max_blocks = kNoFloor;  // used_bytes: the charge, as computed
  Open();
  ASSERT_OK(Put("a", Bytes(1, 8 * kKiB)));
  ASSERT_OK(Put("b", Bytes(2, 8 * kKiB)));
  EXPECT_OK(tier_->Delete("ns", "a"));
  EXPECT_FALSE(tier_->Contains("ns", "a"));
  EXPECT_THAT(Read("a"), StatusIs(Code::kNotFound));
  EXPECT_THAT(tier_->Delete("ns", "a"), StatusIs(Code::kNotFound));
  EXPECT_EQ(tier_->Stats().used_bytes, Charge("ns", "b", 8 * kKiB));
  Close();
  Open();
  EXPECT_FALSE(tier_->Contains("ns", "a"));
  EXPECT_TRUE(ReadsBack("b", Bytes(2, 8 * kKiB)));
  // A deleted key can be stored again.
  EXPECT_THAT(Put("a", Bytes(1, 8 * kKiB)),
              IsOkAndHolds(NvmePutOutcome::kStored));
}

TEST_F(NvmeTierTest, EvictsLeastRecentlyUsedFirst) {
  constexpr size_t kSize = 16 * kKiB;
  options_.capacity_bytes = 10 * Charge("ns", Key(0), kSize);
  Open();
  for (int i = 0; i < 10; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  EXPECT_EQ(tier_->Stats().evictions, 0u);

  ASSERT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));                  // read: 0 becomes most recent
  ASSERT_OK(Put(Key(1), Bytes(1, kSize)));  // existing put: 1 as well
  ASSERT_OK(Put(Key(10), Bytes(10, kSize)));
  EXPECT_FALSE(tier_->Contains("ns", Key(2)));  // the least recent went
  for (int i : {0, 1, 3, 9, 10}) EXPECT_TRUE(tier_->Contains("ns", Key(i)));
  ASSERT_OK(Put(Key(11), Bytes(11, kSize)));
  EXPECT_FALSE(tier_->Contains("ns", Key(3)));
  EXPECT_TRUE(tier_->Contains("ns", Key(4)));

  NvmeTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.evictions, 2u);
  EXPECT_EQ(stats.evicted_bytes, 2 * kSize);
  EXPECT_EQ(stats.blocks, 10u);
  EXPECT_LE(stats.used_bytes, stats.capacity_bytes);

  // Recency survives a restart: 4 is now the least recent, then 5.
  Close();
  Open();
  ASSERT_OK(Put(Key(12), Bytes(12, kSize)));
  EXPECT_FALSE(tier_->Contains("ns", Key(4)));
  EXPECT_TRUE(tier_->Contains("ns", Key(5)));
  EXPECT_TRUE(tier_->Contains("ns", Key(0)));
}

// Chains are cut from their ends: a block whose child is stored goes only
// after that child, whatever their recency, and whichever of the two reached
// the tier first (DRAM demotes children before parents).
TEST_F(NvmeTierTest, EvictionTakesLeavesBeforeTheirParents) {
  constexpr size_t kSize = 16 * kKiB;
  // Keys c0..c2 (chain c0 <- c1 <- c2) and x, y are all 8 bytes long.
  const std::string c0 = "chain-00", c1 = "chain-01", c2 = "chain-02";
  const uint64_t charge = Charge("ns", c0, kSize, c0.size());
  options_.capacity_bytes = 5 * charge;
  for (bool child_first : {false, true}) {
    SCOPED_TRACE(child_first ? "children stored first" : "parents first");
    Open();
    if (child_first) {
      ASSERT_OK(Put(c2, Bytes(2, kSize), c1));
      ASSERT_OK(Put(c1, Bytes(1, kSize), c0));
      ASSERT_OK(Put(c0, Bytes(0, kSize)));
    } else {
      ASSERT_OK(Put(c0, Bytes(0, kSize)));
      ASSERT_OK(Put(c1, Bytes(1, kSize), c0));
      ASSERT_OK(Put(c2, Bytes(2, kSize), c1));
    }
    ASSERT_OK(Put(Key(1), Bytes(11, kSize)));
    ASSERT_OK(Put(Key(2), Bytes(12, kSize)));
    // The chain's root and middle are now the least recently used blocks;
    // plain LRU would evict them first.
    ASSERT_TRUE(ReadsBack(c2, Bytes(2, kSize)));
    ASSERT_TRUE(ReadsBack(Key(1), Bytes(11, kSize)));
    ASSERT_TRUE(ReadsBack(Key(2), Bytes(12, kSize)));

    std::vector<std::string> order;
    std::vector<std::string> all = {c0, c1, c2, Key(1), Key(2)};
    for (int i = 0; i < 5; ++i) {
      ASSERT_OK(Put(Key(100 + i), Bytes(100 + i, kSize)));
      for (const std::string& k : all) {
        if (!tier_->Contains("ns", k) &&
            std::find(order.begin(), order.end(), k) == order.end()) {
          order.push_back(k);
        }
      }
    }
    // The leaves by recency (c2, Key(1), Key(2)), each parent right after
    // its last child goes.
    EXPECT_THAT(order, ::testing::ElementsAre(c2, c1, c0, Key(1), Key(2)));
    EXPECT_LE(tier_->Stats().used_bytes, options_.capacity_bytes);
    Close();
    fs::remove_all(dir_);
  }
}

// The links are rebuilt from the records at open: after a restart the root
// of a chain still outlives its own child and an unrelated leaf used after
// it.
TEST_F(NvmeTierTest, PrefixOrderSurvivesRestart) {
  constexpr size_t kSize = 16 * kKiB;
  const std::string c0 = "chain-00", c1 = "chain-01";
  options_.capacity_bytes = 3 * Charge("ns", c0, kSize, c0.size());
  Open();
  ASSERT_OK(Put(c1, Bytes(1, kSize), c0));
  ASSERT_OK(Put(c0, Bytes(0, kSize)));  // older than Key(1) below, a parent
  ASSERT_OK(Put(Key(1), Bytes(11, kSize)));
  ASSERT_TRUE(ReadsBack(c1, Bytes(1, kSize)));
  Close();
  Open();
  ASSERT_OK(Put(Key(2), Bytes(12, kSize)));
  EXPECT_FALSE(tier_->Contains("ns", Key(1)));  // least recent leaf
  EXPECT_TRUE(tier_->Contains("ns", c0));
  ASSERT_OK(Put(Key(3), Bytes(13, kSize)));
  EXPECT_FALSE(tier_->Contains("ns", c1));
  EXPECT_TRUE(tier_->Contains("ns", c0));
  ASSERT_OK(Put(Key(4), Bytes(14, kSize)));
  EXPECT_FALSE(tier_->Contains("ns", c0));  // a leaf now, at the old end
  EXPECT_TRUE(tier_->Contains("ns", Key(2)));
  EXPECT_TRUE(tier_->Contains("ns", Key(3)));
}

// Parent links a client made up (a block naming itself, two blocks naming
// each other) never make blocks unevictable: puts keep succeeding and the
// tier stays within its capacity.
TEST_F(NvmeTierTest, ParentCyclesDoNotBlockEviction) {
  constexpr size_t kSize = 16 * kKiB;
  options_.capacity_bytes = 4 * Charge("ns", Key(0), kSize, Key(0).size());
  Open();
  ASSERT_OK(Put(Key(0), Bytes(0, kSize), Key(0)));
  ASSERT_OK(Put(Key(1), Bytes(1, kSize), Key(2)));
  ASSERT_OK(Put(Key(2), Bytes(2, kSize), Key(1)));
  for (int i = 3; i < 20; ++i) {
    ASSERT_OK(Put(Key(i), Bytes(i, kSize), Key(i - 1)));
    ASSERT_LE(tier_->Stats().used_bytes, options_.capacity_bytes);
  }
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(tier_->Contains("ns", Key(i))) << i;
  EXPECT_EQ(tier_->Stats().blocks, 4u);
}

TEST_F(NvmeTierTest, FourTimesCapacityStaysBoundedAndLosesNothingReported) {
  constexpr size_t kSize = 16 * kKiB;
  options_.capacity_bytes = 1 * kMiB;
  Open();
  const uint64_t per_block = Charge("ns", Key(100), kSize);
  const int total = static_cast<int>(4 * options_.capacity_bytes / kSize);
  for (int i = 0; i < total; ++i) {
    ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
    ASSERT_LE(tier_->Stats().used_bytes, options_.capacity_bytes);
    if (i % 7 == 0 && i >= 20) {
      // Keep an older block hot; it must survive the churn.
      ASSERT_TRUE(ReadsBack(Key(20), Bytes(20, kSize)));
    }
  }
  NvmeTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.blocks + stats.evictions, static_cast<uint64_t>(total));
  EXPECT_GE(stats.used_bytes + per_block, options_.capacity_bytes)
      << "eviction freed more than needed";
  EXPECT_TRUE(tier_->Contains("ns", Key(20)));

  // Every block the tier reports is served, intact, before and after a
  // restart.
  auto check_all = [&] {
    uint64_t present = 0;
    for (int i = 0; i < total; ++i) {
      if (!tier_->Contains("ns", Key(i))) continue;
      ++present;
      EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
    }
    EXPECT_EQ(present, tier_->Stats().blocks);
    return present;
  };
  uint64_t present = check_all();
  Close();
  Open();
  EXPECT_EQ(check_all(), present);
}

// A flood of tiny blocks: each is charged at least capacity_bytes /
// max_blocks, so the tier holds at most max_blocks of them (its index's
// heap grows with their number, and is rebuilt at every open), and charges
// them the same when it reopens. Blocks charged more than that are charged
// as before. A reopen with a lower bound evicts down to it.
TEST_F(NvmeTierTest, TinyBlocksAreBoundedByMaxBlocks) {
  options_.capacity_bytes = 1 * kMiB;
  options_.max_blocks = 128;  // 8 KiB each at least
  Open();
  for (int i = 0; i < 500; ++i) {
    ASSERT_OK(Put(Key(i), Bytes(i, 1)));
    ASSERT_LE(tier_->Stats().blocks, 128u) << i;
  }
  NvmeTierStats st = tier_->Stats();
  EXPECT_EQ(st.blocks, 128u);
  EXPECT_EQ(st.used_bytes, 128 * 8 * kKiB);
  EXPECT_EQ(st.evictions, 500u - 128u);
  EXPECT_THAT(Read(Key(499)), IsOkAndHolds(Bytes(499, 1)));
  EXPECT_EQ(tier_->Meta("ns", Key(499))->size, 1u);

  // A block above the floor costs its own charge (three tiny ones make room).
  const std::string big = Bytes(1000, 20000);
  ASSERT_OK(Put("big", big));
  st = tier_->Stats();
  EXPECT_EQ(st.blocks, 126u);
  const uint64_t used = 125 * 8 * kKiB + Charge("ns", "big", big.size());
  EXPECT_EQ(st.used_bytes, used);

  Close();
  Open();
  st = tier_->Stats();
  EXPECT_EQ(st.blocks, 126u);
  EXPECT_EQ(st.used_bytes, used);
  EXPECT_THAT(Read("big"), IsOkAndHolds(big));

  Close();
  options_.max_blocks = 64;  // 16 KiB each at least
  Open();
  EXPECT_LE(tier_->Stats().blocks, 64u);
  EXPECT_LE(tier_->Stats().used_bytes, options_.capacity_bytes);
}

// The default bound is one block per kNvmeDefaultBlockBytes of capacity; a
// capacity under that needs an explicit one.
TEST_F(NvmeTierTest, TheDefaultBoundIsOneBlockPer16KiB) {
  EXPECT_EQ(NvmeTierMaxBlocks(64 * kMiB, 0), 4096u);
  EXPECT_EQ(NvmeTierMaxBlocks(64 * kMiB, 10), 10u);
  options_.capacity_bytes = 8 * kKiB;
  EXPECT_THAT(OpenNvmeTier(options_, &clock_),
              StatusIs(Code::kInvalidArgument));
  options_.max_blocks = 1;
  Open();
  ASSERT_OK(Put(Key(1), Bytes(1, 1)));
  EXPECT_EQ(tier_->Stats().used_bytes, 8 * kKiB);
}

TEST_F(NvmeTierTest, ShrunkCapacityEvictsOldestAtOpen) {
  constexpr size_t kSize = 8 * kKiB;
  Open();
  for (int i = 0; i < 20; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  Close();
  options_.capacity_bytes = 5 * Charge("ns", Key(10), kSize);
  options_.max_blocks = kNoFloor;  // 5 blocks of 8 KiB
  Open();
  NvmeTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.blocks, 5u);
  EXPECT_LE(stats.used_bytes, options_.capacity_bytes);
  for (int i = 0; i < 15; ++i) EXPECT_FALSE(tier_->Contains("ns", Key(i))) << i;
  for (int i = 15; i < 20; ++i) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
}

TEST_F(NvmeTierTest, ByteFlippedInBlobFileIsDataLossAndDropped) {
  constexpr size_t kSize = 64 * kKiB;
  Open();
  for (int i = 0; i < 8; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  Close();
  CorruptBlobBytes(Bytes(3, kSize));
  Open();

  std::string buf(kSize, '\0');
  absl::Status s = tier_->Read("ns", Key(3), absl::MakeSpan(buf));
  EXPECT_THAT(s, StatusIs(Code::kDataLoss));
  EXPECT_THAT(std::string(s.message()), HasSubstr("dropped"));
  EXPECT_EQ(tier_->Stats().integrity_errors, 1u);
  EXPECT_FALSE(tier_->Contains("ns", Key(3)));
  EXPECT_THAT(Read(Key(3)), StatusIs(Code::kNotFound));
  for (int i : {0, 1, 2, 4, 5, 6, 7}) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
  EXPECT_EQ(tier_->Stats().blocks, 7u);
  EXPECT_EQ(tier_->Stats().integrity_errors, 1u);

  // The drop was durable: the block does not come back after a restart.
  Close();
  Open();
  EXPECT_FALSE(tier_->Contains("ns", Key(3)));
  EXPECT_EQ(tier_->Stats().blocks, 7u);
}

// One corrupt blob must not cost the tier its writes. Compact's forced blob
// garbage collection relocates every live blob, the corrupt one too, and
// RocksDB fails that compaction with Corruption: a background error that
// stops writes and that DB::Resume does not clear. The contract holds
// anyway: the bad block is dropped and counted, and the tier writes again.
TEST_F(NvmeTierTest, ACorruptBlobDoesNotStopWritesAfterACompaction) {
  constexpr size_t kSize = 64 * kKiB;
  Open();
  for (int i = 0; i < 8; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  Close();
  CorruptBlobBytes(Bytes(3, kSize));
  Open();

  // The compaction scrubs the bad block away and compacts again.
  absl::Status compacted = tier_->Compact();
  EXPECT_OK(compacted);
  clock_.Advance(options_.resume_interval);
  EXPECT_THAT(Put(Key(100), Bytes(100, kSize)),
              IsOkAndHolds(NvmePutOutcome::kStored))
      << "Compact returned " << compacted;
  NvmeTierStats stats = tier_->Stats();
  EXPECT_TRUE(stats.writable) << stats.write_error;
  EXPECT_FALSE(tier_->Contains("ns", Key(3)));
  EXPECT_EQ(stats.integrity_errors, 1u);
  for (int i : {0, 1, 2, 4, 5, 6, 7, 100}) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
  // And the state lasts: a second compaction and a restart change nothing.
  EXPECT_OK(tier_->Compact());
  Close();
  Open();
  EXPECT_TRUE(tier_->Stats().writable);
  EXPECT_FALSE(tier_->Contains("ns", Key(3)));
  EXPECT_EQ(tier_->Stats().blocks, 8u);
  EXPECT_THAT(Put(Key(101), Bytes(101, kSize)),
              IsOkAndHolds(NvmePutOutcome::kStored));
}

// A corrupt table file is another matter: small blocks live in the LSM, and
// deleting their keys does not take the bad bytes out of the file; every
// compaction of it fails. Suppressed like a blob's, that error left RocksDB
// retrying the compaction for ever while level-0 files piled up, until it
// stopped writes without an error: every put, delete and flush hung. The
// tier now stops its writes with a clear error instead, and reads go on.
TEST_F(NvmeTierTest, ACorruptTableFileStopsWritesWithAClearError) {
  constexpr size_t kSize = 1000;  // under the blob threshold: in the .sst
  // RocksDB's message names the file, in the tier's directory: a directory
  // named for blobs makes it no blob's.
  options_.path = dir_ + "/blobstore.blob";
  Open();
  for (int i = 0; i < 20; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());
  Close();
  CorruptBlobBytes(Bytes(5, kSize), ".sst");
  Open();

  EXPECT_FALSE(tier_->Compact().ok());
  NvmeTierStats stats = tier_->Stats();
  EXPECT_FALSE(stats.writable);
  EXPECT_THAT(stats.write_error,
              HasSubstr("table file of the NVMe tier is corrupt"));
  // Refused at once, with that error; not a hang.
  absl::StatusOr<NvmePutOutcome> put = Put(Key(100), Bytes(100, kSize));
  EXPECT_THAT(put.status(), StatusIs(Code::kUnavailable));
  EXPECT_THAT(std::string(put.status().message()), HasSubstr("moved away"));
  clock_.Advance(options_.resume_interval);
  EXPECT_THAT(Put(Key(101), Bytes(101, kSize)).status(),
              StatusIs(Code::kUnavailable));
  // Reads go on: each block is served intact or not at all.
  int intact = 0;
  for (int i = 0; i < 20; ++i) {
    std::string buf(kSize, '\0');
    absl::Status s = tier_->Read("ns", Key(i), absl::MakeSpan(buf));
    if (s.ok()) {
      EXPECT_EQ(buf, Bytes(i, kSize)) << i;
      ++intact;
    } else {
      EXPECT_THAT(s, StatusIs(Code::kDataLoss)) << i;
    }
  }
  EXPECT_GE(intact, 10);
  EXPECT_FALSE(tier_->Contains("ns", Key(5)));
}

// A block whose bytes cannot be read (an I/O error: a bad sector, here its
// blob file gone) was left indexed: found by every lookup, missed by every
// read, refused as "stored already" to a put, for good; and the scrub
// stopped at it. Now reads and scrubs drop it, and it can be put again.
TEST_F(NvmeTierTest, BlocksThatCannotBeReadAreDroppedAndCanBePutAgain) {
  constexpr size_t kSize = 64 * kKiB;
  StoreBlocksAndRemoveTheirBlobFile(4, kSize);
  ASSERT_TRUE(tier_->Contains("ns", Key(0)));

  std::string buf(kSize, '\0');
  absl::Status s = tier_->Read("ns", Key(0), absl::MakeSpan(buf));
  EXPECT_THAT(s, StatusIs(Code::kDataLoss));
  EXPECT_THAT(std::string(s.message()), HasSubstr("could not be read"));
  EXPECT_FALSE(tier_->Contains("ns", Key(0)));
  EXPECT_EQ(tier_->Stats().integrity_errors, 1u);

  // The scrub goes past them and drops the rest.
  absl::StatusOr<NvmeVerifyReport> report = tier_->Verify();
  ASSERT_OK(report.status());
  EXPECT_EQ(report->corrupt_dropped, 3u);
  EXPECT_EQ(report->blocks_checked, 0u);
  EXPECT_EQ(tier_->Stats().blocks, 0u);
  EXPECT_EQ(tier_->Stats().integrity_errors, 4u);
  for (int i = 0; i < 4; ++i) EXPECT_FALSE(tier_->Contains("ns", Key(i))) << i;

  // Put again, they are served.
  for (int i = 0; i < 4; ++i) {
    EXPECT_THAT(Put(Key(i), Bytes(i, kSize)),
                IsOkAndHolds(NvmePutOutcome::kStored))
        << i;
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
  EXPECT_TRUE(tier_->Stats().writable) << tier_->Stats().write_error;
}

// An I/O error that passes (a controller reset, a sector the drive
// retries) dropped the block for good: a burst of promotions during a
// reset of a few seconds emptied the tier of what it read. A read now
// tries once more, in the same snapshot, and serves the block if that
// works; a MultiRead (a batch of promotions) tries each block again.
TEST_F(NvmeTierTest, AReadThatMeetsAnIoErrorOnceIsTriedAgain) {
  constexpr size_t kSize = 64 * kKiB;
  Open();
  for (int i = 0; i < 4; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());
  // The blob file is open: each read below is one read of it.
  ASSERT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));
  fault_fs_->FailNextBlobReads(1);
  EXPECT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));
  EXPECT_TRUE(tier_->Contains("ns", Key(0)));
  NvmeTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.read_retries, 1u);
  EXPECT_EQ(stats.integrity_errors, 0u);
  EXPECT_EQ(stats.unreadable_kept, 0u);

  // A batch whose read fails (one read of the file for all of them).
  std::vector<std::string> keys, bufs(4, std::string(kSize, '\0'));
  for (int i = 0; i < 4; ++i) keys.push_back(Key(i));
  std::vector<NvmeReadRequest> requests;
  for (int i = 0; i < 4; ++i) {
    requests.push_back({keys[i], absl::MakeSpan(bufs[i])});
  }
  fault_fs_->FailNextBlobReads(1);
  std::vector<absl::Status> results = tier_->MultiRead("ns", requests);
  for (int i = 0; i < 4; ++i) {
    EXPECT_OK(results[i]) << i;
    EXPECT_TRUE(bufs[i] == Bytes(i, kSize)) << i;
    EXPECT_TRUE(tier_->Contains("ns", Key(i))) << i;
  }
  stats = tier_->Stats();
  EXPECT_GE(stats.read_retries, 2u);
  EXPECT_EQ(stats.integrity_errors, 0u);
  EXPECT_EQ(stats.blocks, 4u);
}

// A read whose retry fails too is a miss (Unavailable), and the block
// stays: the device may be failing for a few seconds more (a controller
// reset), and the next read serves it. (Dropped at once, it was lost for
// good.)
TEST_F(NvmeTierTest, ABlockThatCannotBeReadOnceIsAMissAndStays) {
  constexpr size_t kSize = 64 * kKiB;
  Open();
  for (int i = 0; i < 2; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());
  ASSERT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));  // the blob file is open
  // The read and its retry fail.
  fault_fs_->FailNextBlobReads(2);
  std::string buf(kSize, '\0');
  absl::Status s = tier_->Read("ns", Key(0), absl::MakeSpan(buf));
  EXPECT_THAT(s, StatusIs(Code::kUnavailable));
  EXPECT_THAT(std::string(s.message()), HasSubstr("Input/output error"));
  EXPECT_TRUE(tier_->Contains("ns", Key(0)));
  NvmeTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.read_retries, 1u);
  EXPECT_EQ(stats.unreadable_kept, 1u);
  EXPECT_EQ(stats.integrity_errors, 0u);
  EXPECT_EQ(stats.blocks, 2u);
  EXPECT_FALSE(stats.read_error_burst);

  // The next read serves it, and clears the mark: one more failure, later,
  // is again only a miss.
  EXPECT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));
  fault_fs_->FailNextBlobReads(2);
  EXPECT_THAT(tier_->Read("ns", Key(0), absl::MakeSpan(buf)),
              StatusIs(Code::kUnavailable));
  EXPECT_TRUE(tier_->Contains("ns", Key(0)));
  EXPECT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));
  EXPECT_EQ(tier_->Stats().integrity_errors, 0u);

  // Nothing was deleted on disk either.
  Close();
  Open();
  EXPECT_EQ(tier_->Stats().blocks, 2u);
  EXPECT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));
  EXPECT_TRUE(ReadsBack(Key(1), Bytes(1, kSize)));
}

// A block that cannot be read on two separate reads (each tried twice) is
// dropped, as a corrupt one: left indexed, it would be a miss for good and
// refused as "stored already" to a put.
TEST_F(NvmeTierTest, ABlockThatCannotBeReadOnTwoReadsIsDropped) {
  constexpr size_t kSize = 64 * kKiB;
  Open();
  for (int i = 0; i < 2; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());
  ASSERT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));  // the blob file is open
  std::string buf(kSize, '\0');
  fault_fs_->FailNextBlobReads(2);
  EXPECT_THAT(tier_->Read("ns", Key(0), absl::MakeSpan(buf)),
              StatusIs(Code::kUnavailable));
  EXPECT_TRUE(tier_->Contains("ns", Key(0)));
  fault_fs_->FailNextBlobReads(2);
  absl::Status s = tier_->Read("ns", Key(0), absl::MakeSpan(buf));
  EXPECT_THAT(s, StatusIs(Code::kDataLoss));
  EXPECT_THAT(std::string(s.message()), HasSubstr("dropped"));
  EXPECT_FALSE(tier_->Contains("ns", Key(0)));
  NvmeTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.integrity_errors, 1u);
  EXPECT_EQ(stats.blocks, 1u);
  EXPECT_TRUE(stats.writable) << stats.write_error;
  EXPECT_TRUE(ReadsBack(Key(1), Bytes(1, kSize)));
  EXPECT_THAT(Put(Key(0), Bytes(0, kSize)),
              IsOkAndHolds(NvmePutOutcome::kStored));
  EXPECT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));
}

// A device that fails reads for a while fails every block read meanwhile,
// twice over for the hot ones: dropping each on its second failure
// emptied the tier of what it was asked for. Past 64 distinct blocks
// within 10 s it is the device, not the blocks: none is dropped for an I/O
// error (reads, scrubs), the stats and the LOG say so, and once the device
// is back every block is served.
TEST_F(NvmeTierTest, ABurstOfUnreadableBlocksDropsNone) {
  constexpr int kBlocks = 80;  // more than the bound's 64
  constexpr size_t kSize = 8 * kKiB;
  Open();
  for (int i = 0; i < kBlocks; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());
  ASSERT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));  // the blob file is open
  // Every read fails, until further notice.
  fault_fs_->FailNextBlobReads(1 << 30);
  std::string buf(kSize, '\0');
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < kBlocks; ++i) {
      EXPECT_THAT(tier_->Read("ns", Key(i), absl::MakeSpan(buf)),
                  StatusIs(Code::kUnavailable))
          << round << " " << i;
    }
  }
  absl::StatusOr<NvmeVerifyReport> report = tier_->Verify();
  ASSERT_OK(report.status());
  EXPECT_EQ(report->corrupt_dropped, 0u);
  EXPECT_EQ(report->unreadable_kept, static_cast<uint64_t>(kBlocks));
  NvmeTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.blocks, static_cast<uint64_t>(kBlocks));
  EXPECT_EQ(stats.integrity_errors, 0u);
  EXPECT_EQ(stats.unreadable_kept, static_cast<uint64_t>(kBlocks));
  EXPECT_EQ(stats.unreadable_drops_held, 2u * kBlocks);
  EXPECT_TRUE(stats.read_error_burst);
  std::ifstream log(options_.path + "/LOG");
  const std::string lines((std::istreambuf_iterator<char>(log)),
                          std::istreambuf_iterator<char>());
  EXPECT_THAT(lines, HasSubstr("the device is failing"));

  fault_fs_->FailNextBlobReads(0);
  clock_.Advance(absl::Seconds(11));
  EXPECT_FALSE(tier_->Stats().read_error_burst);
  for (int i = 0; i < kBlocks; ++i) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
}

// A scrub is a read like any other: it keeps a block that cannot be read
// (the first time), and drops it when the next scrub cannot read it
// either.
TEST_F(NvmeTierTest, AScrubDropsABlockOnlyWhenItCannotBeReadTwice) {
  constexpr size_t kSize = 64 * kKiB;
  Open();
  for (int i = 0; i < 4; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());
  ASSERT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));  // the blob file is open
  fault_fs_->FailNextBlobReads(1 << 30);
  absl::StatusOr<NvmeVerifyReport> report = tier_->Verify();
  ASSERT_OK(report.status());
  EXPECT_EQ(report->unreadable_kept, 4u);
  EXPECT_EQ(report->corrupt_dropped, 0u);
  EXPECT_EQ(tier_->Stats().blocks, 4u);
  report = tier_->Verify();
  ASSERT_OK(report.status());
  EXPECT_EQ(report->unreadable_kept, 0u);
  EXPECT_EQ(report->corrupt_dropped, 4u);
  fault_fs_->FailNextBlobReads(0);
  NvmeTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.blocks, 0u);
  EXPECT_EQ(stats.integrity_errors, 4u);
  EXPECT_TRUE(stats.writable) << stats.write_error;
}

// The same blocks met by a compaction first (blob garbage collection reads
// every live blob): the I/O error stopped the tier's writes until a
// restart, and every restart again at the next such compaction. The
// compaction now scrubs them away and compacts again, as for a corrupt blob.
TEST_F(NvmeTierTest, ACompactionThatCannotReadABlobScrubsAndWritesGoOn) {
  constexpr size_t kSize = 64 * kKiB;
  StoreBlocksAndRemoveTheirBlobFile(4, kSize);

  EXPECT_OK(tier_->Compact());
  NvmeTierStats stats = tier_->Stats();
  EXPECT_TRUE(stats.writable) << stats.write_error;
  EXPECT_EQ(stats.blocks, 0u);
  EXPECT_EQ(stats.integrity_errors, 4u);
  EXPECT_THAT(Put(Key(100), Bytes(100, kSize)),
              IsOkAndHolds(NvmePutOutcome::kStored));
  EXPECT_TRUE(ReadsBack(Key(100), Bytes(100, kSize)));
  Close();
  Open();
  EXPECT_TRUE(tier_->Stats().writable);
  EXPECT_EQ(tier_->Stats().blocks, 1u);
  EXPECT_OK(tier_->Compact());
}

// A compaction that meets blocks with I/O errors scrubs; that scrub only
// marks them (an I/O error may pass), so when the compaction fails again a
// second scrub drops the blocks that still cannot be read and the
// compaction goes through, writes on.
TEST_F(NvmeTierTest,
       ACompactionThatMeetsIoErrorsDropsTheBlocksThatKeepFailing) {
  constexpr size_t kSize = 64 * kKiB;
  Open();
  for (int i = 0; i < 4; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());
  ASSERT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));  // the blob file is open
  fault_fs_->FailNextBlobReads(1 << 30);
  EXPECT_OK(tier_->Compact());
  fault_fs_->FailNextBlobReads(0);
  NvmeTierStats stats = tier_->Stats();
  EXPECT_TRUE(stats.writable) << stats.write_error;
  EXPECT_EQ(stats.blocks, 0u);
  EXPECT_EQ(stats.integrity_errors, 4u);
  EXPECT_THAT(Put(Key(100), Bytes(100, kSize)),
              IsOkAndHolds(NvmePutOutcome::kStored));
  EXPECT_TRUE(ReadsBack(Key(100), Bytes(100, kSize)));
  EXPECT_OK(tier_->Compact());
}

// An I/O error of the process, not of the block (out of file descriptors:
// RocksDB opens a blob file at its first read), passes: the block is kept
// and the read is Unavailable, not dropped as unreadable.
TEST_F(NvmeTierTest, AReadThatFailsForWantOfFileDescriptorsDropsNothing) {
  constexpr size_t kSize = 64 * kKiB;
  Open();
  for (int i = 0; i < 4; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());
  Close();
  Open();  // the blob file is not open yet
  rlimit saved;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  absl::Status read;
  {
    absl::Cleanup restore = [&] { setrlimit(RLIMIT_NOFILE, &saved); };
    // A new descriptor takes the lowest free number: none is below this.
    int lowest_free = 0;
    while (fcntl(lowest_free, F_GETFD) != -1) ++lowest_free;
    rlimit tight = saved;
    tight.rlim_cur = static_cast<rlim_t>(lowest_free);
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &tight), 0);
    std::string buf(kSize, '\0');
    read = tier_->Read("ns", Key(0), absl::MakeSpan(buf));
  }
  EXPECT_THAT(read, StatusIs(Code::kUnavailable));
  EXPECT_TRUE(tier_->Contains("ns", Key(0)));
  EXPECT_EQ(tier_->Stats().integrity_errors, 0u);
  for (int i = 0; i < 4; ++i)
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
}

// MakeWritesDurable waits for the puts begun before it (their evictions are
// not listed any more), not for those begun after: under steady demotions
// puts overlap, and waiting for none to be in flight held an admin evict
// for its whole 10 s bound, then went on without the guarantee.
TEST_F(NvmeTierTest, MakeWritesDurableWaitsOnlyForPutsBegunBeforeIt) {
  Open();
  ASSERT_FALSE(options_.use_wal);
  std::atomic<int> writes{0};
  absl::Notification a_held, release_a, b_held, release_b;
  internal::SyncPointCallback hold("NvmeTier::Put:Writing", [&](void*) {
    if (writes.fetch_add(1) == 0) {
      a_held.Notify();
      release_a.WaitForNotification();
    } else {
      b_held.Notify();
      release_b.WaitForNotification();
    }
  });
  std::thread a([&] { EXPECT_OK(Put(Key(1), Bytes(1, 4 * kKiB)).status()); });
  a_held.WaitForNotification();
  absl::Notification durable;
  absl::Status durable_status;
  std::thread m([&] {
    durable_status = tier_->MakeWritesDurable();
    durable.Notify();
  });
  // It waits for the put begun before it.
  EXPECT_FALSE(durable.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  std::thread b([&] { EXPECT_OK(Put(Key(2), Bytes(2, 4 * kKiB)).status()); });
  b_held.WaitForNotification();
  release_a.Notify();
  // Not for the one begun after (held until the end).
  EXPECT_TRUE(durable.WaitForNotificationWithTimeout(absl::Seconds(8)))
      << "waited for a put begun after it";
  release_b.Notify();
  a.join();
  b.join();
  m.join();
  EXPECT_OK(durable_status);
  EXPECT_TRUE(ReadsBack(Key(1), Bytes(1, 4 * kKiB)));
}

TEST_F(NvmeTierTest, MultiReadMixesHitsMissesAndCorruptBlocks) {
  constexpr size_t kSize = 32 * kKiB;
  Open();
  for (int i = 0; i < 4; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  Close();
  CorruptBlobBytes(Bytes(2, kSize));
  Open();

  const std::vector<std::string> keys = {
      Key(0),  // hit
      Key(9),  // miss
      Key(2),  // corrupt
      "",      // bad key
      Key(3),  // hit
      Key(1),  // wrong destination size
      Key(1),  // hit
  };
  std::vector<std::string> bufs(keys.size(), std::string(kSize, '\0'));
  bufs[5].resize(kSize - 1);
  std::vector<NvmeReadRequest> requests;
  for (size_t i = 0; i < keys.size(); ++i) {
    requests.push_back({keys[i], absl::MakeSpan(bufs[i])});
  }
  std::vector<absl::Status> results = tier_->MultiRead("ns", requests);
  ASSERT_EQ(results.size(), requests.size());
  EXPECT_OK(results[0]);
  EXPECT_THAT(results[1], StatusIs(Code::kNotFound));
  EXPECT_THAT(results[2], StatusIs(Code::kDataLoss));
  EXPECT_THAT(results[3], StatusIs(Code::kInvalidArgument));
  EXPECT_OK(results[4]);
  EXPECT_THAT(results[5], StatusIs(Code::kInvalidArgument));
  EXPECT_OK(results[6]);
  EXPECT_EQ(bufs[0], Bytes(0, kSize));
  EXPECT_EQ(bufs[4], Bytes(3, kSize));
  EXPECT_EQ(bufs[6], Bytes(1, kSize));
  EXPECT_FALSE(tier_->Contains("ns", Key(2)));
  EXPECT_EQ(tier_->Stats().integrity_errors, 1u);
  EXPECT_EQ(tier_->Meta("ns", Key(1))->read_count, 1u);

  // A bad namespace fails every request.
  for (const absl::Status& r : tier_->MultiRead("bad ns", requests)) {
    EXPECT_THAT(r, StatusIs(Code::kInvalidArgument));
  }
}

// MultiRead reports the checksum it verified the bytes against: that of the
// block as stored when it read, not of an earlier Meta, whose block may
// have been replaced meanwhile by other bytes of the same size (a promotion
// publishes what it read). A failed request leaves its checksum alone.
TEST_F(NvmeTierTest, MultiReadReportsTheChecksumItVerified) {
  constexpr size_t kSize = 16 * kKiB;
  Open();
  ASSERT_OK(Put(Key(0), Bytes(0, kSize)));
  ASSERT_OK(Put(Key(1), Bytes(1, kSize)));
  auto before = tier_->Meta("ns", Key(0));
  ASSERT_OK(before);
  ASSERT_OK(tier_->Delete("ns", Key(0)));
  ASSERT_OK(Put(Key(0), Bytes(100, kSize)));
  ASSERT_OK(tier_->Delete("ns", Key(1)));
  ASSERT_OK(Put(Key(1), Bytes(1, 2 * kSize)));  // another size

  const std::string keys[2] = {Key(0), Key(1)};
  std::string replaced(kSize, '\0'), resized(kSize, '\0');
  uint64_t replaced_sum = 0, resized_sum = 7;
  std::vector<NvmeReadRequest> requests = {
      {keys[0], absl::MakeSpan(replaced), &replaced_sum},
      {keys[1], absl::MakeSpan(resized), &resized_sum},
  };
  std::vector<absl::Status> results = tier_->MultiRead("ns", requests);
  ASSERT_EQ(results.size(), 2u);
  ASSERT_OK(results[0]);
  EXPECT_EQ(replaced, Bytes(100, kSize));
  EXPECT_EQ(replaced_sum, BlockChecksum(Bytes(100, kSize)));
  EXPECT_NE(replaced_sum, before->checksum);
  EXPECT_THAT(results[1], StatusIs(Code::kInvalidArgument));
  EXPECT_EQ(resized_sum, 7u);
}

// A field of /proc/self/status in KiB ("VmRSS:", "VmHWM:"), or -1.
int64_t ProcStatusKiB(absl::string_view field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (!absl::StartsWith(line, field)) continue;
    return std::strtoll(line.c_str() + field.size(), nullptr, 10);
  }
  return -1;
}

// RocksDB copies every value a MultiGet returns onto the heap, and a
// promotion reads into DRAM slots it has already taken: one MultiGet of a
// whole batch (up to 1024 blocks of up to 256 MiB) would hold the batch's
// bytes twice, the second time outside the DRAM tier's bound. MultiRead
// reads in chunks of bounded bytes instead. Measured as the process's peak
// resident memory (VmHWM, reset through /proc/self/clear_refs) over the
// read of a 256 MiB batch into a destination touched beforehand: what is
// measured is memory, not time, so the machine's load does not matter, and
// the peak is exact where sampling the RSS could miss it.
TEST_F(NvmeTierTest, MultiReadOfALargeBatchHoldsOnlyAChunkOfItOnTheHeap) {
  constexpr int kBlocks = 64;
  constexpr size_t kSize = 4 * kMiB;
  options_.capacity_bytes = 512 * kMiB;
  Open();
  std::vector<std::string> keys;
  {
    std::string bytes(kSize, '\0');
    for (int i = 0; i < kBlocks; ++i) {
      keys.push_back(Key(i));
      std::memset(bytes.data(), 'a' + i % 26, kSize);
      std::memcpy(bytes.data(), keys[i].data(), keys[i].size());
      ASSERT_OK(Put(keys[i], bytes));
    }
  }
  ASSERT_OK(tier_->Flush());  // read from blob files, as in real use
  // Like the DRAM arena: every page resident before the read.
  std::vector<char> dest(kBlocks * kSize, 1);
  std::vector<NvmeReadRequest> requests;
  for (int i = 0; i < kBlocks; ++i) {
    requests.push_back({keys[i], absl::MakeSpan(dest.data() + i * kSize, kSize)});
  }
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";  // VmHWM := VmRSS (Linux 4.0 and later)
    if (!clear.flush()) GTEST_SKIP() << "cannot reset VmHWM";
  }
  const int64_t before = ProcStatusKiB("VmRSS:");
  ASSERT_GT(before, 0);
  ASSERT_LE(ProcStatusKiB("VmHWM:"), before + 1024) << "VmHWM was not reset";
  std::vector<absl::Status> results = tier_->MultiRead("ns", requests);
  const int64_t peak = ProcStatusKiB("VmHWM:");

  ASSERT_EQ(results.size(), requests.size());
  for (int i = 0; i < kBlocks; ++i) {
    ASSERT_OK(results[i]) << i;
    const char* block = dest.data() + i * kSize;
    EXPECT_EQ(absl::string_view(block, keys[i].size()), keys[i]);
    EXPECT_EQ(block[kSize - 1], 'a' + i % 26) << i;
  }
  EXPECT_LT(peak - before, 96 * 1024)
      << "reading " << (kBlocks * kSize >> 20) << " MiB into memory already "
      << "resident raised the peak RSS by " << (peak - before) / 1024 << " MiB";
}

// MultiRead plans under the index lock and reads afterwards. A block
// deleted and put again with other bytes (or another size) in between is
// read as it was planned (its bytes under its checksum) or missed, never
// as the new bytes checked against the old checksum: that would be a false
// integrity error. Nothing is counted corrupt and the new blocks stay.
TEST_F(NvmeTierTest, ABlockReplacedWhileAMultiReadRunsIsNoIntegrityError) {
  constexpr size_t kSize = 16 * kKiB;
  Open();
  ASSERT_OK(Put(Key(0), Bytes(0, kSize)));
  ASSERT_OK(Put(Key(1), Bytes(1, kSize)));
  ASSERT_OK(tier_->Flush());  // read from blob files, as in real use
  {
    bool replaced = false;
    internal::SyncPointCallback replace(
        "NvmeTier::MultiRead:Planned", [&](void*) {
          if (std::exchange(replaced, true)) return;
          EXPECT_OK(tier_->Delete("ns", Key(0)));
          EXPECT_OK(Put(Key(0), Bytes(100, kSize)));  // same size
          EXPECT_OK(tier_->Delete("ns", Key(1)));
          EXPECT_OK(Put(Key(1), Bytes(101, 2 * kSize)));  // another size
        });
    const std::string keys[2] = {Key(0), Key(1)};
    std::string got[2] = {std::string(kSize, '\0'), std::string(kSize, '\0')};
    uint64_t sums[2] = {7, 7};
    std::vector<NvmeReadRequest> requests = {
        {keys[0], absl::MakeSpan(got[0]), &sums[0]},
        {keys[1], absl::MakeSpan(got[1]), &sums[1]},
    };
    std::vector<absl::Status> results = tier_->MultiRead("ns", requests);
    ASSERT_TRUE(replaced);
    ASSERT_EQ(results.size(), 2u);
    for (int i = 0; i < 2; ++i) {
      if (results[i].ok()) {  // the block as planned
        EXPECT_TRUE(got[i] == Bytes(i, kSize)) << i;
        EXPECT_EQ(sums[i], BlockChecksum(Bytes(i, kSize))) << i;
      } else {
        EXPECT_THAT(results[i], StatusIs(Code::kNotFound)) << i;
      }
    }
  }
  NvmeTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.integrity_errors, 0u);
  EXPECT_EQ(stats.orphans_dropped, 0u);
  EXPECT_EQ(stats.blocks, 2u);
  EXPECT_TRUE(ReadsBack(Key(0), Bytes(100, kSize)));
  EXPECT_TRUE(ReadsBack(Key(1), Bytes(101, 2 * kSize)));
}

// Blocks deleted or evicted while Verify scans, before the scan reaches
// them, are still in the scan's snapshot but gone from the index. They are
// not bytes without metadata: no orphan is counted (a false integrity
// alarm), and a put of such an id after the scan passed it goes through at
// once instead of waiting for the scan to end (the evictor demoting it
// again would stall for the whole scan).
TEST_F(NvmeTierTest, VerifyTakesNoBlockDeletedDuringTheScanForAnOrphan) {
  constexpr size_t kSize = 16 * kKiB;
  options_.capacity_bytes = 10 * Charge("ns", Key(0), kSize);
  Open();
  for (int i = 0; i < 10; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());
  // Least recent first: 3, 4, ..., 9, 0, 1, 2.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(ReadsBack(Key(i), Bytes(i, kSize)));

  absl::Notification reput_done;
  bool reput_during_scan = false;
  std::thread reput;
  {
    internal::SyncPointCallback scanned(
        "NvmeTier::Verify:Scanned", [&](void* arg) {
          const std::string& id = *static_cast<std::string*>(arg);
          if (absl::EndsWith(id, Key(0))) {
            // Ahead of the scan: 3 deleted, 4 evicted by the put of 21.
            EXPECT_OK(tier_->Delete("ns", Key(3)));
            EXPECT_OK(Put(Key(20), Bytes(20, kSize)));
            EXPECT_OK(Put(Key(21), Bytes(21, kSize)));
            EXPECT_FALSE(tier_->Contains("ns", Key(4)));
          } else if (absl::EndsWith(id, Key(8))) {
            // The scan has passed 3 (and 4): put 3 again, beside it.
            reput_during_scan =
                PutBesideTheScan(reput, reput_done, Key(3), Bytes(3, kSize));
          }
        });
    auto report = tier_->Verify();
    if (reput.joinable()) reput.join();
    ASSERT_OK(report);
    EXPECT_EQ(report->orphans_dropped, 0u);
    EXPECT_EQ(report->missing_dropped, 0u);
    EXPECT_EQ(report->corrupt_dropped, 0u);
    EXPECT_EQ(report->blocks_checked, 8u);  // 0-2 and 5-9
  }
  EXPECT_TRUE(reput_during_scan) << "the put waited for the scan to end";
  NvmeTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.orphans_dropped, 0u);
  EXPECT_EQ(stats.integrity_errors, 0u);
  EXPECT_EQ(stats.blocks, 10u);
  EXPECT_TRUE(ReadsBack(Key(3), Bytes(3, kSize)));
  EXPECT_TRUE(ReadsBack(Key(20), Bytes(20, kSize)));
  EXPECT_TRUE(ReadsBack(Key(21), Bytes(21, kSize)));
  // (Real orphans are still found: HalfWrittenBlocksAreDroppedNotServed.)
}

// A block put again while Verify starts (indexed, its records not yet
// written when the scan's snapshot is taken) is not judged by the bytes
// that snapshot holds under its id: those of an earlier block whose delete
// failed (a full disk), which stay on disk. Verify used to drop the new,
// good block as corrupt (a false integrity error, a critical alert).
TEST_F(NvmeTierTest, VerifyDoesNotJudgeABlockBeingWrittenByOlderBytes) {
  constexpr size_t kSize = 16 * kKiB;
  Open();
  ASSERT_OK(Put(Key(1), Bytes(1, kSize)));
  ASSERT_OK(Put(Key(2), Bytes(2, kSize)));
  ASSERT_OK(tier_->Flush());
  fault_fs_->SetDiskFull(true);
  ASSERT_FALSE(tier_->Delete("ns", Key(1)).ok());  // its records stay
  fault_fs_->SetDiskFull(false);
  clock_.Advance(options_.resume_interval);

  absl::Notification writing, snapshot_taken, put_done;
  std::thread reput;
  {
    internal::SyncPointCallback held("NvmeTier::Put:Writing", [&](void*) {
      if (snapshot_taken.HasBeenNotified()) return;
      writing.Notify();
      snapshot_taken.WaitForNotification();
    });
    internal::SyncPointCallback taken("NvmeTier::Verify:Snapshot", [&](void*) {
      snapshot_taken.Notify();
      put_done.WaitForNotification();  // lands before the scan reads
    });
    reput = std::thread([&] {
      EXPECT_THAT(Put(Key(1), Bytes(101, kSize)),
                  IsOkAndHolds(NvmePutOutcome::kStored));
      put_done.Notify();
    });
    writing.WaitForNotification();
    auto report = tier_->Verify();
    reput.join();
    ASSERT_OK(report);
    EXPECT_EQ(report->corrupt_dropped, 0u);
    EXPECT_EQ(report->blocks_checked, 2u);
  }
  EXPECT_EQ(tier_->Stats().integrity_errors, 0u);
  EXPECT_TRUE(ReadsBack(Key(1), Bytes(101, kSize)));
  EXPECT_TRUE(ReadsBack(Key(2), Bytes(2, kSize)));
}

// Verify drops what it finds as it goes: a put of an orphan's id (bytes
// without metadata) made after the scan met it waits only for that delete,
// not for the rest of the scan.
TEST_F(NvmeTierTest, APutOfAnOrphansIdDoesNotWaitForTheScanToEnd) {
  constexpr size_t kSize = 16 * kKiB;
  Open();
  for (int i = 0; i < 10; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  Close();
  ASSERT_NO_FATAL_FAILURE(DeleteRecords('m', {Key(3)}));  // an orphan
  Open();
  ASSERT_FALSE(tier_->Contains("ns", Key(3)));

  absl::Notification put_done;
  bool put_during_scan = false;
  std::thread put;
  {
    internal::SyncPointCallback scanned(
        "NvmeTier::Verify:Scanned", [&](void* arg) {
          if (!absl::EndsWith(*static_cast<std::string*>(arg), Key(8))) return;
          put_during_scan = PutBesideTheScan(put, put_done, Key(3), Bytes(3, kSize));
        });
    auto report = tier_->Verify();
    if (put.joinable()) put.join();
    ASSERT_OK(report);
    EXPECT_EQ(report->orphans_dropped, 1u);
    EXPECT_EQ(report->blocks_checked, 9u);
    EXPECT_EQ(report->snapshots, 1u);  // scrub_snapshot_bytes: 1 GiB
  }
  EXPECT_TRUE(put_during_scan) << "the put waited for the scan to end";
  EXPECT_TRUE(ReadsBack(Key(3), Bytes(3, kSize)));
  EXPECT_EQ(tier_->Stats().blocks, 10u);
}

// A scrub goes on in a fresh RocksDB snapshot after every
// scrub_snapshot_bytes it reads (a snapshot keeps the blob files of blocks
// deleted meanwhile on disk: one held through the scrub of a large tier
// held back the space of hours of evictions), and judges as through one:
// blocks deleted, put or put again ahead of it are neither reported nor
// dropped, and a real orphan is still found.
TEST_F(NvmeTierTest, AScrubGoesOnInFreshSnapshots) {
  constexpr size_t kSize = 16 * kKiB;
  options_.scrub_snapshot_bytes = kSize;  // a fresh one after every block
  Open();
  for (int i = 0; i < 10; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  Close();
  ASSERT_NO_FATAL_FAILURE(DeleteRecords('m', {Key(3)}));  // an orphan
  Open();
  {
    internal::SyncPointCallback scanned(
        "NvmeTier::Verify:Scanned", [&](void* arg) {
          if (!absl::EndsWith(*static_cast<std::string*>(arg), Key(1))) return;
          // Ahead of the scan: in the snapshot it reads now, not in the
          // next one.
          EXPECT_OK(tier_->Delete("ns", Key(5)));
          EXPECT_OK(tier_->Delete("ns", Key(8)));
          EXPECT_OK(Put(Key(8), Bytes(108, kSize)));
          EXPECT_OK(Put(Key(20), Bytes(20, kSize)));
        });
    auto report = tier_->Verify();
    ASSERT_OK(report);
    EXPECT_EQ(report->orphans_dropped, 1u);
    EXPECT_EQ(report->corrupt_dropped, 0u);
    EXPECT_EQ(report->missing_dropped, 0u);
    EXPECT_EQ(report->blocks_checked, 7u);  // 0, 1, 2, 4, 6, 7 and 9
    // One more than the blocks it met: a fresh one after each.
    EXPECT_GE(report->snapshots, report->blocks_checked + 1);
  }
  NvmeTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.integrity_errors, 0u);
  EXPECT_EQ(stats.orphans_dropped, 1u);
  EXPECT_EQ(stats.blocks, 9u);  // 0-2, 4, 6-9 and 20
  EXPECT_FALSE(tier_->Contains("ns", Key(3)));
  EXPECT_FALSE(tier_->Contains("ns", Key(5)));
  EXPECT_TRUE(ReadsBack(Key(8), Bytes(108, kSize)));
  EXPECT_TRUE(ReadsBack(Key(20), Bytes(20, kSize)));
  EXPECT_TRUE(ReadsBack(Key(9), Bytes(9, kSize)));
}

// Shutdown cuts a scrub short: StopMaintenance ends a Verify in progress at
// its next block (Cancelled) and refuses later Verify and Compact calls,
// while puts and reads go on.
TEST_F(NvmeTierTest, StopMaintenanceCutsAScrubShortAndRefusesNewOnes) {
  constexpr size_t kSize = 16 * kKiB;
  Open();
  for (int i = 0; i < 10; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  int scanned = 0;
  {
    internal::SyncPointCallback stop("NvmeTier::Verify:Scanned", [&](void*) {
      if (++scanned == 2) tier_->StopMaintenance();
    });
    EXPECT_THAT(tier_->Verify(), StatusIs(absl::StatusCode::kCancelled));
  }
  EXPECT_LE(scanned, 3);  // it stopped at the next block, not at the end
  EXPECT_THAT(tier_->Verify(), StatusIs(absl::StatusCode::kCancelled));
  EXPECT_THAT(tier_->Compact(), StatusIs(absl::StatusCode::kCancelled));
  EXPECT_EQ(tier_->Stats().integrity_errors, 0u);
  ASSERT_OK(Put(Key(10), Bytes(10, kSize)));
  for (int i = 0; i <= 10; ++i) EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
}

// A caller that gives up (kvdepotctl's Ctrl-C) ends its scrub at the next
// block; the tier is not stopped by it: the next scrub runs to the end.
TEST_F(NvmeTierTest, AScrubWhoseCallerGaveUpStopsAtTheNextBlock) {
  constexpr size_t kSize = 16 * kKiB;
  Open();
  for (int i = 0; i < 10; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  int asked = 0;
  auto report = tier_->Verify([&] { return ++asked > 3; });
  EXPECT_THAT(report, StatusIs(absl::StatusCode::kCancelled));
  EXPECT_LE(asked, 5);  // asked before each block: stopped after 3 of 10
  auto full = tier_->Verify();
  ASSERT_OK(full);
  EXPECT_EQ(full->blocks_checked, 10u);
}

TEST_F(NvmeTierTest, VerifyDropsCorruptBlocks) {
  constexpr size_t kSize = 16 * kKiB;
  Open();
  for (int i = 0; i < 12; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  Close();
  CorruptBlobBytes(Bytes(4, kSize));
  CorruptBlobBytes(Bytes(9, kSize));
  Open();

  auto report = tier_->Verify();
  ASSERT_OK(report);
  EXPECT_EQ(report->blocks_checked, 10u);
  EXPECT_EQ(report->bytes_checked, 10 * kSize);
  EXPECT_EQ(report->corrupt_dropped, 2u);
  EXPECT_EQ(report->missing_dropped, 0u);
  EXPECT_EQ(report->orphans_dropped, 0u);
  EXPECT_EQ(tier_->Stats().integrity_errors, 2u);
  EXPECT_FALSE(tier_->Contains("ns", Key(4)));
  EXPECT_FALSE(tier_->Contains("ns", Key(9)));
  for (int i : {0, 3, 5, 8, 11}) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }

  report = tier_->Verify();  // clean now
  ASSERT_OK(report);
  EXPECT_EQ(report->blocks_checked, 10u);
  EXPECT_EQ(report->corrupt_dropped, 0u);
}

// Blocks with only one of their two records cannot be made through the tier
// (both go in one WriteBatch); make them with RocksDB directly, as damaged or
// hand-edited files would.
TEST_F(NvmeTierTest, HalfWrittenBlocksAreDroppedNotServed) {
  constexpr size_t kSize = 8 * kKiB;
  options_.max_blocks = kNoFloor;  // used_bytes: the charges, as computed
  Open();
  for (int i = 0; i < 5; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  Close();
  {
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), options_.path, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    // Format 2 keys: 'm' or 'd', then the id (namespace length, namespace,
    // key).
    auto record = [](char kind, const std::string& key) {
      return absl::StrCat(std::string(1, kind), std::string(1, '\x02'), "ns", key);
    };
    EXPECT_TRUE(db->Delete({}, record('d', Key(1))).ok());  // meta only
    EXPECT_TRUE(db->Delete({}, record('d', Key(2))).ok());  // meta only
    EXPECT_TRUE(db->Delete({}, record('m', Key(3))).ok());  // data only
    ASSERT_TRUE(db->Close().ok());
  }
  Open();
  // The index comes from metadata: 1 and 2 look present, 3 does not.
  EXPECT_TRUE(tier_->Contains("ns", Key(1)));
  EXPECT_FALSE(tier_->Contains("ns", Key(3)));
  EXPECT_THAT(Read(Key(1)), StatusIs(Code::kNotFound));
  EXPECT_FALSE(tier_->Contains("ns", Key(1)));
  EXPECT_EQ(tier_->Stats().orphans_dropped, 1u);

  auto report = tier_->Verify();
  ASSERT_OK(report);
  EXPECT_EQ(report->missing_dropped, 1u);  // Key(2): metadata, no bytes
  EXPECT_EQ(report->orphans_dropped, 1u);  // Key(3): bytes, no metadata
  EXPECT_EQ(report->blocks_checked, 2u);   // Key(0), Key(4)
  EXPECT_FALSE(tier_->Contains("ns", Key(2)));
  EXPECT_EQ(tier_->Stats().blocks, 2u);
  EXPECT_EQ(tier_->Stats().used_bytes, 2 * Charge("ns", Key(0), kSize));

  // All three keys can be stored again, and a second scrub is clean.
  for (int i : {1, 2, 3}) {
    EXPECT_THAT(Put(Key(i), Bytes(i, kSize)),
                IsOkAndHolds(NvmePutOutcome::kStored));
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize)));
  }
  EXPECT_TRUE(ScrubsClean(5u));
}

// The tier leaves min_free_bytes free on its file system: RocksDB meeting
// a full disk through the tier's own writes often cannot resume even once
// space is back (parallel flushes lose their files), and loses what its
// memtables held. Puts past that line are refused, nothing written or
// evicted, and work again once the space is there.
TEST_F(NvmeTierTest, PutsThatWouldLeaveTooLittleFreeSpaceAreRefused) {
  constexpr size_t kSize = 64 * kKiB;
  options_.min_free_bytes = 8 << 20;
  Open();
  ASSERT_OK(Put(Key(1), Bytes(1, kSize)));
  // What the memtables hold counts as used (their flush writes it).
  const uint64_t unflushed = tier_->Stats().unflushed_bytes;
  EXPECT_GE(unflushed, kSize);
  fault_fs_->SetFreeSpace((8 << 20) + unflushed + kSize - 1);  // a byte short
  auto refused = Put(Key(2), Bytes(2, kSize));
  EXPECT_THAT(refused, StatusIs(Code::kUnavailable));
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("file system is nearly full"));
  NvmeTierStats stats = tier_->Stats();
  EXPECT_FALSE(stats.writable);
  EXPECT_THAT(stats.write_error, HasSubstr("leaves 8388608 bytes free"));
  EXPECT_EQ(stats.blocks, 1u);
  EXPECT_FALSE(tier_->Contains("ns", Key(2)));
  EXPECT_TRUE(ReadsBack(Key(1), Bytes(1, kSize)));  // reads go on
  EXPECT_EQ(fault_fs_->injected_errors(), 0u);      // RocksDB never saw it
  // A block stored already needs no write: found, not refused (a promoted
  // block leaving DRAM again is no failed demotion).
  EXPECT_THAT(Put(Key(1), Bytes(1, kSize)),
              IsOkAndHolds(NvmePutOutcome::kAlreadyPresent));

  fault_fs_->SetFreeSpace((8 << 20) + unflushed + kSize);  // just enough
  EXPECT_TRUE(tier_->Stats().writable);  // seen without a put (an idle tier)
  EXPECT_THAT(Put(Key(2), Bytes(2, kSize)),
              IsOkAndHolds(NvmePutOutcome::kStored));
  EXPECT_TRUE(tier_->Stats().writable);
  EXPECT_EQ(tier_->Stats().write_error, "");
  fault_fs_->ClearFreeSpace();  // the real file system: plenty
  EXPECT_THAT(Put(Key(3), Bytes(3, kSize)),
              IsOkAndHolds(NvmePutOutcome::kStored));
  EXPECT_TRUE(ReadsBack(Key(2), Bytes(2, kSize)));
}

// Blocks larger than a memtable fill one each, and six memtables waiting
// for a slow disk hold far more than the default reserve counts: what they
// hold counts as used, so puts stop before their flushes could meet a full
// disk (a review lost 4 of 6 acknowledged 80 MiB blocks that way).
TEST_F(NvmeTierTest, WhatTheMemtablesHoldCountsAgainstTheFreeSpace) {
  constexpr size_t kSize = 8 << 20;
  options_.min_free_bytes = 8 << 20;
  options_.capacity_bytes = uint64_t{1} << 30;
  Open();
  fault_fs_->SetTableFilesHeld(true);  // a disk slower than the puts
  absl::Cleanup release = [&] { fault_fs_->SetTableFilesHeld(false); };
  fault_fs_->SetFreeSpace((8 << 20) + (20 << 20));
  int stored = 0;
  absl::Status refused;
  for (int i = 0; i < 4 && refused.ok(); ++i) {
    absl::StatusOr<NvmePutOutcome> put = Put(Key(i), Bytes(i, kSize));
    if (put.ok()) {
      ++stored;
    } else {
      refused = put.status();
    }
  }
  EXPECT_EQ(stored, 2);
  EXPECT_THAT(refused, StatusIs(Code::kUnavailable));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("nearly full"));
  EXPECT_GE(tier_->Stats().unflushed_bytes, 2 * kSize);
  EXPECT_EQ(fault_fs_->injected_errors(), 0u);
  std::move(release).Invoke();
  fault_fs_->ClearFreeSpace();
  ASSERT_OK(tier_->Flush());
  EXPECT_LT(tier_->Stats().unflushed_bytes, kSize);
  EXPECT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));
  EXPECT_TRUE(ReadsBack(Key(1), Bytes(1, kSize)));
  EXPECT_THAT(Put(Key(2), Bytes(2, kSize)),
              IsOkAndHolds(NvmePutOutcome::kStored));
}

TEST_F(NvmeTierTest, DiskFullFailsPutsCleanlyAndRecovers) {
  constexpr size_t kSize = 64 * kKiB;
  Open();
  for (int i = 0; i < 10; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());

  fault_fs_->SetDiskFull(true);
  // Writes go to the memtable first; the failure surfaces when RocksDB
  // flushes, and from then on every put fails.
  absl::Status failure;
  std::vector<int> stored;
  for (int i = 10; i < 200 && failure.ok(); ++i) {
    auto put = Put(Key(i), Bytes(i, kSize));
    if (put.ok()) {
      stored.push_back(i);
    } else {
      failure = put.status();
    }
  }
  ASSERT_FALSE(failure.ok()) << "no put failed on a full disk";
  EXPECT_THAT(failure, StatusIs(Code::kUnavailable));
  EXPECT_THAT(std::string(failure.message()), HasSubstr("disk full"));
  EXPECT_GT(fault_fs_->injected_errors(), 0u);

  // Fails fast while RocksDB is stopped, with a clear message.
  auto again = Put(Key(500), Bytes(500, kSize));
  EXPECT_THAT(again, StatusIs(Code::kUnavailable));
  EXPECT_THAT(std::string(again.status().message()),
              HasSubstr("not accepting writes"));
  NvmeTierStats stats = tier_->Stats();
  EXPECT_FALSE(stats.writable);
  EXPECT_THAT(stats.write_error, HasSubstr("no space left on device"));
  EXPECT_GE(stats.write_errors, 1u);
  EXPECT_EQ(stats.blocks, 10 + stored.size());
  EXPECT_FALSE(tier_->Contains("ns", Key(500)));

  // Everything stored before still reads.
  for (int i = 0; i < 10; ++i) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
  for (int i : stored) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }

  // Some space comes back, less than the tier leaves free: no resume is
  // tried yet (a resume flushes every memtable; one that fails for want of
  // room can leave RocksDB unable to resume at all).
  fault_fs_->SetDiskFull(false);
  fault_fs_->SetFreeSpace(1 << 20);
  clock_.Advance(options_.resume_interval);
  again = Put(Key(500), Bytes(500, kSize));
  EXPECT_THAT(again, StatusIs(Code::kUnavailable));
  EXPECT_THAT(std::string(again.status().message()),
              HasSubstr("no room to resume yet (1048576 bytes free"));
  // Space comes back: after resume_interval, puts work again.
  fault_fs_->ClearFreeSpace();
  clock_.Advance(options_.resume_interval);
  EXPECT_THAT(Put(Key(500), Bytes(500, kSize)),
              IsOkAndHolds(NvmePutOutcome::kStored));
  EXPECT_TRUE(tier_->Stats().writable);
  EXPECT_EQ(tier_->Stats().write_error, "");
  ASSERT_OK(tier_->Flush());

  // And everything the tier reported survives a restart.
  Close();
  Open();
  EXPECT_EQ(tier_->Stats().blocks, 11 + stored.size());
  for (int i = 0; i < 10; ++i) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
  for (int i : stored) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
  EXPECT_TRUE(ReadsBack(Key(500), Bytes(500, kSize)));
}

// Holds a RocksDB background thread until `release` is notified.
struct BusyThread {
  std::atomic<int>* started;
  absl::Notification* release;
  static void Run(void* arg) {
    auto* self = static_cast<BusyThread*>(arg);
    self->started->fetch_add(1);
    self->release->WaitForNotification();
  }
};

// Waits up to 20 s for `done`.
bool Eventually(const std::function<bool()>& done) {
  for (absl::Time end = absl::Now() + absl::Seconds(20); absl::Now() < end;
       absl::SleepFor(absl::Milliseconds(5))) {
    if (done()) return true;
  }
  return done();
}

// RocksDB 7.8 loses a flush it had scheduled when a background error stops
// it before the flush starts (the job returns without taking its request
// off the queue, and no later one is counted for it), and then DB::Resume
// waits for that flush for good. Made to happen here step by step: one
// flush held while it creates its file, a second one scheduled behind it
// that cannot start (every other flush thread busy), then the disk full.
// The tier must not hang on it (it did, under load, in
// DiskFullFailsPutsCleanlyAndRecovers): writes fail with a clear error,
// reads go on, closing ends, and what was flushed survives.
TEST_F(NvmeTierTest, AFlushRocksDbLostLeavesWritesOffWithoutAHang) {
  constexpr size_t kSize = 64 * kKiB;
  options_.max_background_jobs = 4;       // 2 flushes at a time
  options_.max_write_buffer_number = 4;   // writes go on while one flushes
  options_.resume_stuck_after = absl::Seconds(2);
  Open();
  for (int i = 0; i < 4; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());

  // The flush threads (the process's, shared by every tier): two, one of
  // them busy here, so that a second flush waits behind the first.
  rocksdb::Env* env = env_.get();
  constexpr auto kHigh = rocksdb::Env::Priority::HIGH;
  env->SetBackgroundThreads(2, kHigh);
  std::atomic<int> started{0};
  absl::Notification release;
  BusyThread busy{&started, &release};
  struct Cleanup {  // whatever fails below, nothing stays held
    FaultInjectionFileSystem* fs;
    absl::Notification* release;
    ~Cleanup() {
      fs->SetTableFilesHeld(false);
      if (!release->HasBeenNotified()) release->Notify();
    }
  } cleanup{fault_fs_.get(), &release};
  env->Schedule(&BusyThread::Run, &busy, kHigh);
  ASSERT_TRUE(Eventually([&] { return started.load() == 1; }));

  fault_fs_->SetTableFilesHeld(true);
  int next = 4;
  // Puts until `done`, or until `memtables` memtables' worth of puts went in
  // since the flush above, and then waits for `done`; false when the held
  // flushes are more than one (the second one started: it would not be
  // lost) or a put fails. The bound keeps the puts off RocksDB's write stop
  // (max_write_buffer_number memtables unflushed), where a put would wait
  // for good on the held flush: on a loaded machine the flush thread can
  // take as long to reach its file as the puts take to fill every memtable.
  const int per_memtable = static_cast<int>(options_.write_buffer_size / kSize);
  auto put_until = [&](const std::function<bool()>& done, double memtables) {
    const int last = 4 + static_cast<int>(memtables * per_memtable);
    while (!done() && next < last) {
      if (fault_fs_->held_creations() > 1) return false;
      absl::StatusOr<NvmePutOutcome> put = Put(Key(next), Bytes(next, kSize));
      if (!put.ok()) return false;
      ++next;
    }
    return Eventually(done);
  };
  // A flush held creating its file (the first memtable switches within
  // 1.25 memtables of puts), and another scheduled behind it (the second
  // switch, within 2.5; the write stop needs 4).
  ASSERT_TRUE(put_until([&] { return fault_fs_->held_creations() > 0; }, 1.25))
      << next - 4 << " puts";
  ASSERT_TRUE(
      put_until([&] { return env->GetThreadPoolQueueLen(kHigh) > 0; }, 2.5))
      << fault_fs_->held_creations() << " held, " << next - 4 << " puts";
  fault_fs_->SetDiskFull(true);
  fault_fs_->SetTableFilesHeld(false);  // the held flush fails: RocksDB stops
  // The second flush ran, and returned at once.
  ASSERT_TRUE(Eventually([&] { return env->GetThreadPoolQueueLen(kHigh) == 0; }));
  release.Notify();
  ASSERT_TRUE(Eventually([&] { return !tier_->Stats().writable; }));

  fault_fs_->SetDiskFull(false);
  clock_.Advance(options_.resume_interval);
  // The resume starts, and is waited for only so long...
  auto put = Put(Key(500), Bytes(500, kSize));
  EXPECT_THAT(put, StatusIs(absl::StatusCode::kUnavailable));
  // ... and then taken for stuck: writes stay off, and say why.
  absl::SleepFor(options_.resume_stuck_after);
  put = Put(Key(500), Bytes(500, kSize));
  EXPECT_THAT(put, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(std::string(put.status().message()),
              HasSubstr("writes stay off until kvdepotd restarts"));
  EXPECT_FALSE(tier_->Stats().writable);
  EXPECT_THAT(tier_->Stats().write_error,
              HasSubstr("writes stay off until kvdepotd restarts"));
  // Reads go on.
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;

  // Closing ends (what the lost flush held is lost with the memtables), and
  // the reopened tier has what was flushed, and takes writes.
  Close();
  Open();
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  EXPECT_THAT(Put(Key(500), Bytes(500, kSize)),
              IsOkAndHolds(NvmePutOutcome::kStored));
  EXPECT_TRUE(ReadsBack(Key(500), Bytes(500, kSize)));
}

// A crash image: the files as they are on disk while the tier is open, as
// kill -9 would leave them (the page cache survives a process crash).
TEST_F(NvmeTierTest, CrashLosesOnlyUnflushedWritesWithoutWal) {
  constexpr size_t kSize = 16 * kKiB;
  for (bool wal : {false, true}) {
    SCOPED_TRACE(wal ? "with WAL" : "without WAL");
    options_.use_wal = wal;
    options_.path = absl::StrCat(dir_, "/nvme-", wal);
    Open();
    for (int i = 0; i < 10; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
    ASSERT_OK(tier_->Flush());
    for (int i = 10; i < 15; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
    OpenCrashImage();
    const uint64_t expected = wal ? 15 : 10;
    EXPECT_EQ(tier_->Stats().blocks, expected);
    for (int i = 0; i < 15; ++i) {
      if (static_cast<uint64_t>(i) < expected) {
        EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
      } else {
        EXPECT_FALSE(tier_->Contains("ns", Key(i))) << i;
      }
    }
    EXPECT_TRUE(ScrubsClean(expected));
    Close();
  }
}

// Without the WAL, what the memtables hold reaches the files once its
// oldest write is max_unflushed_age old, though no memtable filled and
// nothing called Flush: a crash then loses only the last seconds of writes.
// That holds for the deletes of evictions as well as for puts.
TEST_F(NvmeTierTest, CrashKeepsWritesOlderThanTheMaxUnflushedAge) {
  constexpr size_t kSize = 16 * kKiB;
  options_.capacity_bytes = 12 * Charge("ns", Key(0), kSize);
  Open();
  for (int i = 0; i < 10; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());
  const uint64_t flushed = tier_->Stats().disk_bytes;
  // Five more: the tier evicts Key(0..2) to make room.
  for (int i = 10; i < 15; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_EQ(tier_->Stats().evictions, 3u);

  clock_.Advance(options_.max_unflushed_age);
  // The flush shows in the live files (a new blob file and table file).
  EXPECT_TRUE(Eventually([&] { return tier_->Stats().disk_bytes > flushed; }))
      << "nothing was flushed " << options_.max_unflushed_age
      << " after the writes";
  OpenCrashImage();
  EXPECT_EQ(tier_->Stats().blocks, 12u);
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(tier_->Contains("ns", Key(i))) << i;
  for (int i = 3; i < 15; ++i) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
  EXPECT_TRUE(ScrubsClean(12u));
}

// Delete (an operator's Evict) goes through the WAL: a deleted block does
// not come back after a crash, however soon after the delete.
TEST_F(NvmeTierTest, ADeletedBlockStaysDeletedAfterACrash) {
  constexpr size_t kSize = 16 * kKiB;
  Open();
  for (int i = 0; i < 5; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());
  ASSERT_OK(tier_->Delete("ns", Key(1)));
  OpenCrashImage();
  EXPECT_FALSE(tier_->Contains("ns", Key(1)));
  EXPECT_EQ(tier_->Stats().blocks, 4u);
  for (int i : {0, 2, 3, 4}) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
}

// A scrub reads for as long as its blocks take (tens of GiB of blocks of up
// to 256 MiB), and the maintenance thread runs it when a compaction met a
// corrupt block: the flush timer must not wait for it. The scrub looks at
// the timer before every block, in its scan and in its second look at the
// blocks the scan did not meet (their bytes missing here), so a write that
// becomes due meanwhile reaches the files. The maintenance thread is held
// at the timer meanwhile, so that only the scrub can flush.
TEST_F(NvmeTierTest, AScrubFlushesWritesThatBecomeDueWhileItRuns) {
  constexpr size_t kSize = 16 * kKiB;
  options_.max_unflushed_age = absl::Milliseconds(40);  // ticks every 10 ms
  for (bool bytes_missing : {false, true}) {
    SCOPED_TRACE(bytes_missing ? "second look" : "scan");
    options_.path = absl::StrCat(dir_, "/nvme-", bytes_missing);
    Open();
    for (int i = 0; i < 10; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
    if (bytes_missing) {
      Close();
      rocksdb::DB* raw = nullptr;
      ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), options_.path, &raw).ok());
      std::unique_ptr<rocksdb::DB> db(raw);
      for (int i = 0; i < 10; ++i) {  // 'd', then the id
        ASSERT_TRUE(
            db->Delete({}, absl::StrCat("d", std::string(1, '\x02'), "ns", Key(i)))
                .ok());
      }
      ASSERT_TRUE(db->Close().ok());
      db.reset();
      Open();
    }
    ASSERT_OK(tier_->Flush());

    // Shared with the callback, which the held thread may still be in
    // when this iteration ends.
    struct Held {
      absl::Notification parked, release;
      std::atomic<bool> wrote{false};
    };
    auto held = std::make_shared<Held>();
    auto release = absl::MakeCleanup([held] {
      if (!held->release.HasBeenNotified()) held->release.Notify();
    });
    const std::thread::id scrubber = std::this_thread::get_id();
    const std::string image = options_.path + "-crash";
    {
      internal::SyncPointCallback timer("NvmeTier::FlushIfDue", [this, held, scrubber](void*) {
        if (std::this_thread::get_id() != scrubber) {  // the maintenance thread
          if (!held->parked.HasBeenNotified()) held->parked.Notify();
          held->release.WaitForNotification();
          return;
        }
        // The scrub's first look at the timer: a write that is due now.
        if (!held->wrote.exchange(true)) {
          EXPECT_OK(Put(Key(100), Bytes(100, kSize)));
          clock_.Advance(options_.max_unflushed_age);
        }
      });
      ASSERT_TRUE(held->parked.WaitForNotificationWithTimeout(absl::Seconds(10)));
      absl::StatusOr<NvmeVerifyReport> report = tier_->Verify();
      ASSERT_OK(report);
      EXPECT_EQ(report->blocks_checked, bytes_missing ? 0u : 10u);
      EXPECT_EQ(report->missing_dropped, bytes_missing ? 10u : 0u);
      EXPECT_TRUE(held->wrote.load()) << "the scrub never looked at the timer";
      // A crash now, the maintenance thread still held, keeps the write.
      CopyCrashImage(options_.path, image);
    }
    std::move(release).Invoke();
    Close();
    options_.path = image;
    Open();
    EXPECT_TRUE(tier_->Contains("ns", Key(100)));
    if (!bytes_missing) {
      EXPECT_TRUE(ScrubsClean(11u));
    }
    Close();
  }
}

TEST_F(NvmeTierTest, CompactReclaimsSpaceOfDeletedBlocks) {
  constexpr size_t kSize = 64 * kKiB;
  Open();
  for (int i = 0; i < 40; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());
  EXPECT_GE(tier_->Stats().disk_bytes, 40 * kSize);
  for (int i = 1; i < 40; ++i) ASSERT_OK(tier_->Delete("ns", Key(i)));
  ASSERT_OK(tier_->Compact());
  NvmeTierStats stats = tier_->Stats();
  EXPECT_LT(stats.disk_bytes, 4 * kSize)
      << stats.blob_garbage_bytes << " bytes of blob garbage";
  EXPECT_EQ(stats.blob_garbage_bytes, 0u);
  EXPECT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));
  Close();
  Open();
  EXPECT_EQ(tier_->Stats().blocks, 1u);
  EXPECT_TRUE(ReadsBack(Key(0), Bytes(0, kSize)));
}

// Compacting rewrites the live data beside the old files: on a file system
// with too little room for that it refuses, writing nothing (it filled the
// disk and stopped the tier's writes); with room for part of it, it
// rewrites the oldest blob files a part at a time.
TEST_F(NvmeTierTest, CompactFitsTheRoomTheFileSystemHas) {
  constexpr size_t kSize = 64 * kKiB;
  options_.min_free_bytes = 8 << 20;
  Open();
  for (int i = 0; i < 40; ++i) {
    ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
    if (i % 10 == 9) {
      ASSERT_OK(tier_->Flush());  // several blob files
    }
  }
  for (int i = 0; i < 40; i += 2) ASSERT_OK(tier_->Delete("ns", Key(i)));
  ASSERT_OK(tier_->Flush());
  const uint64_t before = tier_->Stats().disk_bytes;
  ASSERT_GE(before, 40 * kSize);

  // Room for one block's worth: refused, no blob file written or removed
  // (only the tables may be, to count the deletes' garbage), nothing lost.
  std::vector<std::string> blob_files = BlobFiles();
  std::sort(blob_files.begin(), blob_files.end());
  fault_fs_->LimitFreeSpace((8 << 20) + tier_->Stats().unflushed_bytes + kSize);
  absl::Status refused = tier_->Compact();
  EXPECT_THAT(refused, StatusIs(Code::kFailedPrecondition));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("free space there"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("bytes free"));
  EXPECT_EQ(fault_fs_->injected_errors(), 0u);
  EXPECT_GE(fault_fs_->lowest_free_space(), uint64_t{8} << 20);
  EXPECT_TRUE(tier_->Stats().writable);
  std::vector<std::string> blob_files_after = BlobFiles();
  std::sort(blob_files_after.begin(), blob_files_after.end());
  EXPECT_EQ(blob_files_after, blob_files);
  EXPECT_EQ(tier_->Stats().blocks, 20u);

  // Room for most of it: done, in parts if need be; the deleted blocks'
  // space comes back.
  fault_fs_->LimitFreeSpace((8 << 20) + tier_->Stats().unflushed_bytes +
                            30 * kSize);
  ASSERT_OK(tier_->Compact());
  EXPECT_EQ(fault_fs_->injected_errors(), 0u);
  EXPECT_LT(tier_->Stats().disk_bytes, before - 10 * kSize);
  EXPECT_TRUE(tier_->Stats().writable);
  fault_fs_->ClearFreeSpace();
  for (int i = 1; i < 40; i += 2) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
}

// A caller that gives up (Ctrl-C, its deadline) ends the compaction: it
// held the one-at-a-time maintenance slot (a cron's verify refused
// meanwhile) until it was done, however long.
TEST_F(NvmeTierTest, ACompactWhoseCallerGaveUpStops) {
  constexpr size_t kSize = 64 * kKiB;
  Open();
  for (int i = 0; i < 20; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());
  for (int i = 0; i < 20; i += 2) ASSERT_OK(tier_->Delete("ns", Key(i)));
  fault_fs_->HoldNextTableFile();  // its flush or its first output
  std::atomic<bool> gave_up{false};
  absl::Status compacted;
  std::thread compact(
      [&] { compacted = tier_->Compact([&] { return gave_up.load(); }); });
  const bool held =
      Eventually([&] { return fault_fs_->held_creations() == 1; });
  gave_up.store(true);
  absl::SleepFor(absl::Milliseconds(200));  // the tier asks every 50 ms
  fault_fs_->ReleaseNextTableFile();
  compact.join();
  ASSERT_TRUE(held);
  EXPECT_THAT(compacted, StatusIs(Code::kCancelled)) << compacted;
  EXPECT_TRUE(tier_->Stats().writable) << tier_->Stats().write_error;
  ASSERT_OK(tier_->Compact());  // the next one runs whole
  for (int i = 1; i < 20; i += 2) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
}

// After an evict of most blocks, RocksDB has not yet counted their blobs
// as garbage (a compaction has to drop their references first): the blob
// files looked live, and Compact refused for want of room to rewrite them,
// though it would have rewritten almost nothing. A pass that rewrites only
// the tables counts that garbage first.
TEST_F(NvmeTierTest, CompactCountsTheGarbageOfRecentDeletesBeforeItRefuses) {
  constexpr size_t kSize = 64 * kKiB;
  options_.min_free_bytes = 8 << 20;
  Open();
  for (int i = 0; i < 40; ++i) {
    ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
    if (i % 10 == 9) {
      ASSERT_OK(tier_->Flush());
    }
  }
  for (int i = 0; i < 40; ++i) {
    if (i % 10 != 0) {
      ASSERT_OK(tier_->Delete("ns", Key(i)));
    }
  }
  ASSERT_OK(tier_->Flush());
  const NvmeTierStats before = tier_->Stats();
  // Room for the four live blocks and the tables, not for any whole blob
  // file (ten blocks).
  fault_fs_->LimitFreeSpace((8 << 20) + before.unflushed_bytes + 8 * kSize);
  ASSERT_OK(tier_->Compact());
  EXPECT_EQ(fault_fs_->injected_errors(), 0u);
  EXPECT_GE(fault_fs_->lowest_free_space(), uint64_t{8} << 20);
  NvmeTierStats after = tier_->Stats();
  EXPECT_TRUE(after.writable) << after.write_error;
  EXPECT_EQ(after.blob_garbage_bytes, 0u);
  EXPECT_LT(after.disk_bytes, 8 * kSize);
  fault_fs_->ClearFreeSpace();
  for (int i = 0; i < 40; i += 10) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
  EXPECT_EQ(after.blocks, 4u);
}

// The oldest blob files may hold much more live data than the average
// (here the first holds ten live blocks, the three after it one each): a
// pass whose age cutoff came from the ratio of the totals rewrote the
// first three files, more than the file system had room for (writes
// stopped on ENOSPC). Each pass now rewrites the oldest files whose live
// blobs fit; on a file system of exactly that much room, nothing fails.
TEST_F(NvmeTierTest, CompactRewritesOnlyTheOldestBlobFilesThatFit) {
  constexpr size_t kSize = 64 * kKiB;
  options_.min_free_bytes = 8 << 20;
  Open();
  for (int i = 0; i < 40; ++i) {
    ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
    if (i % 10 == 9) {
      ASSERT_OK(tier_->Flush());  // blob files of ten blocks each
    }
  }
  ASSERT_EQ(BlobFiles().size(), 4u);
  for (int i = 10; i < 40; ++i) {
    if (i % 10 != 0) {
      ASSERT_OK(tier_->Delete("ns", Key(i)));
    }
  }
  ASSERT_OK(tier_->Flush());
  // RocksDB counts a deleted blob as garbage once a compaction has dropped
  // its reference: three more level-0 files (small blocks, kept in the
  // tables) start the automatic one that merges the deletes.
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(Put(absl::StrCat("small-", i), Bytes(i, kKiB)));
    ASSERT_OK(tier_->Flush());
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (tier_->Stats().blob_garbage_bytes < 27 * kSize &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const NvmeTierStats before = tier_->Stats();
  ASSERT_GE(before.blob_garbage_bytes, 27 * kSize);
  ASSERT_EQ(BlobFiles().size(), 4u);
  uint64_t tables = 0;
  for (const std::string& f : FilesEndingIn(".sst")) tables += fs::file_size(f);

  // Room beside the tables for the first file's live blobs (ten blocks and
  // their record headers) and a little more, not for the second file's too.
  fault_fs_->LimitFreeSpace((8 << 20) + before.unflushed_bytes + tables +
                            10 * kSize + 40 * kKiB);
  ASSERT_OK(tier_->Compact());
  EXPECT_EQ(fault_fs_->injected_errors(), 0u);
  // Never into the room the tier keeps for RocksDB's flushes.
  EXPECT_GE(fault_fs_->lowest_free_space(), uint64_t{8} << 20);
  NvmeTierStats after = tier_->Stats();
  EXPECT_TRUE(after.writable) << after.write_error;
  EXPECT_EQ(after.blob_garbage_bytes, 0u);
  EXPECT_LT(after.disk_bytes, before.disk_bytes - 20 * kSize);
  fault_fs_->ClearFreeSpace();
  for (int i = 0; i < 40; ++i) {
    if (i < 10 || i % 10 == 0) {
      EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
    } else {
      EXPECT_FALSE(tier_->Contains("ns", Key(i))) << i;
    }
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(ReadsBack(absl::StrCat("small-", i), Bytes(i, kKiB))) << i;
  }
}

// An operator's Compact runs beside RocksDB's own compactions. Here it is
// held at its first output file while puts and flushes make more level-0
// files than RocksDB's write stop (level0_stop_writes_trigger, 36): the
// automatic compactions must go on meanwhile, or every put (a demotion)
// waits in RocksDB until the admin compaction ends.
TEST_F(NvmeTierTest, PutsGoOnWhileACompactRuns) {
  constexpr size_t kSize = 1 * kKiB;  // inline: each flush makes one table
  constexpr int kFlushes = 45;
  options_.max_background_jobs = 4;  // two compactions at a time
  Open();
  for (int i = 0; i < 3; ++i) ASSERT_OK(Put(Key(i), Bytes(i, kSize)));
  ASSERT_OK(tier_->Flush());

  fault_fs_->HoldNextTableFile();
  absl::Notification puts_done;
  struct Cleanup {  // whatever fails below, nothing stays held
    FaultInjectionFileSystem* fs;
    std::vector<std::thread>* threads;
    ~Cleanup() {
      fs->ReleaseNextTableFile();
      for (std::thread& t : *threads) t.join();
    }
  };
  std::vector<std::thread> threads;
  Cleanup cleanup{fault_fs_.get(), &threads};
  absl::Status compacted;
  threads.emplace_back([&] { compacted = tier_->Compact(); });
  ASSERT_TRUE(Eventually([&] { return fault_fs_->held_creations() == 1; }));

  std::atomic<int> failed{0};
  threads.emplace_back([&] {
    for (int i = 3; i < 3 + kFlushes; ++i) {
      if (!Put(Key(i), Bytes(i, kSize)).ok()) ++failed;
      if (!tier_->Flush().ok()) ++failed;
    }
    puts_done.Notify();
  });
  // A bound against a hang, not a speed test: the puts take well under a
  // second unless they stall.
  EXPECT_TRUE(puts_done.WaitForNotificationWithTimeout(absl::Seconds(60)))
      << "puts stalled behind the held compaction";
  EXPECT_EQ(fault_fs_->held_creations(), 1) << "the compaction went on";
  fault_fs_->ReleaseNextTableFile();
  for (std::thread& t : threads) t.join();
  threads.clear();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_OK(compacted);
  for (int i = 0; i < 3 + kFlushes; ++i) {
    EXPECT_TRUE(ReadsBack(Key(i), Bytes(i, kSize))) << i;
  }
}

TEST_F(NvmeTierTest, ConcurrentPutsReadsAndDeletes) {
  // Content-addressed as in real use: a key always has the same bytes, so
  // every successful read can be checked. The capacity holds about half the
  // key space, so eviction races with everything else.
  constexpr size_t kSize = 8 * kKiB;
  constexpr int kKeys = 64;
  constexpr int kThreads = 4;
  constexpr int kOps = 400;
  options_.capacity_bytes = 32 * Charge("ns", Key(10), kSize);
  options_.max_blocks = kNoFloor;  // 32 blocks of 8 KiB
  Open();
  std::atomic<int> bad{0}, reads_ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::string buf(kSize, '\0');
      for (int op = 0; op < kOps; ++op) {
        int k = static_cast<int>(rng() % kKeys);
        switch (rng() % 8) {
          case 0:
          case 1:
          case 2: {
            auto put = Put(Key(k), Bytes(k, kSize));
            if (!put.ok()) bad++;
            break;
          }
          case 3:
            if (absl::Status s = tier_->Delete("ns", Key(k));
                !s.ok() && !absl::IsNotFound(s)) {
              bad++;
            }
            break;
          case 4:
            tier_->Contains("ns", Key(k));
            break;
          default: {
            absl::Status s = tier_->Read("ns", Key(k), absl::MakeSpan(buf));
            if (s.ok()) {
              reads_ok++;
              if (buf != Bytes(k, kSize)) bad++;
            } else if (!absl::IsNotFound(s)) {
              bad++;
            }
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(reads_ok.load(), 0);

  NvmeTierStats stats = tier_->Stats();
  EXPECT_LE(stats.used_bytes, options_.capacity_bytes);
  EXPECT_EQ(stats.integrity_errors, 0u);
  uint64_t present = 0;
  for (int k = 0; k < kKeys; ++k) {
    if (!tier_->Contains("ns", Key(k))) continue;
    ++present;
    EXPECT_TRUE(ReadsBack(Key(k), Bytes(k, kSize))) << k;
  }
  EXPECT_EQ(present, stats.blocks);
  EXPECT_EQ(stats.used_bytes, present * Charge("ns", Key(10), kSize));
}

TEST_F(NvmeTierTest, RejectsBadInputAndStoresNothing) {
  options_.capacity_bytes = 1 * kMiB;
  options_.max_block_bytes = 512 * kKiB;
  Open();
  const std::string bytes = Bytes(1, 4 * kKiB);
  const uint64_t sum = BlockChecksum(bytes);
  const std::string long_key(257, 'k');
  EXPECT_THAT(tier_->Put("ns", "", "", bytes, sum),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(tier_->Put("ns", long_key, "", bytes, sum),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(tier_->Put("", "k", "", bytes, sum),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(tier_->Put("bad ns!", "k", "", bytes, sum),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(tier_->Put("ns", "k", long_key, bytes, sum),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(tier_->Put("ns", "k", "", "", BlockChecksum("")),
              StatusIs(Code::kInvalidArgument));
  auto mismatch = tier_->Put("ns", "k", "", bytes, sum ^ 1);
  EXPECT_THAT(mismatch, StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(std::string(mismatch.status().message()), HasSubstr("checksum"));
  const std::string too_big = Bytes(2, 600 * kKiB);
  EXPECT_THAT(tier_->Put("ns", "k", "", too_big, BlockChecksum(too_big)),
              StatusIs(Code::kInvalidArgument));
  options_.max_block_bytes = 4 * kMiB;
  Open();
  const std::string never_fits = Bytes(3, 1 * kMiB);
  EXPECT_THAT(tier_->Put("ns", "k", "", never_fits, BlockChecksum(never_fits)),
              StatusIs(Code::kResourceExhausted));

  std::string buf(16, '\0');
  EXPECT_THAT(tier_->Read("ns", "", absl::MakeSpan(buf)),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(tier_->Read("ns", long_key, absl::MakeSpan(buf)),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(tier_->Read("ns", "k", absl::MakeSpan(buf)),
              StatusIs(Code::kNotFound));
  EXPECT_THAT(tier_->Meta("ns", ""), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(tier_->Delete("ns", ""), StatusIs(Code::kInvalidArgument));
  EXPECT_FALSE(tier_->Contains("ns", ""));
  EXPECT_FALSE(tier_->Contains("ns", "k"));

  NvmeTierStats stats = tier_->Stats();
  EXPECT_EQ(stats.blocks, 0u);
  EXPECT_EQ(stats.used_bytes, 0u);
  EXPECT_EQ(stats.puts, 0u);
  EXPECT_EQ(stats.write_errors, 0u);

  // A good put still works, and reading it into a wrong-size buffer fails
  // without touching the block.
  ASSERT_OK(tier_->Put("ns", "k", "", bytes, sum));
  EXPECT_THAT(tier_->Read("ns", "k", absl::MakeSpan(buf)),
              StatusIs(Code::kInvalidArgument));
  EXPECT_TRUE(ReadsBack("k", bytes));
}

// A tier written by a build of format 1 (three column families) is refused
// with a clear message, and left as it was.
TEST_F(NvmeTierTest, OpenRefusesTheOldFormat) {
  {
    rocksdb::Options o;
    o.create_if_missing = true;
    o.create_missing_column_families = true;
    std::vector<rocksdb::ColumnFamilyDescriptor> families = {
        {rocksdb::kDefaultColumnFamilyName, o}, {"meta", o}, {"data", o}};
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* raw = nullptr;
    fs::create_directories(options_.path);
    ASSERT_TRUE(
        rocksdb::DB::Open(o, options_.path, families, &handles, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    ASSERT_TRUE(db->Put({}, "kvdepot.nvme_tier.format", "1").ok());
    for (auto* h : handles) ASSERT_TRUE(db->DestroyColumnFamilyHandle(h).ok());
    ASSERT_TRUE(db->Close().ok());
  }
  auto tier = OpenNvmeTier(options_, &clock_);
  EXPECT_THAT(tier, StatusIs(Code::kFailedPrecondition));
  EXPECT_THAT(std::string(tier.status().message()), HasSubstr("format '1'"));
  std::vector<std::string> families;
  ASSERT_TRUE(rocksdb::DB::ListColumnFamilies(rocksdb::DBOptions(),
                                              options_.path, &families)
                  .ok());
  EXPECT_EQ(families.size(), 3u);
}

TEST_F(NvmeTierTest, OpenRefusesDisabledBadAndLockedTiers) {
  NvmeTierOptions disabled = options_;
  disabled.capacity_bytes = 0;
  EXPECT_THAT(OpenNvmeTier(disabled, &clock_),
              StatusIs(Code::kFailedPrecondition));
  EXPECT_FALSE(fs::exists(options_.path)) << "a disabled tier touched disk";

  NvmeTierOptions no_path = options_;
  no_path.path = "";
  EXPECT_THAT(OpenNvmeTier(no_path, &clock_),
              StatusIs(Code::kInvalidArgument));
  NvmeTierOptions no_age = options_;
  no_age.max_unflushed_age = absl::ZeroDuration();
  EXPECT_THAT(OpenNvmeTier(no_age, &clock_), StatusIs(Code::kInvalidArgument));
  EXPECT_FALSE(fs::exists(options_.path));

  // Parents are created; a second opener of the same directory is refused
  // with a message naming it.
  options_.path = dir_ + "/a/b/nvme";
  Open();
  auto second = OpenNvmeTier(options_, &clock_);
  EXPECT_THAT(second, StatusIs(Code::kUnavailable));
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr(options_.path));
  Close();
  Open();  // the lock is released on close

  // A path under a regular file cannot be opened.
  std::ofstream(dir_ + "/file") << "x";
  NvmeTierOptions under_file = options_;
  under_file.path = dir_ + "/file/nvme";
  EXPECT_FALSE(OpenNvmeTier(under_file, &clock_).ok());
}

}  // namespace
}  // namespace kvdepot
