// pull_protocols_bench: how a daemon can best take a client's blocks over
// UCX, measured before building on either way. Two processes on this host:
// a "client" with a registered buffer of --blocks blocks, a "daemon" with a
// registered arena of as many, --depth blocks in flight, each block to a
// slot of its own in turn (so, as in kvdepotd, the bytes are cold):
//
//   get  the daemon reads the client's buffer with ucp_get_nbx (what
//        kvdepotd's PullBlocks does: daemon-driven, the client never learns
//        an arena address);
//   am   the client sends each block as a rendezvous active message and the
//        daemon receives it with ucp_am_recv_data_nbx straight into its slot
//        (the daemon still chooses the address; over TCP, where UCX 1.13
//        emulates get with messages, this lets UCX use its TCP put_zcopy).
//
// Over TCP only: over shared memory kvdepotd copies a co-located client's
// blocks itself, without UCX in the path.
//
// Rounds alternate get, am, get, am...; prints a table, the ratio am/get of
// the best rounds, and one JSON object (--json PATH also writes it there).
// Every block the daemon receives is checked against the client's pattern.
//
//   pull_protocols_bench [--block-size 262144] [--blocks 1024] [--depth 16]
//                        [--seconds 2] [--rounds 3] [--json PATH]
#include <sys/select.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transport/ucx_context.h"
#include "transport/ucx_test_util.h"

namespace kvdepot {
namespace {

struct Args {
  uint64_t block_size = 256 * 1024;
  uint64_t blocks = 1024;
  int depth = 16;
  double seconds = 2;
  int rounds = 3;
  std::string json;
};

constexpr uint16_t kBlockMessage = 7;
constexpr char kPattern = 0x5a;

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "pull_protocols_bench: %s\n", why.c_str());
  std::exit(1);
}

void Check(ucs_status_t st, const char* what) {
  if (st != UCS_OK) Die(absl::StrCat(what, ": ", ucs_status_string(st)));
}

// Length-prefixed messages over a pipe.
void Send(int fd, const std::string& s) {
  const uint32_t n = static_cast<uint32_t>(s.size());
  if (write(fd, &n, sizeof n) != sizeof n ||
      write(fd, s.data(), n) != static_cast<ssize_t>(n)) {
    Die("pipe write failed");
  }
}

std::string Receive(int fd) {
  uint32_t n = 0;
  if (read(fd, &n, sizeof n) != sizeof n) Die("pipe read failed");
  std::string s(n, '\0');
  for (size_t got = 0; got < n;) {
    const ssize_t r = read(fd, s.data() + got, n - got);
    if (r <= 0) Die("pipe read failed");
    got += static_cast<size_t>(r);
  }
  return s;
}

bool Readable(int fd) {
  fd_set fds;
  FD_ZERO(&fds);
  FD_SET(fd, &fds);
  timeval now = {0, 0};
  return select(fd + 1, &fds, nullptr, nullptr, &now) > 0;
}

// One process's UCX side: context, a worker progressed by this thread, a
// registered region of `blocks` blocks, an endpoint to the peer.
class Side {
 public:
  // The client's buffer is allocated through UCX (as libkvdepot's
  // AllocateBuffer does); the daemon's is ordinary memory it registers (as
  // kvdepotd's arena).
  Side(const Args& a, char fill, bool ucx_allocated) : a_(a) {
    UcxContextOptions options;
    options.config = ucx_test::TransportConfig("tcp");
    auto context = UcxContext::Create(options);
    if (!context.ok()) Die(context.status().ToString());
    context_ = *std::move(context);
    ucp_worker_params_t params = {};
    params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    params.thread_mode = UCS_THREAD_MODE_SINGLE;
    Check(ucp_worker_create(context_->handle(), &params, &worker_), "ucp_worker_create");
    const size_t size = a.block_size * a.blocks;
    if (!ucx_allocated) memory_.assign(size, 0);
    auto region = ucx_allocated ? context_->Allocate(size)
                                : context_->Register(memory_.data(), size);
    if (!region.ok()) Die(region.status().ToString());
    region_ = *std::move(region);
    std::memset(region_->base(), fill, region_->size());
  }
  ~Side() {
    if (ep_ != nullptr) {  // the daemon's, while the client still serves
      ucp_request_param_t param = {};
      Finish(ucp_ep_close_nbx(ep_, &param));
    }
    if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
    region_.reset();
    ucp_worker_destroy(worker_);
  }

  std::string address() const {
    ucp_address_t* address = nullptr;
    size_t length = 0;
    Check(ucp_worker_get_address(worker_, &address, &length), "ucp_worker_get_address");
    std::string s(reinterpret_cast<const char*>(address), length);
    ucp_worker_release_address(worker_, address);
    return s;
  }
  void Connect(const std::string& peer) {
    ucp_ep_params_t params = {};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address = reinterpret_cast<const ucp_address_t*>(peer.data());
    Check(ucp_ep_create(worker_, &params, &ep_), "ucp_ep_create");
  }
  void Unpack(const std::string& rkey) {
    Check(ucp_ep_rkey_unpack(ep_, rkey.data(), &rkey_), "ucp_ep_rkey_unpack");
  }
  // Waits for a request UCX returned (progressing), and frees it.
  void Finish(ucs_status_ptr_t request) {
    if (request == nullptr) return;
    if (UCS_PTR_IS_ERR(request)) Die(ucs_status_string(UCS_PTR_STATUS(request)));
    while (ucp_request_check_status(request) == UCS_INPROGRESS) {
      ucp_worker_progress(worker_);
    }
    ucp_request_free(request);
  }
  char* block(uint64_t i) const { return region_->base() + (i % a_.blocks) * a_.block_size; }

  const Args& a_;
  std::unique_ptr<UcxContext> context_;
  ucp_worker_h worker_ = nullptr;
  std::vector<char> memory_;
  std::unique_ptr<MemoryRegion> region_;
  ucp_ep_h ep_ = nullptr;
  ucp_rkey_h rkey_ = nullptr;
};

// Operations in flight, counted by their completion callbacks.
struct Flight {
  int in_flight = 0;
  uint64_t done = 0;
  bool failed = false;
  void Posted(ucs_status_ptr_t request) {
    if (UCS_PTR_IS_ERR(request)) {
      failed = true;
    } else if (request == nullptr) {
      ++done;  // completed in place
    } else {
      ++in_flight;
    }
  }
  static void Completed(void* request, ucs_status_t status, void* arg) {
    auto* f = static_cast<Flight*>(arg);
    --f->in_flight;
    ++f->done;
    f->failed |= status != UCS_OK;
    ucp_request_free(request);
  }
  static void Received(void* request, ucs_status_t status, size_t /*length*/,
                       void* arg) {
    Completed(request, status, arg);
  }
};

// The daemon's pending rendezvous descriptors (am).
struct Arrivals {
  std::deque<void*> descriptors;
  uint64_t eager = 0;  // blocks that came eagerly: not what is measured
};

ucs_status_t OnBlock(void* arg, const void* /*header*/, size_t /*header_length*/,
                     void* data, size_t /*length*/, const ucp_am_recv_param_t* param) {
  auto* arrivals = static_cast<Arrivals*>(arg);
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
    ++arrivals->eager;
    return UCS_OK;
  }
  arrivals->descriptors.push_back(data);
  return UCS_INPROGRESS;  // kept until ucp_am_recv_data_nbx
}

// The client process: serves gets (progress) or sends blocks (am) until
// the daemon says stop, then finishes what is in flight and says done.
int RunClient(const Args& a, bool am, int from_daemon, int to_daemon) {
  Side side(a, kPattern, /*ucx_allocated=*/true);
  Send(to_daemon, side.address());
  void* packed = nullptr;
  size_t packed_size = 0;
  Check(ucp_rkey_pack(side.context_->handle(), side.region_->handle(), &packed,
                      &packed_size),
        "ucp_rkey_pack");
  Send(to_daemon, std::string(static_cast<char*>(packed), packed_size));
  ucp_rkey_buffer_release(packed);
  Send(to_daemon, std::to_string(side.region_->address()));
  side.Connect(Receive(from_daemon));
  Flight flight;
  uint64_t sent = 0;
  for (unsigned spin = 0;; ++spin) {
    while (am && flight.in_flight < a.depth) {
      ucp_request_param_t param = {};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                           UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FIELD_FLAGS;
      param.cb.send = &Flight::Completed;
      param.user_data = &flight;
      param.memh = side.region_->handle();
      param.flags = UCP_AM_SEND_FLAG_RNDV;
      flight.Posted(ucp_am_send_nbx(side.ep_, kBlockMessage, nullptr, 0,
                                    side.block(sent++), a.block_size, &param));
    }
    ucp_worker_progress(side.worker_);
    if (flight.failed) Die("a send failed");
    if (spin % 256 == 0 && Readable(from_daemon)) break;  // "stop"
  }
  Receive(from_daemon);
  while (flight.in_flight > 0) ucp_worker_progress(side.worker_);
  Send(to_daemon, "done");
  // The daemon closes its endpoint first; serve until it says so.
  while (!Readable(from_daemon)) ucp_worker_progress(side.worker_);
  side.ep_ = nullptr;  // its peer is gone: ucp_worker_destroy releases it
  return 0;
}

struct Round {
  double gb_per_s = 0;
  uint64_t blocks = 0;
};

// The daemon process (this one): takes blocks for --seconds, then stops the
// client and checks what arrived.
Round RunDaemon(const Args& a, bool am, int from_client, int to_client) {
  Side side(a, 0, /*ucx_allocated=*/false);
  const std::string client_address = Receive(from_client);
  const std::string rkey = Receive(from_client);
  uint64_t base = 0;
  if (!absl::SimpleAtoi(Receive(from_client), &base)) Die("bad base address");
  side.Connect(client_address);
  side.Unpack(rkey);
  Send(to_client, side.address());
  Arrivals arrivals;
  ucp_am_handler_param_t handler = {};
  handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                       UCP_AM_HANDLER_PARAM_FIELD_ARG;
  handler.id = kBlockMessage;
  handler.cb = &OnBlock;
  handler.arg = &arrivals;
  Check(ucp_worker_set_am_recv_handler(side.worker_, &handler), "set_am_recv_handler");

  Flight flight;
  uint64_t posted = 0;
  auto request = [&] {
    ucp_request_param_t param = {};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_MEMH;
    param.user_data = &flight;
    param.memh = side.region_->handle();
    return param;
  };
  // One pass: receives the blocks that arrived (am) or posts gets up to
  // --depth in flight while `more` (get), then progresses the worker.
  auto pump = [&](bool more) {
    if (am) {
      while (!arrivals.descriptors.empty()) {
        void* desc = arrivals.descriptors.front();
        arrivals.descriptors.pop_front();
        ucp_request_param_t param = request();
        param.cb.recv_am = &Flight::Received;
        flight.Posted(ucp_am_recv_data_nbx(side.worker_, desc, side.block(posted++),
                                           a.block_size, &param));
      }
    } else {
      while (more && flight.in_flight < a.depth) {
        ucp_request_param_t param = request();
        param.cb.send = &Flight::Completed;
        const uint64_t i = posted++;
        flight.Posted(ucp_get_nbx(side.ep_, side.block(i), a.block_size,
                                  base + (i % a.blocks) * a.block_size, side.rkey_,
                                  &param));
      }
    }
    ucp_worker_progress(side.worker_);
    if (flight.failed) Die("a transfer failed");
  };
  // Warm-up: the connection and the first blocks are not timed.
  while (flight.done < static_cast<uint64_t>(4 * a.depth)) pump(true);
  const uint64_t done_before = flight.done;
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Seconds(a.seconds);
  for (unsigned spin = 0;; ++spin) {
    pump(true);
    if (spin % 64 == 0 && absl::Now() >= end) break;
  }
  Round round;
  round.blocks = flight.done - done_before;
  round.gb_per_s = static_cast<double>(round.blocks * a.block_size) /
                   absl::ToDoubleSeconds(absl::Now() - start) / 1e9;
  Send(to_client, "stop");
  // The client finishes its sends only once they are received.
  for (unsigned spin = 0;; ++spin) {
    pump(false);
    if (flight.in_flight == 0 && spin % 64 == 0 && Readable(from_client)) break;
  }
  Receive(from_client);  // "done"
  while (flight.in_flight > 0 || !arrivals.descriptors.empty()) pump(false);
  if (arrivals.eager != 0) Die("blocks came eagerly, not as rendezvous");
  // Every slot that was written holds the client's bytes.
  for (uint64_t i = 0; i < std::min<uint64_t>(posted, a.blocks); ++i) {
    const char* b = side.block(i);
    for (uint64_t off : {uint64_t{0}, a.block_size / 2, a.block_size - 1}) {
      if (b[off] != kPattern) Die(absl::StrCat("block ", i, " was not received"));
    }
  }
  return round;
}

Round Measure(const Args& a, bool am) {
  int to_child[2], to_parent[2];
  if (pipe(to_child) != 0 || pipe(to_parent) != 0) Die("pipe failed");
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) Die("fork failed");
  if (pid == 0) {
    close(to_child[1]);
    close(to_parent[0]);
    _exit(RunClient(a, am, to_child[0], to_parent[1]));
  }
  close(to_child[0]);
  close(to_parent[1]);
  // When it returns, the daemon's endpoint and worker are gone.
  const Round round = RunDaemon(a, am, to_parent[0], to_child[1]);
  Send(to_child[1], "bye");
  int status = 0;
  waitpid(pid, &status, 0);
  close(to_child[1]);
  close(to_parent[0]);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) Die("the client process failed");
  return round;
}

int Usage(const std::string& why) {
  std::fprintf(stderr, "pull_protocols_bench: %s\n", why.c_str());
  return 2;
}

int Main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string key = argv[i];
    if (i + 1 >= argc) return Usage("missing value for " + key);
    const std::string value = argv[i + 1];
    bool ok = true;
    if (key == "--block-size") {
      ok = absl::SimpleAtoi(value, &a.block_size) && a.block_size > 0;
    } else if (key == "--blocks") {
      ok = absl::SimpleAtoi(value, &a.blocks) && a.blocks > 0;
    } else if (key == "--depth") {
      ok = absl::SimpleAtoi(value, &a.depth) && a.depth > 0;
    } else if (key == "--seconds") {
      ok = absl::SimpleAtod(value, &a.seconds) && a.seconds > 0;
    } else if (key == "--rounds") {
      ok = absl::SimpleAtoi(value, &a.rounds) && a.rounds > 0;
    } else if (key == "--json") {
      a.json = value;
    } else {
      return Usage("unknown argument " + key);
    }
    if (!ok) return Usage("bad value for " + key);
  }
  std::vector<Round> get, am;
  std::printf("round  protocol  GB/s    blocks\n");
  for (int r = 1; r <= a.rounds; ++r) {
    for (bool use_am : {false, true}) {
      const Round round = Measure(a, use_am);
      (use_am ? am : get).push_back(round);
      std::printf("%-5d  %-8s  %-6.3f  %llu\n", r, use_am ? "am" : "get",
                  round.gb_per_s, static_cast<unsigned long long>(round.blocks));
    }
  }
  auto best = [](const std::vector<Round>& rounds) {
    double b = 0;
    for (const Round& r : rounds) b = std::max(b, r.gb_per_s);
    return b;
  };
  auto median = [](std::vector<Round> rounds) {
    std::sort(rounds.begin(), rounds.end(),
              [](const Round& x, const Round& y) { return x.gb_per_s < y.gb_per_s; });
    return rounds[rounds.size() / 2].gb_per_s;
  };
  const double best_get = best(get), best_am = best(am);
  const double median_get = median(get), median_am = median(am);
  std::printf("best:   get %.3f GB/s, am %.3f GB/s, am/get %.2f\n", best_get, best_am,
              best_am / best_get);
  std::printf("median: get %.3f GB/s, am %.3f GB/s, am/get %.2f\n", median_get,
              median_am, median_am / median_get);
  const std::string json = absl::StrCat(
      "{\"tool\": \"pull_protocols_bench\", \"transport\": \"tcp\", "
      "\"block_size\": ", a.block_size, ", \"blocks\": ", a.blocks,
      ", \"depth\": ", a.depth, ", \"seconds\": ", a.seconds, ", \"rounds\": ",
      a.rounds, ", \"get_gb_per_s\": ", best_get, ", \"am_gb_per_s\": ", best_am,
      ", \"ratio_am_over_get\": ", best_am / best_get,
      ", \"median_get_gb_per_s\": ", median_get, ", \"median_am_gb_per_s\": ",
      median_am, ", \"median_ratio_am_over_get\": ", median_am / median_get, "}");
  std::printf("%s\n", json.c_str());
  if (!a.json.empty()) {
    FILE* f = std::fopen(a.json.c_str(), "w");
    if (f == nullptr) return Usage("cannot write " + a.json);
    std::fprintf(f, "%s\n", json.c_str());
    std::fclose(f);
  }
  return best_get > 0 && best_am > 0 ? 0 : 1;
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) { return kvdepot::Main(argc, argv); }
