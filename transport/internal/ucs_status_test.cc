#include "transport/internal/ucs_status.h"

#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace kvdepot::transport_internal {
namespace {

TEST(UcsToStatusTest, SuccessAndProgressAreOk) {
  EXPECT_TRUE(UcsToStatus(UCS_OK, "x").ok());
  EXPECT_TRUE(UcsToStatus(UCS_INPROGRESS, "x").ok());
}

// A caller tells a peer that is gone or unreachable (it falls back or
// retries: Unavailable) from its own mistakes and UCX's bugs by the code.
TEST(UcsToStatusTest, EachClassMapsToItsCode) {
  struct Case {
    ucs_status_t ucs;
    absl::StatusCode code;
  };
  const Case cases[] = {
      {UCS_ERR_CANCELED, absl::StatusCode::kCancelled},
      {UCS_ERR_TIMED_OUT, absl::StatusCode::kDeadlineExceeded},
      {UCS_ERR_UNREACHABLE, absl::StatusCode::kUnavailable},
      {UCS_ERR_CONNECTION_RESET, absl::StatusCode::kUnavailable},
      // Not Unavailable: a client takes that for a session to drop, and an
      // rkey whose shared memory cannot be mapped fails the same way in the
      // next session (OpenSession falls back to gRPC on any code).
      {UCS_ERR_SHMEM_SEGMENT, absl::StatusCode::kInternal},
      {UCS_ERR_ENDPOINT_TIMEOUT, absl::StatusCode::kUnavailable},
      {static_cast<ucs_status_t>(UCS_ERR_FIRST_LINK_FAILURE - 1),
       absl::StatusCode::kUnavailable},
      {UCS_ERR_NO_MEMORY, absl::StatusCode::kResourceExhausted},
      {UCS_ERR_INVALID_ADDR, absl::StatusCode::kInvalidArgument},
      {UCS_ERR_NO_ELEM, absl::StatusCode::kFailedPrecondition},
      {UCS_ERR_NO_MESSAGE, absl::StatusCode::kInternal},
  };
  for (const Case& c : cases) {
    absl::Status st = UcsToStatus(c.ucs, "ucp_ep_create");
    EXPECT_EQ(st.code(), c.code) << ucs_status_string(c.ucs) << ": " << st;
    EXPECT_TRUE(absl::StartsWith(st.message(), "ucp_ep_create: ")) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), ucs_status_string(c.ucs)))
        << st;
  }
}

}  // namespace
}  // namespace kvdepot::transport_internal
