#include "server/peer_credentials.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

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

// The table format, including another user's socket and sockets that are
// not ESTABLISHED at the same address.
TEST(LocalPeerUidTest, ReadsTheKernelsTableFormat) {
  const std::string dir = ::testing::TempDir() + "/proc_net";
  ASSERT_EQ(system(absl::StrCat("mkdir -p ", dir).c_str()), 0);
  std::ofstream(dir + "/tcp")
      << "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when "
         "retrnsmt   uid  timeout inode\n"
      << "   0: 0100007F:A0D2 0100007F:1F90 0A 00000000:00000000 00:00000000 "
         "00000000     7        0 1 1 0000000000000000 100 0 0 10 0\n"
      << "   1: 0100007F:A0D2 0100007F:1F90 01 00000000:00000000 00:00000000 "
         "00000000  1234        0 2 1 0000000000000000 20 4 30 10 -1\n";
  std::ofstream(dir + "/tcp6")
      << "  sl  local_address                         remote_address           "
         "     "
         "st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
      << "   0: 00000000000000000000000001000000:B00B "
         "00000000000000000000000001000000:1F90 01 00000000:00000000 "
         "00:00000000 "
         "00000000  4321        0 3 1 0000000000000000 20 4 30 10 -1\n";
  EXPECT_EQ(LocalPeerUid("ipv4:127.0.0.1:41170", dir), 1234u);
  EXPECT_EQ(LocalPeerUid("ipv6:[::1]:45067", dir), 4321u);
  EXPECT_EQ(LocalPeerUid("ipv4:127.0.0.1:41171", dir), std::nullopt);
}

}  // namespace
}  // namespace kvdepot
