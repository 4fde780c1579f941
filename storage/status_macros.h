// Small status helpers. Debian 12's Abseil (20220623) ships no
// status_macros.h, so the project defines these once, here.
#ifndef KVDEPOT_STORAGE_STATUS_MACROS_H_
#define KVDEPOT_STORAGE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVDEPOT_CONCAT_INNER_(a, b) a##b
#define KVDEPOT_CONCAT_(a, b) KVDEPOT_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status kvdepot_status_ = (expr);         \
    if (!kvdepot_status_.ok()) return kvdepot_status_; \
  } while (0)

// ASSIGN_OR_RETURN(lhs, expr): evaluates `expr` (an absl::StatusOr<T>); on
// error returns its status, otherwise moves the value into `lhs`.
#define ASSIGN_OR_RETURN(lhs, expr) \
  KVDEPOT_ASSIGN_OR_RETURN_IMPL_(KVDEPOT_CONCAT_(kvdepot_sor_, __LINE__), lhs, expr)
#define KVDEPOT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()

#endif  // KVDEPOT_STORAGE_STATUS_MACROS_H_
