// HttpServer: the small HTTP/1.1 server of kvdepotd's operator endpoints
// (/metrics, the status page, /status.json), on civetweb. It serves GET and
// HEAD of a fixed set of exact paths; other methods get 405, other paths 404,
// and a request with a body (Content-Length above 0, or any
// Transfer-Encoding) 413 whatever its method or path, without its body
// being read.
// A bounded pool of threads runs the handlers, connections close after each
// response, and a client that has not sent its whole request within
// `request_timeout` is dropped.
// Responses are gzip-compressed when the client accepts it.
//
// Thread-safe: handlers run concurrently on the server's threads.
#ifndef KVDEPOT_SERVER_HTTP_SERVER_H_
#define KVDEPOT_SERVER_HTTP_SERVER_H_

#include <spdlog/logger.h>
#include <sys/socket.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

struct mg_context;
struct mg_connection;

namespace kvdepot {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // extra ones
};

// Builds the response to a GET (HEAD gets its headers without the body).
// Must not throw.
using HttpHandler = std::function<HttpResponse()>;

struct HttpServerOptions {
  // HOST:PORT (IPv6 as [ADDR]:PORT); port 0 picks a free one. A host name is
  // resolved once, at Start (its first IPv4 address, else its first IPv6
  // one, as civetweb binds it).
  std::string listen;
  // Connections served at once (civetweb starts them all at Start; an idle
  // one costs its stack, mostly untouched, and a request buffer). More wait
  // in civetweb's queue and then the kernel's accept backlog. A connection
  // holds its thread until its request is answered or dropped, so it takes
  // more than this many idle or slow connections to delay anyone, and then
  // by request_timeout for each `threads` of them ahead.
  int threads = 128;
  // Bound on receiving a request's headers, counted from when a thread takes
  // the connection up (a client trickling bytes gains nothing), and on
  // sending its response.
  // Short: a scraper sends its request at once, and a scrape queued behind
  // idle connections must still get its answer within Prometheus's scrape
  // timeout (10 s by default).
  absl::Duration request_timeout = absl::Seconds(2);
};

class HttpServer {
 public:
  // Binds and starts serving `routes` (exact path -> handler). Unavailable,
  // with civetweb's reason, when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      const HttpServerOptions& options,
      absl::flat_hash_map<std::string, HttpHandler> routes,
      std::shared_ptr<spdlog::logger> logger);
  // Stops listening and waits for running handlers.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Whether this build of civetweb serves IPv6 addresses (Debian 12's does
  // not: "[::]:9551" cannot be bound).
  static bool SupportsIpv6();

  // The bound port (the real one when 0 was asked).
  int port() const { return port_; }

 private:
  HttpServer(absl::flat_hash_map<std::string, HttpHandler> routes,
             std::shared_ptr<spdlog::logger> logger);
  static int OnRequest(mg_connection* conn);
  static int OnLog(const mg_connection* conn, const char* message);
  int Serve(mg_connection* conn);
  // Sets wake_addr_ and wake_len_ from `listen` (HttpServerOptions::listen)
  // and port_.
  void SetWakeAddress(const std::string& listen);

  const absl::flat_hash_map<std::string, HttpHandler> routes_;
  const std::shared_ptr<spdlog::logger> log_;
  mg_context* ctx_ = nullptr;  // set once by Start
  int port_ = 0;
  // Where a connection reaches the listener (loopback for a wildcard
  // address, the resolved address for a host name); the destructor connects
  // there to make civetweb notice the stop at once instead of after its 2 s
  // poll. Empty (wake_len_ 0) when there is nowhere to knock.
  sockaddr_storage wake_addr_{};
  socklen_t wake_len_ = 0;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_HTTP_SERVER_H_
