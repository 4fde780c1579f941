#include "transport/net_devices.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "tests/test_dir.h"

namespace kvdepot {
namespace {

// A host with loopback, two Ethernet devices and no RDMA.
const std::vector<NetInterfaceAddress> kHost = {
    {"lo", "127.0.0.1", true},   {"lo", "::1", true},
    {"eth0", "10.0.0.5", false}, {"eth0", "fd00::2", false},
    {"eth1", "192.168.1.7", false},
};

std::string Devices(std::string_view address,
                    const std::vector<std::string>& rdma = {}) {
  UcxDeviceChoice c = UcxDevicesFor(address, kHost, rdma);
  return c.net_devices.value_or("<every device>");
}

TEST(SplitHostPortTest, SplitsHostsAndBracketedIpv6Addresses) {
  struct Case {
    const char* address;
    const char* host;
    const char* port;
  };
  for (const Case& c : {Case{"127.0.0.1:50551", "127.0.0.1", "50551"},
                        Case{"localhost:0", "localhost", "0"},
                        Case{"[::1]:9551", "::1", "9551"},
                        Case{"[fe80::1%eth0]:80", "fe80::1%eth0", "80"},
                        Case{":80", "", "80"},
                        Case{"host:", "host", ""}}) {
    absl::StatusOr<HostPort> split = SplitHostPort(c.address);
    ASSERT_TRUE(split.ok()) << c.address << ": " << split.status();
    EXPECT_EQ(split->host, c.host) << c.address;
    EXPECT_EQ(split->port, c.port) << c.address;
  }
  for (const char* bad : {"80", "localhost", "[::1", "[::1]", "[::1]80", "::1:80", ""}) {
    absl::StatusOr<HostPort> split = SplitHostPort(bad);
    EXPECT_EQ(split.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(split.status().message().find("is not HOST:PORT"), std::string::npos)
        << split.status();
  }
}

TEST(SplitHostPortTest, PortsAreUpTo5DigitsOfAtMost65535) {
  EXPECT_EQ(PortNumber("0"), std::optional<uint16_t>(0));
  EXPECT_EQ(PortNumber("50551"), std::optional<uint16_t>(50551));
  EXPECT_EQ(PortNumber("65535"), std::optional<uint16_t>(65535));
  EXPECT_EQ(PortNumber("00080"), std::optional<uint16_t>(80));
  for (const char* bad : {"", "65536", "100431", "000080", "-1", "+80", "8o", " 80", "http"}) {
    EXPECT_EQ(PortNumber(bad), std::nullopt) << bad;
  }
}

TEST(SplitHostPortTest, JoinPutsIpv6HostsInBrackets) {
  EXPECT_EQ(JoinHostPort("127.0.0.1", 50551), "127.0.0.1:50551");
  EXPECT_EQ(JoinHostPort("localhost", 0), "localhost:0");
  EXPECT_EQ(JoinHostPort("::1", 9551), "[::1]:9551");
  for (const char* address : {"10.1.2.3:7", "[fd00::2]:7", "name:7"}) {
    absl::StatusOr<HostPort> split = SplitHostPort(address);
    ASSERT_TRUE(split.ok()) << address;
    EXPECT_EQ(JoinHostPort(split->host, 7), address);
  }
}

// gRPC targets are read for their host: with a scheme, without a port.
TEST(UcxDevicesForTest, TargetsWithASchemeOrNoPortAreReadForTheirHost) {
  for (const char* target : {"dns:///10.0.0.5:50551", "dns://8.8.8.8/10.0.0.5:50551",
                             "ipv4:10.0.0.5:50551", "10.0.0.5", "[fd00::2]",
                             "ipv6:[fd00::2]:1", "fd00::2"}) {
    EXPECT_EQ(Devices(target), "eth0,lo") << target;
  }
}

TEST(UcxDevicesForTest, LoopbackAddressesKeepUcxOnTheLoopbackDevice) {
  for (const char* address :
       {"127.0.0.1:50551", "127.0.0.1:0", "127.8.9.10:1", "[::1]:50551",
        "localhost:50551", "ipv4:127.0.0.1:50551", "ipv6:[::1]:50551",
        "dns:///127.0.0.1:50551", "dns://8.8.8.8/127.0.0.1:1", "::1",
        "unix:/run/kvdepot.sock", "unix-abstract:kvdepot", "[::ffff:127.0.0.1]:1"}) {
    SCOPED_TRACE(address);
    EXPECT_EQ(Devices(address), "lo");
    EXPECT_TRUE(UcxDevicesFor(address, kHost, {}).confined());
  }
}

TEST(UcxDevicesForTest, TheLoopbackDeviceIsFoundByItsFlagNotItsName) {
  const std::vector<NetInterfaceAddress> host = {{"lo0", "127.0.0.1", true},
                                                 {"em1", "10.1.1.1", false}};
  EXPECT_EQ(UcxDevicesFor("127.0.0.1:1", host, {}).net_devices.value_or(""), "lo0");
  EXPECT_EQ(UcxDevicesFor("10.1.1.1:1", host, {}).net_devices.value_or(""), "em1,lo0");
}

TEST(UcxDevicesForTest, AnAddressOfADeviceKeepsThatDeviceLoopbackAndRdma) {
  EXPECT_EQ(Devices("10.0.0.5:50551"), "eth0,lo");
  EXPECT_EQ(Devices("[fd00::2]:50551"), "eth0,lo");
  EXPECT_EQ(Devices("[::ffff:10.0.0.5]:50551"), "eth0,lo");  // v4-mapped
  EXPECT_EQ(Devices("ipv4:192.168.1.7:1,10.0.0.5:1"), "eth1,lo");  // the first
  // RDMA devices have no IP address UCX could be told apart by; they stay.
  EXPECT_EQ(Devices("192.168.1.7:1", {"mlx5_0:1", "mlx5_1:1"}),
            "eth1,lo,mlx5_0:1,mlx5_1:1");
  UcxDeviceChoice c = UcxDevicesFor("10.0.0.5:1", kHost, {"mlx5_0:1"});
  EXPECT_NE(c.why.find("eth0"), std::string::npos) << c.why;
  EXPECT_NE(c.why.find("RDMA"), std::string::npos) << c.why;
}

TEST(UcxDevicesForTest, TheWildcardAndForeignAddressesLeaveEveryDevice) {
  for (const char* address : {"0.0.0.0:50551", "[::]:50551", ":50551", "*:50551"}) {
    SCOPED_TRACE(address);
    UcxDeviceChoice c = UcxDevicesFor(address, kHost, {});
    EXPECT_FALSE(c.confined());
    EXPECT_NE(c.why.find("every address"), std::string::npos) << c.why;
  }
  // A daemon on another host: nothing here has its address.
  UcxDeviceChoice c = UcxDevicesFor("203.0.113.9:50551", kHost, {});
  EXPECT_FALSE(c.confined());
  EXPECT_NE(c.why.find("203.0.113.9"), std::string::npos) << c.why;
}

TEST(UcxDevicesForTest, ThisHostsOwnAddressesMapToTheirDevices) {
  std::vector<NetInterfaceAddress> local = LocalInterfaceAddresses();
  ASSERT_FALSE(local.empty()) << "getifaddrs found nothing, not even loopback";
  UcxDeviceChoice loopback = UcxDevicesFor("127.0.0.1:1");
  ASSERT_TRUE(loopback.confined()) << loopback.why;
  for (const NetInterfaceAddress& i : local) {
    if (i.loopback) {
      EXPECT_EQ(*loopback.net_devices, i.device);
      continue;
    }
    if (i.address.rfind("fe80:", 0) == 0) continue;  // link-local: needs a scope
    SCOPED_TRACE(absl::StrCat(i.device, " ", i.address));
    UcxDeviceChoice c = UcxDevicesFor(absl::StrCat("[", i.address, "]:1"));
    ASSERT_TRUE(c.confined()) << c.why;
    std::vector<std::string> named = absl::StrSplit(*c.net_devices, ',');
    EXPECT_NE(std::find(named.begin(), named.end(), i.device), named.end())
        << *c.net_devices;
  }
}

TEST(UcxDevicesToReachTest, AClientOfARemoteDaemonKeepsToTheDeviceItsRouteLeavesBy) {
  // The routing table of kHost: 10/8 by eth0, everything else by eth1.
  auto route = [](const std::string& to) -> std::optional<std::string> {
    if (to.rfind("10.", 0) == 0) return "10.0.0.5";
    if (to == "fd00::9") return "fd00::2";
    if (to.find(':') != std::string::npos) return std::nullopt;  // no v6 route
    return "192.168.1.7";
  };
  auto reach = [&](std::string_view address, std::vector<std::string> rdma = {}) {
    return UcxDevicesToReach(address, kHost, rdma, route).net_devices.value_or("<every device>");
  };
  EXPECT_EQ(reach("10.9.8.7:50551"), "eth0,lo");
  EXPECT_EQ(reach("203.0.113.9:50551"), "eth1,lo");
  EXPECT_EQ(reach("[fd00::9]:50551"), "eth0,lo");
  EXPECT_EQ(reach("10.9.8.7:50551", {"mlx5_0:1"}), "eth0,lo,mlx5_0:1");
  UcxDeviceChoice c = UcxDevicesToReach("10.9.8.7:1", kHost, {}, route);
  EXPECT_NE(c.why.find("eth0"), std::string::npos) << c.why;
  // No route: UCX's default, said why.
  c = UcxDevicesToReach("[2001:db8::1]:1", kHost, {}, route);
  EXPECT_FALSE(c.confined());
  EXPECT_NE(c.why.find("no route"), std::string::npos) << c.why;
  // A daemon on this host: as UcxDevicesFor, the route is not asked.
  auto no_route = [](const std::string&) -> std::optional<std::string> {
    ADD_FAILURE() << "asked for a route";
    return std::nullopt;
  };
  EXPECT_EQ(UcxDevicesToReach("127.0.0.1:1", kHost, {}, no_route).net_devices.value_or(""), "lo");
  EXPECT_EQ(UcxDevicesToReach("10.0.0.5:1", kHost, {}, no_route).net_devices.value_or(""),
            "eth0,lo");
  EXPECT_FALSE(UcxDevicesToReach("0.0.0.0:1", kHost, {}, no_route).confined());
}

TEST(UcxDevicesToReachTest, ThisHostsRoutesLeadToItsDevices) {
  // With this host's own tables: an address of one of its devices is
  // reached locally, so the choice names that device.
  for (const NetInterfaceAddress& i : LocalInterfaceAddresses()) {
    if (i.loopback || i.address.find(':') != std::string::npos) continue;
    SCOPED_TRACE(absl::StrCat(i.device, " ", i.address));
    UcxDeviceChoice c = UcxDevicesToReach(absl::StrCat(i.address, ":1"));
    ASSERT_TRUE(c.confined()) << c.why;
    std::vector<std::string> named = absl::StrSplit(*c.net_devices, ',');
    EXPECT_NE(std::find(named.begin(), named.end(), i.device), named.end())
        << *c.net_devices;
  }
  EXPECT_EQ(UcxDevicesToReach("127.0.0.1:1").net_devices.value_or(""),
            UcxDevicesFor("127.0.0.1:1").net_devices.value_or("?"));
}

TEST(UcxNetDevicesSetTest, TheConfigOrTheEnvironmentChoosesFirst) {
  const char* saved = std::getenv("UCX_NET_DEVICES");
  const std::string restore = saved != nullptr ? saved : "";
  unsetenv("UCX_NET_DEVICES");
  EXPECT_FALSE(UcxNetDevicesSetting({}).has_value());
  EXPECT_FALSE(
      UcxNetDevicesSetting({{"TLS", "tcp"}, {"TCP_TX_SEG_SIZE", "512k"}}).has_value());
  EXPECT_EQ(UcxNetDevicesSetting({{"NET_DEVICES", "eth0"}}).value_or(""), "eth0");
  EXPECT_EQ(UcxNetDevicesSetting({{"UCX_NET_DEVICES", "eth0"}}).value_or(""), "eth0");
  setenv("UCX_NET_DEVICES", "eth1", 1);
  EXPECT_EQ(UcxNetDevicesSetting({}).value_or(""), "eth1");
  EXPECT_EQ(UcxNetDevicesSetting({{"NET_DEVICES", "eth0"}}).value_or(""), "eth0");
  if (saved != nullptr) {
    setenv("UCX_NET_DEVICES", restore.c_str(), 1);
  } else {
    unsetenv("UCX_NET_DEVICES");
  }
}

// A NET_DEVICES the config names is checked against the host's devices
// (UCX takes any name and leaves out the ones it does not find, so a
// misspelled device silently took the data plane off the network).
TEST(MissingNetDevicesTest, NamesThatAreNoDeviceOfThisHostAreListed) {
  namespace fs = std::filesystem;
  const std::string root = testing::FreshTestDir("sysfs-");
  const std::string net = root + "/net", ib = root + "/infiniband";
  fs::create_directories(net + "/lo");
  fs::create_directories(net + "/eth0");
  fs::create_directories(ib + "/mlx5_0/ports/1");
  // /sys/class/net's entries are links to the devices' directories.
  fs::create_directories(root + "/devices/bond0");
  fs::create_directory_symlink(root + "/devices/bond0", net + "/bond0");
  const auto missing = [&](std::string_view devices) {
    return absl::StrJoin(MissingNetDevices(devices, net, ib), ",");
  };
  EXPECT_EQ(missing("lo"), "");
  EXPECT_EQ(missing("eth0,lo,bond0,mlx5_0:1"), "");
  EXPECT_EQ(missing("eth9"), "eth9");
  EXPECT_EQ(missing("lo,eth9,eth0,wlan0"), "eth9,wlan0");
  EXPECT_EQ(missing(" eth0 , eth9 "), "eth9");
  // RDMA ports: the device and the port must both exist.
  EXPECT_EQ(missing("mlx5_0:2,mlx5_1:1"), "mlx5_0:2,mlx5_1:1");
  // An exclusion list is checked too: a misspelled one excludes nothing.
  EXPECT_EQ(missing("^eth9"), "eth9");
  EXPECT_EQ(missing("^eth0"), "");
  // Not checked: every device, empty entries, patterns.
  EXPECT_EQ(missing("all"), "");
  EXPECT_EQ(missing(""), "");
  EXPECT_EQ(missing("eth0,,lo,"), "");
  EXPECT_EQ(missing("eth*,mlx5_?:1"), "");
  // A path is no device name, and is not followed out of the directory.
  EXPECT_EQ(missing("../infiniband,.,.."), "../infiniband,.,..");
  // This host's own devices, as getifaddrs lists them, all exist.
  std::vector<std::string> here;
  for (const NetInterfaceAddress& i : LocalInterfaceAddresses()) {
    // Not an IPv4 alias label ("eth0:1"), which UCX does not take either.
    if (i.device.find(':') == std::string::npos) here.push_back(i.device);
  }
  EXPECT_EQ(absl::StrJoin(MissingNetDevices(absl::StrJoin(here, ",")), ","),
            "");
  EXPECT_EQ(absl::StrJoin(MissingNetDevices("kvdepot-no-such-device0"), ","),
            "kvdepot-no-such-device0");
}

}  // namespace
}  // namespace kvdepot
