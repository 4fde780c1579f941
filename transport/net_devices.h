// Which network devices UCX may listen on, chosen from the address a
// process is reached at.
//
// UCX opens a TCP listener on every network device it uses, for every
// worker, on an ephemeral port; by default that is every device of the
// host. Over TCP (and shared memory) UCX 1.13 serves one-sided reads and
// writes from any peer that connects, at whatever address the peer names
// (transport/README.md, caveat 1): such a listener is a door into the
// process's memory. So kvdepotd keeps its data plane's devices to where its
// gRPC listener is (a daemon on loopback: `lo` only), and libkvdepot its
// own to the devices it reaches its daemon by (a daemon on this host: `lo`).
//
// Thread-safe (no state).
#ifndef KVDEPOT_TRANSPORT_NET_DEVICES_H_
#define KVDEPOT_TRANSPORT_NET_DEVICES_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

// "HOST:PORT" or "[V6]:PORT" split in two. `host` has no brackets
// ("::1"); `port` is the text after the last colon, unchecked (it may be
// empty or not a number). InvalidArgument, saying why, for no ":PORT", no
// ']' after "[", or an IPv6 address without brackets ("::1:80").
// kvdepotd's listen addresses, the HTTP server's, and the host:port part
// of gRPC targets are all read with it.
struct HostPort {
  std::string host;
  std::string port;
};
absl::StatusOr<HostPort> SplitHostPort(absl::string_view address);
// A HostPort's port as a number: nullopt unless it is 1 to 5 decimal
// digits of at most 65535 (0 included: "any port" for a listener).
std::optional<uint16_t> PortNumber(absl::string_view port);
// `host` and `port` as an address: "[::1]:80" for an IPv6 host.
std::string JoinHostPort(absl::string_view host, int port);

// A network interface address of this host, as getifaddrs lists it.
struct NetInterfaceAddress {
  std::string device;   // "eth0"
  std::string address;  // numeric, as inet_ntop prints it: "10.0.0.5", "fd00::2"
  bool loopback = false;
};

struct UcxDeviceChoice {
  // UCX's NET_DEVICES value; nullopt: UCX's default (every device).
  std::optional<std::string> net_devices;
  // Why, for a log line: "the address is loopback", "nothing on this host
  // has 10.1.2.3: every device"...
  std::string why;
  // True when the choice keeps UCX off every device that is not where
  // `address` is (net_devices set).
  bool confined() const { return net_devices.has_value(); }
};

// The devices for a process reached at `address` (a gRPC listen address or
// target: "127.0.0.1:50551", "[::1]:0", "localhost:50551", "0.0.0.0:50551",
// "dns:///host:port", "ipv4:10.0.0.5:50551", "unix:/run/kvdepot.sock"):
// - loopback (127/8, ::1, "localhost", a unix socket): the loopback device;
// - an address of this host's devices: those devices, the loopback device
//   (co-located clients) and every RDMA device (UCX names them, e.g.
//   "mlx5_0:1"; `rdma_devices`), so RDMA stays on;
// - the wildcard (0.0.0.0, ::, an empty host), a host name that does not
//   resolve here, or an address no device of this host has: nullopt.
// `interfaces` and `rdma_devices` describe the host (tests give their own).
UcxDeviceChoice UcxDevicesFor(std::string_view address,
                              const std::vector<NetInterfaceAddress>& interfaces,
                              const std::vector<std::string>& rdma_devices);
// The same for this host (getifaddrs, /sys/class/infiniband).
UcxDeviceChoice UcxDevicesFor(std::string_view address);

// For a client of the daemon at `address`: UcxDevicesFor's choice where it
// confines UCX (a daemon on this host); else the devices this host's routes
// to the daemon's addresses leave by (`route_source`: the source address
// the routing picks), with the loopback and RDMA devices. The daemon
// connects to the client over those. Nullopt (every device) for the
// wildcard, a name that does not resolve, or no route.
UcxDeviceChoice UcxDevicesToReach(
    std::string_view address, const std::vector<NetInterfaceAddress>& interfaces,
    const std::vector<std::string>& rdma_devices,
    absl::FunctionRef<std::optional<std::string>(const std::string&)> route_source);
// The same for this host (its routing table, through a connected UDP
// socket: nothing is sent).
UcxDeviceChoice UcxDevicesToReach(std::string_view address);

// This host's interface addresses (getifaddrs; IPv4 and IPv6 only).
std::vector<NetInterfaceAddress> LocalInterfaceAddresses();
// This host's RDMA ports as UCX names them ("mlx5_0:1"), from
// /sys/class/infiniband; empty without RDMA.
std::vector<std::string> LocalRdmaDevices();

// UCX's NET_DEVICES where it is already chosen: by `config` (a
// UcxContextOptions::config), else by the environment's UCX_NET_DEVICES;
// nullopt where neither names it.
std::optional<std::string> UcxNetDevicesSetting(
    const std::map<std::string, std::string>& config);

// The entries of a UCX NET_DEVICES value ("eth0,mlx5_0:1", "^eth1") that
// name no device of this host: a network interface is a directory in
// `sysfs_net` (/sys/class/net), an RDMA port "DEV:PORT" one in
// `sysfs_infiniband` (/sys/class/infiniband/DEV/ports/PORT). UCX takes any
// name there, and leaves out the devices it does not find without a word:
// with a misspelled device the data plane has no network device while it
// still reports itself on (clients fall back to gRPC). Not checked: "all",
// empty entries and patterns ('*', '?', '['). A leading '^' (every device but
// these) is read past: a device excluded by a misspelled name is used.
std::vector<std::string> MissingNetDevices(
    std::string_view net_devices,
    const std::string& sysfs_net = "/sys/class/net",
    const std::string& sysfs_infiniband = "/sys/class/infiniband");

}  // namespace kvdepot

#endif  // KVDEPOT_TRANSPORT_NET_DEVICES_H_
