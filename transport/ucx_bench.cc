// ucx_bench: one-sided GET (or PUT) bandwidth of kvdepot_transport between
// two processes on this host, the way a client reads the daemon's arena:
// a server process registers a region; the client has --threads threads,
// each with its own worker and endpoint, issuing batches of --batch
// transfers of --block-size bytes at random block offsets into a registered
// buffer, for --seconds. Prints one JSON object per run (see
// compare_ucx_perftest.sh, which runs ucx_perftest beside it).
//
//   ucx_bench [--transport tcp|shm] [--op get|put] [--threads 1]
//             [--block-size 262144] [--batch 8] [--seconds 3]
//             [--region-size 67108864]
#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "transport/ucx_context.h"
#include "transport/ucx_endpoint.h"
#include "transport/ucx_test_util.h"
#include "transport/ucx_worker.h"

namespace kvdepot {
namespace {

struct Args {
  std::string transport = "tcp";
  std::string op = "get";
  int threads = 1;
  uint64_t block_size = 256 * 1024;
  int batch = 8;
  double seconds = 3;
  uint64_t region_size = 64 << 20;
  bool serve = false;
};

int Usage(const char* why) {
  std::fprintf(stderr, "ucx_bench: %s\n", why);
  return 2;
}

UcxContextOptions ContextOptions(const Args& a) {
  UcxContextOptions options;
  options.config = ucx_test::TransportConfig(a.transport);
  return options;
}

// The server: registers the region, prints "SERVE <address> <rkey> <base>",
// serves until its standard input closes.
int Serve(const Args& a) {
  auto context = UcxContext::Create(ContextOptions(a));
  if (!context.ok()) return Usage(context.status().ToString().c_str());
  auto worker = UcxWorker::Create(**context);
  if (!worker.ok()) return Usage(worker.status().ToString().c_str());
  std::vector<char> memory(a.region_size, 1);
  absl::Status served = ucx_test::ServeUntilStdinCloses(**context, **worker, memory);
  return served.ok() ? 0 : Usage(served.ToString().c_str());
}

struct ThreadResult {
  uint64_t bytes = 0;
  uint64_t batches = 0;
  uint64_t errors = 0;
  std::vector<double> batch_us;
};

int Client(const Args& a, const char* self) {
  ucx_test::PeerProcess server(
      self, {"--serve", "1", "--transport", a.transport, "--region-size",
             std::to_string(a.region_size)});
  const std::vector<std::string> words =
      absl::StrSplit(server.ReadLine(), ' ');
  uint64_t base = 0;
  if (words.size() != 4 || !absl::SimpleAtoi(words[3], &base)) {
    return Usage("the server process did not start");
  }
  const std::string address = absl::HexStringToBytes(words[1]);
  const RemoteRegion remote{absl::HexStringToBytes(words[2]), base,
                            a.region_size};

  auto context = UcxContext::Create(ContextOptions(a));
  if (!context.ok()) return Usage(context.status().ToString().c_str());
  const uint64_t blocks = a.region_size / a.block_size;
  std::vector<ThreadResult> results(a.threads);
  std::atomic<int> ready{0};
  std::atomic<bool> go{false}, failed{false};
  absl::Time start, end;
  std::vector<std::thread> threads;
  for (int t = 0; t < a.threads; ++t) {
    threads.emplace_back([&, t] {
      auto worker = UcxWorker::Create(**context);
      std::unique_ptr<UcxEndpoint> endpoint;
      absl::StatusOr<uint32_t> id = absl::UnknownError("not connected");
      if (worker.ok()) {
        UcxEndpointOptions options;
        options.peer_error_handling = ucx_test::PeerErrorHandling(a.transport);
        auto e = UcxEndpoint::Connect(**worker, address, std::move(options));
        if (e.ok()) {
          endpoint = *std::move(e);
          id = endpoint->AddRemoteRegion(remote);
        }
      }
      std::vector<char> buffer(a.batch * a.block_size, 2);
      auto local = (*context)->Register(buffer.data(), buffer.size());
      if (!id.ok() || !local.ok()) failed = true;
      ++ready;
      while (!go) std::this_thread::yield();
      if (failed) return;
      std::mt19937_64 rng(t);
      ThreadResult& r = results[t];
      std::vector<Transfer> batch(a.batch);
      while (absl::Now() < end) {
        for (int i = 0; i < a.batch; ++i) {
          batch[i] = Transfer{*id, base + (rng() % blocks) * a.block_size,
                              buffer.data() + i * a.block_size, a.block_size,
                              local->get()};
        }
        const absl::Time t0 = absl::Now();
        TransferHandle h = a.op == "get"
                               ? endpoint->Get(batch, t0 + absl::Seconds(10))
                               : endpoint->Put(batch, t0 + absl::Seconds(10));
        h.Wait();
        if (!h.overall_status().ok()) {
          ++r.errors;
          std::fprintf(stderr, "ucx_bench: %s\n",
                       h.overall_status().ToString().c_str());
          return;
        }
        r.batch_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
        r.bytes += a.batch * a.block_size;
        ++r.batches;
      }
    });
  }
  while (ready < a.threads) std::this_thread::yield();
  start = absl::Now();
  end = start + absl::Seconds(a.seconds);
  go = true;
  for (std::thread& t : threads) t.join();
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  server.CloseStdin();
  server.Wait();
  if (failed) return Usage("a client thread could not connect");

  ThreadResult total;
  for (ThreadResult& r : results) {
    total.bytes += r.bytes;
    total.batches += r.batches;
    total.errors += r.errors;
    total.batch_us.insert(total.batch_us.end(), r.batch_us.begin(),
                          r.batch_us.end());
  }
  std::sort(total.batch_us.begin(), total.batch_us.end());
  // Nearest rank (as tools/bench_tally.h): the p99 of 100 batches is the
  // 99th, not the largest.
  auto pct = [&](double p) {
    if (total.batch_us.empty()) return 0.0;
    const double rank =
        std::ceil(p * static_cast<double>(total.batch_us.size()));
    const size_t index = static_cast<size_t>(std::max(1.0, rank)) - 1;
    return total.batch_us[std::min(index, total.batch_us.size() - 1)];
  };
  std::printf(
      "{\"tool\": \"ucx_bench\", \"transport\": \"%s\", \"op\": \"%s\", "
      "\"threads\": %d, \"block_size\": %llu, \"batch\": %d, \"seconds\": "
      "%.3f, \"bytes\": %llu, \"gb_per_s\": %.4f, \"blocks_per_s\": %.1f, "
      "\"batch_p50_us\": %.1f, \"batch_p99_us\": %.1f, \"errors\": %llu}\n",
      a.transport.c_str(), a.op.c_str(), a.threads,
      static_cast<unsigned long long>(a.block_size), a.batch, elapsed,
      static_cast<unsigned long long>(total.bytes), total.bytes / elapsed / 1e9,
      total.bytes / elapsed / a.block_size, pct(0.5), pct(0.99),
      static_cast<unsigned long long>(total.errors));
  return total.errors == 0 && total.batches > 0 ? 0 : 1;
}

int Main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string key = argv[i];
    if (i + 1 >= argc) return Usage(("missing value for " + key).c_str());
    const std::string value = argv[i + 1];
    bool ok = true;
    if (key == "--transport") {
      a.transport = value;
      ok = value == "tcp" || value == "shm";
    } else if (key == "--op") {
      a.op = value;
      ok = value == "get" || value == "put";
    } else if (key == "--threads") {
      ok = absl::SimpleAtoi(value, &a.threads) && a.threads > 0;
    } else if (key == "--block-size") {
      ok = absl::SimpleAtoi(value, &a.block_size) && a.block_size > 0;
    } else if (key == "--batch") {
      ok = absl::SimpleAtoi(value, &a.batch) && a.batch > 0;
    } else if (key == "--seconds") {
      ok = absl::SimpleAtod(value, &a.seconds) && a.seconds > 0;
    } else if (key == "--region-size") {
      ok = absl::SimpleAtoi(value, &a.region_size);
    } else if (key == "--serve") {
      a.serve = true;
    } else {
      return Usage(("unknown argument " + key).c_str());
    }
    if (!ok) return Usage(("bad value for " + key).c_str());
  }
  if (a.region_size < a.block_size) return Usage("region smaller than a block");
  return a.serve ? Serve(a) : Client(a, "/proc/self/exe");
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) { return kvdepot::Main(argc, argv); }
