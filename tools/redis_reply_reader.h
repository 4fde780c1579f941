// What redis-load stores in Redis and how it reads Redis's replies back.
// Header-only; used by redis-load (tools/redis_load.cc) and its test.
//
// Keys are redis-benchmark's (`key:` + 12 digits, as `-r` makes them), so
// both clients read the same working set. The value of key i at size S is
// stamped, at its start and at its end, with ValueStamp(i, S) (the end gets
// as much of the stamp as fits after the start's copy); the bytes between
// are a fixed pattern. A GET reply is checked for its length, both stamps
// (so a reply holding another key's value, another size's value, or bytes
// shifted by a framing error is caught) and the CRLF after it; the pattern
// itself is not compared (that would cost a pass over every byte).
#ifndef KVDEPOT_TOOLS_REDIS_REPLY_READER_H_
#define KVDEPOT_TOOLS_REDIS_REPLY_READER_H_

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string>

namespace kvdepot {

// Bytes of the stamp at each end of a value.
inline constexpr size_t kValueStampBytes = 32;

// "key:000000000123": the key redis-benchmark -r writes for index 123.
inline std::string RedisKey(uint64_t index) {
  char key[32];
  std::snprintf(key, sizeof(key), "key:%012llu",
                static_cast<unsigned long long>(index));
  return key;
}

// The 32-byte stamp of key `index`'s value of `size` bytes.
inline std::string ValueStamp(uint64_t index, uint64_t size) {
  char stamp[kValueStampBytes + 1];
  std::snprintf(stamp, sizeof(stamp), "K%012lluS%012llu",
                static_cast<unsigned long long>(index),
                static_cast<unsigned long long>(size));
  std::string s(stamp);
  s.resize(kValueStampBytes, '#');
  return s;
}

// Where the stamps lie in a value of `size` bytes: [0, head) holds the
// stamp's first `head` bytes, [tail, size) its first `size - tail` bytes.
struct StampLayout {
  size_t head;
  size_t tail;
};
inline StampLayout LayoutOf(uint64_t size) {
  const size_t head = static_cast<size_t>(std::min<uint64_t>(size, kValueStampBytes));
  const size_t tail = static_cast<size_t>(
      std::max<uint64_t>(head, size > kValueStampBytes ? size - kValueStampBytes : 0));
  return {head, tail};
}

// The byte at `offset` of every value's pattern (between the stamps).
inline char PatternByte(uint64_t offset) {
  return static_cast<char>('a' + offset % 26);
}

// The whole value of key `index` (for tests and small sizes).
inline std::string MakeValue(uint64_t index, uint64_t size) {
  std::string v(size, '\0');
  for (uint64_t i = 0; i < size; ++i) v[i] = PatternByte(i);
  const std::string stamp = ValueStamp(index, size);
  const StampLayout l = LayoutOf(size);
  std::memcpy(&v[0], stamp.data(), l.head);
  std::memcpy(&v[l.tail], stamp.data(), size - l.tail);
  return v;
}

// ReplyReader parses the stream of RESP replies on one connection, in
// pieces of any size (as recv() returns them), without copying values:
// a GET reply's value is only looked at where its stamps are. For each
// request sent, the caller first calls Expect() (GET: with the key's
// index; SET: any). A reply is good when it is what was asked: `+OK` for a
// SET; for a GET, a bulk string of exactly the value size whose stamps are
// the expected key's. Anything else that is still well-formed RESP (a nil,
// an error, a value of another length or with another stamp) is a bad
// reply, counted and described once in first_bad(); bytes that are not
// RESP where a reply should start are a protocol error: Feed() returns
// false and the connection cannot be read further. Not thread-safe (one
// per connection).
class ReplyReader {
 public:
  enum class Kind { kGet, kSet };

  ReplyReader(Kind kind, uint64_t value_size)
      : kind_(kind), size_(value_size), layout_(LayoutOf(value_size)) {}

  ReplyReader(const ReplyReader&) = delete;
  ReplyReader& operator=(const ReplyReader&) = delete;

  // The next reply is the answer to a request for key `index`.
  void Expect(uint64_t index) { expected_.push_back(index); }

  // Replies awaited (Expect()ed and not yet read completely).
  size_t pending() const { return expected_.size(); }
  uint64_t good() const { return good_; }
  uint64_t bad() const { return bad_; }
  const std::string& first_bad() const { return first_bad_; }
  const std::string& protocol_error() const { return protocol_error_; }

  // Consumes `n` bytes. Returns false on a protocol error (also when more
  // replies arrive than were expected).
  bool Feed(const char* data, size_t n) {
    if (!protocol_error_.empty()) return false;
    while (n > 0) {
      if (state_ == State::kLine) {
        const char* nl = static_cast<const char*>(std::memchr(data, '\n', n));
        const size_t take = nl ? static_cast<size_t>(nl - data) + 1 : n;
        if (line_.size() + take > kMaxLine) return Fail("reply line too long");
        line_.append(data, take);
        data += take;
        n -= take;
        if (nl && !StartReply()) return false;
      } else {
        const size_t take = static_cast<size_t>(std::min<uint64_t>(n, body_left_));
        Capture(data, take);
        data += take;
        n -= take;
        body_left_ -= take;
        if (body_left_ == 0 && !FinishBulk()) return false;
      }
    }
    return true;
  }

 private:
  enum class State { kLine, kBody };
  static constexpr size_t kMaxLine = 4096;

  bool Fail(const std::string& why) {
    protocol_error_ = why;
    return false;
  }

  void Bad(const std::string& why) {
    ++bad_;
    if (first_bad_.empty()) first_bad_ = why;
  }

  // line_ holds one whole line, "\r\n" included.
  bool StartReply() {
    if (line_.size() < 3 || line_[line_.size() - 2] != '\r') {
      return Fail("reply line not ended by CRLF");
    }
    if (expected_.empty()) return Fail("a reply that no request asked for");
    const std::string body = line_.substr(1, line_.size() - 3);
    const char type = line_[0];
    line_.clear();
    if (type == '$') {
      char* end = nullptr;
      const long long len = std::strtoll(body.c_str(), &end, 10);
      if (body.empty() || *end != '\0' || len < -1) return Fail("bad bulk length");
      if (len == -1) {  // nil: the key does not exist
        Bad("GET of " + RedisKey(expected_.front()) + " returned nil");
        expected_.pop_front();
        return true;
      }
      bulk_len_ = static_cast<uint64_t>(len);
      body_left_ = bulk_len_ + 2;
      offset_ = 0;
      captured_.assign(kValueStampBytes * 2 + 2, '\0');
      bulk_layout_ = LayoutOf(bulk_len_);
      state_ = State::kBody;
      return true;
    }
    const uint64_t key = expected_.front();
    expected_.pop_front();
    if (type == '+' && kind_ == Kind::kSet && body == "OK") {
      ++good_;
    } else if (type == '-') {
      Bad("error reply: " + body);
    } else if (type == '+' || type == ':') {
      Bad("unexpected reply " + std::string(1, type) + body + " for " + RedisKey(key));
    } else {
      return Fail("reply of unknown type '" + std::string(1, type) + "'");
    }
    return true;
  }

  // Keeps the bytes of the value's stamps (and its closing CRLF) that lie in
  // [offset_, offset_ + n) of the bulk string: captured_ holds the head
  // stamp at [0, 32) and the tail (from bulk_layout_.tail, CRLF included)
  // at [32, ...).
  void Capture(const char* data, size_t n) {
    const uint64_t begin = offset_, end = offset_ + n;
    offset_ = end;
    const uint64_t head = bulk_layout_.head;
    if (begin < head) {
      const uint64_t e = std::min(end, head);
      std::memcpy(&captured_[begin], data, e - begin);
    }
    const uint64_t tail = bulk_layout_.tail;
    if (end > tail) {
      const uint64_t b = std::max(begin, tail);
      std::memcpy(&captured_[kValueStampBytes + (b - tail)], data + (b - begin), end - b);
    }
  }

  // Returns false on a protocol error.
  bool FinishBulk() {
    state_ = State::kLine;
    const uint64_t key = expected_.front();
    expected_.pop_front();
    const size_t tail_len = bulk_len_ - bulk_layout_.tail;
    if (captured_.compare(kValueStampBytes + tail_len, 2, "\r\n") != 0) {
      return Fail("bulk string not ended by CRLF");
    }
    if (kind_ != Kind::kGet) {
      Bad("a value in reply to SET");
      return true;
    }
    if (bulk_len_ != size_) {
      Bad("GET of " + RedisKey(key) + " returned " + std::to_string(bulk_len_) +
          " bytes, not " + std::to_string(size_));
      return true;
    }
    const std::string stamp = ValueStamp(key, size_);
    if (captured_.compare(0, layout_.head, stamp, 0, layout_.head) != 0 ||
        captured_.compare(kValueStampBytes, tail_len, stamp, 0, tail_len) != 0) {
      Bad("GET of " + RedisKey(key) + " returned a value stamped \"" +
          captured_.substr(0, layout_.head) + "\", not this key's");
      return true;
    }
    ++good_;
    return true;
  }

  const Kind kind_;
  const uint64_t size_;
  const StampLayout layout_;

  std::deque<uint64_t> expected_;
  State state_ = State::kLine;
  std::string line_;          // the reply line read so far
  uint64_t bulk_len_ = 0;     // kBody: the bulk string's length
  StampLayout bulk_layout_{0, 0};
  uint64_t body_left_ = 0;    // kBody: bytes left, CRLF included
  uint64_t offset_ = 0;       // kBody: bytes of the bulk string read so far
  std::string captured_;
  uint64_t good_ = 0;
  uint64_t bad_ = 0;
  std::string first_bad_;
  std::string protocol_error_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_TOOLS_REDIS_REPLY_READER_H_
