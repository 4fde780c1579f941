#include "transport/net_devices.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "transport/ucx_context.h"

namespace kvdepot {
namespace {

struct Host {
  bool unix_socket = false;
  std::string name;  // empty: every address (":50551")
};

// The host part of a gRPC listen address or target.
Host HostOf(absl::string_view address) {
  absl::string_view rest = address;
  if (absl::StartsWith(rest, "unix:") || absl::StartsWith(rest, "unix-abstract:")) {
    return {true, ""};
  }
  if (absl::ConsumePrefix(&rest, "dns://")) {
    // dns://[authority]/host:port
    const size_t slash = rest.find('/');
    rest = slash == absl::string_view::npos ? rest : rest.substr(slash + 1);
  } else if (!absl::ConsumePrefix(&rest, "dns:") &&
             !absl::ConsumePrefix(&rest, "ipv4:")) {
    absl::ConsumePrefix(&rest, "ipv6:");
  }
  rest = rest.substr(0, rest.find(','));  // ipv4:a:p,b:p -- the first
  if (absl::StatusOr<HostPort> split = SplitHostPort(rest); split.ok()) {
    return {false, std::move(split->host)};
  }
  if (absl::ConsumePrefix(&rest, "[")) {  // "[::1]", no port
    return {false, std::string(rest.substr(0, rest.find(']')))};
  }
  return {false, std::string(rest)};  // a bare IPv6 address, or no port
}

// `sa` as a numeric address, IPv4-mapped IPv6 as IPv4; empty for other
// families.
std::string Numeric(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    return inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf)) ? buf : "";
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      return inet_ntop(AF_INET, &in6->sin6_addr.s6_addr[12], buf, sizeof(buf)) ? buf : "";
    }
    return inet_ntop(AF_INET6, &in6->sin6_addr, buf, sizeof(buf)) ? buf : "";
  }
  return "";
}

// The numeric addresses `host` stands for (numeric hosts without a lookup).
std::vector<std::string> Resolve(const std::string& host) {
  std::string name = host;
  if (const size_t scope = name.find('%'); scope != std::string::npos) {
    name.resize(scope);  // fe80::1%eth0
  }
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  if (getaddrinfo(name.c_str(), nullptr, &hints, &list) != 0) return {};
  std::vector<std::string> out;
  for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
    std::string n = Numeric(a->ai_addr);
    if (!n.empty() && std::find(out.begin(), out.end(), n) == out.end()) {
      out.push_back(std::move(n));
    }
  }
  freeaddrinfo(list);
  return out;
}

bool IsLoopback(const std::string& numeric) {
  in_addr a4{};
  if (inet_pton(AF_INET, numeric.c_str(), &a4) == 1) {
    return (ntohl(a4.s_addr) >> 24) == 127;
  }
  in6_addr a6{};
  return inet_pton(AF_INET6, numeric.c_str(), &a6) == 1 && IN6_IS_ADDR_LOOPBACK(&a6);
}

bool IsWildcard(const std::string& numeric) {
  return numeric == "0.0.0.0" || numeric == "::";
}

void AddOnce(std::vector<std::string>& list, const std::string& item) {
  if (std::find(list.begin(), list.end(), item) == list.end()) list.push_back(item);
}

std::vector<std::string> LoopbackDevices(
    const std::vector<NetInterfaceAddress>& interfaces) {
  std::vector<std::string> out;
  for (const NetInterfaceAddress& i : interfaces) {
    if (i.loopback) AddOnce(out, i.device);
  }
  if (out.empty()) out.push_back("lo");
  return out;
}

// `devices` (not empty) with the loopback and RDMA devices added.
UcxDeviceChoice Confined(std::vector<std::string> devices, std::string why,
                         const std::vector<NetInterfaceAddress>& interfaces,
                         const std::vector<std::string>& rdma_devices) {
  for (const std::string& d : LoopbackDevices(interfaces)) AddOnce(devices, d);
  for (const std::string& d : rdma_devices) AddOnce(devices, d);
  if (!rdma_devices.empty()) absl::StrAppend(&why, " (and RDMA stays on)");
  return {absl::StrJoin(devices, ","), std::move(why)};
}

// The source address this host's routing picks for `numeric` (a UDP
// socket connected there: nothing is sent); nullopt without a route.
std::optional<std::string> RouteSource(const std::string& numeric) {
  sockaddr_storage ss = {};
  socklen_t len = 0;
  auto* in = reinterpret_cast<sockaddr_in*>(&ss);
  auto* in6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (inet_pton(AF_INET, numeric.c_str(), &in->sin_addr) == 1) {
    in->sin_family = AF_INET;
    in->sin_port = htons(9);
    len = sizeof(*in);
  } else if (inet_pton(AF_INET6, numeric.c_str(), &in6->sin6_addr) == 1) {
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(9);
    len = sizeof(*in6);
  } else {
    return std::nullopt;
  }
  const int fd = socket(ss.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  std::optional<std::string> out;
  sockaddr_storage local = {};
  socklen_t local_len = sizeof(local);
  if (connect(fd, reinterpret_cast<sockaddr*>(&ss), len) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) == 0) {
    std::string n = Numeric(reinterpret_cast<sockaddr*>(&local));
    if (!n.empty()) out = std::move(n);
  }
  close(fd);
  return out;
}

// The addresses UcxDevicesFor's choice looks at: none for a unix socket,
// "localhost", the wildcard or an empty host (decided by the name), else
// the host's, resolved once.
std::vector<std::string> AddressesOf(const Host& host) {
  if (host.unix_socket || host.name.empty() || host.name == "*" ||
      host.name == "localhost") {
    return {};
  }
  return Resolve(host.name);
}

// UcxDevicesFor with `host` parsed and its `addresses` (AddressesOf).
UcxDeviceChoice DevicesHere(const Host& host, const std::vector<std::string>& addresses,
                            const std::vector<NetInterfaceAddress>& interfaces,
                            const std::vector<std::string>& rdma_devices) {
  const std::vector<std::string> loopback_devices = LoopbackDevices(interfaces);
  if (host.unix_socket || host.name == "localhost") {
    return {absl::StrJoin(loopback_devices, ","), "the address is on this host only"};
  }
  if (host.name.empty() || host.name == "*") {
    return {std::nullopt, "the address is every address of this host"};
  }
  if (addresses.empty()) {
    return {std::nullopt, absl::StrCat("'", host.name, "' does not resolve here")};
  }
  if (std::any_of(addresses.begin(), addresses.end(), IsWildcard)) {
    return {std::nullopt, "the address is every address of this host"};
  }
  if (std::all_of(addresses.begin(), addresses.end(), IsLoopback)) {
    return {absl::StrJoin(loopback_devices, ","), "the address is loopback"};
  }
  std::vector<std::string> devices;
  for (const std::string& a : addresses) {
    if (IsLoopback(a)) continue;
    for (const NetInterfaceAddress& i : interfaces) {
      if (!i.loopback && i.address == a) AddOnce(devices, i.device);
    }
  }
  if (devices.empty()) {
    return {std::nullopt, absl::StrCat("no device of this host has ",
                                       absl::StrJoin(addresses, " or "))};
  }
  std::string why = absl::StrCat("the address is on ", absl::StrJoin(devices, ","));
  return Confined(std::move(devices), std::move(why), interfaces, rdma_devices);
}

}  // namespace

absl::StatusOr<HostPort> SplitHostPort(absl::string_view address) {
  auto bad = [address](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "' is not HOST:PORT: ", why));
  };
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos) return bad("no ']' after the IPv6 address");
    absl::string_view rest = address.substr(close + 1);
    if (!absl::ConsumePrefix(&rest, ":")) return bad("no :PORT after ']'");
    return HostPort{std::string(address.substr(1, close - 1)), std::string(rest)};
  }
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return bad("no :PORT");
  const absl::string_view host = address.substr(0, colon);
  if (host.find(':') != absl::string_view::npos) {
    return bad("an IPv6 address goes in brackets, as [::1]:9551");
  }
  return HostPort{std::string(host), std::string(address.substr(colon + 1))};
}

std::optional<uint16_t> PortNumber(absl::string_view port) {
  uint32_t number = 0;
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(),
                   [](char c) { return absl::ascii_isdigit(static_cast<unsigned char>(c)); }) ||
      !absl::SimpleAtoi(port, &number) || number > 65535) {
    return std::nullopt;
  }
  return static_cast<uint16_t>(number);
}

std::string JoinHostPort(absl::string_view host, int port) {
  return host.find(':') == absl::string_view::npos ? absl::StrCat(host, ":", port)
                                                   : absl::StrCat("[", host, "]:", port);
}

UcxDeviceChoice UcxDevicesFor(std::string_view address,
                              const std::vector<NetInterfaceAddress>& interfaces,
                              const std::vector<std::string>& rdma_devices) {
  const Host host = HostOf(absl::string_view(address.data(), address.size()));
  return DevicesHere(host, AddressesOf(host), interfaces, rdma_devices);
}

UcxDeviceChoice UcxDevicesFor(std::string_view address) {
  return UcxDevicesFor(address, LocalInterfaceAddresses(), LocalRdmaDevices());
}

UcxDeviceChoice UcxDevicesToReach(
    std::string_view address, const std::vector<NetInterfaceAddress>& interfaces,
    const std::vector<std::string>& rdma_devices,
    absl::FunctionRef<std::optional<std::string>(const std::string&)> route_source) {
  const Host host = HostOf(absl::string_view(address.data(), address.size()));
  const std::vector<std::string> addresses = AddressesOf(host);
  UcxDeviceChoice here = DevicesHere(host, addresses, interfaces, rdma_devices);
  if (here.confined() || addresses.empty() ||
      std::any_of(addresses.begin(), addresses.end(), IsWildcard)) {
    return here;
  }
  std::vector<std::string> devices;
  for (const std::string& a : addresses) {
    const std::optional<std::string> source = route_source(a);
    if (!source.has_value()) continue;
    for (const NetInterfaceAddress& i : interfaces) {
      if (!i.loopback && i.address == *source) AddOnce(devices, i.device);
    }
  }
  if (devices.empty()) {
    return {std::nullopt, absl::StrCat("no route to ", absl::StrJoin(addresses, " or "),
                                       " from a device of this host")};
  }
  std::string why = absl::StrCat("the route to ", addresses.front(), " leaves by ",
                                 absl::StrJoin(devices, ","));
  return Confined(std::move(devices), std::move(why), interfaces, rdma_devices);
}

UcxDeviceChoice UcxDevicesToReach(std::string_view address) {
  return UcxDevicesToReach(address, LocalInterfaceAddresses(), LocalRdmaDevices(),
                           RouteSource);
}

std::vector<NetInterfaceAddress> LocalInterfaceAddresses() {
  std::vector<NetInterfaceAddress> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    std::string numeric = Numeric(i->ifa_addr);
    if (numeric.empty()) continue;
    out.push_back({i->ifa_name, std::move(numeric), (i->ifa_flags & IFF_LOOPBACK) != 0});
  }
  freeifaddrs(list);
  return out;
}

std::vector<std::string> LocalRdmaDevices() {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  std::error_code ec;
  for (const fs::directory_entry& dev : fs::directory_iterator("/sys/class/infiniband", ec)) {
    std::error_code port_ec;
    for (const fs::directory_entry& port :
         fs::directory_iterator(dev.path() / "ports", port_ec)) {
      out.push_back(absl::StrCat(dev.path().filename().string(), ":",
                                 port.path().filename().string()));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> MissingNetDevices(
    std::string_view net_devices, const std::string& sysfs_net,
    const std::string& sysfs_infiniband) {
  namespace fs = std::filesystem;
  absl::string_view list(net_devices.data(), net_devices.size());
  list = absl::StripAsciiWhitespace(list);
  absl::ConsumePrefix(&list, "^");
  std::vector<std::string> missing;
  for (absl::string_view entry : absl::StrSplit(list, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty() || entry == "all" ||
        entry.find_first_of("*?[") != absl::string_view::npos) {
      continue;
    }
    // An interface name has no '/' (and "." and ".." are not ones): such an
    // entry names nothing, and must not walk the file system.
    const bool odd = entry.find('/') != absl::string_view::npos ||
                     entry == "." || entry == "..";
    std::error_code ec;
    bool found = false;
    if (!odd) {
      const size_t colon = entry.rfind(':');
      found =
          colon == absl::string_view::npos
              ? fs::is_directory(fs::path(sysfs_net) / std::string(entry), ec)
              : fs::is_directory(fs::path(sysfs_infiniband) /
                                     std::string(entry.substr(0, colon)) /
                                     "ports" /
                                     std::string(entry.substr(colon + 1)),
                                 ec);
    }
    if (!found) missing.emplace_back(entry);
  }
  return missing;
}

std::optional<std::string> UcxNetDevicesSetting(
    const std::map<std::string, std::string>& config) {
  if (std::optional<std::string> set = UcxConfigValue(config, "NET_DEVICES")) return set;
  if (const char* env = std::getenv("UCX_NET_DEVICES")) return std::string(env);
  return std::nullopt;
}

}  // namespace kvdepot
