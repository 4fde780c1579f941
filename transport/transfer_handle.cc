#include "transport/transfer_handle.h"

#include <utility>

#include "transport/internal/transfer_batch.h"

namespace kvdepot {

TransferHandle::TransferHandle(
    std::shared_ptr<transport_internal::TransferBatch> batch)
    : batch_(std::move(batch)) {}

bool TransferHandle::IsReady() const { return batch_->IsReady(); }

void TransferHandle::OnReady(absl::AnyInvocable<void() &&> done) const {
  batch_->OnReady(std::move(done));
}

void TransferHandle::Wait() const {
  batch_->WaitUntil(absl::InfiniteFuture());
}

bool TransferHandle::WaitUntil(absl::Time deadline) const {
  return batch_->WaitUntil(deadline);
}

bool TransferHandle::abandoned() const { return batch_->abandoned(); }

void TransferHandle::OnReleased(absl::AnyInvocable<void() &&> done) const {
  batch_->OnReleased(std::move(done));
}

size_t TransferHandle::size() const { return batch_->size(); }

const absl::Status& TransferHandle::status(size_t i) const {
  return batch_->result()[i];
}

const std::vector<absl::Status>& TransferHandle::statuses() const {
  return batch_->result();
}

absl::Status TransferHandle::overall_status() const {
  for (const absl::Status& s : batch_->result()) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
