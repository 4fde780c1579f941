#include "server/http_server.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/sinks/null_sink.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

std::shared_ptr<spdlog::logger> NullLogger() {
  return std::make_shared<spdlog::logger>(
      "http", std::make_shared<spdlog::sinks::null_sink_mt>());
}

int Connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

// Reads until the server closes the connection (or 10 s pass).
std::string ReadAll(int fd) {
  std::string out;
  char buf[4096];
  pollfd p{fd, POLLIN, 0};
  while (poll(&p, 1, 10'000) == 1) {
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// Sends `request` verbatim and returns the whole response.
std::string Send(int port, const std::string& request) {
  int fd = Connect(port);
  EXPECT_EQ(write(fd, request.data(), request.size()),
            static_cast<ssize_t>(request.size()));
  std::string response = ReadAll(fd);
  close(fd);
  return response;
}

std::string Request(const std::string& method, const std::string& path,
                    const std::string& headers = "") {
  return absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: test\r\n", headers,
                      "\r\n");
}

std::string BodyOf(const std::string& response) {
  size_t end = response.find("\r\n\r\n");
  return end == std::string::npos ? "" : response.substr(end + 4);
}

std::string Gunzip(const std::string& in) {
  z_stream zs{};
  EXPECT_EQ(inflateInit2(&zs, 16 + MAX_WBITS), Z_OK);
  std::string out(1 << 20, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(inflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  inflateEnd(&zs);
  return out;
}

// One server for the suite.
class HttpServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    HttpServerOptions options;
    options.listen = "127.0.0.1:0";
    options.request_timeout = absl::Milliseconds(500);
    absl::flat_hash_map<std::string, HttpHandler> routes = {
        {"/hello",
         [] {
           return HttpResponse{200, "text/plain", "hello"};
         }},
        {"/big",
         [] {
           return HttpResponse{200, "text/plain", std::string(5000, 'x')};
         }},
        {"/teapot",
         [] {
           return HttpResponse{418, "text/plain", "short", {{"X-Kind", "tea"}}};
         }},
    };
    auto server = HttpServer::Start(options, std::move(routes), NullLogger());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server).release();
    ASSERT_GT(server_->port(), 0);
  }
  static void TearDownTestSuite() { delete server_; }

  static HttpServer* server_;
};
HttpServer* HttpServerTest::server_ = nullptr;

TEST_F(HttpServerTest, ServesGetAndHeadOfItsRoutes) {
  std::string r = Send(server_->port(), Request("GET", "/hello"));
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("Content-Type: text/plain\r\n"));
  EXPECT_THAT(r, HasSubstr("Content-Length: 5\r\n"));
  EXPECT_EQ(BodyOf(r), "hello");

  r = Send(server_->port(), Request("HEAD", "/hello"));
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("Content-Length: 5\r\n"));
  EXPECT_EQ(BodyOf(r), "");

  r = Send(server_->port(), Request("GET", "/teapot"));
  EXPECT_THAT(r, StartsWith("HTTP/1.1 418 "));
  EXPECT_THAT(r, HasSubstr("X-Kind: tea\r\n"));
}

TEST_F(HttpServerTest, OtherPathsAreNotFoundOtherMethodsNotAllowed) {
  EXPECT_THAT(Send(server_->port(), Request("GET", "/")),
              StartsWith("HTTP/1.1 404 "));
  EXPECT_THAT(Send(server_->port(), Request("GET", "/hello/x")),
              StartsWith("HTTP/1.1 404 "));
  std::string r = Send(server_->port(), Request("POST", "/hello"));
  EXPECT_THAT(r, StartsWith("HTTP/1.1 405 "));
  EXPECT_THAT(r, HasSubstr("Allow: GET, HEAD\r\n"));
  // With a body, whatever the method or path: 413, the body unread.
  EXPECT_THAT(Send(server_->port(),
                   Request("POST", "/hello", "Content-Length: 2\r\n") + "ab"),
              StartsWith("HTTP/1.1 413 "));
  EXPECT_THAT(Send(server_->port(), Request("PUT", "/nothing", "Content-Length: 2\r\n") + "ab"),
              StartsWith("HTTP/1.1 413 "));
  EXPECT_THAT(Send(server_->port(), Request("DELETE", "/hello")),
              StartsWith("HTTP/1.1 405 "));
}

TEST_F(HttpServerTest, CompressesLargeBodiesForClientsThatAcceptGzip) {
  std::string r =
      Send(server_->port(),
           Request("GET", "/big", "Accept-Encoding: deflate, gzip\r\n"));
  EXPECT_THAT(r, HasSubstr("Content-Encoding: gzip\r\n"));
  EXPECT_EQ(Gunzip(BodyOf(r)), std::string(5000, 'x'));

  r = Send(server_->port(),
           Request("GET", "/big", "Accept-Encoding: gzip;q=0\r\n"));
  EXPECT_THAT(r, Not(HasSubstr("Content-Encoding")));
  EXPECT_EQ(BodyOf(r), std::string(5000, 'x'));
  r = Send(server_->port(),
           Request("GET", "/hello", "Accept-Encoding: gzip\r\n"));
  EXPECT_EQ(BodyOf(r), "hello");  // too small to bother
}

TEST_F(HttpServerTest, DropsAClientThatSendsNothing) {
  int fd = Connect(server_->port());
  absl::Time start = absl::Now();
  ReadAll(fd);  // returns when the server closes
  close(fd);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // And the thread it held serves again.
  EXPECT_EQ(BodyOf(Send(server_->port(), Request("GET", "/hello"))), "hello");
}

// With the default options, idle connections (a scraper's stalled peers, or
// a hostile one) up to half the pool leave room: a request is answered
// while they are still open, not once the server drops them.
// A server with kvdepotd's default options on a free loopback port,
// answering `path` with `body`.
absl::StatusOr<std::unique_ptr<HttpServer>> StartWithDefaults(const std::string& path,
                                                              const std::string& body) {
  HttpServerOptions options;
  options.listen = "127.0.0.1:0";
  return HttpServer::Start(
      options, {{path, [body] { return HttpResponse{200, "text/plain", body}; }}},
      NullLogger());
}

TEST(HttpServerDefaultsTest, IdleConnectionsLeaveRoomForRequests) {
  auto server = StartWithDefaults("/hello", "hello");
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  std::vector<int> idle;
  for (int i = 0; i < 8; ++i) idle.push_back(Connect(port));
  EXPECT_EQ(BodyOf(Send(port, Request("GET", "/hello"))), "hello");
  for (int fd : idle) {
    pollfd p{fd, POLLIN, 0};
    EXPECT_EQ(poll(&p, 1, 0), 0) << "an idle connection was dropped first";
    close(fd);
  }
}

// More idle connections than the server has threads (a stalled scraper's
// peers, or a hostile client; the reviewer's 50 made a scrape take 14.7 s
// with 16 threads and a 5 s timeout): the scrape is still answered while
// they are open, within one request_timeout, not after several.
TEST(HttpServerDefaultsTest, IdleConnectionsBeyondTheThreadsDoNotStarveAScrape) {
  HttpServerOptions options;  // kvdepotd's defaults
  auto server = StartWithDefaults("/metrics", "up 1");
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  std::vector<int> idle;
  for (int i = 0; i < options.threads + 16; ++i) idle.push_back(Connect(port));
  const absl::Time start = absl::Now();
  EXPECT_EQ(BodyOf(Send(port, Request("GET", "/metrics"))), "up 1");
  // Generous (a loaded machine), but under 2 x request_timeout of the old
  // defaults: the scrape waited for every thread's idle connection to time
  // out, twice over.
  EXPECT_LT(absl::Now() - start, absl::Seconds(6));
  for (int fd : idle) close(fd);
}

// Clients that send their request a byte at a time gain no time: the
// timeout counts from the accept, not from the last byte.
TEST(HttpServerDefaultsTest, TricklingClientsDoNotStarveAScrape) {
  HttpServerOptions options;
  auto server = StartWithDefaults("/metrics", "up 1");
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  std::vector<int> slow;
  for (int i = 0; i < options.threads + 16; ++i) slow.push_back(Connect(port));
  std::atomic<bool> done{false};
  std::thread trickle([&] {
    const std::string request =
        Request("GET", "/metrics", "X-Pad: " + std::string(40, 'a') + "\r\n");
    for (size_t i = 0; i < request.size() && !done.load(); ++i) {
      for (int fd : slow) send(fd, &request[i], 1, MSG_NOSIGNAL);  // dropped: EPIPE
      absl::SleepFor(absl::Milliseconds(200));
    }
  });
  absl::SleepFor(absl::Milliseconds(300));  // every thread is taken
  const absl::Time start = absl::Now();
  EXPECT_EQ(BodyOf(Send(port, Request("GET", "/metrics"))), "up 1");
  EXPECT_LT(absl::Now() - start, absl::Seconds(6));
  done = true;
  trickle.join();
  for (int fd : slow) close(fd);
}

// A client that reads its response a little at a time holds its thread
// for a bounded time, not for as long as it likes (a review feared that
// civetweb renews its send timeout on every byte the client takes; it
// does not: the response is cut), so with one thread a scrape behind it
// is still answered.
TEST(HttpServerSlowReaderTest, AClientReadingSlowlyDoesNotHoldItsThread) {
  HttpServerOptions options;
  options.listen = "127.0.0.1:0";
  options.threads = 1;
  options.request_timeout = absl::Milliseconds(500);
  auto server = HttpServer::Start(
      options,
      {{"/huge",
        [] {
          return HttpResponse{200, "text/plain", std::string(8 << 20, 'h')};
        }},
       {"/metrics",
        [] {
          return HttpResponse{200, "text/plain", "up 1"};
        }}},
      NullLogger());
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  const int slow = socket(AF_INET, SOCK_STREAM, 0);
  const int small = 4096;
  ASSERT_EQ(setsockopt(slow, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)), 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(slow, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string request = Request("GET", "/huge");
  ASSERT_EQ(write(slow, request.data(), request.size()),
            static_cast<ssize_t>(request.size()));
  // 1 KiB every 100 ms: progress well within each send's timeout.
  std::atomic<bool> done{false};
  std::atomic<size_t> received{0};
  std::thread reader([&] {
    char buf[1024];
    while (!done.load()) {
      const ssize_t n = recv(slow, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0) break;  // the server closed it
      if (n > 0) received += static_cast<size_t>(n);
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  absl::SleepFor(absl::Milliseconds(300));  // the only thread is taken
  const absl::Time start = absl::Now();
  EXPECT_EQ(BodyOf(Send(port, Request("GET", "/metrics"))), "up 1");
  // Generous (a loaded machine); before, the scrape waited for the slow
  // client's 8 MiB (Send gives up after 10 s).
  EXPECT_LT(absl::Now() - start, absl::Seconds(6));
  done = true;
  reader.join();
  EXPECT_LT(received.load(), size_t{8} << 20);
  close(slow);
}

// A request with a body is refused before its body is read: the connection
// closes while the client is still sending (civetweb used to read and
// discard the body after the answer, one timeout per read, for as long as
// the client kept trickling it).
TEST_F(HttpServerTest, RequestsWithABodyAreRefusedWithoutReadingIt) {
  for (const std::string& headers :
       {std::string("Content-Length: 100000000\r\n"),
        std::string("Transfer-Encoding: chunked\r\n")}) {
    int fd = Connect(server_->port());
    const std::string request = Request("GET", "/hello", headers) + "a";
    ASSERT_EQ(write(fd, request.data(), request.size()),
              static_cast<ssize_t>(request.size()));
    std::atomic<bool> done{false};
    std::thread trickle([&] {
      for (int i = 0; i < 100 && !done.load(); ++i) {
        send(fd, "b", 1, MSG_NOSIGNAL);  // EPIPE once closed
        absl::SleepFor(absl::Milliseconds(100));
      }
    });
    // ReadAll returns when the server closes the connection; the client
    // trickles for 10 s, so a server draining the body would not close.
    const std::string response = ReadAll(fd);
    const bool trickling = !done.exchange(true);
    trickle.join();
    close(fd);
    EXPECT_THAT(response, StartsWith("HTTP/1.1 413 ")) << headers;
    EXPECT_THAT(response, Not(HasSubstr("hello"))) << headers;
    EXPECT_TRUE(trickling) << "the server closed only when the client stopped";
  }
  // Without a body, the same request is served.
  EXPECT_EQ(BodyOf(Send(server_->port(), Request("GET", "/hello", "Content-Length: 0\r\n"))),
            "hello");
}

// Every thread held by clients trickling request bodies: a scrape is
// still answered (they are refused as soon as their headers are in).
TEST(HttpServerDefaultsTest, ClientsTricklingABodyDoNotStarveAScrape) {
  HttpServerOptions options;
  auto server = StartWithDefaults("/metrics", "up 1");
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  std::vector<int> slow;
  const std::string request =
      Request("GET", "/metrics", "Content-Length: 100000000\r\n");
  for (int i = 0; i < options.threads + 16; ++i) {
    slow.push_back(Connect(port));
    send(slow.back(), request.data(), request.size(), MSG_NOSIGNAL);
  }
  std::atomic<bool> done{false};
  std::thread trickle([&] {
    while (!done.load()) {
      for (int fd : slow) send(fd, "b", 1, MSG_NOSIGNAL);  // dropped: EPIPE
      absl::SleepFor(absl::Milliseconds(200));
    }
  });
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(BodyOf(Send(port, Request("GET", "/metrics"))), "up 1");
  done = true;
  trickle.join();
  for (int fd : slow) close(fd);
}

// Stopping does not wait for civetweb's 2 s poll when the server listens on
// a host name: the destructor knocks on the address the name resolved to.
TEST(HttpServerStopTest, StopsAtOnceOnAHostName) {
  HttpServerOptions options;
  options.listen = "localhost:0";
  options.threads = 4;
  auto server = HttpServer::Start(options, {}, NullLogger());
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  // A request first: civetweb's listener is then inside a fresh 2 s poll.
  EXPECT_THAT(Send((*server)->port(), Request("GET", "/")), StartsWith("HTTP/1.1 404 "));
  const absl::Time start = absl::Now();
  server->reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST_F(HttpServerTest, AddressInUseIsUnavailable) {
  HttpServerOptions options;
  options.listen = absl::StrCat("127.0.0.1:", server_->port());
  auto second = HttpServer::Start(options, {}, NullLogger());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr(options.listen));
}

}  // namespace
}  // namespace kvdepot
