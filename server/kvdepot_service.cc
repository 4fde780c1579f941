#include "server/kvdepot_service.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "server/version.h"
#include "storage/block_key.h"
#include "storage/status_macros.h"

namespace kvdepot {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

namespace {

v1::Tier ToProto(Tier t) {
  switch (t) {
    case Tier::kDram:
      return v1::TIER_DRAM;
    case Tier::kNvme:
      return v1::TIER_NVME;
    case Tier::kNone:
      break;
  }
  return v1::TIER_UNSPECIFIED;
}

std::vector<absl::string_view> Views(
    const google::protobuf::RepeatedPtrField<std::string>& keys) {
  return std::vector<absl::string_view>(keys.begin(), keys.end());
}

// Public RPCs never act as the in-process session.
absl::Status RequireSession(uint64_t session_id) {
  if (session_id == kInternalSession) {
    return absl::NotFoundError("session_id is required (call OpenSession)");
  }
  return absl::OkStatus();
}

void FillNamespace(const NamespaceStats& ns, v1::NamespaceStats* out) {
  out->set_name(ns.name);
  out->set_blocks(ns.blocks);
  out->set_bytes(ns.bytes);
  out->set_lookups(ns.lookups);
  out->set_hits(ns.hits);
}

}  // namespace

KvDepotService::KvDepotService(TieredStore& store, ServerMetrics& metrics,
                               Clock& clock,
                               std::shared_ptr<spdlog::logger> logger)
    : store_(store), metrics_(metrics), clock_(clock), log_(std::move(logger)),
      started_(clock.Now()) {}

template <typename Fn>
grpc::Status KvDepotService::Call(const char* op, Fn&& fn) {
  absl::Time start = clock_.Now();
  absl::Status st = fn();
  metrics_.RecordRequest(op, st.code(), clock_.Now() - start);
  switch (st.code()) {
    case absl::StatusCode::kOk:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kCancelled:
      break;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kResourceExhausted:
      log_->debug("{} rejected: {}", op, st.ToString());
      break;
    default:
      log_->warn("{} failed: {}", op, st.ToString());
  }
  return ToGrpcStatus(st);
}

grpc::Status KvDepotService::OpenSession(grpc::ServerContext* ctx,
                                         const v1::OpenSessionRequest* req,
                                         v1::OpenSessionResponse* resp) {
  return Call("OpenSession", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(SessionGrant g,
                     store_.OpenSession(absl::Milliseconds(req->lease_ms()),
                                        req->client_name()));
    resp->set_session_id(g.id);
    resp->set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(g.lease)));
    const StoreOptions& o = store_.options();
    resp->set_max_block_bytes(std::min<uint64_t>(o.max_block_bytes,
                                                 store_.dram_region().size));
    resp->set_max_batch_keys(o.max_batch_keys);
    resp->set_max_chunk_bytes(kMaxChunkBytes);
    log_->info("session {} opened by '{}' from {} (lease {})", g.id,
               req->client_name(), ctx->peer(), absl::FormatDuration(g.lease));
    return absl::OkStatus();
  });
}

grpc::Status KvDepotService::KeepAlive(grpc::ServerContext*,
                                       const v1::KeepAliveRequest* req,
                                       v1::KeepAliveResponse* resp) {
  return Call("KeepAlive", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(absl::Duration lease, store_.KeepAlive(req->session_id()));
    resp->set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(lease)));
    return absl::OkStatus();
  });
}

grpc::Status KvDepotService::CloseSession(grpc::ServerContext*,
                                          const v1::CloseSessionRequest* req,
                                          v1::CloseSessionResponse* resp) {
  return Call("CloseSession", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(SessionRelease rel, store_.CloseSession(req->session_id()));
    resp->set_pins_released(rel.pins_released);
    resp->set_reservations_aborted(rel.reservations_aborted);
    log_->info("session {} closed ({} pins released, {} puts aborted)",
               req->session_id(), rel.pins_released, rel.reservations_aborted);
    return absl::OkStatus();
  });
}

grpc::Status KvDepotService::Lookup(grpc::ServerContext*,
                                    const v1::LookupRequest* req,
                                    v1::LookupResponse* resp) {
  return Call("Lookup", [&]() -> absl::Status {
    if (req->pin()) RETURN_IF_ERROR(RequireSession(req->session_id()));
    std::vector<absl::string_view> keys = Views(req->keys());
    ASSIGN_OR_RETURN(LookupResult r,
                     store_.Lookup(req->session_id(), req->namespace_(), keys,
                                   req->prefix(), req->pin()));
    uint64_t hits = 0;
    for (const LookupEntry& e : r.entries) {
      v1::LookupEntry* out = resp->add_entries();
      out->set_found(e.found);
      if (!e.found) continue;
      ++hits;
      out->set_tier(ToProto(e.tier));
      out->set_size(e.size);
      out->set_checksum(e.checksum);
      if (req->pin()) out->set_offset(e.offset);
    }
    resp->set_prefix_hits(r.prefix_hits);
    resp->set_pin_id(r.pin_id);
    metrics_.RecordLookup(hits, keys.size() - hits);
    return absl::OkStatus();
  });
}

grpc::Status KvDepotService::Unpin(grpc::ServerContext*,
                                   const v1::UnpinRequest* req,
                                   v1::UnpinResponse* resp) {
  return Call("Unpin", [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireSession(req->session_id()));
    ASSIGN_OR_RETURN(uint32_t n, store_.Unpin(req->session_id(), req->pin_id()));
    resp->set_blocks_released(n);
    return absl::OkStatus();
  });
}

grpc::Status KvDepotService::BeginPut(grpc::ServerContext*,
                                      const v1::BeginPutRequest* req,
                                      v1::BeginPutResponse* resp) {
  return Call("BeginPut", [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireSession(req->session_id()));
    std::vector<PutSpec> specs;
    specs.reserve(req->blocks_size());
    for (const v1::PutSpec& b : req->blocks()) {
      specs.push_back(PutSpec{b.key(), b.parent_key(), b.size()});
    }
    ASSIGN_OR_RETURN(Reservation r,
                     store_.BeginPut(req->session_id(), req->namespace_(), specs));
    resp->set_reservation_id(r.id);
    for (const PutSlot& s : r.slots) {
      v1::PutSlot* out = resp->add_slots();
      out->set_state(s.exists ? v1::PUT_SLOT_EXISTS : v1::PUT_SLOT_RESERVED);
      out->set_offset(s.offset);
    }
    return absl::OkStatus();
  });
}

grpc::Status KvDepotService::CommitPut(grpc::ServerContext*,
                                       const v1::CommitPutRequest* req,
                                       v1::CommitPutResponse* resp) {
  return Call("CommitPut", [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireSession(req->session_id()));
    std::vector<uint64_t> sums(req->checksums().begin(), req->checksums().end());
    ASSIGN_OR_RETURN(std::vector<CommitOutcome> out,
                     store_.CommitPut(req->session_id(), req->reservation_id(), sums));
    for (CommitOutcome o : out) {
      switch (o) {
        case CommitOutcome::kStored:
          resp->add_results(v1::COMMIT_STORED);
          break;
        case CommitOutcome::kAlreadyExists:
          resp->add_results(v1::COMMIT_ALREADY_EXISTS);
          break;
        case CommitOutcome::kChecksumMismatch:
          resp->add_results(v1::COMMIT_CHECKSUM_MISMATCH);
          break;
      }
    }
    return absl::OkStatus();
  });
}

grpc::Status KvDepotService::AbortPut(grpc::ServerContext*,
                                      const v1::AbortPutRequest* req,
                                      v1::AbortPutResponse*) {
  return Call("AbortPut", [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireSession(req->session_id()));
    return store_.AbortPut(req->session_id(), req->reservation_id());
  });
}

grpc::Status KvDepotService::Write(grpc::ServerContext* ctx,
                                   grpc::ServerReader<v1::WriteRequest>* reader,
                                   v1::WriteResponse* resp) {
  return Call("Write", [&] { return DoWrite(ctx, reader, resp); });
}

// One block in flight on a Write stream. A standalone block owns an internal
// reservation (aborted if the stream ends before the block is complete); a
// reservation-target block holds a SlotHandle of the client's reservation.
namespace {
struct BlockInFlight {
  TieredStore* store = nullptr;
  std::string key;
  uint64_t size = 0;
  uint64_t checksum = 0;
  uint64_t filled = 0;
  bool standalone = false;
  bool discard = false;  // key already stored: consume and drop the bytes
  ReservationId internal_id = 0;
  std::unique_ptr<SlotHandle> slot;  // where the bytes go (unless discard)

  ~BlockInFlight() {
    if (internal_id != 0) store->AbortPut(kInternalSession, internal_id).IgnoreError();
  }
};
}  // namespace

absl::Status KvDepotService::DoWrite(
    grpc::ServerContext* ctx, grpc::ServerReader<v1::WriteRequest>* reader,
    v1::WriteResponse* resp) {
  std::optional<BlockInFlight> cur;
  v1::WriteRequest msg;
  while (reader->Read(&msg)) {
    if (!msg.has_header() && msg.data().empty()) {
      return absl::InvalidArgumentError("empty WriteRequest");
    }
    if (msg.has_header()) {
      const v1::WriteHeader& h = msg.header();
      if (cur) {
        return absl::InvalidArgumentError(absl::StrCat(
            "header for a new block while block ", KeyToHex(cur->key),
            " has ", cur->filled, " of ", cur->size, " bytes"));
      }
      cur.emplace();
      cur->store = &store_;
      cur->key = h.key();
      cur->checksum = h.checksum();
      if (h.reservation_id() != 0) {
        RETURN_IF_ERROR(RequireSession(h.session_id()));
        ASSIGN_OR_RETURN(cur->slot, store_.AcquireSlot(h.session_id(),
                                                       h.reservation_id(), h.slot()));
        cur->size = cur->slot->bytes().size();
        if (h.size() != cur->size) {
          return absl::InvalidArgumentError(absl::StrCat(
              "header declares ", h.size(), " bytes but slot ", h.slot(),
              " of reservation ", h.reservation_id(), " holds ", cur->size));
        }
      } else {
        cur->standalone = true;
        cur->size = h.size();
        PutSpec spec{h.key(), h.parent_key(), h.size()};
        ASSIGN_OR_RETURN(Reservation r,
                         store_.BeginPut(kInternalSession, h.namespace_(), {&spec, 1}));
        if (r.slots[0].exists) {
          cur->discard = true;
        } else {
          cur->internal_id = r.id;
          ASSIGN_OR_RETURN(cur->slot, store_.AcquireSlot(kInternalSession, r.id, 0));
        }
      }
    }
    if (msg.data().empty()) continue;
    const std::string& data = msg.data();
    if (!cur) return absl::InvalidArgumentError("data before any header");
    if (data.size() > kMaxChunkBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk of ", data.size(), " bytes exceeds the ", kMaxChunkBytes,
          "-byte limit"));
    }
    if (cur->filled + data.size() > cur->size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block ", KeyToHex(cur->key), " has more bytes than its declared size ",
          cur->size));
    }
    if (!cur->discard) {
      std::memcpy(cur->slot->bytes().data() + cur->filled, data.data(), data.size());
    }
    cur->filled += data.size();
    metrics_.AddBytesIn(data.size());
    if (cur->filled < cur->size) continue;

    // The block is complete.
    cur->slot.reset();
    if (!cur->standalone) {
      resp->add_results(v1::WRITE_SLOT_FILLED);
    } else if (cur->discard) {
      resp->add_results(v1::WRITE_ALREADY_EXISTS);
    } else {
      ReservationId id = std::exchange(cur->internal_id, 0);
      ASSIGN_OR_RETURN(std::vector<CommitOutcome> out,
                       store_.CommitPut(kInternalSession, id, {&cur->checksum, 1}));
      if (out[0] == CommitOutcome::kChecksumMismatch) {
        return absl::InvalidArgumentError(absl::StrCat(
            "checksum mismatch for block ", KeyToHex(cur->key),
            ": the bytes do not match the declared XXH3-64"));
      }
      resp->add_results(out[0] == CommitOutcome::kStored ? v1::WRITE_STORED
                                                         : v1::WRITE_ALREADY_EXISTS);
    }
    cur.reset();
  }
  if (ctx->IsCancelled()) return absl::CancelledError("client cancelled the write");
  if (cur) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stream ended inside block ", KeyToHex(cur->key), ": got ", cur->filled,
        " of ", cur->size, " bytes"));
  }
  return absl::OkStatus();
}

grpc::Status KvDepotService::Read(grpc::ServerContext* ctx,
                                  const v1::ReadRequest* req,
                                  grpc::ServerWriter<v1::ReadResponse>* writer) {
  return Call("Read", [&] { return DoRead(ctx, *req, writer); });
}

absl::Status KvDepotService::DoRead(grpc::ServerContext* ctx,
                                    const v1::ReadRequest& req,
                                    grpc::ServerWriter<v1::ReadResponse>* writer) {
  RETURN_IF_ERROR(ValidateNamespace(req.namespace_()));
  if (static_cast<uint64_t>(req.keys_size()) > store_.options().max_batch_keys) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch of ", req.keys_size(), " keys exceeds the limit of ",
        store_.options().max_batch_keys));
  }
  if (req.keys_size() == 0) return absl::InvalidArgumentError("no keys to read");
  const char* base = store_.dram_region().base;
  v1::ReadResponse msg;
  for (const std::string& key : req.keys()) {
    absl::string_view k = key;
    // Pin one block at a time: it cannot be evicted while it streams, and a
    // large batch never pins more than one block.
    ASSIGN_OR_RETURN(LookupResult r,
                     store_.Lookup(kInternalSession, req.namespace_(), {&k, 1},
                                   false, /*pin=*/true));
    const LookupEntry& e = r.entries[0];
    if (!e.found) {
      return absl::NotFoundError(absl::StrCat(
          "block ", KeyToHex(key), " not found in namespace ", req.namespace_()));
    }
    absl::Cleanup unpin = [&] {
      store_.Unpin(kInternalSession, r.pin_id).IgnoreError();
    };
    // The header rides with the first chunk, and the stream's last message
    // with the trailers: one write per chunk, no extra round trips.
    const bool last_key = &key == &req.keys(req.keys_size() - 1);
    uint64_t off = 0;
    do {
      size_t n = std::min<uint64_t>(kMaxChunkBytes, e.size - off);
      msg.Clear();
      if (off == 0) {
        v1::ReadHeader* h = msg.mutable_header();
        h->set_key(key);
        h->set_size(e.size);
        h->set_checksum(e.checksum);
      }
      msg.mutable_data()->assign(base + e.offset + off, n);
      off += n;
      grpc::WriteOptions options;
      if (last_key && off == e.size) options.set_last_message();
      bool ok = writer->Write(msg, options);
      if (!ok) return absl::CancelledError("client went away");
      metrics_.AddBytesOut(n);
    } while (off < e.size);
    if (ctx->IsCancelled()) return absl::CancelledError("client cancelled the read");
  }
  return absl::OkStatus();
}

grpc::Status KvDepotService::Evict(grpc::ServerContext*,
                                   const v1::EvictRequest* req,
                                   v1::EvictResponse* resp) {
  return Call("Evict", [&]() -> absl::Status {
    std::vector<absl::string_view> keys = Views(req->keys());
    ASSIGN_OR_RETURN(EvictResult r, store_.Evict(req->namespace_(), keys, req->all()));
    resp->set_evicted_blocks(r.evicted_blocks);
    resp->set_evicted_bytes(r.evicted_bytes);
    for (const std::string& k : r.pinned_keys) resp->add_pinned_keys(k);
    resp->set_pinned_blocks(r.pinned_blocks);
    resp->set_missing_keys(r.missing_keys);
    log_->info("evict {}: {} blocks ({} bytes) removed, {} pinned kept",
               req->namespace_(), r.evicted_blocks, r.evicted_bytes,
               r.pinned_blocks);
    return absl::OkStatus();
  });
}

grpc::Status KvDepotService::Stats(grpc::ServerContext*, const v1::StatsRequest*,
                                   v1::StatsResponse* resp) {
  return Call("Stats", [&]() -> absl::Status {
    StoreStats st = store_.Stats();
    v1::TierStats* d = resp->mutable_dram();
    d->set_used_bytes(st.dram.used_bytes);
    d->set_capacity_bytes(st.dram.capacity_bytes);
    d->set_blocks(st.dram.blocks);
    d->set_hits(st.dram.hits);
    d->set_evictions(st.dram.evictions);
    resp->set_sessions(st.sessions);
    resp->set_pins(st.pins);
    resp->set_reservations(st.reservations);
    resp->set_reserved_bytes(st.reserved_bytes);
    resp->set_lookup_keys(st.lookup_keys);
    resp->set_lookup_hits(st.lookup_hits);
    resp->set_puts(st.puts);
    resp->set_put_bytes(st.put_bytes);
    resp->set_integrity_errors(st.integrity_errors);
    for (const NamespaceStats& ns : st.namespaces) {
      FillNamespace(ns, resp->add_namespaces());
    }
    resp->set_uptime_ms(static_cast<uint64_t>(
        absl::ToInt64Milliseconds(clock_.Now() - started_)));
    resp->set_version(kVersion);
    return absl::OkStatus();
  });
}

grpc::Status KvDepotService::ListNamespaces(grpc::ServerContext*,
                                            const v1::ListNamespacesRequest*,
                                            v1::ListNamespacesResponse* resp) {
  return Call("ListNamespaces", [&]() -> absl::Status {
    for (const NamespaceStats& ns : store_.ListNamespaces()) {
      FillNamespace(ns, resp->add_namespaces());
    }
    return absl::OkStatus();
  });
}

}  // namespace kvdepot
