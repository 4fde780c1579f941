#include "server/logging.h"

#include <spdlog/details/log_msg.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvdepot {
namespace {

// %j: the message as the inside of a JSON string.
class JsonMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    for (char c : msg.payload) {
      switch (c) {
        case '"': dest.append(std::string_view("\\\"")); break;
        case '\\': dest.append(std::string_view("\\\\")); break;
        case '\n': dest.append(std::string_view("\\n")); break;
        case '\r': dest.append(std::string_view("\\r")); break;
        case '\t': dest.append(std::string_view("\\t")); break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            std::string esc = absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
            dest.append(std::string_view(esc));
          } else {
            dest.push_back(c);
          }
      }
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonMessageFlag>();
  }
};

// Appends to a file; Reopen closes it and opens the path again.
class ReopenableFileSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit ReopenableFileSink(std::string path) : path_(std::move(path)) {}
  ~ReopenableFileSink() override {
    if (file_ != nullptr) std::fclose(file_);
  }

  bool Open() {
    std::lock_guard<std::mutex> lock(mutex_);
    return OpenLocked();
  }
  // The new file replaces the old one only once it is open: on failure,
  // lines keep going to the old file (moved away, but still written).
  absl::Status Reopen() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::FILE* file = std::fopen(path_.c_str(), "ae");
    if (file == nullptr) {
      return absl::PermissionDeniedError(absl::StrCat(
          "cannot reopen log file ", path_, ": ", std::strerror(errno),
          "; still writing to the file it had open"));
    }
    if (file_ != nullptr) std::fclose(file_);
    file_ = file;
    return absl::OkStatus();
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    if (file_ == nullptr) return;
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    std::fwrite(formatted.data(), 1, formatted.size(), file_);
  }
  void flush_() override {
    if (file_ != nullptr) std::fflush(file_);
  }

 private:
  bool OpenLocked() {
    file_ = std::fopen(path_.c_str(), "ae");
    return file_ != nullptr;
  }

  const std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace

absl::StatusOr<Logger> MakeLogger(const std::string& name, const LogOptions& options) {
  spdlog::level::level_enum level = spdlog::level::from_str(options.level);
  if (level == spdlog::level::off && options.level != "off") {
    return absl::InvalidArgumentError(absl::StrCat("unknown log level '", options.level, "'"));
  }
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  if (options.format == "json") {
    formatter->add_flag<JsonMessageFlag>('j').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%e%z","level":"%l","logger":"%n","msg":"%j"})");
  } else if (options.format == "text") {
    formatter->set_pattern(options.file.empty() ? "%Y-%m-%dT%H:%M:%S.%e%z %^%l%$ %v"
                                                : "%Y-%m-%dT%H:%M:%S.%e%z %l %v");
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("log_format must be text or json, not '", options.format, "'"));
  }
  Logger out;
  if (options.file.empty()) {
    auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    sink->set_formatter(std::move(formatter));
    out.logger = std::make_shared<spdlog::logger>(name, std::move(sink));
    out.reopen = [] { return absl::OkStatus(); };
  } else {
    auto sink = std::make_shared<ReopenableFileSink>(options.file);
    if (!sink->Open()) {
      return absl::PermissionDeniedError(absl::StrCat(
          "cannot open log file ", options.file, ": ", std::strerror(errno)));
    }
    sink->set_formatter(std::move(formatter));
    out.logger = std::make_shared<spdlog::logger>(name, sink);
    out.reopen = [sink] { return sink->Reopen(); };
  }
  out.logger->set_level(level);
  out.logger->flush_on(spdlog::level::info);
  return out;
}

bool ConditionLog::ShouldLog(absl::string_view message, absl::Time now) {
  std::string shape;
  shape.reserve(message.size());
  for (char c : message) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) shape.push_back(c);
  }
  const bool holds = !message.empty();
  if (shape != shape_ || (holds && now - logged_ >= remind_)) {
    shape_ = std::move(shape);
    logged_ = now;
    return true;
  }
  return false;
}

bool LogLimiter::Allow(absl::string_view site, uint64_t* left_out,
                       absl::Time now) {
  absl::MutexLock lock(&mu_);
  Site& s = sites_[std::string(site)];
  if (now - s.window_start >= window_) {
    s.window_start = now;
    s.logged = 0;
  }
  if (s.logged >= burst_) {
    ++s.left_out;
    return false;
  }
  ++s.logged;
  *left_out = std::exchange(s.left_out, 0);
  return true;
}

std::vector<std::pair<std::string, uint64_t>> LogLimiter::TakeLeftOut(
    absl::Time now) {
  std::vector<std::pair<std::string, uint64_t>> out;
  absl::MutexLock lock(&mu_);
  for (auto& [site, s] : sites_) {
    if (s.left_out == 0 || now - s.window_start < window_) continue;
    out.emplace_back(site, std::exchange(s.left_out, 0));
  }
  return out;
}

std::string LeftOutNote(uint64_t left_out) {
  if (left_out == 0) return std::string();
  return absl::StrCat(" (", left_out, " more like it left out)");
}

}  // namespace kvdepot
