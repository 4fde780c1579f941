#include "transport/ucx_context.h"

#include <fstream>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "transport/internal/ucs_status.h"

namespace kvdepot {
namespace {

// The first line of a file, trimmed; empty when it cannot be read.
std::string FirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return std::string(absl::StripAsciiWhitespace(line));
}

}  // namespace

std::string LocalHostId() {
  return absl::StrCat(FirstLine("/etc/machine-id"), "/",
                      FirstLine("/proc/sys/kernel/random/boot_id"));
}

using transport_internal::UcsToStatus;

absl::StatusOr<std::unique_ptr<UcxContext>> UcxContext::Create(
    const UcxContextOptions& options) {
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return UcsToStatus(st, "ucp_config_read");
  for (const auto& [key, value] : options.config) {
    std::string_view name = key;
    if (name.substr(0, 4) == "UCX_") name.remove_prefix(4);
    for (std::string_view prefix : kTransportPrefixes) {
      if (name.size() > prefix.size() &&
          name.substr(0, prefix.size()) == prefix) {
        name.remove_prefix(prefix.size());
        break;
      }
    }
    st = ucp_config_modify(config, std::string(name).c_str(), value.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return absl::InvalidArgumentError(
          absl::StrCat("UCX setting ", key, "=", value, ": ",
                       ucs_status_string(st)));
    }
  }

  ucp_params_t params = {};
  params.field_mask = UCP_PARAM_FIELD_FEATURES |
                      UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  // AM: kvdepot's request path (UcxWorker::SetMessageHandler).
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  // Workers are single-threaded, but Register may run on any thread.
  params.mt_workers_shared = 1;
  params.name = options.name.c_str();
  ucp_context_h context = nullptr;
  st = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (st != UCS_OK) {
    absl::Status status = UcsToStatus(st, "ucp_init");
    // "No such device" is UCX's way of saying no transport fits.
    if (st == UCS_ERR_NO_DEVICE || st == UCS_ERR_NO_ELEM) {
      status = absl::UnavailableError(status.message());
    }
    return status;
  }
  return std::unique_ptr<UcxContext>(new UcxContext(context));
}

UcxContext::~UcxContext() { ucp_cleanup(context_); }

absl::StatusOr<std::unique_ptr<MemoryRegion>> UcxContext::Register(
    void* base, size_t size) {
  if (base == nullptr || size == 0) {
    return absl::InvalidArgumentError(
        "memory registration needs a non-null base and a non-zero size");
  }
  return Map(base, size);
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> UcxContext::Allocate(
    size_t size) {
  if (size == 0) return absl::InvalidArgumentError("allocation of 0 bytes");
  return Map(nullptr, size);
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> UcxContext::Map(void* base,
                                                              size_t size) {
  ucp_mem_map_params_t params = {};
  params.field_mask =
      UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = base;
  params.length = size;
  if (base == nullptr) {
    params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    params.flags = UCP_MEM_MAP_ALLOCATE;
  }
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context_, &params, &memh);
  if (st != UCS_OK) return UcsToStatus(st, "ucp_mem_map");
  ucp_mem_attr_t attr = {};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_MEM_TYPE;
  st = ucp_mem_query(memh, &attr);
  if (st != UCS_OK) {
    ucp_mem_unmap(context_, memh);
    return UcsToStatus(st, "ucp_mem_query");
  }
  // Host memory only: both ends read the blocks on the CPU (checksums, the
  // daemon's in-place copies). A UCX built with CUDA or ROCm support
  // recognizes device memory here; one without (Debian's) cannot, and a
  // device pointer must not be passed at all.
  if (attr.mem_type != UCS_MEMORY_TYPE_HOST) {
    ucp_mem_unmap(context_, memh);
    return absl::InvalidArgumentError(absl::StrCat(
        "memory at ", absl::Hex(reinterpret_cast<uintptr_t>(base)),
        " is ", ucs_memory_type_names[attr.mem_type],
        " memory; only host memory can be registered (stage device memory "
        "through page-locked host buffers: gpu/README.md)"));
  }
  if (base == nullptr) base = attr.address;

  void* rkey_buffer = nullptr;
  size_t rkey_size = 0;
  st = ucp_rkey_pack(context_, memh, &rkey_buffer, &rkey_size);
  if (st != UCS_OK) {
    ucp_mem_unmap(context_, memh);
    return UcsToStatus(st, "ucp_rkey_pack");
  }
  std::string packed(static_cast<const char*>(rkey_buffer), rkey_size);
  ucp_rkey_buffer_release(rkey_buffer);
  return std::unique_ptr<MemoryRegion>(new MemoryRegion(
      context_, memh, static_cast<char*>(base), size, std::move(packed)));
}

}  // namespace kvdepot
