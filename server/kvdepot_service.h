// KvDepotService: the gRPC adapter of kvdepot.v1.KvDepot. Each method
// validates what only the wire can get wrong, calls the TieredStore, converts
// the absl::Status (absl codes are the gRPC codes) and finishes; Call() times,
// counts and logs every RPC in one place. Block bytes on this path are copied
// between protobuf chunks of at most 1 MiB and the store's DRAM arena.
//
// Thread-safe (gRPC calls methods from its thread pool).
#ifndef KVDEPOT_SERVER_KVDEPOT_SERVICE_H_
#define KVDEPOT_SERVER_KVDEPOT_SERVICE_H_

#include <spdlog/logger.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"
#include "server/metrics.h"
#include "storage/clock.h"
#include "storage/tiered_store.h"

namespace kvdepot {

inline constexpr size_t kMaxChunkBytes = 1 << 20;

// Converts an absl::Status to a grpc::Status with the same code and message.
grpc::Status ToGrpcStatus(const absl::Status& status);

class KvDepotService final : public v1::KvDepot::Service {
 public:
  // `store`, `metrics` and `clock` must outlive the service.
  KvDepotService(TieredStore& store, ServerMetrics& metrics, Clock& clock,
                 std::shared_ptr<spdlog::logger> logger);

  grpc::Status OpenSession(grpc::ServerContext* ctx,
                           const v1::OpenSessionRequest* req,
                           v1::OpenSessionResponse* resp) override;
  grpc::Status KeepAlive(grpc::ServerContext* ctx,
                         const v1::KeepAliveRequest* req,
                         v1::KeepAliveResponse* resp) override;
  grpc::Status CloseSession(grpc::ServerContext* ctx,
                            const v1::CloseSessionRequest* req,
                            v1::CloseSessionResponse* resp) override;
  grpc::Status Lookup(grpc::ServerContext* ctx, const v1::LookupRequest* req,
                      v1::LookupResponse* resp) override;
  grpc::Status Unpin(grpc::ServerContext* ctx, const v1::UnpinRequest* req,
                     v1::UnpinResponse* resp) override;
  grpc::Status BeginPut(grpc::ServerContext* ctx,
                        const v1::BeginPutRequest* req,
                        v1::BeginPutResponse* resp) override;
  grpc::Status CommitPut(grpc::ServerContext* ctx,
                         const v1::CommitPutRequest* req,
                         v1::CommitPutResponse* resp) override;
  grpc::Status AbortPut(grpc::ServerContext* ctx,
                        const v1::AbortPutRequest* req,
                        v1::AbortPutResponse* resp) override;
  grpc::Status Write(grpc::ServerContext* ctx,
                     grpc::ServerReader<v1::WriteRequest>* reader,
                     v1::WriteResponse* resp) override;
  grpc::Status Read(grpc::ServerContext* ctx, const v1::ReadRequest* req,
                    grpc::ServerWriter<v1::ReadResponse>* writer) override;
  grpc::Status Evict(grpc::ServerContext* ctx, const v1::EvictRequest* req,
                     v1::EvictResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const v1::StatsRequest* req,
                     v1::StatsResponse* resp) override;
  grpc::Status ListNamespaces(grpc::ServerContext* ctx,
                              const v1::ListNamespacesRequest* req,
                              v1::ListNamespacesResponse* resp) override;

 private:
  // Runs `fn`, records metrics under `op`, logs failures that are the
  // daemon's fault, and converts the status.
  template <typename Fn>
  grpc::Status Call(const char* op, Fn&& fn);

  absl::Status DoWrite(grpc::ServerContext* ctx,
                       grpc::ServerReader<v1::WriteRequest>* reader,
                       v1::WriteResponse* resp);
  absl::Status DoRead(grpc::ServerContext* ctx, const v1::ReadRequest& req,
                      grpc::ServerWriter<v1::ReadResponse>* writer);

  TieredStore& store_;
  ServerMetrics& metrics_;
  Clock& clock_;
  const std::shared_ptr<spdlog::logger> log_;
  const absl::Time started_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_KVDEPOT_SERVICE_H_
