// HttpServer: the small HTTP/1.1 server of kvdepotd's operator endpoints
// (/metrics, the status page, /status.json), on civetweb. It serves GET and
// HEAD of a fixed set of exact paths; other methods get 405, other paths 404.
// A bounded pool of threads runs the handlers, connections close after each
// response, and a client that sends nothing for `request_timeout` is dropped.
// Responses are gzip-compressed when the client accepts it.
//
// Thread-safe: handlers run concurrently on the server's threads.
#ifndef KVDEPOT_SERVER_HTTP_SERVER_H_
#define KVDEPOT_SERVER_HTTP_SERVER_H_

#include <spdlog/logger.h>

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
  // HOST:PORT (IPv6 as [ADDR]:PORT); port 0 picks a free one.
  std::string listen;
  // Requests served at once; more wait in civetweb's accept queue. A
  // connection holds its thread until its request is answered or dropped,
  // so this many idle connections delay everyone else by up to
  // request_timeout (idle threads cost only their stacks).
  int threads = 16;
  // Bound on receiving a request and on sending its response: well under
  // Prometheus's default scrape timeout (10 s), so a scrape queued behind
  // idle connections still gets its answer.
  absl::Duration request_timeout = absl::Seconds(5);
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

  // The bound port (the real one when 0 was asked).
  int port() const { return port_; }

 private:
  HttpServer(absl::flat_hash_map<std::string, HttpHandler> routes,
             std::shared_ptr<spdlog::logger> logger);
  static int OnRequest(mg_connection* conn);
  static int OnLog(const mg_connection* conn, const char* message);
  int Serve(mg_connection* conn);

  const absl::flat_hash_map<std::string, HttpHandler> routes_;
  const std::shared_ptr<spdlog::logger> log_;
  mg_context* ctx_ = nullptr;  // set once by Start
  int port_ = 0;
  // Where a connection reaches the listener (loopback for a wildcard
  // address); the destructor connects there to make civetweb notice the
  // stop at once instead of after its 2 s poll.
  std::string wake_host_ = "127.0.0.1";
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_HTTP_SERVER_H_
