// kvdepotctl: the admin CLI of kvdepot, over libkvdepot.
//
//   kvdepotctl [--server HOST:PORT] [--json] COMMAND ...
//
// Commands: health, put, get, lookup, evict, stats, namespaces (see --help and
// README.md). Keys are given in hex. This output and these exit codes are a
// contract scripts rely on:
//   0 ok, 1 error (message on stderr), 2 usage error, 3 not found.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"

namespace kvdepot {
namespace {

constexpr int kOk = 0, kError = 1, kUsage = 2, kNotFound = 3;

struct UsageError {
  std::string message;
};

std::string HexToBytes(const std::string& hex, const char* what) {
  if (hex.empty() || hex.size() % 2 != 0) {
    throw UsageError{absl::StrCat(what, " '", hex, "' must be an even number of hex digits")};
  }
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) {
      throw UsageError{absl::StrCat(what, " '", hex, "' is not hex")};
    }
  }
  return absl::HexStringToBytes(hex);
}

const char* TierJson(v1::Tier t) {
  switch (t) {
    case v1::TIER_DRAM:
      return "\"dram\"";
    case v1::TIER_NVME:
      return "\"nvme\"";
    default:
      return "null";
  }
}

// JSON string literal (namespace names and messages).
std::string Quote(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppend(&out, "\\u00", absl::BytesToHexString(std::string(1, c)));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string NamespaceJson(const v1::NamespaceStats& ns) {
  return absl::StrCat("{\"name\": ", Quote(ns.name()), ", \"blocks\": ", ns.blocks(),
                      ", \"bytes\": ", ns.bytes(), ", \"lookups\": ", ns.lookups(),
                      ", \"hits\": ", ns.hits(), "}");
}

int Fail(const absl::Status& st) {
  std::cerr << "kvdepotctl: " << st.message() << " ("
            << absl::StatusCodeToString(st.code()) << ")\n";
  return st.code() == absl::StatusCode::kNotFound ? kNotFound : kError;
}

struct Ctl {
  std::string server = "127.0.0.1:50551";
  bool json = false;
  double timeout_s = 30;
  // Subcommand arguments.
  std::string ns, key, parent, file, out;
  bool prefix = false, pin = false, all = false;
  std::vector<std::string> keys;

  std::unique_ptr<Client> Connect() {
    ClientOptions o;
    o.server = server;
    o.rpc_timeout = absl::Seconds(timeout_s);
    o.client_name = "kvdepotctl";
    return std::move(Client::Connect(o)).value();
  }

  int Health() {
    absl::Status st = Connect()->Health();
    if (!st.ok()) return Fail(st);
    std::cout << (json ? "{\"status\": \"SERVING\"}" : "SERVING") << "\n";
    return kOk;
  }

  int Put() {
    std::string k = HexToBytes(key, "--key");
    std::string p = parent.empty() ? "" : HexToBytes(parent, "--parent");
    std::ifstream in(file, std::ios::binary);
    if (!in) return Fail(absl::NotFoundError(absl::StrCat("cannot open ", file)));
    std::stringstream buf;
    buf << in.rdbuf();
    std::string bytes = buf.str();
    BlockToPut b{k, p, bytes};
    auto r = Connect()->Put(ns, {&b, 1});
    if (!r.ok()) {
      // A put never reports "not found": a missing session or namespace is
      // an error here, not exit 3.
      std::cerr << "kvdepotctl: " << r.status().message() << " ("
                << absl::StatusCodeToString(r.status().code()) << ")\n";
      return kError;
    }
    const char* result = (*r)[0] == PutResult::kStored ? "stored" : "exists";
    if (json) {
      std::cout << "{\"result\": \"" << result << "\", \"size\": " << bytes.size() << "}\n";
    } else {
      std::cout << result << " " << bytes.size() << " bytes\n";
    }
    return kOk;
  }

  int Get() {
    std::string k = HexToBytes(key, "--key");
    absl::string_view kv = k;
    auto r = Connect()->Get(ns, {&kv, 1});
    if (!r.ok()) {
      if (r.status().code() == absl::StatusCode::kNotFound) {
        std::cerr << "kvdepotctl: not found: " << key << "\n";
        return kNotFound;
      }
      return Fail(r.status());
    }
    const Block& b = (*r)[0];
    if (out == "-") {
      std::cout.write(b.bytes.data(), static_cast<std::streamsize>(b.bytes.size()));
      return kOk;
    }
    std::ofstream o(out, std::ios::binary | std::ios::trunc);
    o.write(b.bytes.data(), static_cast<std::streamsize>(b.bytes.size()));
    o.close();
    if (!o) return Fail(absl::InternalError(absl::StrCat("cannot write ", out)));
    if (json) {
      std::cout << "{\"size\": " << b.bytes.size() << ", \"checksum\": \""
                << absl::StrCat(absl::Hex(b.checksum, absl::kZeroPad16)) << "\"}\n";
    }
    return kOk;
  }

  int Lookup() {
    std::vector<std::string> raw;
    for (const auto& h : keys) raw.push_back(HexToBytes(h, "key"));
    std::vector<absl::string_view> views(raw.begin(), raw.end());
    auto client = Connect();
    auto r = client->Lookup(ns, views, prefix, pin);
    if (!r.ok()) return Fail(r.status());
    if (json) {
      std::vector<std::string> entries;
      for (size_t i = 0; i < r->entries.size(); ++i) {
        const BlockInfo& e = r->entries[i];
        entries.push_back(absl::StrCat(
            "{\"key\": \"", absl::AsciiStrToLower(keys[i]), "\", \"found\": ",
            e.found ? "true" : "false", ", \"tier\": ", TierJson(e.tier),
            ", \"size\": ", e.size, "}"));
      }
      std::cout << "{\"prefix_hits\": " << r->prefix_hits;
      if (pin) std::cout << ", \"pin_id\": " << r->pin_id;
      std::cout << ", \"entries\": [" << absl::StrJoin(entries, ", ") << "]}\n";
    } else {
      for (size_t i = 0; i < r->entries.size(); ++i) {
        const BlockInfo& e = r->entries[i];
        std::cout << absl::AsciiStrToLower(keys[i]) << "  "
                  << (e.found ? absl::StrCat(e.tier == v1::TIER_NVME ? "nvme" : "dram",
                                             "  ", e.size, " bytes")
                              : std::string("miss"))
                  << "\n";
      }
      std::cout << "prefix hits: " << r->prefix_hits << "\n";
    }
    return kOk;
  }

  int Evict() {
    if (all == !keys.empty()) throw UsageError{"evict needs --all or keys, not both"};
    std::vector<std::string> raw;
    for (const auto& h : keys) raw.push_back(HexToBytes(h, "key"));
    std::vector<absl::string_view> views(raw.begin(), raw.end());
    auto r = Connect()->Evict(ns, views, all);
    if (!r.ok()) return Fail(r.status());
    if (json) {
      std::vector<std::string> pinned;
      for (const auto& k : r->pinned_keys()) {
        pinned.push_back(absl::StrCat("\"", absl::BytesToHexString(k), "\""));
      }
      std::cout << "{\"evicted_blocks\": " << r->evicted_blocks()
                << ", \"evicted_bytes\": " << r->evicted_bytes()
                << ", \"pinned_blocks\": " << r->pinned_blocks()
                << ", \"missing_keys\": " << r->missing_keys()
                << ", \"pinned_keys\": [" << absl::StrJoin(pinned, ", ") << "]}\n";
    } else {
      std::cout << "evicted " << r->evicted_blocks() << " blocks ("
                << r->evicted_bytes() << " bytes); kept " << r->pinned_blocks()
                << " pinned; " << r->missing_keys() << " not found\n";
    }
    return kOk;
  }

  int Stats() {
    auto r = Connect()->Stats();
    if (!r.ok()) return Fail(r.status());
    const v1::TierStats& d = r->dram();
    auto tier_json = [](const v1::TierStats& t) {
      return absl::StrCat("{\"used_bytes\": ", t.used_bytes(), ", \"capacity_bytes\": ",
                          t.capacity_bytes(), ", \"blocks\": ", t.blocks(),
                          ", \"hits\": ", t.hits(), ", \"evictions\": ", t.evictions(), "}");
    };
    if (json) {
      std::vector<std::string> nss;
      for (const auto& ns_stats : r->namespaces()) nss.push_back(NamespaceJson(ns_stats));
      std::cout << "{\"tiers\": {\"dram\": " << tier_json(d)
                << ", \"nvme\": " << tier_json(r->nvme()) << "}"
                << ", \"demotions\": " << r->demotions()
                << ", \"demotion_failures\": " << r->demotion_failures()
                << ", \"promotions\": " << r->promotions()
                << ", \"demotions_skipped\": " << r->demotions_skipped()
                << ", \"sessions\": " << r->sessions() << ", \"pins\": " << r->pins()
                << ", \"reservations\": " << r->reservations()
                << ", \"reserved_bytes\": " << r->reserved_bytes()
                << ", \"lookup_keys\": " << r->lookup_keys()
                << ", \"lookup_hits\": " << r->lookup_hits()
                << ", \"puts\": " << r->puts() << ", \"put_bytes\": " << r->put_bytes()
                << ", \"integrity_errors\": " << r->integrity_errors()
                << ", \"uptime_ms\": " << r->uptime_ms()
                << ", \"version\": " << Quote(r->version())
                << ", \"namespaces\": [" << absl::StrJoin(nss, ", ") << "]}\n";
    } else {
      double pct = d.capacity_bytes() ? 100.0 * d.used_bytes() / d.capacity_bytes() : 0;
      std::printf("kvdepotd %s, up %.1f s\n", r->version().c_str(), r->uptime_ms() / 1e3);
      std::printf("dram: %llu blocks, %llu / %llu bytes (%.1f%%), %llu evictions\n",
                  static_cast<unsigned long long>(d.blocks()),
                  static_cast<unsigned long long>(d.used_bytes()),
                  static_cast<unsigned long long>(d.capacity_bytes()), pct,
                  static_cast<unsigned long long>(d.evictions()));
      const v1::TierStats& n = r->nvme();
      std::printf("nvme: %llu blocks, %llu / %llu bytes; %llu demotions (%llu failed), "
                  "%llu promotions\n",
                  static_cast<unsigned long long>(n.blocks()),
                  static_cast<unsigned long long>(n.used_bytes()),
                  static_cast<unsigned long long>(n.capacity_bytes()),
                  static_cast<unsigned long long>(r->demotions()),
                  static_cast<unsigned long long>(r->demotion_failures()),
                  static_cast<unsigned long long>(r->promotions()));
      std::printf("lookups: %llu keys, %llu hits; puts: %llu (%llu bytes)\n",
                  static_cast<unsigned long long>(r->lookup_keys()),
                  static_cast<unsigned long long>(r->lookup_hits()),
                  static_cast<unsigned long long>(r->puts()),
                  static_cast<unsigned long long>(r->put_bytes()));
      std::printf("sessions: %llu, pins: %llu, reservations: %llu\n",
                  static_cast<unsigned long long>(r->sessions()),
                  static_cast<unsigned long long>(r->pins()),
                  static_cast<unsigned long long>(r->reservations()));
    }
    return kOk;
  }

  int Verify() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(24));
    v1::VerifyResponse r;
    absl::Status st = FromGrpcStatus(Connect()->stub().Verify(&ctx, v1::VerifyRequest(), &r));
    if (!st.ok()) return Fail(st);
    if (json) {
      std::cout << "{\"blocks_checked\": " << r.blocks_checked()
                << ", \"bytes_checked\": " << r.bytes_checked()
                << ", \"corrupt_dropped\": " << r.corrupt_dropped()
                << ", \"missing_dropped\": " << r.missing_dropped()
                << ", \"orphans_dropped\": " << r.orphans_dropped() << "}\n";
    } else {
      std::cout << "checked " << r.blocks_checked() << " blocks (" << r.bytes_checked()
                << " bytes); dropped " << r.corrupt_dropped() << " corrupt, "
                << r.missing_dropped() << " missing, " << r.orphans_dropped()
                << " orphaned\n";
    }
    return kOk;
  }

  int Compact() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(24));
    v1::CompactResponse r;
    absl::Status st = FromGrpcStatus(Connect()->stub().Compact(&ctx, v1::CompactRequest(), &r));
    if (!st.ok()) return Fail(st);
    std::cout << (json ? "{\"compacted\": true}" : "compacted") << "\n";
    return kOk;
  }

  int Namespaces() {
    auto r = Connect()->ListNamespaces();
    if (!r.ok()) return Fail(r.status());
    if (json) {
      std::vector<std::string> nss;
      for (const auto& ns_stats : r->namespaces()) nss.push_back(NamespaceJson(ns_stats));
      std::cout << "{\"namespaces\": [" << absl::StrJoin(nss, ", ") << "]}\n";
    } else {
      for (const auto& n : r->namespaces()) {
        std::cout << n.name() << "  " << n.blocks() << " blocks  " << n.bytes()
                  << " bytes  " << n.hits() << "/" << n.lookups() << " hits\n";
      }
    }
    return kOk;
  }
};

int Main(int argc, char** argv) {
  Ctl ctl;
  CLI::App app{"kvdepotctl: administer a kvdepotd"};
  app.require_subcommand(1);
  app.add_option("--server", ctl.server, "kvdepotd address (default 127.0.0.1:50551)");
  app.add_flag("--json", ctl.json, "machine-readable output");
  app.add_option("--timeout", ctl.timeout_s, "RPC deadline in seconds (default 30)");

  auto* health = app.add_subcommand("health", "exit 0 when the daemon is serving");
  auto* put = app.add_subcommand("put", "store a file as a block (put-if-absent)");
  put->add_option("--ns", ctl.ns, "namespace")->required();
  put->add_option("--key", ctl.key, "key (hex)")->required();
  put->add_option("--parent", ctl.parent, "parent key (hex)");
  put->add_option("--file", ctl.file, "file with the block's bytes")->required();
  auto* get = app.add_subcommand("get", "write a block to a file (exit 3 on a miss)");
  get->add_option("--ns", ctl.ns, "namespace")->required();
  get->add_option("--key", ctl.key, "key (hex)")->required();
  get->add_option("--out", ctl.out, "output file, - for stdout")->required();
  auto* lookup = app.add_subcommand("lookup", "look up keys");
  lookup->add_option("--ns", ctl.ns, "namespace")->required();
  lookup->add_flag("--prefix", ctl.prefix, "stop at the first miss");
  lookup->add_flag("--pin", ctl.pin, "pin the hits (released when kvdepotctl exits)");
  lookup->add_option("keys", ctl.keys, "keys (hex)")->required();
  auto* evict = app.add_subcommand("evict", "remove unpinned blocks");
  evict->add_option("--ns", ctl.ns, "namespace")->required();
  evict->add_flag("--all", ctl.all, "every block of the namespace");
  evict->add_option("keys", ctl.keys, "keys (hex)");
  auto* stats = app.add_subcommand("stats", "tier and namespace counters");
  auto* namespaces = app.add_subcommand("namespaces", "list namespaces");
  auto* verify = app.add_subcommand("verify", "scrub NVMe blocks against their checksums");
  auto* compact = app.add_subcommand("compact", "compact the NVMe tier");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? kOk : kUsage;
  }
  try {
    if (health->parsed()) return ctl.Health();
    if (put->parsed()) return ctl.Put();
    if (get->parsed()) return ctl.Get();
    if (lookup->parsed()) return ctl.Lookup();
    if (evict->parsed()) return ctl.Evict();
    if (stats->parsed()) return ctl.Stats();
    if (namespaces->parsed()) return ctl.Namespaces();
    if (verify->parsed()) return ctl.Verify();
    if (compact->parsed()) return ctl.Compact();
  } catch (const UsageError& e) {
    std::cerr << "kvdepotctl: " << e.message << "\n";
    return kUsage;
  }
  return kUsage;
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) { return kvdepot::Main(argc, argv); }
