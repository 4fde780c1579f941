#include "server/status_page.h"

#include <prometheus/text_serializer.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "server/status_page_html.h"
#include "server/version.h"

namespace kvdepot {
namespace {

using Buckets = std::vector<prometheus::ClientMetric::Bucket>;

// A minimal JSON writer: commas and escaping, nothing else. Keys and values
// alternate as the caller writes them.
class JsonWriter {
 public:
  JsonWriter& Open(char bracket) {
    Separate();
    out_ += bracket;
    first_ = true;
    return *this;
  }
  JsonWriter& Close(char bracket) {
    out_ += bracket;
    first_ = false;
    return *this;
  }
  JsonWriter& Key(absl::string_view key) {
    Str(key);
    out_ += ':';
    first_ = true;  // the value needs no comma
    return *this;
  }
  JsonWriter& Str(absl::string_view s) {
    Separate();
    out_ += '"';
    for (char c : s) {
      const auto u = static_cast<unsigned char>(c);
      if (c == '"' || c == '\\') {
        out_ += '\\';
        out_ += c;
      } else if (u < 0x20 || c == '<' || c == '>' || c == '&') {
        // <, > and & too, so the text stays inert even inside HTML.
        absl::StrAppendFormat(&out_, "\\u%04x", u);
      } else {
        out_ += c;
      }
    }
    out_ += '"';
    return *this;
  }
  JsonWriter& Null() {
    Separate();
    out_ += "null";
    return *this;
  }
  JsonWriter& Bool(bool v) {
    Separate();
    out_ += v ? "true" : "false";
    return *this;
  }
  JsonWriter& Int(uint64_t v) {
    Separate();
    absl::StrAppend(&out_, v);
    return *this;
  }
  // Six significant digits, or a whole number from a million up; null when
  // not finite.
  JsonWriter& Num(double v) {
    if (!std::isfinite(v)) return Null();
    Separate();
    if (std::abs(v) < 1e6) {
      absl::StrAppendFormat(&out_, "%.6g", v);
    } else {
      absl::StrAppendFormat(&out_, "%.0f", v);
    }
    return *this;
  }
  JsonWriter& Num(std::optional<double> v) { return Num(v.value_or(NAN)); }
  std::string Take() { return std::move(out_); }

 private:
  void Separate() {
    if (!first_) out_ += ',';
    first_ = false;
  }
  std::string out_;
  bool first_ = true;
};

std::optional<double> Ratio(double part, double whole) {
  if (whole <= 0) return std::nullopt;
  return std::clamp(part / whole, 0.0, 1.0);
}

const std::string* Label(const prometheus::ClientMetric& m,
                         absl::string_view name) {
  for (const auto& l : m.label) {
    if (l.name == name) return &l.value;
  }
  return nullptr;
}

}  // namespace

StatusSample SampleMetrics(
    const std::vector<prometheus::MetricFamily>& families, absl::Time time) {
  StatusSample s;
  s.time = time;
  auto sum = [](const prometheus::MetricFamily& f, absl::string_view label,
                absl::string_view value) {
    double total = 0;
    for (const prometheus::ClientMetric& m : f.metric) {
      const std::string* v = label.empty() ? nullptr : Label(m, label);
      if (!label.empty() && (v == nullptr || *v != value)) continue;
      total += m.counter.value;
    }
    return total;
  };
  for (const prometheus::MetricFamily& f : families) {
    if (f.name == "kvdepot_lookup_keys_total") {
      s.lookup_keys = sum(f, "", "");
      s.lookup_hits = sum(f, "result", "hit");
    } else if (f.name == "kvdepot_lookup_prefix_keys_asked_total") {
      s.prefix_keys = sum(f, "", "");
    } else if (f.name == "kvdepot_lookup_prefix_hit_keys_total") {
      s.prefix_hits = sum(f, "", "");
    } else if (f.name == "kvdepot_bytes_total") {
      s.bytes_in = sum(f, "direction", "in");
      s.bytes_out = sum(f, "direction", "out");
    } else if (f.name == "kvdepot_requests_total") {
      s.requests = sum(f, "", "");
    } else if (f.name == "kvdepot_integrity_errors_total") {
      s.integrity_errors = sum(f, "", "");
    } else if (f.name == "kvdepot_request_duration_seconds") {
      for (const prometheus::ClientMetric& m : f.metric) {
        if (const std::string* op = Label(m, "op"))
          s.latency[*op] = m.histogram.bucket;
      }
    }
  }
  return s;
}

double CounterRate(double from, double to, absl::Duration span) {
  const double seconds = absl::ToDoubleSeconds(span);
  if (seconds <= 0 || to <= from) return 0;
  return (to - from) / seconds;
}

std::optional<double> HistogramQuantile(double q, const Buckets& from,
                                        const Buckets& to) {
  if (to.empty() || (!from.empty() && from.size() != to.size()))
    return std::nullopt;
  auto delta = [&](size_t i) -> double {
    const uint64_t before = from.empty() ? 0 : from[i].cumulative_count;
    return to[i].cumulative_count > before
               ? static_cast<double>(to[i].cumulative_count - before)
               : 0;
  };
  const double total = delta(to.size() - 1);
  if (total <= 0) return std::nullopt;
  const double rank = q * total;
  double below = 0;  // observations in the buckets before i
  for (size_t i = 0; i < to.size(); ++i) {
    const double upto = std::max(delta(i), below);  // through bucket i
    if (upto < rank) {
      below = upto;
      continue;
    }
    if (std::isinf(to[i].upper_bound)) {
      if (i == 0) return std::nullopt;
      return to[i - 1].upper_bound;
    }
    // below < rank <= upto, so the bucket is not empty.
    const double lower = i == 0 ? 0 : to[i - 1].upper_bound;
    return lower +
           (to[i].upper_bound - lower) * (rank - below) / (upto - below);
  }
  return std::nullopt;  // unreachable: the +Inf bucket holds `total`
}

SampleRing::SampleRing(size_t capacity)
    : ring_(std::max<size_t>(capacity, 1)) {}

void SampleRing::Push(StatusSample sample) {
  ring_[next_] = std::move(sample);
  next_ = (next_ + 1) % ring_.size();
  size_ = std::min(size_ + 1, ring_.size());
}

const StatusSample& SampleRing::At(size_t i) const {
  return ring_[(next_ + ring_.size() - size_ + i) % ring_.size()];
}

const StatusSample& SampleRing::Latest() const { return At(size_ - 1); }

const StatusSample& SampleRing::WindowStart(absl::Duration window) const {
  const absl::Time earliest = Latest().time - window;
  for (size_t i = 0; i + 1 < size_; ++i) {
    if (At(i).time >= earliest) return At(i);
  }
  return Latest();
}

StatusPage::StatusPage(Sources sources, const Clock& clock,
                       absl::Duration sample_period)
    : sources_(std::move(sources)),
      clock_(clock),
      period_(sample_period),
      start_(clock.Now()),
      ring_(static_cast<size_t>(kWindow / sample_period) + 1) {
  TakeSample();
}

StatusPage::~StatusPage() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (sampler_.joinable()) sampler_.join();
}

void StatusPage::StartSampler() {
  sampler_ = std::thread([this] { SamplerLoop(); });
}

void StatusPage::SamplerLoop() {
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), period_)) {
    mu_.Unlock();
    TakeSample();
    mu_.Lock();
  }
}

void StatusPage::TakeSample() {
  // The sources take their own locks; read them outside ours.
  StoreStats store = sources_.store_stats();
  StatusSample s = SampleMetrics(sources_.metrics(), clock_.Now());
  s.demotions = store.demotions;
  s.promotions = store.promotions;

  absl::MutexLock lock(&mu_);
  const double before = ring_.size() > 0 ? ring_.Latest().integrity_errors : 0;
  if (s.integrity_errors > before) {
    errors_.emplace_back(s.time,
                         static_cast<uint64_t>(s.integrity_errors - before));
    last_error_ = s.time;
  }
  while (!errors_.empty() && errors_.front().first <= s.time - kErrorWindow) {
    errors_.pop_front();
  }
  store_ = std::move(store);
  ring_.Push(std::move(s));
}

// /status.json:
//   health            "SERVING"; "NOT_SERVING" before gRPC is up, and
//                     while draining to stop
//   accepting_puts    false while an admin drain (kvdepotctl drain) holds
//   version, commit   of this build; uptime_seconds
//   window_seconds    what the "last minute" figures span (less at start)
//   tiers.{dram,nvme} used_bytes, capacity_bytes, blocks
//   hit_ratio, prefix_hit_ratio   {last_minute, since_start}: keys found /
//                     keys looked up (prefix: leading keys found / keys asked
//                     by prefix lookups); null with no lookups
//   lookup_keys       {last_minute, since_start}
//   throughput        bytes_in/bytes_out/requests _per_second, last minute
//   totals            bytes_in, bytes_out, requests since start
//   latency           [{op, requests, p50_seconds, p99_seconds}], last
//                     minute; null percentiles for an op with no requests
//   namespaces        count, top: [{name, blocks, bytes, lookups, hits}]
//                     (kTopNamespaces, by lookups, then bytes; the store's
//                     counts, where a Read's keys count as looked up, as
//                     they do in the lookup metrics)
//   sessions, pins, pinned_blocks, reservations
//   integrity_errors  total, last_hour, last_unix_seconds (null: none yet)
//   demotions, promotions   {total, per_second (last minute)}
std::string StatusPage::Json() {
  const bool serving = sources_.serving();
  const absl::Time now = clock_.Now();
  absl::MutexLock lock(&mu_);
  const StatusSample& last = ring_.Latest();
  const StatusSample& first = ring_.WindowStart(kWindow);
  const absl::Duration span = last.time - first.time;
  const StoreStats& st = store_;

  JsonWriter w;
  w.Open('{');
  w.Key("health").Str(serving ? "SERVING" : "NOT_SERVING");
  w.Key("accepting_puts").Bool(!st.draining);
  w.Key("version").Str(kVersion);
  w.Key("commit").Str(kGitCommit);
  w.Key("uptime_seconds")
      .Int(static_cast<uint64_t>(
          absl::ToInt64Seconds(std::max(now - start_, absl::ZeroDuration()))));
  w.Key("window_seconds")
      .Int(static_cast<uint64_t>(std::llround(absl::ToDoubleSeconds(span))));

  w.Key("tiers").Open('{');
  for (const auto& [name, tier] :
       {std::pair{"dram", &st.dram}, std::pair{"nvme", &st.nvme}}) {
    w.Key(name).Open('{');
    w.Key("used_bytes").Int(tier->used_bytes);
    w.Key("capacity_bytes").Int(tier->capacity_bytes);
    w.Key("blocks").Int(tier->blocks);
    w.Close('}');
  }
  w.Close('}');

  auto ratio = [&](const char* key, double StatusSample::*part,
                   double StatusSample::*whole) {
    w.Key(key).Open('{');
    w.Key("last_minute")
        .Num(Ratio(last.*part - first.*part, last.*whole - first.*whole));
    w.Key("since_start").Num(Ratio(last.*part, last.*whole));
    w.Close('}');
  };
  ratio("hit_ratio", &StatusSample::lookup_hits, &StatusSample::lookup_keys);
  ratio("prefix_hit_ratio", &StatusSample::prefix_hits,
        &StatusSample::prefix_keys);
  w.Key("lookup_keys").Open('{');
  w.Key("last_minute")
      .Int(static_cast<uint64_t>(
          std::max(0.0, last.lookup_keys - first.lookup_keys)));
  w.Key("since_start").Int(static_cast<uint64_t>(last.lookup_keys));
  w.Close('}');

  w.Key("throughput").Open('{');
  w.Key("bytes_in_per_second")
      .Num(CounterRate(first.bytes_in, last.bytes_in, span));
  w.Key("bytes_out_per_second")
      .Num(CounterRate(first.bytes_out, last.bytes_out, span));
  w.Key("requests_per_second")
      .Num(CounterRate(first.requests, last.requests, span));
  w.Close('}');
  w.Key("totals").Open('{');
  w.Key("bytes_in").Int(static_cast<uint64_t>(last.bytes_in));
  w.Key("bytes_out").Int(static_cast<uint64_t>(last.bytes_out));
  w.Key("requests").Int(static_cast<uint64_t>(last.requests));
  w.Close('}');

  w.Key("latency").Open('[');
  static const Buckets kNone;
  for (const auto& [op, buckets] : last.latency) {
    auto it = first.latency.find(op);
    const Buckets& before = it == first.latency.end() ? kNone : it->second;
    const uint64_t total =
        buckets.empty() ? 0 : buckets.back().cumulative_count;
    const uint64_t old = before.empty() ? 0 : before.back().cumulative_count;
    w.Open('{');
    w.Key("op").Str(op);
    w.Key("requests").Int(total > old ? total - old : 0);
    w.Key("p50_seconds").Num(HistogramQuantile(0.5, before, buckets));
    w.Key("p99_seconds").Num(HistogramQuantile(0.99, before, buckets));
    w.Close('}');
  }
  w.Close(']');

  std::vector<const NamespaceStats*> top;
  for (const NamespaceStats& ns : st.namespaces) top.push_back(&ns);
  const size_t n = std::min(top.size(), kTopNamespaces);
  std::partial_sort(top.begin(), top.begin() + n, top.end(),
                    [](const NamespaceStats* a, const NamespaceStats* b) {
                      return std::tie(b->lookups, b->bytes, a->name) <
                             std::tie(a->lookups, a->bytes, b->name);
                    });
  w.Key("namespaces").Open('{');
  w.Key("count").Int(st.namespaces.size());
  w.Key("top").Open('[');
  for (size_t i = 0; i < n; ++i) {
    w.Open('{');
    w.Key("name").Str(top[i]->name);
    w.Key("blocks").Int(top[i]->blocks);
    w.Key("bytes").Int(top[i]->bytes);
    w.Key("lookups").Int(top[i]->lookups);
    w.Key("hits").Int(top[i]->hits);
    w.Close('}');
  }
  w.Close(']').Close('}');

  w.Key("sessions").Int(st.sessions);
  w.Key("pins").Int(st.pins);
  w.Key("pinned_blocks").Int(st.pinned_blocks);
  w.Key("reservations").Int(st.reservations);

  uint64_t last_hour = 0;
  for (const auto& [time, count] : errors_) {
    if (time > last.time - kErrorWindow) last_hour += count;
  }
  w.Key("integrity_errors").Open('{');
  w.Key("total").Int(static_cast<uint64_t>(last.integrity_errors));
  w.Key("last_hour").Int(last_hour);
  w.Key("last_unix_seconds");
  if (last_error_) {
    w.Int(static_cast<uint64_t>(absl::ToUnixSeconds(*last_error_)));
  } else {
    w.Null();
  }
  w.Close('}');

  auto moves = [&](const char* key, uint64_t StatusSample::*field) {
    w.Key(key).Open('{');
    w.Key("total").Int(last.*field);
    w.Key("per_second")
        .Num(CounterRate(static_cast<double>(first.*field),
                         static_cast<double>(last.*field), span));
    w.Close('}');
  };
  moves("demotions", &StatusSample::demotions);
  moves("promotions", &StatusSample::promotions);
  w.Close('}');
  return w.Take();
}

const char* StatusPage::Html() { return kStatusPageHtml; }

absl::flat_hash_map<std::string, HttpHandler> MetricsPortRoutes(
    prometheus::Registry& registry, StatusPage& page) {
  // The page's script is inline; nothing else may load from anywhere.
  static constexpr char kPagePolicy[] =
      "default-src 'none'; script-src 'unsafe-inline'; style-src "
      "'unsafe-inline'; "
      "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
      "form-action 'none'";
  return {
      {"/metrics",
       [&registry] {
         return HttpResponse{
             200, "text/plain; version=0.0.4; charset=utf-8",
             prometheus::TextSerializer().Serialize(registry.Collect())};
       }},
      {"/status.json",
       [&page] {
         return HttpResponse{200, "application/json", page.Json()};
       }},
      {"/",
       [] {
         return HttpResponse{200,
                             "text/html; charset=utf-8",
                             StatusPage::Html(),
                             {{"Content-Security-Policy", kPagePolicy}}};
       }},
  };
}

}  // namespace kvdepot
