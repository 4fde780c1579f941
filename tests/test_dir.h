// A directory of the running test's own, for unit tests that write files.
#ifndef KVDEPOT_TESTS_TEST_DIR_H_
#define KVDEPOT_TESTS_TEST_DIR_H_

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace kvdepot::testing {

// <gtest's TempDir>/<prefix><test name>, emptied of what an earlier run
// left, and made unless `create` is false (for tests of code that makes
// it itself).
inline std::string FreshTestDir(const std::string& prefix, bool create = true) {
  const std::string dir =
      ::testing::TempDir() + "/" + prefix +
      ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::filesystem::remove_all(dir);
  if (create) std::filesystem::create_directories(dir);
  return dir;
}

// Whether the file system of directory `dir` (which must exist) takes
// open(O_DIRECT): tmpfs before Linux 6.6 and some FUSE and network file
// systems refuse it (EINVAL). Tests of direct I/O skip where it does not.
inline bool DirectIoWorks(const std::string& dir) {
  const std::string probe = dir + "/.direct-io-test";
  const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  return fd >= 0;
}

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_TEST_DIR_H_
