// CRC32C for RocksDB on the CPU's crc32 instruction.
//
// Debian's librocksdb is a portable build: its CRC32C has no SSE4.2 path and
// runs a table loop at 1-2 GB/s. Every blob record the NVMe tier writes is
// checksummed with it on RocksDB's flush threads, and on a small machine that
// loop, not the disk, bounds how fast the tier fills (tools/results/
// nvme_fill_profile.txt). librocksdb calls rocksdb::crc32c::Extend through
// its PLT, so a definition in the executable takes its place.
// rocksdb_crc32c.cc defines it: the crc32 instruction where the CPU has
// SSE4.2, librocksdb's own code otherwise. The results are the same
// Castagnoli CRC either way (rocksdb_crc32c_test checks them against
// librocksdb's).
//
// KVDEPOT_ROCKSDB_CRC32C=librocksdb in the environment keeps librocksdb's
// own code, for comparison. Only on x86-64; elsewhere librocksdb's own code runs and this reports so.
#ifndef KVDEPOT_STORAGE_ROCKSDB_CRC32C_H_
#define KVDEPOT_STORAGE_ROCKSDB_CRC32C_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace kvdepot {

// Which CRC32C RocksDB runs in this process, for the startup log:
// "crc32 instruction" when kvdepot's takes the place of librocksdb's,
// otherwise "librocksdb's" with the reason.
absl::string_view RocksCrc32cImplementation();

// librocksdb's own rocksdb::crc32c::Extend, found past kvdepot's; nullptr
// where it cannot be found. For tests.
using Crc32cExtendFn = uint32_t (*)(uint32_t crc, const char* data, size_t n);
Crc32cExtendFn LibRocksdbCrc32cExtend();

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_ROCKSDB_CRC32C_H_
