#include "server/http_server.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "transport/net_devices.h"

namespace kvdepot {
namespace {

// Bodies smaller than this go out uncompressed.
constexpr size_t kMinGzipBytes = 1024;

// True when the Accept-Encoding header lists gzip (and not with q=0).
bool AcceptsGzip(const mg_connection* conn) {
  const char* header = mg_get_header(conn, "Accept-Encoding");
  if (header == nullptr) return false;
  for (absl::string_view item : absl::StrSplit(header, ',')) {
    std::vector<absl::string_view> parts = absl::StrSplit(item, ';');
    if (!absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(parts[0]), "gzip")) {
      continue;
    }
    for (size_t i = 1; i < parts.size(); ++i) {
      absl::string_view p = absl::StripAsciiWhitespace(parts[i]);
      double q = 1;
      if (absl::ConsumePrefix(&p, "q=") && absl::SimpleAtod(p, &q) && q <= 0) {
        return false;
      }
    }
    return true;
  }
  return false;
}

// gzip of `in`; empty on failure (the caller then sends it uncompressed).
std::string Gzip(const std::string& in) {
  z_stream zs{};
  // 16 + MAX_WBITS: a gzip header and trailer rather than zlib's.
  if (deflateInit2(&zs, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 16 + MAX_WBITS, 8,
                   Z_DEFAULT_STRATEGY) != Z_OK) {
    return "";
  }
  std::string out(deflateBound(&zs, in.size()), '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  const int rc = deflate(&zs, Z_FINISH);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return rc == Z_STREAM_END ? out : "";
}

void WriteResponse(mg_connection* conn, const HttpResponse& r, bool head) {
  std::string body_storage;
  const std::string* body = &r.body;
  std::string headers = absl::StrCat(
      "HTTP/1.1 ", r.status, " ", mg_get_response_code_text(conn, r.status),
      "\r\nContent-Type: ", r.content_type,
      "\r\nCache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n"
      "Connection: close\r\n");
  if (r.body.size() >= kMinGzipBytes && AcceptsGzip(conn)) {
    body_storage = Gzip(r.body);
    if (!body_storage.empty()) {
      body = &body_storage;
      absl::StrAppend(&headers, "Content-Encoding: gzip\r\n");
    }
  }
  absl::StrAppend(&headers, "Vary: Accept-Encoding\r\n");
  for (const auto& [name, value] : r.headers) {
    absl::StrAppend(&headers, name, ": ", value, "\r\n");
  }
  absl::StrAppend(&headers, "Content-Length: ", body->size(), "\r\n\r\n");
  if (!head) headers += *body;
  // A client that went away is not our error; civetweb closes the connection.
  mg_write(conn, headers.data(), headers.size());
}

HttpResponse Error(int status, std::string message) {
  HttpResponse r;
  r.status = status;
  r.body = std::move(message) + "\n";
  return r;
}

}  // namespace

HttpServer::HttpServer(absl::flat_hash_map<std::string, HttpHandler> routes,
                       std::shared_ptr<spdlog::logger> logger)
    : routes_(std::move(routes)), log_(std::move(logger)) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    const HttpServerOptions& options,
    absl::flat_hash_map<std::string, HttpHandler> routes,
    std::shared_ptr<spdlog::logger> logger) {
  static absl::once_flag init;
  absl::call_once(init, [] { mg_init_library(0); });

  std::unique_ptr<HttpServer> server(
      new HttpServer(std::move(routes), std::move(logger)));
  const std::string threads = absl::StrCat(options.threads);
  const std::string timeout_ms =
      absl::StrCat(absl::ToInt64Milliseconds(options.request_timeout));
  // No document_root: civetweb serves no files, only what OnRequest answers.
  // clang-format off
  const char* civet_options[] = {
      "listening_ports",    options.listen.c_str(),
      "num_threads",        threads.c_str(),
      "request_timeout_ms", timeout_ms.c_str(),
      "enable_keep_alive",  "no",
      nullptr};
  // clang-format on
  mg_callbacks callbacks{};
  callbacks.begin_request = &HttpServer::OnRequest;
  callbacks.log_message = &HttpServer::OnLog;
  mg_init_data init_data{};
  init_data.callbacks = &callbacks;
  init_data.user_data = server.get();
  init_data.configuration_options = civet_options;
  char error_text[256] = "";
  unsigned error_code = 0;
  mg_error_data error{&error_code, error_text, sizeof(error_text)};
  server->ctx_ = mg_start2(&init_data, &error);
  if (server->ctx_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve HTTP on ", options.listen, ": ",
        error_text[0] != '\0' ? error_text : "civetweb failed to start"));
  }
  mg_server_port ports[4] = {};
  if (mg_get_server_ports(server->ctx_, 4, ports) > 0) {
    server->port_ = ports[0].port;
  }
  server->SetWakeAddress(options.listen);
  return server;
}

bool HttpServer::SupportsIpv6() {
  // Feature 8: IPv6 (civetweb.h); may be asked before mg_init_library.
  return mg_check_feature(8) != 0;
}

void HttpServer::SetWakeAddress(const std::string& listen) {
  // "HOST:PORT", "[V6]:PORT" or "PORT"; a wildcard host is reached on
  // loopback.
  absl::StatusOr<HostPort> split = SplitHostPort(listen);
  const std::string host = split.ok() ? split->host : "";
  std::string name = host;
  if (host == "::") {
    name = "::1";
  } else if (host.empty() || host == "0.0.0.0" || host == "*") {
    name = "127.0.0.1";
  }
  // A host name is resolved here, once (a lookup in the destructor could
  // hang on DNS): IPv4 first, as civetweb binds it.
  for (int family : {AF_INET, AF_INET6}) {
    addrinfo hints{};
    hints.ai_family = family;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (getaddrinfo(name.c_str(), nullptr, &hints, &found) != 0) continue;
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      if (a->ai_family != family || a->ai_addrlen > sizeof(wake_addr_)) continue;
      std::memcpy(&wake_addr_, a->ai_addr, a->ai_addrlen);
      wake_len_ = a->ai_addrlen;
      break;
    }
    freeaddrinfo(found);
    if (wake_len_ > 0) break;
  }
  if (wake_len_ == 0) {
    log_->debug("http: cannot resolve {}: stopping waits for civetweb's poll",
                name);
    return;
  }
  const uint16_t port = htons(static_cast<uint16_t>(port_));
  if (wake_addr_.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&wake_addr_)->sin_port = port;
  } else {
    reinterpret_cast<sockaddr_in6*>(&wake_addr_)->sin6_port = port;
  }
}

namespace {

// Opens and closes a TCP connection to `addr`; best effort.
void Knock(const sockaddr_storage& addr, socklen_t len) {
  const int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  connect(fd, reinterpret_cast<const sockaddr*>(&addr), len);
  close(fd);
}

}  // namespace

HttpServer::~HttpServer() {
  if (ctx_ == nullptr) return;
  if (wake_len_ == 0) {
    mg_stop(ctx_);
    return;
  }
  // civetweb's listener thread polls in 2 s quanta and sees the stop only
  // between them, so a daemon's SIGTERM would wait up to 2 s here. A
  // connection wakes the poll: knock until mg_stop has returned.
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped] {
    while (!stopped.load()) {
      Knock(wake_addr_, wake_len_);
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  mg_stop(ctx_);
  stopped = true;
  waker.join();
}

int HttpServer::OnRequest(mg_connection* conn) {
  auto* self = static_cast<HttpServer*>(mg_get_user_data(mg_get_context(conn)));
  return self->Serve(conn);
}

int HttpServer::OnLog(const mg_connection* conn, const char* message) {
  auto* self = static_cast<HttpServer*>(
      conn == nullptr ? nullptr : mg_get_user_data(mg_get_context(conn)));
  if (self == nullptr) return 0;
  self->log_->debug("http: {}", message);
  return 1;  // handled: civetweb writes no log of its own
}

int HttpServer::Serve(mg_connection* conn) {
  const mg_request_info* req = mg_get_request_info(conn);
  // Nothing served takes a body. Refused without reading it: after an
  // ordinary answer civetweb reads and discards what is left of a body,
  // with its timeout on each read rather than the whole, so a client
  // trickling a body byte by byte held the thread for as long as it liked
  // (128 of them stopped every scrape). An error sent with
  // mg_send_http_error closes the connection at once instead.
  if (req->content_length > 0 || mg_get_header(conn, "Transfer-Encoding") != nullptr) {
    mg_send_http_error(conn, 413, "%s", "kvdepotd's HTTP endpoints take no request body\n");
    return 413;
  }
  const bool head = std::strcmp(req->request_method, "HEAD") == 0;
  HttpResponse response;
  auto route =
      req->local_uri == nullptr ? routes_.end() : routes_.find(req->local_uri);
  if (route == routes_.end()) {
    response = Error(404, "not found");
  } else if (!head && std::strcmp(req->request_method, "GET") != 0) {
    response = Error(405, "method not allowed");
    response.headers.emplace_back("Allow", "GET, HEAD");
  } else {
    response = route->second();
  }
  WriteResponse(conn, response, head);
  return response.status;
}

}  // namespace kvdepot
