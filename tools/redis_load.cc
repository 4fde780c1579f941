// redis-load: a load generator for Redis that is not itself the bottleneck,
// the baseline client of tools/compare_redis.sh next to redis-benchmark.
//
//   redis-load (--port N [--host 127.0.0.1] | --unix PATH)
//              --op get|set|fill --size BYTES [--clients 4] [--pipeline 1]
//              [--keys 1024] [--duration 5] [--requests N] [--seed 1] [--json]
//
// Each client is a thread with its own connection (TCP_NODELAY on TCP).
// A round trip writes --pipeline requests (RESP written by hand; a SET's
// value is sent from one shared buffer with sendmsg(), not copied per
// request), then reads every reply with recv() calls of up to several MiB
// into one buffer per connection, parsed in place (redis_reply_reader.h):
// redis-benchmark (hiredis) reads a 256 KiB value in 16 KiB pieces and
// copies it again into a reply object, which here capped its GETs at about
// half of what Redis serves.
//   get   GETs random keys of the working set (--keys keys, key:000000000000
//         .. as redis-benchmark -r names them; a pipeline may repeat a key).
//         Every reply must be a value of --size bytes stamped with its key
//         (as `fill` stores them): anything else is a bad reply.
//   set   SETs random keys of the working set to their stamped values.
//   fill  SETs every key of the working set once (keys split over the
//         clients), then stops: what `get` needs stored first.
// Every reply is checked (SET: +OK). A run lasts --duration seconds (every
// round trip started is finished) or until --requests requests were made
// (split over the clients, whole pipelines), whichever comes first.
//
// Reports requests (ops: good replies; errors: bad ones), round trips
// (calls), the seconds from the common start to the last client's end,
// ops/s, calls/s, GB/s (values moved x --size / 1e9 / s) and p50/p99/p999
// latency per round trip: from writing its first request to reading its
// last reply's last byte. Output: one human line on stdout; with --json,
// one JSON object on stdout and the human line on stderr. Exit codes: 0
// when every reply was good, 1 when one was not or Redis could not be
// reached or spoke something else than RESP, 2 for a usage error.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <arpa/inet.h>
#include <limits.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/notification.h"
#include "tools/bench_tally.h"
#include "tools/redis_reply_reader.h"

namespace kvdepot {
namespace {

using SteadyClock = std::chrono::steady_clock;

// The receive buffer of a connection: room for a whole pipeline of replies,
// within these bounds (a loopback socket rarely holds more than a few MiB).
constexpr size_t kMinRecvBuffer = size_t{1} << 20;
constexpr size_t kMaxRecvBuffer = size_t{16} << 20;
// Largest value accepted (Redis's proto-max-bulk-len default is 512 MB).
constexpr uint64_t kMaxValueSize = uint64_t{512} << 20;

enum class Op { kGet, kSet, kFill };

struct LoadConfig {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string unix_path;
  std::string op_name;
  Op op = Op::kGet;
  uint64_t size = 0;
  int clients = 1;
  int pipeline = 1;
  uint64_t keys = 1024;
  double duration_s = 5;
  uint64_t requests = 0;  // > 0: at most this many in all
  uint64_t seed = 1;
  bool json = false;
};

// What one connection measured (ops: good replies; errors: bad ones).
struct ConnResult : CallTally {
  std::string error;      // why the connection stopped early, if it did
  std::string first_bad;  // the first bad reply, described
  SteadyClock::time_point end;
};

int Connect(const LoadConfig& config, std::string* error) {
  int fd = -1;
  if (!config.unix_path.empty()) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (config.unix_path.size() >= sizeof(addr.sun_path)) {
      *error = "unix socket path too long";
      return -1;
    }
    std::memcpy(addr.sun_path, config.unix_path.c_str(), config.unix_path.size() + 1);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      *error = absl::StrFormat("connect %s: %s", config.unix_path, std::strerror(errno));
      close(fd);
      return -1;
    }
  } else {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(config.port));
    if (inet_pton(AF_INET, config.host.c_str(), &addr.sin_addr) != 1) {
      *error = "--host must be an IPv4 address";
      return -1;
    }
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      *error = absl::StrFormat("connect %s:%d: %s", config.host, config.port,
                               std::strerror(errno));
      close(fd);
      return -1;
    }
    const int one = 1;
    if (fd >= 0) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  if (fd < 0) *error = absl::StrFormat("socket: %s", std::strerror(errno));
  return fd;
}

// Writes every byte of `iov` (modified as it goes). Returns false with
// `*error` set when the connection fails.
bool SendAll(int fd, std::vector<iovec>& iov, std::string* error) {
  size_t first = 0;
  while (first < iov.size()) {
    msghdr msg{};
    msg.msg_iov = &iov[first];
    msg.msg_iovlen = std::min<size_t>(iov.size() - first, IOV_MAX);
    const ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      *error = absl::StrFormat("send: %s", std::strerror(errno));
      return false;
    }
    size_t left = static_cast<size_t>(sent);
    while (first < iov.size() && left >= iov[first].iov_len) {
      left -= iov[first].iov_len;
      ++first;
    }
    if (left > 0) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return true;
}

// One connection's load: runs round trips until `deadline` or `quota`
// requests (0: no quota), or, for fill, over its share of the keys. Not
// thread-safe: one thread runs it; `config` and `pattern` must outlive it.
class Connection {
 public:
  Connection(const LoadConfig& config, int id, const std::string& pattern)
      : config_(config),
        id_(id),
        pattern_(pattern),
        reader_(config.op == Op::kGet ? ReplyReader::Kind::kGet : ReplyReader::Kind::kSet,
                config.size),
        rng_(config.seed * 1000003 + static_cast<uint64_t>(id)),
        recv_buffer_(std::clamp<uint64_t>(
            static_cast<uint64_t>(config.pipeline) * (config.size + 64),
            kMinRecvBuffer, kMaxRecvBuffer)) {}

  ~Connection() {
    if (fd_ >= 0) close(fd_);
  }

  bool Open() {
    fd_ = Connect(config_, &result_.error);
    return fd_ >= 0;
  }

  void Run(SteadyClock::time_point deadline, uint64_t quota) {
    uint64_t next_fill_key = static_cast<uint64_t>(id_);
    uint64_t made = 0;
    std::vector<uint64_t> keys;
    while (result_.error.empty()) {
      keys.clear();
      if (config_.op == Op::kFill) {
        for (int i = 0; i < config_.pipeline && next_fill_key < config_.keys; ++i) {
          keys.push_back(next_fill_key);
          next_fill_key += static_cast<uint64_t>(config_.clients);
        }
        if (keys.empty()) break;
      } else {
        if (SteadyClock::now() >= deadline || (quota > 0 && made >= quota)) break;
        std::uniform_int_distribution<uint64_t> pick(0, config_.keys - 1);
        for (int i = 0; i < config_.pipeline; ++i) keys.push_back(pick(rng_));
      }
      made += keys.size();
      RoundTrip(keys);
    }
    result_.end = SteadyClock::now();
  }

  ConnResult& result() { return result_; }

 private:
  void RoundTrip(const std::vector<uint64_t>& keys) {
    const SteadyClock::time_point start = SteadyClock::now();
    const uint64_t good_before = reader_.good(), bad_before = reader_.bad();
    if (!Send(keys)) return;
    while (reader_.pending() > 0) {
      const ssize_t got = recv(fd_, recv_buffer_.data(), recv_buffer_.size(), 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        result_.error = got == 0 ? std::string("Redis closed the connection")
                                 : absl::StrFormat("recv: %s", std::strerror(errno));
        return;
      }
      if (!reader_.Feed(recv_buffer_.data(), static_cast<size_t>(got))) {
        result_.error = "protocol error: " + reader_.protocol_error();
        return;
      }
    }
    const std::chrono::duration<double, std::micro> took = SteadyClock::now() - start;
    const uint64_t good = reader_.good() - good_before, bad = reader_.bad() - bad_before;
    result_.ops += good;
    result_.errors += bad;
    ++result_.calls;
    if (bad == 0) result_.latencies_us.push_back(took.count());
    if (bad > 0 && result_.first_bad.empty()) result_.first_bad = reader_.first_bad();
  }

  bool Send(const std::vector<uint64_t>& keys) {
    iov_.clear();
    if (config_.op == Op::kGet) {
      commands_.assign(1, std::string());
      for (uint64_t key : keys) {
        const std::string k = RedisKey(key);
        absl::StrAppendFormat(&commands_[0], "*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n", k.size(), k);
        reader_.Expect(key);
      }
      iov_.push_back({commands_[0].data(), commands_[0].size()});
    } else {
      // SET key value: the command and the head stamp, the shared pattern,
      // the tail stamp and CRLF. commands_ is sized first: iov_ points into it.
      const StampLayout l = LayoutOf(config_.size);
      commands_.assign(keys.size() * 2, std::string());
      for (size_t i = 0; i < keys.size(); ++i) {
        const std::string stamp = ValueStamp(keys[i], config_.size);
        std::string& head = commands_[2 * i];
        std::string& tail = commands_[2 * i + 1];
        const std::string k = RedisKey(keys[i]);
        head = absl::StrFormat("*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n", k.size(), k,
                               config_.size);
        head.append(stamp, 0, l.head);
        tail.assign(stamp, 0, config_.size - l.tail);
        tail.append("\r\n");
        iov_.push_back({head.data(), head.size()});
        if (l.tail > l.head) {
          iov_.push_back({const_cast<char*>(pattern_.data()) + l.head, l.tail - l.head});
        }
        iov_.push_back({tail.data(), tail.size()});
        reader_.Expect(keys[i]);
      }
    }
    return SendAll(fd_, iov_, &result_.error);
  }

  const LoadConfig& config_;
  const int id_;
  const std::string& pattern_;  // the values' bytes between the stamps
  ReplyReader reader_;
  std::mt19937_64 rng_;
  std::vector<char> recv_buffer_;
  std::vector<std::string> commands_;
  std::vector<iovec> iov_;
  int fd_ = -1;
  ConnResult result_;
};

int RunLoad(const LoadConfig& config) {
  std::string pattern(config.size, '\0');
  for (uint64_t i = 0; i < config.size; ++i) pattern[i] = PatternByte(i);

  std::vector<std::unique_ptr<Connection>> conns;
  for (int i = 0; i < config.clients; ++i) {
    conns.push_back(std::make_unique<Connection>(config, i, pattern));
    if (!conns.back()->Open()) {
      std::fprintf(stderr, "redis-load: %s\n", conns.back()->result().error.c_str());
      return 1;
    }
  }
  // Per-connection quota: whole pipelines, together at least --requests.
  uint64_t quota = 0;
  if (config.requests > 0) {
    const uint64_t per = (config.requests + config.clients - 1) / config.clients;
    const uint64_t p = static_cast<uint64_t>(config.pipeline);
    quota = (per + p - 1) / p * p;
  }

  absl::BlockingCounter ready(config.clients);
  absl::Notification go;
  SteadyClock::time_point start, deadline;
  std::vector<std::thread> threads;
  for (auto& conn : conns) {
    threads.emplace_back([&, c = conn.get()] {
      ready.DecrementCount();
      go.WaitForNotification();
      c->Run(deadline, quota);
    });
  }
  ready.Wait();
  start = SteadyClock::now();
  deadline = start + std::chrono::duration_cast<SteadyClock::duration>(
                         std::chrono::duration<double>(config.duration_s));
  go.Notify();  // start and deadline are written before, read after
  for (std::thread& t : threads) t.join();

  std::vector<ConnResult> results;
  SteadyClock::time_point end = start;
  std::string error, first_bad;
  for (auto& conn : conns) {
    ConnResult& r = conn->result();
    end = std::max(end, r.end);
    if (error.empty() && !r.error.empty()) error = r.error;
    if (first_bad.empty() && !r.first_bad.empty()) first_bad = r.first_bad;
    results.push_back(std::move(r));
  }
  const TallySummary s = Summarize(results);
  const double seconds = std::chrono::duration<double>(end - start).count();
  const double ops_per_sec = seconds > 0 ? static_cast<double>(s.ops) / seconds : 0;
  const double calls_per_sec = seconds > 0 ? static_cast<double>(s.calls) / seconds : 0;
  const double gb_per_sec = ops_per_sec * static_cast<double>(config.size) / 1e9;

  const std::string via =
      config.unix_path.empty() ? absl::StrFormat("%s:%d", config.host, config.port)
                               : config.unix_path;
  const std::string human = absl::StrFormat(
      "redis-load %s %d bytes x%d -P %d (%s): %d ops (%d errors) in %.3f s, "
      "%.0f ops/s, %.3f GB/s, round trip p50 %.0f us p99 %.0f us p999 %.0f us",
      config.op_name, config.size, config.clients, config.pipeline, via, s.ops, s.errors,
      seconds, ops_per_sec, gb_per_sec, s.p50_us, s.p99_us, s.p999_us);
  if (config.json) {
    std::printf(
        "{\"tool\":\"redis-load\",\"op\":\"%s\",\"block_size\":%llu,\"clients\":%d,"
        "\"pipeline\":%d,\"keys\":%llu,\"ops\":%llu,\"errors\":%llu,\"calls\":%llu,"
        "\"seconds\":%.6f,\"ops_per_sec\":%.3f,\"calls_per_sec\":%.3f,\"gb_per_sec\":%.6f,"
        "\"p50_us\":%.3f,\"p99_us\":%.3f,\"p999_us\":%.3f,"
        "\"latency_unit\":\"round trip, first request byte written to last reply byte read\","
        "\"min_thread_ops\":%llu,\"max_thread_ops\":%llu}\n",
        config.op_name.c_str(), static_cast<unsigned long long>(config.size), config.clients,
        config.pipeline, static_cast<unsigned long long>(config.keys),
        static_cast<unsigned long long>(s.ops), static_cast<unsigned long long>(s.errors),
        static_cast<unsigned long long>(s.calls), seconds, ops_per_sec, calls_per_sec,
        gb_per_sec, s.p50_us, s.p99_us, s.p999_us,
        static_cast<unsigned long long>(s.min_thread_ops),
        static_cast<unsigned long long>(s.max_thread_ops));
  }
  std::fprintf(config.json ? stderr : stdout, "%s\n", human.c_str());
  if (!first_bad.empty()) std::fprintf(stderr, "redis-load: bad reply: %s\n", first_bad.c_str());
  if (!error.empty()) std::fprintf(stderr, "redis-load: %s\n", error.c_str());
  return (s.errors > 0 || !error.empty()) ? 1 : 0;
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) {
  kvdepot::LoadConfig config;
  CLI::App app{"redis-load: GET/SET load on Redis over N connections (see redis_load.cc)"};
  app.add_option("--host", config.host, "Redis's IPv4 address");
  app.add_option("--port", config.port, "Redis's TCP port")->check(CLI::Range(1, 65535));
  app.add_option("--unix", config.unix_path, "Redis's Unix socket (instead of TCP)");
  app.add_option("--op", config.op_name, "get, set or fill")
      ->required()
      ->check(CLI::IsMember({"get", "set", "fill"}));
  app.add_option("--size", config.size, "value size in bytes")
      ->required()
      ->check(CLI::Range(uint64_t{1}, kvdepot::kMaxValueSize));
  app.add_option("--clients", config.clients, "connections, one thread each")
      ->check(CLI::Range(1, 1024));
  app.add_option("--pipeline", config.pipeline, "requests per round trip")
      ->check(CLI::Range(1, 4096));
  app.add_option("--keys", config.keys, "working set: keys key:000000000000 ..")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1000000000000}));  // 12 digits: keys are 16 bytes
  app.add_option("--duration", config.duration_s, "seconds (get, set)")
      ->check(CLI::PositiveNumber);
  app.add_option("--requests", config.requests, "at most this many requests (get, set)");
  app.add_option("--seed", config.seed, "seed of the key choice");
  app.add_flag("--json", config.json, "one JSON object on stdout");
  CLI11_PARSE(app, argc, argv);
  if (config.port == 0 && config.unix_path.empty()) {
    std::fprintf(stderr, "redis-load: give --port or --unix\n");
    return 2;
  }
  config.op = config.op_name == "get"   ? kvdepot::Op::kGet
              : config.op_name == "set" ? kvdepot::Op::kSet
                                        : kvdepot::Op::kFill;
  return kvdepot::RunLoad(config);
}
