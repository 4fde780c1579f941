// gMock matchers for absl::Status / StatusOr (Debian 12's Abseil has none).
#ifndef KVDEPOT_TESTS_STATUS_MATCHERS_H_
#define KVDEPOT_TESTS_STATUS_MATCHERS_H_

#include <gmock/gmock.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvdepot::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

// EXPECT_THAT(store->Lookup(...), StatusIs(absl::StatusCode::kNotFound));
MATCHER_P(StatusIs, code,
          std::string("has status code ") +
              absl::StatusCodeToString(static_cast<absl::StatusCode>(code))) {
  const absl::Status& s = ::kvdepot::testing::GetStatus(arg);
  *result_listener << "whose status is " << s;
  return s.code() == code;
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = ::kvdepot::testing::GetStatus(arg);
  *result_listener << "whose status is " << s;
  return s.ok();
}

}  // namespace kvdepot::testing

#define ASSERT_OK(expr) ASSERT_THAT((expr), ::kvdepot::testing::IsOk())
#define EXPECT_OK(expr) EXPECT_THAT((expr), ::kvdepot::testing::IsOk())

#endif  // KVDEPOT_TESTS_STATUS_MATCHERS_H_
