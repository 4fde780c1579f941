#include "server/config.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/http_server.h"
#include "storage/dram_arena.h"
#include "storage/sizes.h"
#include "transport/net_devices.h"
#include "transport/ucx_context.h"

namespace kvdepot {

absl::StatusOr<absl::Duration> ParseDurationFlag(absl::string_view text) {
  absl::Duration d;
  if (!absl::ParseDuration(absl::StripAsciiWhitespace(text), &d) ||
      d < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad duration '", text, "' (e.g. 30s, 500ms)"));
  }
  // ParseDuration takes "inf" (and saturates a huge number to it): no
  // timeout or lease of ours may be infinite (an infinite drain_timeout let
  // SIGTERM wait forever).
  if (d == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("duration '", text, "' must be finite (e.g. 30s, 500ms)"));
  }
  return d;
}

absl::StatusOr<uint32_t> ParseAdmission(absl::string_view s) {
  if (s == "always") return 0;
  uint32_t n = 0;
  if (absl::ConsumePrefix(&s, "reads>=") && absl::SimpleAtoi(s, &n) && n >= 1 &&
      n <= 255) {
    return n;
  }
  return absl::InvalidArgumentError(
      "nvme admission must be 'always' or 'reads>=N' (N in 1..255)");
}

absl::StatusOr<HugePageMode> ParseHugePages(absl::string_view s) {
  if (s == "auto") return HugePageMode::kAuto;
  if (s == "on" || s == "true") return HugePageMode::kOn;
  if (s == "off" || s == "false") return HugePageMode::kOff;
  return absl::InvalidArgumentError(
      absl::StrCat("hugepages must be auto, on or off, not '", s, "'"));
}

absl::Status CheckListenAddress(absl::string_view address) {
  auto bad = [address](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "' is not HOST:PORT: ", why));
  };
  absl::StatusOr<HostPort> split = SplitHostPort(address);
  if (!split.ok()) return split.status();
  const absl::string_view host = split->host;
  const absl::string_view port = split->port;
  if (absl::StartsWith(address, "[")) {
    // A scope ("fe80::1%eth0") is not part of the address.
    std::string numeric(host.substr(0, host.find('%')));
    in6_addr v6;
    if (numeric.empty() || inet_pton(AF_INET6, numeric.c_str(), &v6) != 1) {
      return bad(absl::StrCat("'", host, "' is not an IPv6 address"));
    }
  } else {
    if (host.empty()) return bad("no host (0.0.0.0 for every address)");
    const bool numeric = std::all_of(host.begin(), host.end(), [](char ch) {
      return absl::ascii_isdigit(static_cast<unsigned char>(ch)) || ch == '.';
    });
    if (numeric) {
      std::string v4_text(host);
      in_addr v4;
      if (inet_pton(AF_INET, v4_text.c_str(), &v4) != 1) {
        return bad(absl::StrCat("'", host, "' is not an IPv4 address"));
      }
    } else if (!std::all_of(host.begin(), host.end(), [](char ch) {
                 return absl::ascii_isalnum(static_cast<unsigned char>(ch)) ||
                        ch == '-' || ch == '.' || ch == '_';
               }) ||
               absl::StartsWith(host, ".") || absl::StartsWith(host, "-")) {
      return bad(absl::StrCat("'", host, "' is not a host name"));
    }
  }
  if (!PortNumber(port).has_value()) {
    return bad(absl::StrCat("port '", port, "' is not 0..65535"));
  }
  return absl::OkStatus();
}

namespace {

// " at line N" for a node read from a file ("" when yaml-cpp has no mark).
std::string AtLine(const YAML::Node& node) {
  const YAML::Mark mark = node.Mark();
  return mark.is_null() ? "" : absl::StrCat(" at line ", mark.line + 1);
}

// The key of one mapping entry: a plain scalar, or InvalidArgument (a
// sequence, mapping or null key, e.g. `? [a, b]`, names no setting; reading
// it as a string would throw).
absl::StatusOr<std::string> KeyOf(const YAML::Node& key, const std::string& path,
                                  absl::string_view where) {
  if (!key.IsScalar()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config ", path, ": a key", where, AtLine(key), " is not a plain scalar"));
  }
  return key.Scalar();
}

// Whether `key` is a string key whose empty value means something (""
// turns the metrics port off, logs to stderr): for those a YAML null is
// that empty string.
bool EmptyValueMeansSomething(absl::string_view key) {
  return key == "metrics_listen" || key == "log_file";
}

// LoadConfigFile past the parse. May throw YAML::Exception (the caller
// turns it into InvalidArgument).
absl::Status ApplyConfig(const YAML::Node& root, const std::string& path, DaemonConfig* c) {
  if (root.IsNull()) return absl::OkStatus();  // empty file
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config ", path, " must be a YAML mapping"));
  }
  using Setter = std::function<absl::Status(const std::string&)>;
  auto size_into = [](uint64_t* out) -> Setter {
    return [out](const std::string& v) -> absl::Status {
      absl::StatusOr<uint64_t> n = ParseSize(v);
      if (!n.ok()) return n.status();
      *out = *n;
      return absl::OkStatus();
    };
  };
  auto string_into = [](std::string* out) -> Setter {
    return [out](const std::string& v) {
      *out = v;
      return absl::OkStatus();
    };
  };
  auto double_into = [](double* out) -> Setter {
    return [out](const std::string& v) {
      return absl::SimpleAtod(v, out)
                 ? absl::OkStatus()
                 : absl::InvalidArgumentError(absl::StrCat("bad number '", v, "'"));
    };
  };
  auto duration_into = [](absl::Duration* out) -> Setter {
    return [out](const std::string& v) -> absl::Status {
      absl::StatusOr<absl::Duration> d = ParseDurationFlag(v);
      if (!d.ok()) return d.status();
      *out = *d;
      return absl::OkStatus();
    };
  };
  auto bool_into = [](bool* out) -> Setter {
    return [out](const std::string& v) {
      if (v != "true" && v != "false") {
        return absl::InvalidArgumentError(
            absl::StrCat("must be true or false, not '", v, "'"));
      }
      *out = v == "true";
      return absl::OkStatus();
    };
  };
  // Into an integer field of any type, range-checked before the value is
  // narrowed into it (an unchecked cast made 4294967297 max_batch_keys 1):
  // at most `limit` and the field type's largest value; ValidateConfig
  // checks the tighter rules.
  auto uint_into = [](auto* out,
                      uint64_t limit = std::numeric_limits<uint64_t>::max()) -> Setter {
    using Field = std::remove_pointer_t<decltype(out)>;
    const uint64_t max =
        std::min(limit, static_cast<uint64_t>(std::numeric_limits<Field>::max()));
    return [out, max](const std::string& v) {
      uint64_t n;
      if (!absl::SimpleAtoi(v, &n)) {
        return absl::InvalidArgumentError(absl::StrCat("bad integer '", v, "'"));
      }
      if (n > max) {
        return absl::InvalidArgumentError(absl::StrCat(v, " is too large (at most ", max, ")"));
      }
      *out = static_cast<Field>(n);
      return absl::OkStatus();
    };
  };
  const std::map<std::string, Setter> setters = {
      {"listen", string_into(&c->listen)},
      {"admin_peers", string_into(&c->admin_peers)},
      {"metrics_listen", string_into(&c->metrics_listen)},
      {"metrics_namespace_labels",
       uint_into(&c->metrics_namespace_labels, 100000)},
      {"metrics_threads", uint_into(&c->metrics_threads)},
      {"metrics_request_timeout", duration_into(&c->metrics_request_timeout)},
      {"data_dir", string_into(&c->data_dir)},
      {"log_level", string_into(&c->log_level)},
      {"log_format", string_into(&c->log_format)},
      {"log_file", string_into(&c->log_file)},
      {"dram_capacity", size_into(&c->store.dram_capacity)},
      {"grpc_memory_limit", size_into(&c->grpc_memory_limit)},
      {"max_block_size", size_into(&c->store.max_block_bytes)},
      {"dram_max_blocks", uint_into(&c->store.dram_max_blocks)},
      {"nvme_max_blocks", uint_into(&c->store.nvme_max_blocks)},
      {"max_batch_keys", uint_into(&c->store.max_batch_keys)},
      {"max_sessions", uint_into(&c->store.max_sessions)},
      {"max_sessions_per_peer", uint_into(&c->store.max_sessions_per_peer)},
      {"max_namespaces", uint_into(&c->store.max_namespaces)},
      {"max_pinned_blocks", uint_into(&c->store.max_pinned_blocks)},
      {"max_pinned_blocks_per_session",
       uint_into(&c->store.max_pinned_blocks_per_session)},
      {"max_pins", uint_into(&c->store.max_pins)},
      {"max_pins_per_session", uint_into(&c->store.max_pins_per_session)},
      {"grpc_max_threads", uint_into(&c->grpc_max_threads)},
      {"grpc_max_streams_per_connection",
       uint_into(&c->grpc_max_streams_per_connection)},
      {"high_watermark", double_into(&c->store.high_watermark)},
      {"low_watermark", double_into(&c->store.low_watermark)},
      {"session_lease", duration_into(&c->store.default_lease)},
      {"grpc_keepalive", duration_into(&c->grpc_keepalive)},
      {"drain_timeout", duration_into(&c->drain_timeout)},
      {"stream_idle_timeout", duration_into(&c->stream_idle_timeout)},
      {"hugepages",
       [c](const std::string& v) -> absl::Status {
         absl::StatusOr<HugePageMode> m = ParseHugePages(v);
         if (!m.ok()) return m.status();
         c->store.hugepages = *m;
         return absl::OkStatus();
       }},
      {"dram_prefault", bool_into(&c->store.prefault_dram)},
      {"nvme_capacity", size_into(&c->store.nvme_capacity)},
      {"nvme_wal", bool_into(&c->store.nvme_use_wal)},
      {"nvme_direct_reads", bool_into(&c->store.nvme_direct_reads)},
      {"nvme_max_unflushed_age",
       duration_into(&c->store.nvme_max_unflushed_age)},
      {"nvme_admission",
       [c](const std::string& v) -> absl::Status {
         absl::StatusOr<uint32_t> n = ParseAdmission(v);
         if (!n.ok()) return n.status();
         c->store.nvme_admit_min_reads = *n;
         return absl::OkStatus();
       }},
      {"persist_on_shutdown", bool_into(&c->persist_on_shutdown)},
      {"create_namespaces", bool_into(&c->store.create_namespaces)},
      {"ucx_enabled", bool_into(&c->ucx_enabled)},
      {"ucx_workers", uint_into(&c->ucx_workers)},
      {"ucx_colocated_workers", uint_into(&c->ucx_colocated_workers)},
      {"ucx_max_buffers_per_session",
       uint_into(&c->ucx_max_buffers_per_session)},
      {"ucx_transfer_timeout", duration_into(&c->ucx_transfer_timeout)},
  };
  // yaml-cpp keeps every entry of a repeated key: each is an error, never
  // "the last one wins".
  std::set<std::string> seen;
  for (const auto& kv : root) {
    absl::StatusOr<std::string> key_or = KeyOf(kv.first, path, "");
    if (!key_or.ok()) return key_or.status();
    const std::string& key = *key_or;
    if (!seen.insert(key).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config ", path, ": key '", key, "' is given more than once", AtLine(kv.first)));
    }
    if (key == "ucx") {
      // A mapping of UCX settings, over the defaults: a setting given
      // replaces the default of that name (however prefixed), the other
      // defaults stay. (Replacing them as a whole made `ucx: {TLS: tcp}`
      // drop the TCP segment sizes libkvdepot clients use, and UCX aborted
      // the daemon at their first put.)
      if (!kv.second.IsMap()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "config ", path, ": 'ucx' must be a mapping of UCX settings"));
      }
      // By UCX's name for each: "TLS" and "UCX_TLS" are one setting.
      std::map<std::string, std::string> ucx_seen;
      for (const auto& setting : kv.second) {
        absl::StatusOr<std::string> name_or = KeyOf(setting.first, path, " in 'ucx'");
        if (!name_or.ok()) return name_or.status();
        const std::string& name = *name_or;
        auto [first, inserted] = ucx_seen.emplace(UcxSettingName(name), name);
        if (!inserted) {
          return absl::InvalidArgumentError(absl::StrCat(
              "config ", path, ": ucx.", name, AtLine(setting.first), " repeats ucx.",
              first->second, " (one setting)"));
        }
        if (setting.second.IsNull()) {
          return absl::InvalidArgumentError(
              absl::StrCat("config ", path, ": ucx.", name,
                           AtLine(setting.first), " has no value"));
        }
        if (!setting.second.IsScalar()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "config ", path, ": ucx.", name, " must be a scalar"));
        }
        // Here, not when the data plane starts: there a bad one only
        // warned (UCX went on without an unknown name; a refused value
        // turned the data plane off), and it is the config's mistake.
        if (absl::Status checked =
                CheckUcxSetting(name, setting.second.as<std::string>());
            !checked.ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat("config ", path, ": ucx.", name,
                           AtLine(setting.first), ": ", checked.message()));
        }
        for (auto it = c->ucx.begin(); it != c->ucx.end();) {
          it = UcxSettingName(it->first) == UcxSettingName(name)
                   ? c->ucx.erase(it)
                   : std::next(it);
        }
        c->ucx[name] = setting.second.as<std::string>();
      }
      continue;
    }
    auto it = setters.find(key);
    if (it == setters.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config ", path, ": unknown key '", key, "'"));
    }
    // A key with nothing after it (`metrics_listen:`) is YAML null, not "".
    // Where an empty string means something (metrics port off, log to
    // stderr) null means the same; elsewhere it is a key left unfinished.
    std::string value;
    if (kv.second.IsNull()) {
      if (!EmptyValueMeansSomething(key)) {
        return absl::InvalidArgumentError(
            absl::StrCat("config ", path, ": '", key, "'", AtLine(kv.first),
                         " has no value"));
      }
    } else if (!kv.second.IsScalar()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config ", path, ": '", key, "' must be a scalar"));
    } else {
      value = kv.second.as<std::string>();
    }
    absl::Status st = it->second(value);
    if (!st.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config ", path, ": ", key, ": ", st.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LoadConfigFile(const std::string& path, DaemonConfig* c) {
  YAML::Node root;
  try {
    // Every document: LoadFile reads the first only, and settings after a
    // "---" (an override appended by a template) would be dropped, typos
    // in them unseen.
    std::vector<YAML::Node> documents = YAML::LoadAllFromFile(path);
    size_t used = 0;
    for (YAML::Node& d : documents) {
      if (d.IsNull()) continue;
      if (++used > 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "config ", path,
            ": more than one YAML document (\"---\"); put every setting in "
            "one"));
      }
      root = d;
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read config ", path, ": ", e.what()));
  }
  // The walk checks each node's type before converting it; this is for
  // whatever it missed (an exception must never reach kvdepotd's main).
  try {
    return ApplyConfig(root, path, c);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("config ", path, ": ", e.what()));
  }
}

absl::Status ValidateConfig(const DaemonConfig& c) {
  const StoreOptions& s = c.store;
  if (c.admin_peers != "local" && c.admin_peers != "any") {
    return absl::InvalidArgumentError(absl::StrCat(
        "admin_peers must be local or any (not '", c.admin_peers, "')"));
  }
  if (!(s.low_watermark > 0 && s.low_watermark <= s.high_watermark &&
        s.high_watermark <= 1.0)) {
    return absl::InvalidArgumentError(
        "watermarks must satisfy 0 < low_watermark <= high_watermark <= 1");
  }
  if (s.dram_capacity < (1 << 20) ||
      s.dram_capacity > DramArena::kMaxCapacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dram_capacity must be 1MiB to ", FormatSize(DramArena::kMaxCapacity)));
  }
  // A block takes at least DramArena::kMinAlloc bytes of either tier: a
  // larger bound could never be reached (and is likely a size written as a
  // count). 0 derives it from the capacity (StoreOptions).
  if (s.dram_max_blocks > s.dram_capacity / DramArena::kMinAlloc) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dram_max_blocks must be 0 (dram_capacity / 4KiB) or 1..",
        s.dram_capacity / DramArena::kMinAlloc, " (dram_capacity / 64)"));
  }
  if (s.nvme_capacity > 0) {
    if (s.nvme_max_blocks > s.nvme_capacity / DramArena::kMinAlloc) {
      return absl::InvalidArgumentError(absl::StrCat(
          "nvme_max_blocks must be 0 (nvme_capacity / 16KiB) or 1..",
          s.nvme_capacity / DramArena::kMinAlloc, " (nvme_capacity / 64)"));
    }
    if (NvmeMaxBlocks(s) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "nvme_capacity ", FormatSize(s.nvme_capacity),
          " is under 16KiB, one block of the default nvme_max_blocks: "
          "give nvme_max_blocks"));
    }
  }
  if (s.max_batch_keys == 0 || s.max_batch_keys > 65536) {
    return absl::InvalidArgumentError("max_batch_keys must be 1..65536");
  }
  if (s.max_sessions == 0 || s.max_sessions > (1u << 20)) {
    return absl::InvalidArgumentError("max_sessions must be 1..1048576");
  }
  // BlockIndex keeps lists per namespace id and shard.
  if (s.max_namespaces == 0 || s.max_namespaces > 65536) {
    return absl::InvalidArgumentError("max_namespaces must be 1..65536");
  }
  // A pinned lookup of n keys may pin n blocks: below max_batch_keys, the
  // largest lookups the daemon takes could never be pinned.
  if (s.max_pinned_blocks_per_session < s.max_batch_keys) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_pinned_blocks_per_session (", s.max_pinned_blocks_per_session,
        ") must be at least max_batch_keys (", s.max_batch_keys, ")"));
  }
  if (s.max_pinned_blocks < s.max_pinned_blocks_per_session) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_pinned_blocks (", s.max_pinned_blocks,
        ") must be at least max_pinned_blocks_per_session (",
        s.max_pinned_blocks_per_session, ")"));
  }
  if (s.max_sessions_per_peer == 0) {
    return absl::InvalidArgumentError(
        "max_sessions_per_peer must be at least 1");
  }
  if (s.max_pins_per_session == 0 || s.max_pins < s.max_pins_per_session) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_pins_per_session must be at least 1 and max_pins (", s.max_pins,
        ") at least max_pins_per_session (", s.max_pins_per_session, ")"));
  }
  if (s.max_block_bytes == 0 || s.max_block_bytes > (uint64_t{1} << 31)) {
    return absl::InvalidArgumentError("max_block_size must be 1B..2GiB");
  }
  if (absl::Status st = CheckListenAddress(c.listen); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("listen: ", st.message()));
  }
  if (!c.metrics_listen.empty()) {
    if (absl::Status st = CheckListenAddress(c.metrics_listen); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("metrics_listen: ", st.message()));
    }
    if (absl::StartsWith(c.metrics_listen, "[") && !HttpServer::SupportsIpv6()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metrics_listen: '", c.metrics_listen,
          "' is IPv6, and this kvdepotd's civetweb serves IPv4 only "
          "(0.0.0.0 for every address)"));
    }
  }
  if (c.metrics_threads < 4 || c.metrics_threads > 1024) {
    return absl::InvalidArgumentError("metrics_threads must be 4..1024");
  }
  if (c.metrics_request_timeout < absl::Milliseconds(100) ||
      c.metrics_request_timeout > absl::Seconds(10)) {
    return absl::InvalidArgumentError("metrics_request_timeout must be 100ms..10s");
  }
  if (c.grpc_max_threads < 2 || c.grpc_max_threads > 4096) {
    return absl::InvalidArgumentError("grpc_max_threads must be 2..4096");
  }
  if (c.grpc_memory_limit < (16 << 20)) {
    return absl::InvalidArgumentError("grpc_memory_limit must be at least 16MiB");
  }
  if (c.grpc_max_streams_per_connection < 1 || c.grpc_max_streams_per_connection > 65536) {
    return absl::InvalidArgumentError("grpc_max_streams_per_connection must be 1..65536");
  }
  if (c.grpc_keepalive != absl::ZeroDuration() &&
      (c.grpc_keepalive < absl::Seconds(1) || c.grpc_keepalive > absl::Hours(24))) {
    return absl::InvalidArgumentError("grpc_keepalive must be 0 (off) or 1s..24h");
  }
  // The store clamps a session's lease into [min_lease, max_lease]; a
  // default outside it would be changed without a word.
  if (s.default_lease < s.min_lease || s.default_lease > s.max_lease) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session_lease must be ", absl::FormatDuration(s.min_lease), "..",
        absl::FormatDuration(s.max_lease), ", not ", absl::FormatDuration(s.default_lease)));
  }
  if (c.stream_idle_timeout < absl::Seconds(1)) {
    return absl::InvalidArgumentError("stream_idle_timeout must be at least 1s");
  }
  if (c.ucx_workers < 1 || c.ucx_workers > 64) {
    return absl::InvalidArgumentError("ucx_workers must be 1..64");
  }
  if (c.ucx_colocated_workers < 0 || c.ucx_colocated_workers > 4096) {
    return absl::InvalidArgumentError("ucx_colocated_workers must be 0..4096");
  }
  if (c.ucx_max_buffers_per_session < 1 ||
      c.ucx_max_buffers_per_session > 65536) {
    return absl::InvalidArgumentError(
        "ucx_max_buffers_per_session must be 1..65536");
  }
  if (c.store.nvme_max_unflushed_age < absl::Milliseconds(100)) {
    return absl::InvalidArgumentError("nvme_max_unflushed_age must be at least 100ms");
  }
  if (c.ucx_transfer_timeout < absl::Milliseconds(100)) {
    return absl::InvalidArgumentError("ucx_transfer_timeout must be at least 100ms");
  }
  if (c.data_dir.empty()) return absl::InvalidArgumentError("data_dir is empty");
  return absl::OkStatus();
}

}  // namespace kvdepot
