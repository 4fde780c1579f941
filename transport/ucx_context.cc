#include "transport/ucx_context.h"

#include <sys/mman.h>
#ifndef KVDEPOT_UCX_CONFIG_TABLES
#error "KVDEPOT_UCX_CONFIG_TABLES (0 or 1) comes from transport/CMakeLists.txt"
#endif
#if KVDEPOT_UCX_CONFIG_TABLES
#include <ucs/config/parser.h>
#endif
#include <uct/api/uct.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "storage/status_macros.h"
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

std::string UcxSettingName(std::string_view key) {
  std::string_view name = key;
  if (name.substr(0, 4) == "UCX_") name.remove_prefix(4);
  for (std::string_view prefix : kTransportPrefixes) {
    if (name.size() > prefix.size() && name.substr(0, prefix.size()) == prefix) {
      name.remove_prefix(prefix.size());
      break;
    }
  }
  return std::string(name);
}

namespace {

// The names of UCP's own settings, as ucp_config_print (public API) lists
// them: "UCX_SEG_SIZE=8K" lines.
std::vector<std::string> UcpOwnSettingNames(const ucp_config_t* config) {
  std::vector<std::string> names;
  char* text = nullptr;
  size_t size = 0;
  FILE* out = open_memstream(&text, &size);
  if (out == nullptr) return names;
  ucp_config_print(config, out, nullptr, UCS_CONFIG_PRINT_CONFIG);
  std::fclose(out);
  for (absl::string_view line :
       absl::StrSplit(absl::string_view(text, size), '\n')) {
    if (!absl::ConsumePrefix(&line, "UCX_")) continue;
    const size_t eq = line.find('=');
    if (eq != absl::string_view::npos) names.emplace_back(line.substr(0, eq));
  }
  std::free(text);
  return names;
}

}  // namespace

absl::Status CheckUcxSettingByUcp(std::string_view key,
                                  std::string_view value) {
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK)
    return transport_internal::UcsToStatus(st, "ucp_config_read");
  const std::string name = UcxSettingName(key);
  // A transport's setting whose prefix, dropped, leaves one of UCP's own
  // (POSIX_SEG_SIZE: UCP's memory pool) would change UCP's instead.
  std::string_view bare = key;
  if (bare.substr(0, 4) == "UCX_") bare.remove_prefix(4);
  const bool dropped = bare.size() != name.size();
  if (dropped) {
    const std::vector<std::string> own = UcpOwnSettingNames(config);
    if (std::find(own.begin(), own.end(), name) != own.end()) {
      ucp_config_release(config);
      return absl::InvalidArgumentError(
          absl::StrCat("with its prefix ",
                       std::string(bare.substr(0, bare.size() - name.size())),
                       " dropped (kvdepot drops it, as UCX 1.13 wants) it "
                       "names UCX's own setting ",
                       name, " (UCX_", name,
                       "), which UCX would change instead of the transport's"));
    }
  }
  st = ucp_config_modify(config, name.c_str(), std::string(value).c_str());
  ucp_config_release(config);
  if (st != UCS_OK) {
    return absl::InvalidArgumentError(absl::StrCat("UCX refuses ", name, "=",
                                                   std::string(value), ": ",
                                                   ucs_status_string(st)));
  }
  return absl::OkStatus();
}

#if KVDEPOT_UCX_CONFIG_TABLES
namespace {

// UCX's registered configuration tables hold UCP's ("UCP context"): the
// table names CheckUcxSetting relies on are this release's. Checked once.
bool UcxTablesAsExpected() {
  static const bool expected = [] {
    for (ucs_list_link_t* at = ucs_config_global_list.next;
         at != &ucs_config_global_list; at = at->next) {
      const auto* table =
          reinterpret_cast<const ucs_config_global_list_entry_t*>(
              reinterpret_cast<const char*>(at) -
              offsetof(ucs_config_global_list_entry_t, list));
      if (table->name != nullptr &&
          std::string_view(table->name) == "UCP context") {
        return true;
      }
    }
    return false;
  }();
  return expected;
}

}  // namespace
#endif

bool UcxSettingsCheckedAgainstTables() {
#if KVDEPOT_UCX_CONFIG_TABLES
  return UcxTablesAsExpected();
#else
  return false;
#endif
}

#if !KVDEPOT_UCX_CONFIG_TABLES
absl::Status CheckUcxSetting(std::string_view key, std::string_view value) {
  return CheckUcxSettingByUcp(key, value);
}
#else
absl::Status CheckUcxSetting(std::string_view key, std::string_view value) {
  // Tables named otherwise than UCX 1.13's: the answers below would be
  // misread.
  if (!UcxTablesAsExpected()) return CheckUcxSettingByUcp(key, value);
  // The transports' tables are UCX's modules': loaded (once) by listing
  // the components.
  static const bool loaded = [] {
    uct_component_h* components = nullptr;
    unsigned count = 0;
    if (uct_query_components(&components, &count) == UCS_OK) {
      uct_release_component_list(components);
    }
    return true;
  }();
  (void)loaded;
  const std::string name = UcxSettingName(key);
  const std::string text(value);
  // The transport prefix kvdepot drops from `key` ("TCP_"), if any.
  std::string_view bare = key;
  if (bare.substr(0, 4) == "UCX_") bare.remove_prefix(4);
  const std::string dropped(bare.substr(0, bare.size() - name.size()));
  // What each table that has a setting `name` says of `value`, through
  // UCX's own parser (UCX 1.13's internal API: Debian 12's libucx).
  struct Answer {
    std::string table, prefix;
    ucs_status_t status;
  };
  std::vector<Answer> answers;
  for (ucs_list_link_t* at = ucs_config_global_list.next;
       at != &ucs_config_global_list; at = at->next) {
    const auto* table = reinterpret_cast<const ucs_config_global_list_entry_t*>(
        reinterpret_cast<const char*>(at) -
        offsetof(ucs_config_global_list_entry_t, list));
    // UCM's settings are read from the environment by UCM alone: UCP
    // passes them nowhere.
    if (table->table == nullptr || table->size == 0 ||
        std::string_view(table->name) == "UCM") {
      continue;
    }
    // The table's values as this process's environment sets them, then the
    // setting (operator new's alignment suits UCX's option structs).
    std::vector<char> opts(table->size);
    if (ucs_config_parser_fill_opts(opts.data(), table->table, "UCX_",
                                    table->prefix,
                                    /*ignore_errors=*/1) != UCS_OK) {
      continue;
    }
    const ucs_status_t st = ucs_config_parser_set_value(
        opts.data(), table->table, name.c_str(), text.c_str());
    ucs_config_parser_release_opts(opts.data(), table->table);
    if (st != UCS_ERR_NO_ELEM) {
      answers.push_back({table->name, table->prefix ? table->prefix : "", st});
    }
  }
  auto answer_of = [&](std::string_view table) -> const Answer* {
    for (const Answer& a : answers) {
      if (a.table == table) return &a;
    }
    return nullptr;
  };
  auto refused = [&](const Answer& a) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX refuses ", name, "=", text, " (", a.table,
                     "; UCX logged the syntax it takes)"));
  };
  // ucp_config_modify's order: UCP's own setting of that name, else UCS's;
  // only a name neither has goes to the transports (each that has it).
  const Answer* own = answer_of("UCP context");
  if (own == nullptr) own = answer_of("UCS global");
  if (own != nullptr) {
    if (!dropped.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("with its prefix ", dropped,
                       " dropped (kvdepot drops it, as UCX "
                       "1.13 wants) it names UCX's own setting ",
                       name, " (UCX_", name,
                       "), which UCX would change instead of the transport's"));
    }
    return own->status == UCS_OK ? absl::OkStatus() : refused(*own);
  }
  if (answer_of("UCS global (runtime read-only)") != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX takes ", name, " only from the environment (UCX_",
                     name, ") when it loads, not as a setting"));
  }
  bool in_its_transport = dropped.empty();
  for (const Answer& a : answers) {
    if (a.status != UCS_OK) return refused(a);  // UCX fails that transport
    in_its_transport |= a.prefix == dropped;
  }
  if (answers.empty() || !in_its_transport) {
    return absl::InvalidArgumentError(absl::StrCat(
        "UCX ", ucp_get_version_string(), " has no setting ", name,
        dropped.empty() ? "" : absl::StrCat(" in its ", dropped, " transport"),
        " (`ucx_info -c -f` lists them; a setting reaches a transport by its "
        "name inside the transport's table: without the prefix, which "
        "kvdepot drops for ",
        absl::StrJoin(kTransportPrefixes, " "),
        ", and as MM_<name> for posix and sysv)"));
  }
  return absl::OkStatus();
}
#endif  // KVDEPOT_UCX_CONFIG_TABLES

std::optional<std::string> UcxConfigValue(
    const std::map<std::string, std::string>& config, std::string_view name) {
  std::optional<std::string> out;
  for (const auto& [key, value] : config) {
    if (UcxSettingName(key) == name) out = value;
  }
  return out;
}

bool UcxTlsAllows(const std::map<std::string, std::string>& config,
                  absl::Span<const absl::string_view> transports) {
  std::string tls = UcxConfigValue(config, "TLS").value_or("");
  if (tls.empty()) {
    const char* env = std::getenv("UCX_TLS");
    tls = env != nullptr ? env : "all";
  }
  absl::string_view list = absl::StripAsciiWhitespace(tls);
  const bool excluding = !list.empty() && list[0] == '^';
  if (excluding) list.remove_prefix(1);
  std::vector<absl::string_view> named;
  for (absl::string_view t : absl::StrSplit(list, ',')) {
    named.push_back(absl::StripAsciiWhitespace(t));
  }
  auto is_named = [&](absl::string_view t) {
    return std::find(named.begin(), named.end(), t) != named.end();
  };
  for (absl::string_view t : transports) {
    if (excluding ? !is_named(t) : is_named(t)) return true;
  }
  return !excluding && is_named("all");
}

namespace {

// A UCX memory-units value as uct_config_get prints it ("8K", "512K",
// "1M", "65536"); nullopt for anything else ("inf", "auto").
std::optional<uint64_t> ParseMemunits(std::string_view s) {
  uint64_t n = 0;
  size_t i = 0;
  for (; i < s.size() && absl::ascii_isdigit(s[i]); ++i) n = n * 10 + (s[i] - '0');
  if (i == 0) return std::nullopt;
  std::string_view unit = s.substr(i);
  if (!unit.empty() && (unit.back() == 'b' || unit.back() == 'B')) {
    unit.remove_suffix(1);
  }
  if (unit.empty()) return n;
  if (unit.size() != 1) return std::nullopt;
  switch (absl::ascii_toupper(unit[0])) {
    case 'K': return n << 10;
    case 'M': return n << 20;
    case 'G': return n << 30;
    default: return std::nullopt;
  }
}

// What UCX's TCP transport reads for its segment sizes: its configuration
// from the environment, with `config`'s settings applied as ucp_config_modify
// applies them. nullopt when UCX has no TCP transport, or may not use it.
std::optional<TcpSegmentSizes> ReadTcpSegmentSizes(
    const std::map<std::string, std::string>& config) {
  constexpr absl::string_view kTcp[] = {"tcp"};
  if (!UcxTlsAllows(config, kTcp)) return std::nullopt;
  uct_component_h* components = nullptr;
  unsigned count = 0;
  if (uct_query_components(&components, &count) != UCS_OK) return std::nullopt;
  std::optional<TcpSegmentSizes> sizes;
  for (unsigned c = 0; c < count && !sizes; ++c) {
    uct_component_attr_t attr = {};
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME;
    if (uct_component_query(components[c], &attr) != UCS_OK ||
        std::string_view(attr.name) != "tcp") {
      continue;
    }
    uct_md_config_t* md_config = nullptr;
    if (uct_md_config_read(components[c], nullptr, nullptr, &md_config) != UCS_OK) {
      break;
    }
    uct_md_h md = nullptr;
    ucs_status_t st = uct_md_open(components[c], "tcp", md_config, &md);
    uct_config_release(md_config);
    if (st != UCS_OK) break;
    uct_iface_config_t* iface_config = nullptr;
    if (uct_md_iface_config_read(md, "tcp", nullptr, nullptr, &iface_config) ==
        UCS_OK) {
      for (const auto& [key, value] : config) {
        // Settings that are not the TCP transport's are refused here.
        uct_config_modify(iface_config, UcxSettingName(key).c_str(), value.c_str());
      }
      char tx[64] = {}, rx[64] = {};
      std::optional<uint64_t> t, r;
      if (uct_config_get(iface_config, "TX_SEG_SIZE", tx, sizeof tx) == UCS_OK &&
          uct_config_get(iface_config, "RX_SEG_SIZE", rx, sizeof rx) == UCS_OK &&
          (t = ParseMemunits(tx)) && (r = ParseMemunits(rx))) {
        sizes = TcpSegmentSizes{*t, *r};
      }
      uct_config_release(iface_config);
    }
    uct_md_close(md);
  }
  uct_release_component_list(components);
  return sizes;
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
    if (absl::Status checked = CheckUcxSetting(key, value); !checked.ok()) {
      ucp_config_release(config);
      return checked;
    }
    st = ucp_config_modify(config, UcxSettingName(key).c_str(), value.c_str());
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
  std::unique_ptr<UcxContext> made(new UcxContext(context));
  made->tcp_segments_ = ReadTcpSegmentSizes(options.config);
  return made;
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

namespace {

// A number file of the cgroup file system ("max" or unreadable: nullopt).
std::optional<uint64_t> ReadCgroupNumber(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  uint64_t value = 0;
  if (!(in >> text) || !absl::SimpleAtoi(text, &value)) return std::nullopt;
  return value;
}

// One field of a cgroup's memory.stat ("inactive_file 4096"); nullopt when
// absent.
std::optional<uint64_t> ReadCgroupStat(const std::string& path, absl::string_view field) {
  std::ifstream in(path);
  std::string name;
  uint64_t value = 0;
  while (in >> name >> value) {
    if (name == field) return value;
  }
  return std::nullopt;
}

}  // namespace

namespace transport_internal {

std::optional<uint64_t> MeminfoValue(absl::string_view field, const std::string& path) {
  std::ifstream meminfo(path);
  std::string line;
  while (std::getline(meminfo, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, field) || !absl::ConsumePrefix(&rest, ":")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    const bool kib = absl::ConsumeSuffix(&rest, "kB");
    uint64_t value = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &value)) return std::nullopt;
    return kib ? value * 1024 : value;
  }
  return std::nullopt;
}

std::optional<uint64_t> CgroupMemoryLeft(const std::string& proc_cgroup,
                                         const std::string& root) {
  std::ifstream cgroups(proc_cgroup);
  std::string line;
  std::optional<uint64_t> left;  // the least of the hierarchies' (v1 and v2)
  while (std::getline(cgroups, line)) {
    std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    // The hierarchy's mount, and its files' names (v2; v1).
    std::string mount, limit_file, usage_file, inactive_field;
    if (parts[0] == "0" && parts[1].empty()) {
      mount = root;
      limit_file = "/memory.max";
      usage_file = "/memory.current";
      inactive_field = "inactive_file";
    } else if (absl::StrContains(parts[1], "memory")) {
      mount = root + "/memory";
      limit_file = "/memory.limit_in_bytes";
      usage_file = "/memory.usage_in_bytes";
      inactive_field = "total_inactive_file";
    } else {
      continue;
    }
    // The process's cgroup as the file names it; where that path is not in
    // this mount, the mount's root: a container that shares the host's
    // cgroup namespace (Docker on v1) sees the host's path, and has its own
    // cgroup mounted at the root.
    std::string dir = mount + parts[2];
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec)) dir = mount;
    // Its ancestors' limits bind it too (a systemd slice's MemoryMax, a
    // pod's limit above its containers'): the least room of any of them,
    // up to the mount's root.
    while (true) {
      std::optional<uint64_t> limit = ReadCgroupNumber(dir + limit_file);
      std::optional<uint64_t> usage = ReadCgroupNumber(dir + usage_file);
      if (limit.has_value() && usage.has_value()) {  // else no limit there
        // Inactive page cache counts in the usage but is reclaimed before
        // the cgroup runs out (a data dir copied in just before start).
        const uint64_t inactive =
            ReadCgroupStat(dir + "/memory.stat", inactive_field).value_or(0);
        const uint64_t used = *usage > inactive ? *usage - inactive : 0;
        const uint64_t here = *limit > used ? *limit - used : 0;
        left = left.has_value() ? std::min(*left, here) : here;
      }
      const size_t slash = dir.rfind('/');
      if (dir.size() <= mount.size() || slash == std::string::npos ||
          slash < mount.size()) {
        break;
      }
      dir.resize(slash);
    }
  }
  return left;
}

}  // namespace transport_internal

absl::StatusOr<std::unique_ptr<MemoryRegion>> UcxContext::Allocate(
    size_t size) {
  if (size == 0) return absl::InvalidArgumentError("allocation of 0 bytes");
  // Every page is made below, in shared memory where UCX takes it: more
  // than the host has would not fail but bring the OOM killer (and a
  // shared-memory file that outlives the killed process, holding /dev/shm).
  if (std::optional<uint64_t> available = transport_internal::MeminfoValue("MemAvailable");
      available.has_value() && size > *available) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "allocation of ", size, " bytes: this host has ", *available,
        " bytes of memory available (MemAvailable)"));
  }
  if (std::optional<uint64_t> left =
          transport_internal::CgroupMemoryLeft("/proc/self/cgroup", "/sys/fs/cgroup");
      left.has_value() && size > *left) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "allocation of ", size, " bytes: this process's memory cgroup (a container's "
        "or unit's limit) allows ", *left, " bytes more"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<MemoryRegion> region, Map(nullptr, size));
  RETURN_IF_ERROR(Prefault(region->base(), region->size()));
  return region;
}

absl::Status UcxContext::Prefault(char* base, size_t size) {
  // UCX hands out memory no page of which exists yet. The first transfer
  // into it would fault on every page, on the progress thread that serves
  // every transfer of its worker: in a run of GET 16 MiB x 16 clients over
  // TCP, 38% of the clients' CPU went to zeroing those pages on their
  // progress threads, while their sockets stayed full and the daemon waited
  // (tools/results/tail_16mib_x16_tcp.txt). So every page is made here, once.
  const long page = sysconf(_SC_PAGESIZE);
  const uintptr_t start = reinterpret_cast<uintptr_t>(base) & ~(page - 1);
  if (madvise(reinterpret_cast<void*>(start),
              reinterpret_cast<uintptr_t>(base) + size - start,
              MADV_POPULATE_WRITE) == 0) {
    return absl::OkStatus();
  }
  if (errno != EINVAL) {
    // ENOMEM; EFAULT where a page would raise SIGBUS: the shared-memory
    // file system (/dev/shm, a container's 64 MiB) is smaller than `size`.
    const int error = errno;
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot make the ", size, " bytes UCX allocated resident (",
        std::strerror(error),
        "): not that much memory, or its shared-memory file system (UCX_POSIX_DIR, "
        "/dev/shm) is smaller"));
  }
  // Kernels before 5.14: a write to each page (of the byte it holds).
  volatile char* bytes = base;
  for (size_t off = 0; off < size; off += page) bytes[off] = bytes[off];
  return absl::OkStatus();
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
