#include "server/peer_credentials.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace kvdepot {
namespace {

// The kernel prints an address as its 32-bit words, each as a host-order
// integer in hex ("%08X"); the port as "%04X".
std::string Word(const unsigned char* bytes) {
  uint32_t w;
  std::memcpy(&w, bytes, sizeof(w));
  return absl::StrFormat("%08X", w);
}

// A v4 address in the v4-mapped form of tcp6 ("%08X" words), so that both
// tables compare equal: a dual-stack listener's end of an IPv4 connection is
// in tcp6.
constexpr absl::string_view kV4MappedPrefix = "0000000000000000FFFF0000";

// One ESTABLISHED socket of /proc/net/tcp{,6}, addresses in tcp6's form.
struct Socket {
  std::string local, remote;
  uint32_t uid = 0;
  uint64_t inode = 0;
};

// The ESTABLISHED sockets of table `path` (tcp when !v6).
void ReadTable(const std::string& path, bool v6, std::vector<Socket>* out) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    std::vector<absl::string_view> f =
        absl::StrSplit(line, ' ', absl::SkipWhitespace());
    // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
    if (f.size() < 10 || f[3] != "01") continue;
    Socket s;
    if (!absl::SimpleAtoi(f[7], &s.uid) || !absl::SimpleAtoi(f[9], &s.inode)) {
      continue;
    }
    const std::string prefix = v6 ? "" : std::string(kV4MappedPrefix);
    s.local = absl::AsciiStrToUpper(absl::StrCat(prefix, f[1]));
    s.remote = absl::AsciiStrToUpper(absl::StrCat(prefix, f[2]));
    out->push_back(std::move(s));
  }
}

// gRPC's name of a peer with the brackets and colons of an IPv6 address
// that some gRPC versions percent-encode ("ipv6:%5B::1%5D:41234") decoded.
std::string DecodePeer(absl::string_view grpc_peer) {
  return absl::StrReplaceAll(grpc_peer, {{"%5B", "["},
                                         {"%5D", "]"},
                                         {"%3A", ":"},
                                         {"%5b", "["},
                                         {"%5d", "]"},
                                         {"%3a", ":"}});
}

// The inodes of this process's sockets (/proc/self/fd/N -> "socket:[I]").
absl::flat_hash_set<uint64_t> OwnSocketInodes() {
  absl::flat_hash_set<uint64_t> inodes;
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end;
       !ec && it != end; it.increment(ec)) {
    std::error_code link_ec;
    const std::string target = std::filesystem::read_symlink(it->path(), link_ec);
    absl::string_view t = target;
    uint64_t inode = 0;
    if (!link_ec && absl::ConsumePrefix(&t, "socket:[") &&
        absl::ConsumeSuffix(&t, "]") && absl::SimpleAtoi(t, &inode)) {
      inodes.insert(inode);
    }
  }
  return inodes;
}

}  // namespace

std::optional<uint32_t> LocalPeerUid(
    absl::string_view grpc_peer, const std::string& proc_net,
    const absl::flat_hash_set<uint64_t>& own_inodes) {
  const std::string decoded = DecodePeer(grpc_peer);
  absl::string_view rest = decoded;
  const bool v4 = absl::ConsumePrefix(&rest, "ipv4:");
  if (!v4 && !absl::ConsumePrefix(&rest, "ipv6:")) return std::nullopt;
  const size_t colon = rest.rfind(':');
  if (colon == absl::string_view::npos) return std::nullopt;
  absl::string_view host = rest.substr(0, colon);
  uint32_t port = 0;
  if (!absl::SimpleAtoi(rest.substr(colon + 1), &port) || port > 65535) {
    return std::nullopt;
  }
  const std::string port_hex = absl::StrFormat(":%04X", port);
  std::string local;  // the peer's address, in tcp6's form
  if (v4) {
    in_addr a{};
    if (inet_pton(AF_INET, std::string(host).c_str(), &a) != 1)
      return std::nullopt;
    local = absl::StrCat(kV4MappedPrefix,
                         Word(reinterpret_cast<const unsigned char*>(&a)));
  } else {
    if (!absl::ConsumePrefix(&host, "[") || !absl::ConsumeSuffix(&host, "]")) {
      return std::nullopt;
    }
    in6_addr a{};
    if (inet_pton(AF_INET6, std::string(host).c_str(), &a) != 1)
      return std::nullopt;
    const auto* b = reinterpret_cast<const unsigned char*>(&a);
    local = Word(b) + Word(b + 4) + Word(b + 8) + Word(b + 12);
  }
  absl::StrAppend(&local, port_hex);
  std::vector<Socket> sockets;
  ReadTable(absl::StrCat(proc_net, "/tcp"), /*v6=*/false, &sockets);
  ReadTable(absl::StrCat(proc_net, "/tcp6"), /*v6=*/true, &sockets);
  // The peer's socket: at its address, with its other end one of ours (the
  // connection's two ends are each other's remote).
  // Counted by inode: the tables are not read atomically, so a socket may
  // show up twice.
  std::optional<uint32_t> uid;
  absl::flat_hash_set<uint64_t> found;
  for (const Socket& peer : sockets) {
    if (peer.local != local || found.contains(peer.inode)) continue;
    for (const Socket& ours : sockets) {
      if (ours.local == peer.remote && ours.remote == peer.local &&
          own_inodes.contains(ours.inode)) {
        uid = peer.uid;
        found.insert(peer.inode);
        break;
      }
    }
  }
  if (found.size() != 1) return std::nullopt;
  return uid;
}

bool PeerIsOnThisHost(absl::string_view grpc_peer) {
  const std::string decoded = DecodePeer(grpc_peer);
  absl::string_view rest = decoded;
  const bool v4 = absl::ConsumePrefix(&rest, "ipv4:");
  if (!v4 && !absl::ConsumePrefix(&rest, "ipv6:")) return false;
  const size_t colon = rest.rfind(':');
  if (colon == absl::string_view::npos) return false;
  absl::string_view host = rest.substr(0, colon);
  in_addr a4{};
  in6_addr a6{};
  bool is_v4 = v4;
  if (v4) {
    if (inet_pton(AF_INET, std::string(host).c_str(), &a4) != 1) return false;
  } else {
    if (!absl::ConsumePrefix(&host, "[") || !absl::ConsumeSuffix(&host, "]")) {
      return false;
    }
    if (inet_pton(AF_INET6, std::string(host).c_str(), &a6) != 1) return false;
    if (IN6_IS_ADDR_LOOPBACK(&a6)) return true;
    if (IN6_IS_ADDR_V4MAPPED(&a6)) {
      std::memcpy(&a4, a6.s6_addr + 12, sizeof(a4));
      is_v4 = true;
    }
  }
  if (is_v4 && reinterpret_cast<const unsigned char*>(&a4)[0] == 127) {
    return true;  // 127.0.0.0/8
  }
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  bool found = false;
  for (ifaddrs* i = list; i != nullptr && !found; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    if (is_v4 && i->ifa_addr->sa_family == AF_INET) {
      const auto* sin = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
      found = std::memcmp(&sin->sin_addr, &a4, sizeof(a4)) == 0;
    } else if (!is_v4 && i->ifa_addr->sa_family == AF_INET6) {
      const auto* sin6 = reinterpret_cast<const sockaddr_in6*>(i->ifa_addr);
      found = std::memcmp(&sin6->sin6_addr, &a6, sizeof(a6)) == 0;
    }
  }
  freeifaddrs(list);
  return found;
}

std::optional<uint32_t> LocalPeerUid(absl::string_view grpc_peer) {
  // Another host's (most callers that are not local): no need to read the
  // host's whole socket tables and every descriptor of kvdepotd to say so.
  if (!PeerIsOnThisHost(grpc_peer)) return std::nullopt;
  return LocalPeerUid(grpc_peer, "/proc/net", OwnSocketInodes());
}

}  // namespace kvdepot
