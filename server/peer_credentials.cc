#include "server/peer_credentials.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>
#include <fstream>
#include <vector>

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

// The uid of the ESTABLISHED socket whose local address is `local` in the
// table `path`.
std::optional<uint32_t> FindUid(const std::string& path,
                                const std::string& local) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    std::vector<absl::string_view> f =
        absl::StrSplit(line, ' ', absl::SkipWhitespace());
    // sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
    if (f.size() < 8 || f[3] != "01") continue;
    if (!absl::EqualsIgnoreCase(f[1], local)) continue;
    uint32_t uid = 0;
    if (absl::SimpleAtoi(f[7], &uid)) return uid;
  }
  return std::nullopt;
}

}  // namespace

std::optional<uint32_t> LocalPeerUid(absl::string_view grpc_peer,
                                     const std::string& proc_net) {
  // Some gRPC versions percent-encode the brackets and colons of an IPv6
  // peer ("ipv6:%5B::1%5D:41234").
  const std::string decoded = absl::StrReplaceAll(grpc_peer, {{"%5B", "["},
                                                              {"%5D", "]"},
                                                              {"%3A", ":"},
                                                              {"%5b", "["},
                                                              {"%5d", "]"},
                                                              {"%3a", ":"}});
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
  std::vector<std::pair<std::string, std::string>> candidates;  // file, local
  if (v4) {
    in_addr a{};
    if (inet_pton(AF_INET, std::string(host).c_str(), &a) != 1)
      return std::nullopt;
    const auto* b = reinterpret_cast<const unsigned char*>(&a);
    candidates.push_back({"tcp", Word(b) + port_hex});
    // A dual-stack socket shows an IPv4 peer as v4-mapped.
    candidates.push_back(
        {"tcp6", "0000000000000000FFFF0000" + Word(b) + port_hex});
  } else {
    if (!absl::ConsumePrefix(&host, "[") || !absl::ConsumeSuffix(&host, "]")) {
      return std::nullopt;
    }
    in6_addr a{};
    if (inet_pton(AF_INET6, std::string(host).c_str(), &a) != 1)
      return std::nullopt;
    const auto* b = reinterpret_cast<const unsigned char*>(&a);
    candidates.push_back({"tcp6", Word(b) + Word(b + 4) + Word(b + 8) +
                                      Word(b + 12) + port_hex});
    // A v4-mapped peer of a dual-stack listener is an IPv4 socket on its side.
    if (IN6_IS_ADDR_V4MAPPED(&a))
      candidates.push_back({"tcp", Word(b + 12) + port_hex});
  }
  for (const auto& [file, local] : candidates) {
    if (std::optional<uint32_t> uid =
            FindUid(absl::StrCat(proc_net, "/", file), local)) {
      return uid;
    }
  }
  return std::nullopt;
}

std::optional<uint32_t> LocalPeerUid(absl::string_view grpc_peer) {
  return LocalPeerUid(grpc_peer, "/proc/net");
}

}  // namespace kvdepot
