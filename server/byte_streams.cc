#include "server/byte_streams.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "storage/block_key.h"
#include "storage/internal/sync_point.h"
#include "storage/status_macros.h"

namespace kvdepot {

// One block in flight on a Write stream. A standalone block owns an internal
// reservation (aborted if the stream ends before the block is complete); a
// reservation-target block holds a SlotHandle of the client's reservation.
struct WriteStream::Block {
  std::string key;
  uint64_t size = 0;
  uint64_t checksum = 0;
  uint64_t filled = 0;
  SessionId session = kInternalSession;  // of a reservation-target block
  ReservationId reservation = 0;         // of a reservation-target block
  bool standalone = false;
  bool discard = false;  // key already stored: consume and drop the bytes
  ReservationId internal_id = 0;
  std::unique_ptr<SlotHandle> slot;  // where the bytes go (unless discard)
};

WriteStream::WriteStream(TieredStore& store, v1::WriteResponse* resp)
    : store_(store), resp_(resp) {}

WriteStream::~WriteStream() { Abort(); }

void WriteStream::Abort() {
  std::unique_ptr<Block> b = std::move(cur_);
  if (b == nullptr) return;
  b->slot.reset();
  if (b->internal_id != 0) {
    store_.AbortPut(kInternalSession, b->internal_id).IgnoreError();
  }
}

absl::Status WriteStream::Start(const v1::WriteHeader& h, bool* would_wait) {
  if (cur_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header for a new block while block ", KeyToHex(cur_->key), " has ",
        cur_->filled, " of ", cur_->size, " bytes"));
  }
  MarkProgress();
  cur_ = std::make_unique<Block>();
  cur_->key = h.key();
  cur_->checksum = h.checksum();
  if (h.reservation_id() != 0) {
    if (h.session_id() == kInternalSession) {
      return absl::NotFoundError("session_id is required (call OpenSession)");
    }
    ASSIGN_OR_RETURN(cur_->slot, store_.AcquireSlot(h.session_id(),
                                                    h.reservation_id(), h.slot()));
    cur_->session = h.session_id();
    cur_->reservation = h.reservation_id();
    cur_->size = cur_->slot->bytes().size();
    if (h.size() != cur_->size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header declares ", h.size(), " bytes but slot ", h.slot(),
          " of reservation ", h.reservation_id(), " holds ", cur_->size));
    }
    // The slot names its block; a header that names another (a client
    // writing the wrong slot) is refused before any byte lands. Key and
    // namespace may be left out; a checksum given is checked at the end.
    cur_->key = cur_->slot->key();
    if (!h.key().empty() && h.key() != cur_->key) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header names block ", KeyToHex(h.key()), " but slot ", h.slot(),
          " of reservation ", h.reservation_id(), " is for block ",
          KeyToHex(cur_->key)));
    }
    if (!h.namespace_().empty()) {
      if (const std::string ns = cur_->slot->ns(); h.namespace_() != ns) {
        return absl::InvalidArgumentError(absl::StrCat(
            "header names namespace ", h.namespace_(), " but slot ", h.slot(),
            " of reservation ", h.reservation_id(), " is in namespace ", ns));
      }
    }
    return absl::OkStatus();
  }
  cur_->standalone = true;
  cur_->size = h.size();
  PutSpec spec{h.key(), h.parent_key(), h.size()};
  absl::StatusOr<Reservation> reserved =
      store_.BeginPut(kInternalSession, h.namespace_(), {&spec, 1}, would_wait);
  if (would_wait != nullptr && *would_wait) {
    cur_.reset();  // nothing of this header applied: it comes again
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(Reservation r, std::move(reserved));
  if (r.slots[0].exists) {
    cur_->discard = true;
    return absl::OkStatus();
  }
  cur_->internal_id = r.id;
  ASSIGN_OR_RETURN(cur_->slot, store_.AcquireSlot(kInternalSession, r.id, 0));
  return absl::OkStatus();
}

absl::Status WriteStream::Complete() {
  MarkProgress();
  std::unique_ptr<Block> b = std::move(cur_);
  if (!b->standalone && b->checksum != 0) {
    // Hashed now, while the bytes are likely in cache; CommitPut takes the
    // slot without hashing it again when its checksum is this one.
    const uint64_t sum = b->slot->Checksum();
    if (sum != b->checksum) {
      b->slot.reset();
      return absl::InvalidArgumentError(absl::StrCat(
          "checksum mismatch for block ", KeyToHex(b->key),
          ": the bytes do not match the header's XXH3-64"));
    }
  }
  if (!b->standalone) {
    // The session may have ended while the slot was written, and its
    // reservation with it, or the reservation ended on its own (AbortPut
    // meanwhile): the slot is gone, not filled (the bytes went to memory
    // being freed). Checked while the slot's handle is held: a CommitPut
    // cannot take the reservation meanwhile (ABORTED while a slot is
    // written), so a reservation gone here was ended, never committed.
    internal::TestSyncPoint("WriteStream::Complete:CheckingReservation",
                            &b->reservation);
    absl::Status open = store_.CheckReservation(b->session, b->reservation);
    b->slot.reset();
    if (!open.ok()) {
      if (absl::IsNotFound(open)) {
        return absl::NotFoundError(absl::StrCat(
            "session ", b->session, " ended while block ", KeyToHex(b->key),
            " was written: its reservation went with it"));
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "reservation ", b->reservation, " ended while block ", KeyToHex(b->key),
          " was written (aborted): its slot went with it"));
    }
    resp_->add_results(v1::WRITE_SLOT_FILLED);
    return absl::OkStatus();
  }
  b->slot.reset();
  if (b->discard) {
    resp_->add_results(v1::WRITE_ALREADY_EXISTS);
    return absl::OkStatus();
  }
  ReservationId id = std::exchange(b->internal_id, 0);
  ASSIGN_OR_RETURN(std::vector<CommitOutcome> out,
                   store_.CommitPut(kInternalSession, id, {&b->checksum, 1}));
  if (out[0] == CommitOutcome::kChecksumMismatch) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checksum mismatch for block ", KeyToHex(b->key),
        ": the bytes do not match the declared XXH3-64"));
  }
  resp_->add_results(out[0] == CommitOutcome::kStored ? v1::WRITE_STORED
                                                      : v1::WRITE_ALREADY_EXISTS);
  return absl::OkStatus();
}

absl::Status WriteStream::Consume(const v1::WriteRequest& msg, bool* would_wait) {
  if (would_wait != nullptr) *would_wait = false;
  // Any error ends the stream: release the unfinished block at once.
  absl::Status st = ConsumeOne(msg, would_wait);
  if (would_wait != nullptr && *would_wait) return absl::OkStatus();
  if (!st.ok()) Abort();
  return st;
}

absl::Status WriteStream::ConsumeOne(const v1::WriteRequest& msg, bool* would_wait) {
  if (!msg.has_header() && msg.data().empty()) {
    return absl::InvalidArgumentError("empty WriteRequest");
  }
  if (msg.has_header()) {
    RETURN_IF_ERROR(Start(msg.header(), would_wait));
    if (would_wait != nullptr && *would_wait) return absl::OkStatus();
  }
  const std::string& data = msg.data();
  if (data.empty()) return absl::OkStatus();
  if (!cur_) return absl::InvalidArgumentError("data before any header");
  if (data.size() > kMaxChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk of ", data.size(), " bytes exceeds the ", kMaxChunkBytes,
        "-byte limit"));
  }
  if (cur_->filled + data.size() > cur_->size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", KeyToHex(cur_->key), " has more bytes than its declared size ",
        cur_->size));
  }
  if (!cur_->discard) {
    std::memcpy(cur_->slot->bytes().data() + cur_->filled, data.data(), data.size());
  }
  cur_->filled += data.size();
  bytes_in_ += data.size();
  bytes_since_progress_ += data.size();
  if (bytes_since_progress_ >= std::max(cur_->size / 16, kProgressBytes)) {
    MarkProgress();
  }
  return cur_->filled == cur_->size ? Complete() : absl::OkStatus();
}

void WriteStream::MarkProgress() {
  progressed_ = true;
  bytes_since_progress_ = 0;
}

bool WriteStream::TakeProgress() { return std::exchange(progressed_, false); }

absl::Status WriteStream::End() {
  if (cur_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stream ended inside block ", KeyToHex(cur_->key), ": got ", cur_->filled,
        " of ", cur_->size, " bytes"));
  }
  return absl::OkStatus();
}

void SharedPin::Unref() {
  if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    store_.Unpin(kInternalSession, pin_).IgnoreError();
    delete this;
  }
}

namespace {

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Wire tag of ReadResponse.data: field 2, length-delimited.
constexpr char kDataTag = (2 << 3) | 2;

}  // namespace

std::string ReadChunk::Serialize() const {
  return prefix + std::string(data, size);
}

ReadStream::~ReadStream() { ReleasePin(); }

void ReadStream::ReleasePin() {
  if (pin_ != nullptr) std::exchange(pin_, nullptr)->Unref();
}

absl::Status ReadStream::Validate() const {
  RETURN_IF_ERROR(ValidateNamespace(req_.namespace_()));
  if (req_.keys_size() == 0) return absl::InvalidArgumentError("no keys to read");
  if (static_cast<uint64_t>(req_.keys_size()) > store_.options().max_batch_keys) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch of ", req_.keys_size(), " keys exceeds the limit of ",
        store_.options().max_batch_keys));
  }
  // Every key before any byte is sent: a bad key later in the batch is the
  // stream's error, not a part-read followed by one.
  for (const std::string& key : req_.keys()) RETURN_IF_ERROR(ValidateKey(key));
  return absl::OkStatus();
}

void ReadStream::PinNext(absl::AnyInvocable<void(absl::Status) &&> done) {
  absl::string_view k = req_.keys(key_);
  auto adopt =
      [this, done = std::move(done)](absl::StatusOr<LookupResult> r) mutable {
        std::move(done)(Adopt(std::move(r)));
      };
  // Keys a Lookup counted already (looked_up) are not counted again.
  if (req_.looked_up()) {
    store_.RepeatLookupAsync(kInternalSession, req_.namespace_(), {&k, 1},
                             /*pin=*/true, std::move(adopt));
  } else {
    store_.LookupAsync(kInternalSession, req_.namespace_(), {&k, 1}, false,
                       /*pin=*/true, std::move(adopt));
  }
}

absl::Status ReadStream::Adopt(absl::StatusOr<LookupResult> r) {
  RETURN_IF_ERROR(r.status());
  lookups_.namespace_known = r->namespace_known;
  lookups_.entries.push_back(r->entries[0]);
  if (!r->entries[0].found) {
    if (r->entries[0].on_nvme) {
      // A miss all the same (the client recomputes), but not for the
      // reason an operator would look for first.
      return absl::NotFoundError(absl::StrCat(
          "block ", KeyToHex(req_.keys(key_)), " of namespace ",
          req_.namespace_(),
          " is stored on NVMe but could not be read into DRAM now (DRAM full "
          "of pinned or reserved blocks, too many promotions queued, its NVMe "
          "copy unreadable or failing its checksum -- then dropped and "
          "counted in kvdepot_integrity_errors_total -- or a corrupt DRAM "
          "copy of it not yet released by its readers)"));
    }
    return absl::NotFoundError(absl::StrCat("block ", KeyToHex(req_.keys(key_)),
                                            " not found in namespace ",
                                            req_.namespace_()));
  }
  entry_ = r->entries[0];
  pin_ = new SharedPin(store_, r->pin_id);
  offset_ = 0;
  return absl::OkStatus();
}

absl::Status ReadStream::Next(ReadChunk* chunk, bool* last) {
  chunk->prefix.clear();
  if (pin_ == nullptr) {
    // Pin one block at a time: it cannot be evicted while its bytes are on
    // their way, and a large batch never pins more than the blocks in flight.
    absl::string_view k = req_.keys(key_);
    RETURN_IF_ERROR(Adopt(store_.Lookup(kInternalSession, req_.namespace_(),
                                        {&k, 1}, false, /*pin=*/true)));
  }
  if (offset_ == 0) {
    v1::ReadResponse header_only;
    v1::ReadHeader* h = header_only.mutable_header();
    h->set_key(req_.keys(key_));
    h->set_size(entry_.size);
    h->set_checksum(entry_.checksum);
    header_only.AppendToString(&chunk->prefix);
  }
  size_t n = std::min<uint64_t>(kMaxChunkBytes, entry_.size - offset_);
  chunk->prefix.push_back(kDataTag);
  AppendVarint(n, &chunk->prefix);
  chunk->data = store_.dram_region().base + entry_.offset + offset_;
  chunk->size = n;
  pin_->Ref();
  chunk->pin = pin_;
  offset_ += n;
  bytes_out_ += n;
  if (offset_ == entry_.size) {
    ReleasePin();
    ++key_;
  }
  *last = key_ == req_.keys_size();
  return absl::OkStatus();
}

}  // namespace kvdepot
