// Helpers for the transport tests and ucx_test_peer (test-only; not part of
// kvdepot_transport).
#ifndef KVDEPOT_TRANSPORT_UCX_TEST_UTIL_H_
#define KVDEPOT_TRANSPORT_UCX_TEST_UTIL_H_

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstddef>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transport/internal/rkey_check.h"
#include "transport/ucx_context.h"
#include "transport/ucx_worker.h"

namespace kvdepot::ucx_test {

// The UCX settings of the transports under test, all on loopback:
//   "tcp"  UCX_TLS=tcp over lo;
//   "shm"  shared memory (UCX 1.13 emulates one-sided transfers of user
//          memory over posix/sysv messages), plus tcp for the endpoints
//          that need peer-failure detection (shared memory cannot).
// Both with the TCP segment sizes the README recommends (kvdepotd's).
// Both with a short keepalive, so tests see a dead peer within a second.
// Endpoints of the "shm" tests turn peer error handling off.
inline std::map<std::string, std::string> TransportConfig(
    const std::string& transport) {
  std::map<std::string, std::string> config = {
      {"KEEPALIVE_INTERVAL", "200ms"},
      {"KEEPALIVE_NUM_EPS", "inf"},
  };
  // TCP segments as kvdepotd and libkvdepot have them by default: UCX 1.13
  // aborts a process that receives a segment larger than its own
  // RX_SEG_SIZE (transport/README, caveat 5), over "shm" too when a
  // co-located client is served over TCP.
  config["TCP_TX_SEG_SIZE"] = "512k";
  config["TCP_RX_SEG_SIZE"] = "512k";
  config["NET_DEVICES"] = "lo";
  config["TLS"] = transport == "tcp" ? "tcp" : "shm,tcp";
  return config;
}

// Whether endpoints over `transport` can have peer error handling.
inline bool PeerErrorHandling(const std::string& transport) {
  return transport == "tcp";
}

// A deterministic byte pattern: the 8 bytes at offset 8*i of a buffer
// filled with `seed` are SplitMix64(seed + i).
// Stops process `pid` (SIGSTOP) and waits, up to 10 s, until every thread
// of it has stopped: a request sent to it before then could still be
// served. False when it did not stop in time.
inline bool StopProcess(pid_t pid) {
  kill(pid, SIGSTOP);
  auto stopped = [pid] {
    const std::string dir = absl::StrCat("/proc/", pid, "/task");
    std::error_code ec;
    for (const auto& task : std::filesystem::directory_iterator(dir, ec)) {
      std::ifstream stat(task.path() / "stat");
      std::string line;
      std::getline(stat, line);
      // "tid (comm) S ...": the state follows the last ')'.
      const size_t paren = line.rfind(')');
      if (paren == std::string::npos || paren + 2 >= line.size() ||
          line[paren + 2] != 'T') {
        return false;
      }
    }
    return !ec;
  };
  for (const absl::Time end = absl::Now() + absl::Seconds(10);;
       absl::SleepFor(absl::Milliseconds(1))) {
    if (stopped()) return true;
    if (absl::Now() >= end) return false;
  }
}

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// REQUIRES: size is a multiple of 8.
inline void FillPattern(char* p, size_t size, uint64_t seed) {
  for (size_t i = 0; i < size / 8; ++i) {
    const uint64_t v = SplitMix64(seed + i);
    std::memcpy(p + 8 * i, &v, 8);
  }
}

// The offset of the first byte that differs from the pattern, or -1.
inline int64_t FirstPatternMismatch(const char* p, size_t size,
                                    uint64_t seed) {
  for (size_t i = 0; i < size / 8; ++i) {
    const uint64_t v = SplitMix64(seed + i);
    if (std::memcmp(p + 8 * i, &v, 8) != 0) return static_cast<int64_t>(8 * i);
  }
  return -1;
}

// A child process running ucx_test_peer with `args`, its standard input
// and output on pipes. The destructor kills it if it is still running.
class PeerProcess {
 public:
  PeerProcess(const std::string& binary, const std::vector<std::string>& args) {
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) return;
    std::vector<std::string> argv_strings = {binary};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : argv_strings) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      // Killed with this process, even when stopped (a test that crashed
      // must not leave a stopped peer holding its output open).
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      dup2(in[0], 0);
      dup2(out[1], 1);
      close(in[0]);
      close(in[1]);
      close(out[0]);
      close(out[1]);
      execv(binary.c_str(), argv.data());
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    stdin_ = in[1];
    stdout_ = fdopen(out[0], "r");
  }
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  ~PeerProcess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      Wait();
    }
    if (stdin_ >= 0) close(stdin_);
    if (stdout_ != nullptr) fclose(stdout_);
  }

  pid_t pid() const { return pid_; }

  // The next line of the child's output, without the newline; empty at
  // end of file.
  std::string ReadLine() {
    std::string line;
    char buf[4096];
    while (stdout_ != nullptr && fgets(buf, sizeof(buf), stdout_) != nullptr) {
      line += buf;
      if (!line.empty() && line.back() == '\n') {
        line.pop_back();
        break;
      }
    }
    return line;
  }

  void Kill() { kill(pid_, SIGKILL); }
  void CloseStdin() {
    if (stdin_ >= 0) close(stdin_);
    stdin_ = -1;
  }

  // Waits for the child to end; returns its wait status.
  int Wait() {
    int status = 0;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    exited_ = true;
    return status;
  }

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
  int stdin_ = -1;
  FILE* stdout_ = nullptr;
};

// The offset of the System V transport key (UCX 1.13: 12 bytes, int32
// shmid then uint64 address) in a packed UCX key, or 0 when it has none.
inline size_t SysvKeyOffset(const std::string& packed) {
  size_t offset = 0;
  transport_internal::ForEachTransportKey(
      packed, [&](int, absl::string_view key) {
        if (key.size() == 12 && offset == 0) offset = key.data() - packed.data();
        return absl::OkStatus();
      })
      .IgnoreError();
  return offset;
}

// The serving side of a peer process (tests, bench): registers `memory`,
// prints "SERVE <worker address hex> <rkey hex> <base>" on stdout and serves
// until stdin closes. Returns the registration error, if any.
inline absl::Status ServeUntilStdinCloses(UcxContext& context, const UcxWorker& worker,
                                          std::vector<char>& memory) {
  auto region = context.Register(memory.data(), memory.size());
  if (!region.ok()) return region.status();
  std::printf("SERVE %s %s %llu\n", absl::BytesToHexString(worker.address()).c_str(),
              absl::BytesToHexString((*region)->packed_rkey()).c_str(),
              static_cast<unsigned long long>((*region)->address()));
  std::fflush(stdout);
  char c;
  while (read(0, &c, 1) > 0) {
  }
  return absl::OkStatus();
}

}  // namespace kvdepot::ucx_test

#endif  // KVDEPOT_TRANSPORT_UCX_TEST_UTIL_H_
