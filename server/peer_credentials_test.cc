#include "server/peer_credentials.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/test_dir.h"

namespace kvdepot {
namespace {

// A connected pair of loopback TCP sockets; `client_port` is the port the
// server side sees as its peer's.
class LoopbackPair {
 public:
  explicit LoopbackPair(int family) {
    listener_ = socket(family, SOCK_STREAM, 0);
    sockaddr_storage addr{};
    socklen_t len;
    if (family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(&addr);
      a->sin_family = AF_INET;
      a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      len = sizeof(sockaddr_in);
    } else {
      auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
      a->sin6_family = AF_INET6;
      a->sin6_addr = in6addr_loopback;
      len = sizeof(sockaddr_in6);
    }
    ok_ = listener_ >= 0 &&
          bind(listener_, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
          listen(listener_, 1) == 0 &&
          getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
    if (!ok_) return;
    client_ = socket(family, SOCK_STREAM, 0);
    ok_ = connect(client_, reinterpret_cast<sockaddr*>(&addr), len) == 0;
    if (!ok_) return;
    accepted_ = accept(listener_, nullptr, nullptr);
    sockaddr_storage mine{};
    socklen_t mine_len = sizeof(mine);
    ok_ = accepted_ >= 0 &&
          getsockname(client_, reinterpret_cast<sockaddr*>(&mine), &mine_len) ==
              0;
    client_port_ =
        family == AF_INET
            ? ntohs(reinterpret_cast<sockaddr_in*>(&mine)->sin_port)
            : ntohs(reinterpret_cast<sockaddr_in6*>(&mine)->sin6_port);
  }
  ~LoopbackPair() {
    for (int fd : {accepted_, client_, listener_}) {
      if (fd >= 0) close(fd);
    }
  }
  bool ok() const { return ok_; }
  int client_port() const { return client_port_; }

 private:
  int listener_ = -1, client_ = -1, accepted_ = -1;
  int client_port_ = 0;
  bool ok_ = false;
};

TEST(LocalPeerUidTest, FindsTheOwnerOfALoopbackIpv4Peer) {
  LoopbackPair pair(AF_INET);
  ASSERT_TRUE(pair.ok());
  const std::string peer = absl::StrCat("ipv4:127.0.0.1:", pair.client_port());
  std::optional<uint32_t> uid = LocalPeerUid(peer);
  ASSERT_TRUE(uid.has_value()) << peer;
  EXPECT_EQ(*uid, getuid());
  // The same socket as a dual-stack listener reports it.
  EXPECT_EQ(LocalPeerUid(
                absl::StrCat("ipv6:[::ffff:127.0.0.1]:", pair.client_port())),
            uid);
}

TEST(LocalPeerUidTest, FindsTheOwnerOfALoopbackIpv6Peer) {
  LoopbackPair pair(AF_INET6);
  if (!pair.ok()) GTEST_SKIP() << "no IPv6 loopback here";
  std::optional<uint32_t> uid =
      LocalPeerUid(absl::StrCat("ipv6:[::1]:", pair.client_port()));
  ASSERT_TRUE(uid.has_value());
  EXPECT_EQ(*uid, getuid());
  EXPECT_EQ(LocalPeerUid(absl::StrCat("ipv6:%5B::1%5D:", pair.client_port())),
            uid);
}

// Peers of this host are told from others without the socket tables:
// LocalPeerUid reads them (and every descriptor of kvdepotd) only for a
// peer of this host, not for each call of a remote one.
TEST(LocalPeerUidTest, PeersOfThisHostAreToldFromOthers) {
  EXPECT_TRUE(PeerIsOnThisHost("ipv4:127.0.0.1:1"));
  EXPECT_TRUE(PeerIsOnThisHost("ipv4:127.1.2.3:1"));
  EXPECT_TRUE(PeerIsOnThisHost("ipv6:[::1]:1"));
  EXPECT_TRUE(PeerIsOnThisHost("ipv6:%5B::ffff:127.0.0.1%5D:1"));
  EXPECT_FALSE(PeerIsOnThisHost("ipv4:203.0.113.5:1"));  // TEST-NET-3
  EXPECT_FALSE(PeerIsOnThisHost("ipv6:[2001:db8::1]:1"));
  EXPECT_FALSE(PeerIsOnThisHost("unix:/tmp/s"));
  EXPECT_FALSE(PeerIsOnThisHost("ipv4:not-an-address:1"));
  // An address of one of this host's interfaces.
  ifaddrs* list = nullptr;
  ASSERT_EQ(getifaddrs(&list), 0);
  std::string own;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN];
    const auto* sin = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
    if (inet_ntop(AF_INET, &sin->sin_addr, text, sizeof(text)) != nullptr &&
        std::string(text).rfind("127.", 0) != 0) {
      own = text;
      break;
    }
  }
  freeifaddrs(list);
  if (!own.empty()) {
    EXPECT_TRUE(PeerIsOnThisHost("ipv4:" + own + ":1")) << own;
  }
}

TEST(LocalPeerUidTest, UnknownOrUnparsablePeersHaveNone) {
  int port = 0;
  {
    LoopbackPair pair(AF_INET);
    ASSERT_TRUE(pair.ok());
    port = pair.client_port();
  }
  // Closed: the socket is not ESTABLISHED any more.
  EXPECT_EQ(LocalPeerUid(absl::StrCat("ipv4:127.0.0.1:", port)), std::nullopt);
  for (const char* peer :
       {"unix:/run/kvdepot.sock", "ipv4:127.0.0.1", "ipv4:x:1", "ipv6:::1:80",
        "ipv4:127.0.0.1:99999", "", "ipv6:[zz]:1"}) {
    EXPECT_EQ(LocalPeerUid(peer), std::nullopt) << peer;
  }
}

// A /proc/net/tcp row: sl local remote st ... uid timeout inode.
std::string Row(int sl, const std::string& local, const std::string& remote,
                const std::string& state, uint32_t uid, uint64_t inode) {
  return absl::StrCat("   ", sl, ": ", local, " ", remote, " ", state,
                      " 00000000:00000000 00:00000000 00000000  ", uid,
                      "        0 ", inode, " 1 0000000000000000 20 4 30 10 -1\n");
}

class PeerTableTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::FreshTestDir("proc_net_"); }
  void Write(const std::string& tcp, const std::string& tcp6) {
    std::ofstream(dir_ + "/tcp")
        << "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when "
           "retrnsmt   uid  timeout inode\n"
        << tcp;
    std::ofstream(dir_ + "/tcp6")
        << "  sl  local_address                         remote_address        "
           "        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout "
           "inode\n"
        << tcp6;
  }
  std::string dir_;
};

// The table format, including sockets that are not ESTABLISHED at the same
// address; the daemon's end (inode 100, 300) is ours.
TEST_F(PeerTableTest, ReadsTheKernelsTableFormat) {
  Write(Row(0, "0100007F:A0D2", "0100007F:1F90", "0A", 7, 1) +
            Row(1, "0100007F:A0D2", "0100007F:1F90", "01", 1234, 2) +
            Row(2, "0100007F:1F90", "0100007F:A0D2", "01", 0, 100),
        Row(0, "00000000000000000000000001000000:B00B",
            "00000000000000000000000001000000:1F90", "01", 4321, 3) +
            Row(1, "00000000000000000000000001000000:1F90",
                "00000000000000000000000001000000:B00B", "01", 0, 300));
  EXPECT_EQ(LocalPeerUid("ipv4:127.0.0.1:41170", dir_, {100, 300}), 1234u);
  EXPECT_EQ(LocalPeerUid("ipv6:[::1]:45067", dir_, {100, 300}), 4321u);
  EXPECT_EQ(LocalPeerUid("ipv4:127.0.0.1:41171", dir_, {100, 300}), std::nullopt);
  // Connected, but not to this process: no answer.
  EXPECT_EQ(LocalPeerUid("ipv4:127.0.0.1:41170", dir_, {300}), std::nullopt);
}

// An IPv4 client of a dual-stack listener: its end is in tcp, the daemon's
// (v4-mapped) in tcp6.
TEST_F(PeerTableTest, MatchesAcrossTheTwoTables) {
  Write(Row(0, "0100007F:A0D2", "0100007F:1F90", "01", 1234, 2),
        Row(0, "0000000000000000FFFF00000100007F:1F90",
            "0000000000000000FFFF00000100007F:A0D2", "01", 0, 100));
  EXPECT_EQ(LocalPeerUid("ipv4:127.0.0.1:41170", dir_, {100}), 1234u);
  EXPECT_EQ(LocalPeerUid("ipv6:[::ffff:127.0.0.1]:41170", dir_, {100}), 1234u);
}

// Another user's socket may share the client's local address (connected
// elsewhere, or bound with SO_REUSEADDR), and come first in the table: the
// peer is the socket whose other end is the daemon's, not the first match.
TEST_F(PeerTableTest, ASocketSharingThePeersAddressDoesNotLendItsUid) {
  Write(Row(0, "0100007F:A0D2", "0100007F:0016", "01", 1001, 50) +
            Row(1, "0100007F:0016", "0100007F:A0D2", "01", 0, 51) +
            Row(2, "0100007F:A0D2", "0100007F:1F90", "01", 1000, 60) +
            Row(3, "0100007F:1F90", "0100007F:A0D2", "01", 0, 61),
        "");
  EXPECT_EQ(LocalPeerUid("ipv4:127.0.0.1:41170", dir_, {61}), 1000u);
  // Both connected to this process (two listeners): ambiguous, no answer.
  EXPECT_EQ(LocalPeerUid("ipv4:127.0.0.1:41170", dir_, {51, 61}), std::nullopt);
}

}  // namespace
}  // namespace kvdepot
