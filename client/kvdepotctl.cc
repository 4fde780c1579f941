// kvdepotctl: the admin CLI of kvdepot, over libkvdepot.
//
//   kvdepotctl [--server HOST:PORT] [--json] [--timeout S] [--transport T]
//              COMMAND ... (the global options may also follow COMMAND)
//
// Commands: health, status, put, get, lookup, evict, inspect, stats,
// namespaces, verify, compact, drain, undrain, quota get|set|remove (see --help
// and README.md). Keys are given in hex. This output and these exit codes are a
// contract scripts rely on:
//   0 ok, 1 error (message on stderr; also when stdout cannot be written),
//   2 usage error (also an input file that cannot be opened or read, or
//     is over 2 GiB; an --out file that cannot be created, or that this
//     user may not write),
//   3 not found.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/cli_output.h"
#include "client/client.h"
#include "storage/block_key.h"
#include "storage/sizes.h"

namespace kvdepot {
namespace {

constexpr int kOk = 0, kError = 1, kUsage = 2, kNotFound = 3;
// verify: the scrub found blocks whose bytes were lost (corrupt or missing;
// it dropped them), so that a scheduled scrub can alert on its exit code.
constexpr int kFoundDamage = 4;

// Thrown inside this file only, caught in Run: a usage error (exit 2) and
// a failure before any command could run (exit 1 or 3, as Fail decides).
struct UsageError {
  std::string message;
};
struct CommandError {
  absl::Status status;
};

// --timeout's range, in seconds: positive and small enough that a deadline
// this far ahead is representable.
constexpr double kMinTimeoutS = 0.001, kMaxTimeoutS = 1e6;
// The largest block put --file takes: kvdepotd's max_block_size is at
// most 2 GiB (server/config.cc), so a larger file is refused unread.
constexpr uint64_t kMaxBlockFileBytes = uint64_t{1} << 31;
// verify and compact scan the whole NVMe tier: without an explicit
// --timeout their deadline is this long.
constexpr absl::Duration kLongRpcTimeout = absl::Hours(24);

std::string HexToBytes(const std::string& hex, const char* what) {
  if (hex.empty() || hex.size() % 2 != 0) {
    throw UsageError{absl::StrCat(what, " '", hex, "' must be an even number of hex digits")};
  }
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) {
      throw UsageError{absl::StrCat(what, " '", hex, "' is not hex")};
    }
  }
  std::string bytes = absl::HexStringToBytes(hex);
  if (bytes.size() > kMaxKeyBytes) {
    throw UsageError{absl::StrCat(what, " is ", bytes.size(),
                                  " bytes; keys are at most ", kMaxKeyBytes)};
  }
  return bytes;
}

// How many symbolic links a path may go through (the kernel's ELOOP limit).
constexpr int kMaxLinkHops = 40;

// The paths a chain of symbolic links starting at `path` goes through:
// `path` first, then each link's target (a relative one read from the
// link's directory); the last is no link (or not there, or unreadable).
// A /proc/PID/fd/N link to a pipe or socket ends at a path that is not
// there ("pipe:[...]").
std::vector<std::string> LinkChain(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<std::string> chain{path};
  for (int hops = 0; hops < kMaxLinkHops; ++hops) {
    struct stat st;
    if (lstat(chain.back().c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) break;
    std::error_code ec;
    const fs::path target = fs::read_symlink(chain.back(), ec);
    if (ec) break;
    // An absolute target replaces the directory.
    chain.push_back((fs::path(chain.back()).parent_path() / target).string());
  }
  return chain;
}

// What a chain of links (LinkChain) says of descriptors: whether it goes
// through a /proc/PID/fd/N link (as /dev/fd/N, /dev/stdout and
// /proc/self/fd/N do), and whether one of them is this process's fd 1.
struct DescriptorNamed {
  bool any = false;
  bool own_stdout = false;
};
DescriptorNamed NamedDescriptor(const std::vector<std::string>& chain) {
  namespace fs = std::filesystem;
  const fs::path own = absl::StrCat("/proc/", getpid());
  DescriptorNamed named;
  for (const std::string& p : chain) {
    const fs::path path(p);
    const std::string n = path.filename().string();
    if (n.empty() || !std::all_of(n.begin(), n.end(), [](char c) {
          return absl::ascii_isdigit(static_cast<unsigned char>(c));
        })) {
      continue;
    }
    std::error_code ec;
    const fs::path dir =
        fs::canonical(path.has_parent_path() ? path.parent_path() : ".", ec);
    if (ec || dir.filename() != "fd" || dir.string().rfind("/proc/", 0) != 0) {
      continue;
    }
    named.any = true;
    // /proc/PID/fd, or a thread's /proc/PID/task/TID/fd.
    if (n == "1" && (dir.parent_path() == own ||
                     dir.parent_path().parent_path() == own / "task")) {
      named.own_stdout = true;
    }
  }
  return named;
}

// True when `path` is the file the results go to (stdout as it was before
// SeparateResults): the same device and inode.
bool IsResultsFile(const std::string& path) {
  struct stat named, results;
  return stat(path.c_str(), &named) == 0 &&
         fstat(fileno(Results()), &results) == 0 &&
         named.st_dev == results.st_dev && named.st_ino == results.st_ino;
}

// Writes a got block to the file `out`. A regular file (new or not) is
// written whole or not at all: into a temporary file beside it, renamed
// over it once closed, so that a failed write (a full disk, a file size
// limit) leaves neither a truncated block that looks whole nor the old
// contents lost. A symbolic link stays one: the file it ends at is
// written so (created when the link dangles). An existing file this user
// may not write is not replaced (though its directory would allow it).
// Anything else that exists (a device, a FIFO) and a file named by its
// descriptor (/dev/fd/3, /dev/stderr: the file that descriptor has open,
// which a rename would not reach) is written in place, as a shell's `>`
// does. A path that cannot be opened or created is the caller's to fix
// (UsageError: 2, as put's --file); a write that fails once open is an
// error (1).
absl::Status WriteOut(const std::string& out, const std::string& bytes) {
  const std::vector<std::string> chain = LinkChain(out);
  const std::string& target = chain.back();
  struct stat existing;
  const bool exists = stat(out.c_str(), &existing) == 0;
  if (!exists && errno != ENOENT) {
    throw UsageError{
        absl::StrCat("--out: cannot open ", out, ": ", std::strerror(errno))};
  }
  const bool in_place =
      exists && (!S_ISREG(existing.st_mode) || NamedDescriptor(chain).any);
  if (exists && !in_place && access(target.c_str(), W_OK) != 0) {
    throw UsageError{absl::StrCat("--out: cannot write ", out, ": ",
                                  std::strerror(errno),
                                  " (a file not writable is not replaced)")};
  }
  const std::string path =
      in_place ? out : absl::StrCat(target, ".kvdepotctl-", getpid(), ".tmp");
  int fd;
  if (in_place) {
    fd = open(path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  } else {
    // O_EXCL: never through a link or file someone put at the name. One
    // left by a kvdepotctl that died with this pid is ours to replace.
    const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
    fd = open(path.c_str(), flags, 0666);
    if (fd < 0 && errno == EEXIST && unlink(path.c_str()) == 0) {
      fd = open(path.c_str(), flags, 0666);
    }
  }
  if (fd < 0) {
    const int err = errno;
    if (!in_place && (err == EACCES || err == EPERM || err == EROFS)) {
      std::string dir = std::filesystem::path(target).parent_path().string();
      throw UsageError{absl::StrCat(
          "--out: cannot create a file in the directory ",
          dir.empty() ? "." : dir, ": ", std::strerror(err), " (", out,
          " is written to a temporary file there, then renamed over it)")};
    }
    throw UsageError{
        absl::StrCat("--out: cannot open ", out, ": ", std::strerror(err))};
  }
  int err = 0;
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      err = errno;
      break;
    }
    done += static_cast<size_t>(n);
  }
  // The old file's permissions, not the umask's, for a file replaced.
  if (err == 0 && !in_place && exists &&
      fchmod(fd, existing.st_mode & 07777) != 0) {
    err = errno;
  }
  if (close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && !in_place && std::rename(path.c_str(), target.c_str()) != 0) {
    err = errno;
  }
  if (err == 0) return absl::OkStatus();
  if (!in_place) unlink(path.c_str());
  return absl::InternalError(
      absl::StrCat("cannot write ", out, ": ", std::strerror(err)));
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
  bool timeout_given = false;  // --timeout was on the command line
  // Subcommand arguments.
  std::string ns, key, parent, file, out;
  bool prefix = false, pin = false, all = false;
  std::vector<std::string> keys;
  std::string quota;  // quota set: a size
  std::string transport = "ucx";  // how put and get move block bytes

  // `moves_bytes`: put and get, the commands --transport is about. The
  // others need no UCX context (its shared-memory segments, its threads):
  // a container's health check runs every few seconds.
  std::unique_ptr<Client> Connect(bool moves_bytes = false) {
    ClientOptions o;
    o.server = server;
    o.rpc_timeout = absl::Seconds(timeout_s);
    o.client_name = "kvdepotctl";
    o.transport = moves_bytes && transport == "ucx"
                      ? ClientOptions::Transport::kUcx
                      : ClientOptions::Transport::kGrpc;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(o);
    if (!client.ok()) {
      // InvalidArgument: the options (--server) are wrong.
      if (absl::IsInvalidArgument(client.status())) {
        throw UsageError{absl::StrCat("--server: ", client.status().message())};
      }
      throw CommandError{client.status()};
    }
    return std::move(client).value();
  }

  // The deadline of an admin RPC started now: --timeout, or `fallback` when
  // --timeout was not given.
  std::chrono::system_clock::time_point Deadline(
      absl::Duration fallback = absl::ZeroDuration()) const {
    absl::Duration d = timeout_given || fallback == absl::ZeroDuration()
                           ? absl::Seconds(timeout_s)
                           : fallback;
    return absl::ToChronoTime(absl::Now() + d);
  }

  // A daemon that did not answer within --timeout (a stalled one keeps its
  // connection up): the next step (the gRPC path, Stats) would only wait
  // as long again, so the command ends with this. (Unreachable is fast.)
  static bool NotAnswering(const absl::Status& st) {
    return absl::IsDeadlineExceeded(st);
  }

  // For put and get with --transport ucx: true when `client` has a UCX
  // session and `bytes` is registered; otherwise, where UCX is what failed
  // (it could not start, the daemon has no data plane or no endpoint to
  // this client: data_plane_status(); the buffer's registration), warns
  // (once) that the command falls back to grpc. A session that could not
  // be opened at all (the daemon down, stopping, not answering) is the
  // command's error: gRPC would fail the same way, and a warning about
  // UCX would mislead. Except at the daemon's session limit
  // (ResourceExhausted): the gRPC path needs no session.
  absl::StatusOr<bool> UseUcx(Client& client, absl::Span<char> bytes) {
    if (transport != "ucx" || bytes.empty()) return false;
    absl::Status st = client.EnsureSession().status();
    if (!st.ok() && !absl::IsResourceExhausted(st)) return st;
    if (st.ok()) st = client.data_plane_status();
    if (st.ok()) st = client.RegisterBuffer(bytes.data(), bytes.size());
    if (NotAnswering(st)) return st;
    if (!st.ok()) {
      std::cerr << "kvdepotctl: warning: falling back to grpc: " << st.message()
                << "\n";
      return false;
    }
    return true;
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
    // A file that cannot be read is a wrong argument and reaches no daemon:
    // a usage error (not "not found", which is about blocks). A directory
    // opens, but its read fails: it once went out as an empty block. A
    // file over the largest block any daemon takes is refused by its size
    // before it is read (it was read whole first, however large).
    struct stat st;
    if (stat(file.c_str(), &st) != 0) {
      throw UsageError{absl::StrCat("--file: cannot open ", file, ": ",
                                    std::strerror(errno))};
    }
    if (S_ISDIR(st.st_mode)) {
      throw UsageError{absl::StrCat("--file: cannot read ", file, ": is a directory")};
    }
    auto too_large = [&](const std::string& size) {
      return UsageError{absl::StrCat("--file: ", file, " is ", size,
                                     "; a block is at most ",
                                     FormatSize(kMaxBlockFileBytes),
                                     " (kvdepotd's largest max_block_size)")};
    };
    if (S_ISREG(st.st_mode) &&
        static_cast<uint64_t>(st.st_size) > kMaxBlockFileBytes) {
      throw too_large(FormatSize(static_cast<uint64_t>(st.st_size)));
    }
    std::ifstream in(file, std::ios::binary);
    if (!in) {
      throw UsageError{absl::StrCat("--file: cannot open ", file, ": ", std::strerror(errno))};
    }
    // istream::read turns a read error into badbit (`buf << in.rdbuf()`
    // left it on the other stream, where an empty file looks the same).
    // Bounded too for what stat cannot size (a pipe) or a growing file.
    std::string bytes;
    char chunk[1 << 16];
    while (in.read(chunk, sizeof chunk) || in.gcount() > 0) {
      bytes.append(chunk, static_cast<size_t>(in.gcount()));
      if (bytes.size() > kMaxBlockFileBytes) {
        throw too_large(
            absl::StrCat("more than ", FormatSize(kMaxBlockFileBytes)));
      }
    }
    if (in.bad()) {
      throw UsageError{absl::StrCat("--file: cannot read ", file)};
    }
    if (bytes.empty()) {
      throw UsageError{absl::StrCat(
          "--file: ", file, " is empty; a block has at least one byte")};
    }
    BlockToPut b{k, p, bytes};
    std::unique_ptr<Client> client = Connect(/*moves_bytes=*/true);
    absl::StatusOr<bool> ucx = UseUcx(*client, absl::MakeSpan(bytes));
    absl::StatusOr<std::vector<PutResult>> r;
    if (!ucx.ok()) {
      r = ucx.status();
    } else if (*ucx) {
      TransferOp op = client->PutFromAsync(ns, {&b, 1});
      op.Wait();
      if (op.statuses()[0].ok()) {
        r = std::vector<PutResult>{op.already_stored(0) ? PutResult::kAlreadyExists
                                                        : PutResult::kStored};
      } else {
        r = op.statuses()[0];
      }
    } else {
      r = client->Put(ns, {&b, 1});
    }
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
    std::unique_ptr<Client> client = Connect(/*moves_bytes=*/true);
    absl::StatusOr<std::vector<Block>> r;
    // Over UCX the buffer must be registered before the read: learn the
    // block's size first (Inspect, which counts no lookup).
    v1::InspectResponse info;
    if (transport == "ucx") {
      grpc::ClientContext ctx;
      ctx.set_deadline(Deadline());
      v1::InspectRequest req;
      req.set_namespace_(ns);
      req.set_key(k);
      const absl::Status inspected =
          FromGrpcStatus(client->stub().Inspect(&ctx, req, &info));
      if (NotAnswering(inspected)) return Fail(inspected);
      if (!inspected.ok()) info.Clear();
    }
    std::string bytes(info.size(), '\0');
    absl::StatusOr<bool> ucx = UseUcx(*client, absl::MakeSpan(bytes));
    if (!ucx.ok()) return Fail(ucx.status());
    if (*ucx) {
      absl::Span<char> dst = absl::MakeSpan(bytes);
      TransferOp op = client->GetIntoAsync(ns, {&kv, 1}, {&dst, 1});
      op.Wait();
      if (op.statuses()[0].ok()) {
        r = std::vector<Block>{Block{k, std::move(bytes), info.checksum()}};
      } else {
        r = op.statuses()[0];
      }
    } else {
      r = client->Get(ns, {&kv, 1});
    }
    if (!r.ok()) {
      if (r.status().code() == absl::StatusCode::kNotFound) {
        std::cerr << "kvdepotctl: not found: " << key << "\n";
        return kNotFound;
      }
      return Fail(r.status());
    }
    const Block& b = (*r)[0];
    // /dev/stdout, /dev/fd/1 and the like name fd 1, which SeparateResults
    // gave to stderr; a path to the results' own file (their pipe, tty or
    // file) is written through them too, in order with them.
    if (out == "-" || NamedDescriptor(LinkChain(out)).own_stdout ||
        IsResultsFile(out)) {
      // Main's FinishOutput flushes and checks stdout.
      std::cout.write(b.bytes.data(), static_cast<std::streamsize>(b.bytes.size()));
      return kOk;
    }
    if (absl::Status st = WriteOut(out, b.bytes); !st.ok()) return Fail(st);
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
    if (all && !keys.empty()) {
      throw UsageError{"evict takes --all or keys, not both"};
    }
    if (!all && keys.empty()) throw UsageError{"evict needs --all or keys"};
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
      return absl::StrCat(
          "{\"used_bytes\": ", t.used_bytes(),
          ", \"capacity_bytes\": ", t.capacity_bytes(),
          ", \"blocks\": ", t.blocks(), ", \"hits\": ", t.hits(),
          ", \"evictions\": ", t.evictions(),
          ", \"integrity_errors\": ", t.integrity_errors(), "}");
    };
    if (json) {
      std::vector<std::string> nss;
      for (const auto& ns_stats : r->namespaces()) nss.push_back(NamespaceJson(ns_stats));
      std::cout << "{\"tiers\": {\"dram\": " << tier_json(d)
                << ", \"nvme\": " << tier_json(r->nvme()) << "}"
                << ", \"demotions\": " << r->demotions()
                << ", \"demotion_failures\": " << r->demotion_failures()
                << ", \"promotions\": " << r->promotions()
                << ", \"promotions_shed\": " << r->promotions_shed()
                << ", \"demotions_skipped\": " << r->demotions_skipped()
                << ", \"sessions\": " << r->sessions() << ", \"pins\": " << r->pins()
                << ", \"reservations\": " << r->reservations()
                << ", \"reserved_bytes\": " << r->reserved_bytes()
                << ", \"lookup_keys\": " << r->lookup_keys()
                << ", \"lookup_hits\": " << r->lookup_hits()
                << ", \"puts\": " << r->puts() << ", \"put_bytes\": " << r->put_bytes()
                << ", \"integrity_errors\": " << r->integrity_errors()
                << ", \"draining\": " << (r->draining() ? "true" : "false")
                << ", \"uptime_ms\": " << r->uptime_ms()
                << ", \"version\": " << Quote(r->version())
                << ", \"namespaces\": [" << absl::StrJoin(nss, ", ") << "]}\n";
    } else {
      double pct = d.capacity_bytes() ? 100.0 * d.used_bytes() / d.capacity_bytes() : 0;
      std::fprintf(Results(), "kvdepotd %s, up %.1f s\n", r->version().c_str(),
                   r->uptime_ms() / 1e3);
      std::fprintf(
          Results(),
          "dram: %llu blocks, %llu / %llu bytes (%.1f%%), %llu evictions\n",
          static_cast<unsigned long long>(d.blocks()),
          static_cast<unsigned long long>(d.used_bytes()),
          static_cast<unsigned long long>(d.capacity_bytes()), pct,
          static_cast<unsigned long long>(d.evictions()));
      const v1::TierStats& n = r->nvme();
      std::fprintf(
          Results(),
          "nvme: %llu blocks, %llu / %llu bytes; %llu demotions (%llu failed), "
          "%llu promotions (%llu shed)\n",
          static_cast<unsigned long long>(n.blocks()),
          static_cast<unsigned long long>(n.used_bytes()),
          static_cast<unsigned long long>(n.capacity_bytes()),
          static_cast<unsigned long long>(r->demotions()),
          static_cast<unsigned long long>(r->demotion_failures()),
          static_cast<unsigned long long>(r->promotions()),
          static_cast<unsigned long long>(r->promotions_shed()));
      std::fprintf(Results(),
                   "lookups: %llu keys, %llu hits; puts: %llu (%llu bytes)\n",
                   static_cast<unsigned long long>(r->lookup_keys()),
                   static_cast<unsigned long long>(r->lookup_hits()),
                   static_cast<unsigned long long>(r->puts()),
                   static_cast<unsigned long long>(r->put_bytes()));
      std::fprintf(Results(),
                   "sessions: %llu, pins: %llu, reservations: %llu\n",
                   static_cast<unsigned long long>(r->sessions()),
                   static_cast<unsigned long long>(r->pins()),
                   static_cast<unsigned long long>(r->reservations()));
      std::fprintf(Results(), "integrity errors: %llu (dram %llu, nvme %llu)\n",
                   static_cast<unsigned long long>(r->integrity_errors()),
                   static_cast<unsigned long long>(d.integrity_errors()),
                   static_cast<unsigned long long>(n.integrity_errors()));
    }
    return kOk;
  }

  int Verify() {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(kLongRpcTimeout));
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
    return r.corrupt_dropped() + r.missing_dropped() > 0 ? kFoundDamage : kOk;
  }

  int Compact() {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(kLongRpcTimeout));
    v1::CompactResponse r;
    absl::Status st = FromGrpcStatus(Connect()->stub().Compact(&ctx, v1::CompactRequest(), &r));
    if (!st.ok()) return Fail(st);
    std::cout << (json ? "{\"compacted\": true}" : "compacted") << "\n";
    return kOk;
  }

  // Runs one unary admin RPC on the raw stub with the --timeout deadline.
  template <typename Req, typename Resp, typename Method>
  absl::Status Call(Method method, const Req& req, Resp* resp) {
    std::unique_ptr<Client> c = Connect();
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    return FromGrpcStatus((c->stub().*method)(&ctx, req, resp));
  }

  int SetDraining(bool draining) {
    v1::SetDrainingRequest req;
    req.set_draining(draining);
    v1::SetDrainingResponse r;
    absl::Status st = Call(&v1::KvDepot::Stub::SetDraining, req, &r);
    if (!st.ok()) return Fail(st);
    if (json) {
      std::cout << "{\"draining\": " << (r.draining() ? "true" : "false")
                << ", \"open_reservations\": " << r.reservations() << "}\n";
    } else {
      std::cout << (r.draining() ? "draining: no new puts; " : "accepting puts; ")
                << r.reservations() << " reserved put(s) still open\n";
    }
    return kOk;
  }

  int Inspect() {
    v1::InspectRequest req;
    req.set_namespace_(ns);
    req.set_key(HexToBytes(key, "--key"));
    v1::InspectResponse r;
    absl::Status st = Call(&v1::KvDepot::Stub::Inspect, req, &r);
    if (!st.ok()) return Fail(st);
    std::string tiers = r.in_dram() && r.in_nvme() ? "dram+nvme"
                        : r.in_dram()              ? "dram"
                                                   : "nvme";
    std::string checksum = absl::StrFormat("%016x", r.checksum());
    std::string parent_hex = absl::BytesToHexString(r.parent());
    if (json) {
      std::cout << "{\"tiers\": " << Quote(tiers) << ", \"size\": " << r.size()
                << ", \"checksum\": " << Quote(checksum) << ", \"pins\": " << r.pins()
                << ", \"cached_children\": " << r.cached_children()
                << ", \"age_ms\": " << r.age_ms() << ", \"dram_reads\": " << r.dram_reads()
                << ", \"nvme_reads\": " << r.nvme_reads()
                << ", \"parent\": " << Quote(parent_hex) << "}\n";
    } else {
      std::cout << "tier: " << tiers << "\nsize: " << r.size() << " bytes\nchecksum: "
                << checksum << " (XXH3-64)\npins: " << r.pins()
                << "\ncached children: " << r.cached_children() << "\n";
      if (r.in_dram()) {
        std::cout << "age: " << absl::FormatDuration(absl::Milliseconds(r.age_ms()))
                  << " in DRAM, " << r.dram_reads() << " lookups\n";
      }
      if (r.in_nvme()) {
        std::cout << "nvme reads: " << r.nvme_reads() << "\nparent: "
                  << (parent_hex.empty() ? "(none)" : parent_hex) << "\n";
      }
    }
    return kOk;
  }

  int QuotaGet() {
    v1::GetQuotaRequest req;
    req.set_namespace_(ns);
    v1::GetQuotaResponse r;
    absl::Status st = Call(&v1::KvDepot::Stub::GetQuota, req, &r);
    if (!st.ok()) return Fail(st);
    if (json) {
      std::cout << "{\"namespace\": " << Quote(ns) << ", \"max_bytes\": " << r.max_bytes()
                << ", \"used_bytes\": " << r.used_bytes() << "}\n";
    } else if (r.max_bytes() == 0) {
      std::cout << ns << ": no quota, " << FormatSize(r.used_bytes()) << " used\n";
    } else {
      std::cout << ns << ": " << FormatSize(r.used_bytes()) << " of "
                << FormatSize(r.max_bytes()) << " used\n";
    }
    return kOk;
  }

  int QuotaSet() {
    absl::StatusOr<uint64_t> bytes = ParseSize(quota);
    if (!bytes.ok()) {
      throw UsageError{absl::StrCat("quota: ", bytes.status().message(),
                                    " (e.g. 64GiB, 0 for none)")};
    }
    v1::SetQuotaRequest req;
    req.set_namespace_(ns);
    req.set_max_bytes(*bytes);
    v1::SetQuotaResponse r;
    absl::Status st = Call(&v1::KvDepot::Stub::SetQuota, req, &r);
    if (!st.ok()) return Fail(st);
    if (json) {
      std::cout << "{\"namespace\": " << Quote(ns) << ", \"max_bytes\": " << *bytes << "}\n";
    } else {
      std::cout << ns << ": quota "
                << (*bytes == 0 ? "removed (still declared: see quota remove)"
                                : FormatSize(*bytes))
                << "\n";
    }
    return kOk;
  }

  int QuotaRemove() {
    v1::SetQuotaRequest req;
    req.set_namespace_(ns);
    req.set_undeclare(true);
    v1::SetQuotaResponse r;
    absl::Status st = Call(&v1::KvDepot::Stub::SetQuota, req, &r);
    if (!st.ok()) return Fail(st);
    if (json) {
      std::cout << "{\"namespace\": " << Quote(ns) << ", \"undeclared\": true}\n";
    } else {
      std::cout << ns << ": quota and declaration removed\n";
    }
    return kOk;
  }

  // One screen: health, tiers, hit ratio, sessions and pins, top namespaces.
  int Status() {
    std::unique_ptr<Client> c = Connect();
    absl::Status health = c->Health();
    if (NotAnswering(health)) return Fail(health);
    auto r = c->Stats();
    if (!r.ok()) return Fail(r.status());
    const char* state = !health.ok() ? "NOT_SERVING" : r->draining() ? "DRAINING" : "SERVING";
    auto ratio = [](uint64_t a, uint64_t b) { return b == 0 ? 0.0 : static_cast<double>(a) / b; };
    std::vector<v1::NamespaceStats> top(r->namespaces().begin(), r->namespaces().end());
    std::sort(top.begin(), top.end(), [](const auto& a, const auto& b) {
      return a.lookups() > b.lookups();
    });
    if (top.size() > 5) top.resize(5);
    if (json) {
      std::vector<std::string> nss;
      for (const auto& n : top) nss.push_back(NamespaceJson(n));
      std::cout << "{\"state\": " << Quote(state) << ", \"version\": " << Quote(r->version())
                << ", \"draining\": " << (r->draining() ? "true" : "false")
                << ", \"uptime_ms\": " << r->uptime_ms()
                << ", \"hit_ratio\": " << ratio(r->lookup_hits(), r->lookup_keys())
                << ", \"sessions\": " << r->sessions() << ", \"pins\": " << r->pins()
                << ", \"reservations\": " << r->reservations()
                << ", \"integrity_errors\": " << r->integrity_errors()
                << ", \"top_namespaces\": [" << absl::StrJoin(nss, ", ") << "]}\n";
      return health.ok() ? kOk : kError;
    }
    std::fprintf(
        Results(), "kvdepotd %s at %s: %s, up %s\n", r->version().c_str(),
        server.c_str(), state,
        absl::FormatDuration(absl::Seconds(r->uptime_ms() / 1000)).c_str());
    for (const auto& [name, t] : {std::pair{"dram", &r->dram()}, std::pair{"nvme", &r->nvme()}}) {
      const double used = ratio(t->used_bytes(), t->capacity_bytes());
      const int bar = static_cast<int>(used * 20 + 0.5);
      std::fprintf(
          Results(),
          "  %s [%s%s] %5.1f%%  %s of %s, %llu blocks, %llu evictions\n", name,
          std::string(bar, '#').c_str(), std::string(20 - bar, '.').c_str(),
          100 * used, FormatSize(t->used_bytes()).c_str(),
          FormatSize(t->capacity_bytes()).c_str(),
          static_cast<unsigned long long>(t->blocks()),
          static_cast<unsigned long long>(t->evictions()));
    }
    std::fprintf(
        Results(),
        "  hits %.1f%% of %llu keys looked up (dram %llu, nvme %llu)\n",
        100 * ratio(r->lookup_hits(), r->lookup_keys()),
        static_cast<unsigned long long>(r->lookup_keys()),
        static_cast<unsigned long long>(r->dram().hits()),
        static_cast<unsigned long long>(r->nvme().hits()));
    std::fprintf(
        Results(),
        "  sessions %llu, pins %llu, open puts %llu, integrity errors %llu "
        "(dram %llu, nvme %llu)\n",
        static_cast<unsigned long long>(r->sessions()),
        static_cast<unsigned long long>(r->pins()),
        static_cast<unsigned long long>(r->reservations()),
        static_cast<unsigned long long>(r->integrity_errors()),
        static_cast<unsigned long long>(r->dram().integrity_errors()),
        static_cast<unsigned long long>(r->nvme().integrity_errors()));
    for (const auto& n : top) {
      std::fprintf(
          Results(), "  ns %-32s %8llu blocks %10s  hits %.1f%%\n",
          n.name().c_str(), static_cast<unsigned long long>(n.blocks()),
          FormatSize(n.bytes()).c_str(), 100 * ratio(n.hits(), n.lookups()));
    }
    return health.ok() ? kOk : kError;
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
                  << " bytes in DRAM  " << n.hits() << "/" << n.lookups() << " hits\n";
      }
    }
    return kOk;
  }
};

// Flushes stdout (iostream and stdio both write to it) and checks that
// everything printed reached it: results written nowhere are an error.
int FinishOutput(int rc) {
  errno = 0;
  std::cout.flush();
  const bool cout_failed = !std::cout;
  if (std::fflush(Results()) != 0 || std::ferror(Results()) || cout_failed) {
    const int err = errno;
    std::cerr << "kvdepotctl: cannot write to stdout"
              << (err != 0 ? absl::StrCat(": ", std::strerror(err)) : "") << "\n";
    return rc == kOk ? kError : rc;
  }
  return rc;
}

int Run(int argc, char** argv) {
  Ctl ctl;
  CLI::App app{"kvdepotctl: administer a kvdepotd"};
  app.require_subcommand(1);
  // The global options below are taken after the subcommand too ("put ...
  // --transport grpc"): a subcommand passes the options it does not know
  // to its parent. Inherited by the subcommands made after this.
  app.fallthrough();
  app.add_option("--server", ctl.server, "kvdepotd address (default 127.0.0.1:50551)");
  app.add_flag("--json", ctl.json, "machine-readable output");
  auto* timeout = app.add_option(
      "--timeout", ctl.timeout_s,
      "RPC deadline in seconds, 0.001 to 1e6 (default 30; verify and compact: 24 h)");
  app.add_option("--transport", ctl.transport,
                 "how put and get move block bytes: ucx (default; falls back "
                 "to grpc with a warning) or grpc")
      ->check(CLI::IsMember({"ucx", "grpc"}));

  auto* health = app.add_subcommand("health", "exit 0 when the daemon is serving");
  auto* put = app.add_subcommand("put", "store a file as a block (put-if-absent)");
  put->add_option("--ns", ctl.ns, "namespace")->required();
  put->add_option("--key", ctl.key, "key (hex)")->required();
  put->add_option("--parent", ctl.parent, "parent key (hex)");
  put->add_option("--file", ctl.file, "file with the block's bytes")->required();
  auto* get = app.add_subcommand("get", "write a block to a file (exit 3 on a miss)");
  get->add_option("--ns", ctl.ns, "namespace")->required();
  get->add_option("--key", ctl.key, "key (hex)")->required();
  get->add_option("--out", ctl.out,
                  "output file (replaced whole, or left as it was on failure), "
                  "- for stdout")
      ->required();
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
  auto* namespaces = app.add_subcommand(
      "namespaces", "list namespaces: blocks and bytes in DRAM, hits/lookups");
  auto* verify = app.add_subcommand("verify", "scrub NVMe blocks against their checksums");
  auto* compact = app.add_subcommand("compact", "compact the NVMe tier");
  auto* status = app.add_subcommand("status", "one screen: health, tiers, hits, sessions, pins");
  auto* drain = app.add_subcommand("drain", "stop accepting puts (reads keep working)");
  auto* undrain = app.add_subcommand("undrain", "accept puts again");
  auto* inspect = app.add_subcommand("inspect", "what the daemon knows about one block");
  inspect->add_option("--ns", ctl.ns, "namespace")->required();
  inspect->add_option("--key", ctl.key, "key (hex)")->required();
  auto* quota = app.add_subcommand("quota", "a namespace's DRAM quota");
  quota->require_subcommand(1);
  auto* quota_get = quota->add_subcommand("get", "show the quota and usage");
  quota_get->add_option("--ns", ctl.ns, "namespace")->required();
  auto* quota_set = quota->add_subcommand("set", "set the quota (0: no limit; the namespace stays declared)");
  quota_set->add_option("--ns", ctl.ns, "namespace")->required();
  quota_set->add_option("size", ctl.quota, "bytes, e.g. 64GiB")->required();
  auto* quota_remove = quota->add_subcommand(
      "remove", "remove the quota and the declaration (an empty namespace may then be forgotten)");
  quota_remove->add_option("--ns", ctl.ns, "namespace")->required();

  // A subcommand's --help lists the global options it also takes.
  std::string globals = "Global options (before or after the subcommand):\n";
  for (const CLI::Option* o : app.get_options()) {
    if (o == app.get_help_ptr()) continue;
    const std::string type = o->get_type_name();
    absl::StrAppend(&globals,
                    absl::StrFormat("  %-27s %s\n",
                                    absl::StrCat(o->get_name(),
                                                 type.empty() ? "" : " ", type),
                                    o->get_description()));
  }
  const auto all = [](CLI::App*) { return true; };
  std::vector<CLI::App*> subcommands = app.get_subcommands(all);
  for (size_t i = 0; i < subcommands.size(); ++i) {  // grows: quota's too
    subcommands[i]->footer(globals);
    for (CLI::App* nested : subcommands[i]->get_subcommands(all)) {
      subcommands.push_back(nested);
    }
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 says "A subcommand is required" for a misspelled one.
    if (app.get_subcommands().empty() && !app.remaining().empty() &&
        app.remaining().front().rfind('-', 0) != 0 && e.get_exit_code() != 0) {
      std::cerr << "kvdepotctl: unknown subcommand '" << app.remaining().front()
                << "' (see --help)\n";
      return kUsage;
    }
    int rc = app.exit(e);
    return rc == 0 ? kOk : kUsage;
  }
  try {
    ctl.timeout_given = timeout->count() > 0;
    // The negated test also rejects NaN.
    if (!(ctl.timeout_s >= kMinTimeoutS && ctl.timeout_s <= kMaxTimeoutS)) {
      throw UsageError{absl::StrCat("--timeout ", ctl.timeout_s,
                                    " must be 0.001 to 1e6 seconds")};
    }
    if (health->parsed()) return ctl.Health();
    if (put->parsed()) return ctl.Put();
    if (get->parsed()) return ctl.Get();
    if (lookup->parsed()) return ctl.Lookup();
    if (evict->parsed()) return ctl.Evict();
    if (stats->parsed()) return ctl.Stats();
    if (namespaces->parsed()) return ctl.Namespaces();
    if (verify->parsed()) return ctl.Verify();
    if (compact->parsed()) return ctl.Compact();
    if (status->parsed()) return ctl.Status();
    if (drain->parsed()) return ctl.SetDraining(true);
    if (undrain->parsed()) return ctl.SetDraining(false);
    if (inspect->parsed()) return ctl.Inspect();
    if (quota_get->parsed()) return ctl.QuotaGet();
    if (quota_set->parsed()) return ctl.QuotaSet();
    if (quota_remove->parsed()) return ctl.QuotaRemove();
  } catch (const UsageError& e) {
    std::cerr << "kvdepotctl: " << e.message << "\n";
    return kUsage;
  } catch (const CommandError& e) {
    return Fail(e.status);
  } catch (const std::exception& e) {
    std::cerr << "kvdepotctl: " << e.what() << "\n";
    return kError;
  }
  return kUsage;
}

int Main(int argc, char** argv) {
  SeparateResults();
  return FinishOutput(Run(argc, argv));
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) { return kvdepot::Main(argc, argv); }
