// The status page of a real kvdepotd under traffic: /status.json agrees with
// what the test did (blocks, namespaces, hit ratios, latency, pins), the
// metrics port answers only GET/HEAD of its paths, health turns NOT_SERVING
// while the daemon drains, and headless Chromium renders the page with the
// live numbers (DOM dump, and a screenshot saved to $KVDEPOT_TEST_OUTPUT_DIR
// or the test's temp dir). The browser part is skipped when Chromium is not
// installed (apt-get install chromium).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "tests/daemon_process.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using testing::CommandResult;
using testing::DaemonProcess;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::RunCommand;

constexpr size_t kBlockBytes = 32 << 10;

// What the traffic should show, from the client's replies.
struct Expected {
  uint64_t blocks = 0;
  std::map<std::string, uint64_t> blocks_by_namespace;
  double keys = 0, hits = 0, prefix_keys = 0, prefix_hits = 0;
  int lookups = 0;  // Lookup RPCs
};

// Puts chains in three namespaces, then lookups with hits and misses (plain,
// prefix, one pinned), and one read.
Expected GenerateTraffic(Client& client) {
  Expected e;
  const std::string bytes(kBlockBytes, 's');
  const std::vector<std::pair<std::string, int>> chains = {
      {"llama3-8b/bf16/tp0", 6},
      {"qwen2-7b/fp8/tp1", 3},
      {"mistral-7b/bf16/tp0", 2}};
  std::map<std::string, std::vector<std::string>> keys;
  for (const auto& [ns, n] : chains) {
    std::vector<BlockToPut> puts;
    for (int i = 0; i < n; ++i) keys[ns].push_back(absl::StrCat(ns, "#", i));
    for (int i = 0; i < n; ++i) {
      puts.push_back({keys[ns][i], i == 0 ? "" : absl::string_view(keys[ns][i - 1]), bytes});
    }
    EXPECT_OK(client.Put(ns, puts));
    e.blocks += n;
    e.blocks_by_namespace[ns] = n;
  }
  auto lookup = [&](const std::string& ns, std::vector<std::string> asked,
                    bool prefix, bool pin) {
    std::vector<absl::string_view> views(asked.begin(), asked.end());
    auto r = client.Lookup(ns, views, prefix, pin);
    ASSERT_OK(r);
    ++e.lookups;
    e.keys += r->entries.size();
    for (const BlockInfo& b : r->entries) e.hits += b.found;
    if (prefix) {
      e.prefix_keys += r->entries.size();
      e.prefix_hits += r->prefix_hits;
    }
  };
  std::vector<std::string> llama = keys["llama3-8b/bf16/tp0"];
  llama.push_back("llama-missing-1");
  llama.push_back("llama-missing-2");
  lookup("llama3-8b/bf16/tp0", llama, /*prefix=*/true, /*pin=*/false);
  lookup("qwen2-7b/fp8/tp1", {keys["qwen2-7b/fp8/tp1"][0], "qwen-missing"},
         true, false);
  lookup("mistral-7b/bf16/tp0", {"m-missing", keys["mistral-7b/bf16/tp0"][1]},
         false, false);
  lookup("qwen2-7b/fp8/tp1", keys["qwen2-7b/fp8/tp1"], false, /*pin=*/true);
  absl::string_view first = keys["llama3-8b/bf16/tp0"][0];
  EXPECT_OK(client.Get("llama3-8b/bf16/tp0", {&first, 1}));
  // A Read's keys are looked up too (a hit here).
  e.keys += 1;
  e.hits += 1;
  return e;
}

// /status.json flattened by Python's json module (which also checks that it
// parses): "tiers.dram.blocks" -> "11", "health" -> "\"SERVING\"".
std::map<std::string, std::string> FetchStatus(const DaemonProcess& d) {
  const std::string dir = testing::MakeTempDir("status-json");
  CommandResult fetch = RunCommand(
      absl::StrCat("curl -sf --max-time 10 -o ", dir, "/status.json http://",
                   d.metrics_address(), "/status.json"));
  EXPECT_EQ(fetch.exit_code, 0) << fetch.err;
  std::ofstream(dir + "/flatten.py") << R"(import json, sys
def walk(path, v):
    if isinstance(v, dict):
        for k, x in v.items(): walk(path + [k], x)
    elif isinstance(v, list):
        for i, x in enumerate(v): walk(path + [str(i)], x)
    else:
        print(".".join(path) + "=" + json.dumps(v))
walk([], json.load(open(sys.argv[1])))
)";
  CommandResult flat = RunCommand(absl::StrCat(
      "/usr/bin/python3 ", dir, "/flatten.py ", dir, "/status.json"));
  EXPECT_EQ(flat.exit_code, 0) << flat.err;
  std::map<std::string, std::string> fields;
  for (absl::string_view line :
       absl::StrSplit(flat.out, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv =
        absl::StrSplit(line, absl::MaxSplits('=', 1));
    fields.insert(kv);
  }
  return fields;
}

double Number(const std::map<std::string, std::string>& fields,
              const std::string& key) {
  double v = -1;
  auto it = fields.find(key);
  EXPECT_TRUE(it != fields.end() && absl::SimpleAtod(it->second, &v))
      << key << " is not a number";
  return v;
}

// Polls until the sampler (once a second) has seen the whole traffic.
std::map<std::string, std::string> StatusAfter(const DaemonProcess& d,
                                               const Expected& e) {
  std::map<std::string, std::string> fields;
  for (int i = 0; i < 100; ++i) {
    fields = FetchStatus(d);
    if (fields["tiers.dram.blocks"] == absl::StrCat(e.blocks) &&
        fields["lookup_keys.since_start"] == absl::StrCat(e.keys) &&
        fields["pins"] == "1") {
      break;
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  return fields;
}

// The index i of the array entry whose `field` is `value`, e.g.
// Find(f, "latency", "op", "\"Lookup\"") -> "latency.2"; "" if none.
std::string Find(const std::map<std::string, std::string>& fields,
                 const std::string& array, const std::string& field,
                 const std::string& value) {
  for (int i = 0;; ++i) {
    auto it = fields.find(absl::StrCat(array, ".", i, ".", field));
    if (it == fields.end()) return "";
    if (it->second == value) return absl::StrCat(array, ".", i);
  }
}

class StatusPageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = DaemonProcess::Start(
        {"--dram-capacity", "64MiB", "--nvme-capacity", "0"});
    ASSERT_OK(d);
    daemon_ = std::move(*d);
    ClientOptions o;
    o.server = daemon_->address();
    client_ = std::move(Client::Connect(o)).value();
    expected_ = GenerateTraffic(*client_);
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
  Expected expected_;
};

TEST_F(StatusPageTest, StatusJsonAgreesWithTheTraffic) {
  const Expected& e = expected_;
  ASSERT_GT(e.hits, 0);
  ASSERT_LT(e.hits, e.keys);
  auto f = StatusAfter(*daemon_, e);
  EXPECT_EQ(f["health"], "\"SERVING\"");
  EXPECT_NE(f["version"], "\"\"");
  EXPECT_NE(f["commit"], "\"\"");
  EXPECT_GE(Number(f, "uptime_seconds"), 0);

  EXPECT_EQ(Number(f, "tiers.dram.blocks"), e.blocks);
  EXPECT_GE(Number(f, "tiers.dram.used_bytes"), e.blocks * kBlockBytes);
  EXPECT_EQ(Number(f, "tiers.dram.capacity_bytes"), 64 << 20);
  EXPECT_EQ(Number(f, "tiers.nvme.capacity_bytes"), 0);

  EXPECT_EQ(Number(f, "namespaces.count"), 3);
  for (const auto& [ns, blocks] : e.blocks_by_namespace) {
    std::string row =
        Find(f, "namespaces.top", "name", absl::StrCat("\"", ns, "\""));
    ASSERT_NE(row, "") << ns;
    EXPECT_EQ(Number(f, row + ".blocks"), blocks) << ns;
    EXPECT_EQ(Number(f, row + ".bytes"), blocks * kBlockBytes) << ns;
  }
  // The most looked-up namespace comes first.
  EXPECT_EQ(f["namespaces.top.0.name"], "\"llama3-8b/bf16/tp0\"");

  // Six significant digits.
  const double hit_ratio = e.hits / e.keys,
               prefix_ratio = e.prefix_hits / e.prefix_keys;
  EXPECT_NEAR(Number(f, "hit_ratio.since_start"), hit_ratio, 1e-5);
  EXPECT_NEAR(Number(f, "hit_ratio.last_minute"), hit_ratio, 1e-5);
  EXPECT_NEAR(Number(f, "prefix_hit_ratio.since_start"), prefix_ratio, 1e-5);
  EXPECT_NEAR(Number(f, "prefix_hit_ratio.last_minute"), prefix_ratio, 1e-5);
  EXPECT_EQ(Number(f, "lookup_keys.last_minute"), e.keys);

  std::string lookup = Find(f, "latency", "op", "\"Lookup\"");
  ASSERT_NE(lookup, "") << "no Lookup latency";
  EXPECT_EQ(Number(f, lookup + ".requests"), e.lookups);
  EXPECT_GT(Number(f, lookup + ".p50_seconds"), 0);
  EXPECT_GE(Number(f, lookup + ".p99_seconds"),
            Number(f, lookup + ".p50_seconds"));
  EXPECT_NE(Find(f, "latency", "op", "\"Write\""), "");

  EXPECT_GE(Number(f, "totals.bytes_in"), e.blocks * kBlockBytes);
  EXPECT_GE(Number(f, "totals.bytes_out"), kBlockBytes);
  EXPECT_GE(Number(f, "totals.requests"), e.lookups + 4);  // + 3 Writes, 1 Read
  EXPECT_GT(Number(f, "throughput.requests_per_second"), 0);
  EXPECT_GT(Number(f, "throughput.bytes_in_per_second"), 0);

  EXPECT_EQ(Number(f, "sessions"), 1);
  EXPECT_EQ(Number(f, "pins"), 1);
  EXPECT_EQ(Number(f, "pinned_blocks"), 3);
  EXPECT_EQ(Number(f, "reservations"), 0);
  EXPECT_EQ(Number(f, "integrity_errors.total"), 0);
  EXPECT_EQ(Number(f, "integrity_errors.last_hour"), 0);
  EXPECT_EQ(f["integrity_errors.last_unix_seconds"], "null");
  EXPECT_EQ(Number(f, "demotions.total"), 0);
}

TEST_F(StatusPageTest, MetricsPortServesOnlyGetAndHeadOfItsPaths) {
  // "CODE CONTENT-TYPE" of one request.
  auto status = [&](const std::string& path, const std::string& flags = "") {
    CommandResult r = RunCommand(absl::StrCat(
        "curl -s --max-time 10 -o /dev/null -w '%{http_code} %{content_type}' ",
        flags, " http://", daemon_->metrics_address(), path));
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.out;
  };
  EXPECT_EQ(status("/"), "200 text/html; charset=utf-8");
  EXPECT_EQ(status("/", "-I"), "200 text/html; charset=utf-8");
  EXPECT_EQ(status("/status.json"), "200 application/json");
  EXPECT_EQ(status("/metrics"), "200 text/plain; version=0.0.4; charset=utf-8");
  EXPECT_THAT(status("/metrics", "-X POST"), ::testing::StartsWith("405 "));
  EXPECT_THAT(status("/status.json", "-X PUT"), ::testing::StartsWith("405 "));
  EXPECT_THAT(status("/nope"), ::testing::StartsWith("404 "));
  EXPECT_THAT(status("/metrics/extra"), ::testing::StartsWith("404 "));
  // Prometheus asks for gzip.
  CommandResult gz =
      RunCommand(absl::StrCat("curl -sf --max-time 10 --compressed http://",
                              daemon_->metrics_address(), "/metrics"));
  EXPECT_THAT(gz.out,
              HasSubstr("kvdepot_requests_total{code=\"OK\",op=\"Lookup\"} "));
}

TEST_F(StatusPageTest, HealthIsNotServingWhileDraining) {
  // A half-written block keeps the daemon draining after SIGTERM.
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = client_->stub().Write(&ctx, &resp);
  v1::WriteRequest msg;
  msg.mutable_header()->set_namespace_("drain");
  msg.mutable_header()->set_key("in-flight");
  msg.mutable_header()->set_size(2 << 20);
  msg.set_data(std::string(1 << 20, 'd'));
  ASSERT_TRUE(writer->Write(msg));
  auto f = StatusAfter(*daemon_, expected_);
  for (int i = 0; i < 100 && f["reservations"] != "1"; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    f = FetchStatus(*daemon_);
  }
  ASSERT_EQ(f["reservations"], "1");
  EXPECT_EQ(f["health"], "\"SERVING\"");
  EXPECT_EQ(f["accepting_puts"], "true");

  // An admin drain keeps serving reads, and the page says puts are off.
  {
    grpc::ClientContext admin;
    admin.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::SetDrainingRequest req;
    req.set_draining(true);
    v1::SetDrainingResponse r;
    ASSERT_TRUE(client_->stub().SetDraining(&admin, req, &r).ok());
  }
  for (int i = 0; i < 100 && f["accepting_puts"] != "false"; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    f = FetchStatus(*daemon_);
  }
  EXPECT_EQ(f["accepting_puts"], "false");
  EXPECT_EQ(f["health"], "\"SERVING\"");

  ::kill(daemon_->pid(), SIGTERM);
  for (int i = 0; i < 100 && f["health"] != "\"NOT_SERVING\""; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    f = FetchStatus(*daemon_);
  }
  EXPECT_EQ(f["health"], "\"NOT_SERVING\"");
  EXPECT_EQ(Number(f, "tiers.dram.blocks"),
            expected_.blocks);  // still answering
  ctx.TryCancel();
  auto rc = daemon_->Stop(SIGTERM, absl::Seconds(15));
  ASSERT_OK(rc);
  EXPECT_EQ(*rc, 0);
}

// Where screenshots go: $KVDEPOT_TEST_OUTPUT_DIR, else the test's temp dir.
std::string OutputDir() {
  const char* dir = std::getenv("KVDEPOT_TEST_OUTPUT_DIR");
  std::string out = dir != nullptr && *dir != '\0' ? dir : ::testing::TempDir();
  std::filesystem::create_directories(out);
  return out;
}

// Runs headless Chromium on `url` with `args`, killed after 60 s. Its
// console messages (JS errors, CSP violations) go to stderr as ":CONSOLE".
// With `virtual_time` it runs the page's timers for 5 s of virtual time
// before acting (a fetch that never ends stalls that clock: without it,
// --dump-dom dumps at the load event, in real time).
CommandResult Chromium(const std::string& binary, const std::string& url,
                       const std::string& args, bool virtual_time = true) {
  return RunCommand(absl::StrCat("timeout -k 5 60 ", binary,
                                 " --headless=new --no-sandbox --disable-gpu "
                                 "--no-first-run --hide-scrollbars"
                                 " --enable-logging=stderr --v=0 ",
                                 virtual_time ? "--virtual-time-budget=5000 " : "",
                                 "--user-data-dir=", testing::MakeTempDir("chromium"),
                                 " ", args, " http://", url, "/"));
}

// Serves the status page (index.html in `dir`) the way a daemon that stops
// answering would: "hang" accepts every status.json request and never
// answers; "once" answers the first with dir/status.json and drops the
// connection of every later one. The page's last bytes (</body>) come
// `hold` seconds after the rest, so Chromium's --dump-dom, which waits for
// the load event, sees the page as it is then. Prints its port to
// dir/port.
constexpr char kStallingServer[] = R"(import http.server, os, socketserver, sys, time
root, mode, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
answered = []
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def do_GET(self):
        if self.path.startswith("/status.json"):
            if mode == "hang":
                time.sleep(60)
            elif not answered:
                answered.append(1)
                body = open(os.path.join(root, "status.json"), "rb").read()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            return
        page = open(os.path.join(root, "index.html"), "rb").read()
        cut = page.rindex(b"</body>")
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.end_headers()
        self.wfile.write(page[:cut])
        self.wfile.flush()
        time.sleep(hold)
        self.wfile.write(page[cut:])
    def log_message(self, *args):
        pass
class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
server = Server(("127.0.0.1", 0), Handler)
with open(os.path.join(root, "port.tmp"), "w") as f:
    f.write(str(server.server_address[1]))
os.rename(os.path.join(root, "port.tmp"), os.path.join(root, "port"))
server.serve_forever()
)";

// Whether the rendered page shows `value` (a small count) in the element of
// `field`.
bool Shows(const std::string& html, const std::string& field,
           const std::string& value) {
  return std::regex_search(
      html,
      std::regex(absl::StrCat("data-field=\"", field, "\"[^>]* data-value=\"",
                              value, "\"[^>]*>", value, "<")));
}

// The Chromium the browser checks drive: $KVDEPOT_CHROMIUM, else Debian's.
std::string ChromiumPath() {
  const char* env = std::getenv("KVDEPOT_CHROMIUM");
  return env != nullptr && *env != '\0' ? env : "/usr/bin/chromium";
}

TEST_F(StatusPageTest, BrowserRendersTheLiveNumbers) {
  const std::string chromium = ChromiumPath();
  if (access(chromium.c_str(), X_OK) != 0) {
    GTEST_SKIP() << chromium << " not found: browser check skipped "
                 << "(apt-get install chromium, or set KVDEPOT_CHROMIUM)";
  }
  const Expected& e = expected_;
  auto f = StatusAfter(*daemon_, e);  // the page shows the sampler's numbers
  ASSERT_EQ(Number(f, "tiers.dram.blocks"), e.blocks);

  CommandResult dom =
      Chromium(chromium, daemon_->metrics_address(), "--dump-dom");
  ASSERT_EQ(dom.exit_code, 0) << dom.err;
  const std::string& html = dom.out;
  EXPECT_THAT(dom.err, Not(HasSubstr(":CONSOLE")))
      << "the page logged to the console";
  EXPECT_TRUE(std::regex_search(
      html, std::regex(R"(data-field="health"[^>]*>SERVING<)")))
      << html;
  EXPECT_TRUE(Shows(html, "tiers.dram.blocks", absl::StrCat(e.blocks))) << html;
  for (const auto& [ns, blocks] : e.blocks_by_namespace) {
    EXPECT_THAT(html, HasSubstr(absl::StrCat(
                          "<td data-field=\"namespace.name\">", ns,
                          "</td><td data-field=\"namespace.blocks\">", blocks,
                          "</td>")));
  }
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      html, m,
      std::regex(
          R"re(data-field="hit_ratio.since_start"[^>]* data-value="([0-9.e-]+)")re")))
      << html;
  double shown = 0;
  ASSERT_TRUE(absl::SimpleAtod(m[1].str(), &shown));
  EXPECT_NEAR(shown, e.hits / e.keys, 1e-5);
  EXPECT_THAT(html, HasSubstr("<tr data-op=\"Lookup\">"));
  EXPECT_TRUE(Shows(html, "pins", "1"));
  EXPECT_TRUE(Shows(html, "integrity_errors.last_hour", "0"));
  EXPECT_TRUE(std::regex_search(
      html, std::regex(R"(data-field="updated"[^>]*>updated )")));

  const std::string png =
      (std::filesystem::path(OutputDir()) / "status_page.png").string();
  std::filesystem::remove(png);
  CommandResult shot =
      Chromium(chromium, daemon_->metrics_address(),
               absl::StrCat("--window-size=1280,900 --screenshot=", png));
  ASSERT_EQ(shot.exit_code, 0) << shot.err;
  ASSERT_TRUE(std::filesystem::exists(png)) << shot.err;
  EXPECT_GT(std::filesystem::file_size(png), 10'000u);
  std::cout << "status page screenshot: " << png << std::endl;
  RecordProperty("screenshot", png);
}

// The page of a daemon that stops answering: its poll is aborted after 5 s
// when no answer comes (it stayed pending forever, and no poll came after
// it), and a failed poll turns the health badge UNREACHABLE and greys the
// sections, which keep the last figures received (the badge stayed green).
TEST_F(StatusPageTest, BrowserShowsADaemonThatStopsAnsweringAsUnreachable) {
  const std::string chromium = ChromiumPath();
  if (access(chromium.c_str(), X_OK) != 0) {
    GTEST_SKIP() << chromium << " not found: browser check skipped "
                 << "(apt-get install chromium, or set KVDEPOT_CHROMIUM)";
  }
  const Expected& e = expected_;
  ASSERT_EQ(Number(StatusAfter(*daemon_, e), "tiers.dram.blocks"), e.blocks);
  for (const std::string& mode : std::vector<std::string>{"hang", "once"}) {
    SCOPED_TRACE(mode);
    const std::string dir = testing::MakeTempDir("stalling");
    std::ofstream(dir + "/serve.py") << kStallingServer;
    CommandResult fetch = RunCommand(absl::StrCat(
        "curl -sf --max-time 10 -o ", dir, "/index.html http://", daemon_->metrics_address(),
        "/ && curl -sf --max-time 10 -o ", dir, "/status.json http://",
        daemon_->metrics_address(), "/status.json"));
    ASSERT_EQ(fetch.exit_code, 0) << fetch.err;
    // 9 s: the 5 s timeout and then some, on a loaded machine.
    CommandResult started = RunCommand(absl::StrCat(
        "/usr/bin/python3 ", dir, "/serve.py ", dir, " ", mode, " 9 > ", dir,
        "/serve.log 2>&1 & echo $!"));
    int pid = 0;
    ASSERT_TRUE(absl::SimpleAtoi(absl::StripAsciiWhitespace(started.out), &pid));
    struct Killer {
      int pid;
      ~Killer() { ::kill(pid, SIGKILL); }
    } killer{pid};
    std::string port;
    for (int i = 0; i < 100 && port.empty(); ++i) {
      std::ifstream(dir + "/port") >> port;
      if (port.empty()) absl::SleepFor(absl::Milliseconds(100));
    }
    ASSERT_FALSE(port.empty()) << "the stalling server did not start";

    CommandResult dom = Chromium(chromium, "127.0.0.1:" + port, "--dump-dom",
                                 /*virtual_time=*/false);
    ASSERT_EQ(dom.exit_code, 0) << dom.err;
    const std::string& html = dom.out;
    EXPECT_TRUE(std::regex_search(
        html, std::regex(R"(class="badge bad" data-field="health">UNREACHABLE<)")))
        << html;
    EXPECT_THAT(html, Not(HasSubstr("<section>")));  // every one is stale
    EXPECT_THAT(html, Not(HasSubstr("<section class=\"wide\">")));
    EXPECT_THAT(html, HasSubstr("<section class=\"stale\">"));
    if (mode == "hang") {
      EXPECT_THAT(html, HasSubstr("unreachable (no answer in 5 s), retrying; "
                                  "figures from never<"));
    } else {
      // The figures of the answer it got stay, greyed.
      EXPECT_TRUE(Shows(html, "tiers.dram.blocks", absl::StrCat(e.blocks))) << html;
      EXPECT_TRUE(std::regex_search(
          html, std::regex(R"(data-field="updated"[^>]*>unreachable \([^)]+\), )"
                           R"(retrying; figures from \d)")))
          << html;
    }
  }
}

}  // namespace
}  // namespace kvdepot
