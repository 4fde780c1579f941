// A directory of the running test's own, for unit tests that write files.
#ifndef KVDEPOT_TESTS_TEST_DIR_H_
#define KVDEPOT_TESTS_TEST_DIR_H_

#include <gtest/gtest.h>

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

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_TEST_DIR_H_
