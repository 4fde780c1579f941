// ucx_test_peer: a client process for the transport tests. It makes its own
// UCX context and worker, connects to the test's server worker, and then
//   --mode idle  prints "ADDRESS <hex worker address>" and waits until its
//                standard input closes (or it is killed);
//   --mode serve connects nowhere: registers a 1 MiB region filled with the
//                pattern of --seed, prints "SERVE <hex worker address>
//                <hex rkey> <region address>" and waits as idle does;
//   --mode rw    reads --blocks blocks of --block-size bytes from the
//                server's region below --pattern-end (filled with the
//                pattern of --seed) and checks every byte, then writes the
//                pattern of --slot-seed into its own slot (at offset --slot)
//                and reads it back.
// Exit status 0 on success, 1 on a failed check, 2 on bad usage.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "transport/ucx_address_sandbox.h"
#include "transport/ucx_context.h"
#include "transport/ucx_endpoint.h"
#include "transport/ucx_test_util.h"
#include "transport/ucx_worker.h"

namespace kvdepot {
namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "ucx_test_peer: %s\n", what.c_str());
  return 1;
}

uint64_t Number(const std::map<std::string, std::string>& args,
                const std::string& key) {
  uint64_t v = 0;
  auto it = args.find(key);
  if (it == args.end() || !absl::SimpleAtoi(it->second, &v)) {
    std::fprintf(stderr, "ucx_test_peer: --%s needs a number\n", key.c_str());
    std::exit(2);
  }
  return v;
}

int Main(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string key = argv[i];
    if (key.rfind("--", 0) != 0) return 2;
    args[key.substr(2)] = argv[i + 1];
  }
  UcxContextOptions options;
  options.config = ucx_test::TransportConfig(args["transport"]);
  auto context = UcxContext::Create(options);
  if (!context.ok()) return Fail(context.status().ToString());
  auto worker = UcxWorker::Create(**context);
  if (!worker.ok()) return Fail(worker.status().ToString());
  if (args["mode"] == "serve") {
    std::vector<char> memory(1 << 20);
    ucx_test::FillPattern(memory.data(), memory.size(), Number(args, "seed"));
    absl::Status served = ucx_test::ServeUntilStdinCloses(**context, **worker, memory);
    return served.ok() ? 0 : Fail(served.ToString());
  }
  UcxEndpointOptions endpoint_options;
  endpoint_options.peer_error_handling =
      ucx_test::PeerErrorHandling(args["transport"]);
  auto endpoint =
      UcxEndpoint::Connect(**worker, absl::HexStringToBytes(args["server"]),
                           std::move(endpoint_options));
  if (!endpoint.ok()) return Fail(endpoint.status().ToString());

  if (args["mode"] == "idle") {
    std::printf("ADDRESS %s\n",
                absl::BytesToHexString((*worker)->address()).c_str());
    std::fflush(stdout);
    char c;
    while (read(0, &c, 1) > 0) {
    }
    return 0;
  }
  if (args["mode"] != "rw") return 2;

  RemoteRegion region;
  region.packed_rkey = absl::HexStringToBytes(args["rkey"]);
  region.base = Number(args, "base");
  region.size = Number(args, "size");
  const uint64_t seed = Number(args, "seed");
  const uint64_t blocks = Number(args, "blocks");
  const uint64_t block_size = Number(args, "block-size");
  const uint64_t slot = Number(args, "slot");  // offset in the region
  const uint64_t slot_seed = Number(args, "slot-seed");
  auto id = (*endpoint)->AddRemoteRegion(region);
  if (!id.ok()) return Fail(id.status().ToString());

  std::vector<char> buffer(2 * block_size);
  auto local = (*context)->Register(buffer.data(), buffer.size());
  if (!local.ok()) return Fail(local.status().ToString());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  // Read pattern blocks in a pseudo-random order.
  const uint64_t pattern_blocks = Number(args, "pattern-end") / block_size;
  for (uint64_t b = 0; b < blocks; ++b) {
    const uint64_t offset =
        (ucx_test::SplitMix64(slot_seed + b) % pattern_blocks) * block_size;
    Transfer t{*id, region.base + offset, buffer.data(), block_size,
               local->get()};
    TransferHandle h = (*endpoint)->Get({t}, deadline);
    h.Wait();
    if (!h.overall_status().ok()) return Fail(h.overall_status().ToString());
    const int64_t bad =
        ucx_test::FirstPatternMismatch(buffer.data(), block_size, seed + offset / 8);
    if (bad >= 0) {
      return Fail("block at offset " + std::to_string(offset) +
                  " differs at byte " + std::to_string(bad));
    }
  }
  ucx_test::FillPattern(buffer.data(), block_size, slot_seed);
  Transfer put{*id, region.base + slot, buffer.data(), block_size,
               local->get()};
  TransferHandle p = (*endpoint)->Put({put}, deadline);
  p.Wait();
  if (!p.overall_status().ok()) return Fail(p.overall_status().ToString());
  Transfer get{*id, region.base + slot, buffer.data() + block_size, block_size,
               local->get()};
  TransferHandle g = (*endpoint)->Get({get}, deadline);
  g.Wait();
  if (!g.overall_status().ok()) return Fail(g.overall_status().ToString());
  if (ucx_test::FirstPatternMismatch(buffer.data() + block_size, block_size,
                                     slot_seed) >= 0) {
    return Fail("slot read back differs from what was put");
  }
  return 0;
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) {
  if (argc > 1 && std::string_view(argv[1]) == kvdepot::kUcxAddressSandboxFlag) {
    // As kvdepotd does (ucx_address_sandbox_test).
    return kvdepot::RunUcxAddressSandbox(std::vector<std::string>(argv + 2, argv + argc));
  }
  return kvdepot::Main(argc, argv);
}
