#include "engine/staged_communicator.h"

#include <algorithm>

#include "common/log.h"

namespace strata::engine {
namespace {

constexpr size_t kPage = 4096;  // page-aligned, so registration pins exactly the staging memory

}  // namespace

StagedCommunicator::~StagedCommunicator() {
  for (int i = 0; i < 2; ++i)
    if (registered_[i]) device_.unregister_host(stage_[i].data());
}

Result<std::byte*> StagedCommunicator::staging(int which, size_t bytes) {
  AlignedBuffer& b = stage_[which];
  if (b.size() < bytes) {
    if (registered_[which]) device_.unregister_host(b.data());
    registered_[which] = false;
    const size_t want = std::max(bytes, 2 * b.size());  // grown geometrically: a few sizes, then none
    b.reset();
    STRATA_ASSIGN_OR_RETURN(b, AlignedBuffer::allocate((want + kPage - 1) / kPage * kPage,
                                                       which == 0 ? "collectives.staging (send)"
                                                                  : "collectives.staging (receive)",
                                                       kPage));
    if (const Status s = device_.register_host(b.data(), b.size()); s.is_ok()) {
      registered_[which] = true;
    } else {
      STRATA_LOG_WARN("group '{}': staging memory not page-locked, so its copies are slower: {}", name(),
                      s.to_string());
    }
  }
  return b.as<std::byte>();
}

Result<bool> StagedCommunicator::on_device(const void* p, size_t bytes) const {
  if (bytes == 0 || !device_.owns(p, 0)) return false;
  if (!device_.owns(p, bytes))
    return Status::internal("group '{}': a buffer of {} bytes starts in {} device memory but runs past the end of its "
                            "allocation",
                            name(), bytes, device_.name());
  return true;
}

Result<const void*> StagedCommunicator::outgoing(const void* send, size_t bytes, bool on_dev) {
  if (!on_dev) return send;
  STRATA_ASSIGN_OR_RETURN(std::byte* st, staging(0, bytes));
  down(st, send, bytes);
  return static_cast<const void*>(st);
}

Result<void*> StagedCommunicator::incoming(void* recv, size_t bytes, bool on_dev) {
  if (!on_dev) return recv;
  STRATA_ASSIGN_OR_RETURN(std::byte* st, staging(1, bytes));
  return static_cast<void*>(st);
}

void StagedCommunicator::down(void* host, const void* dev, size_t bytes) {
  device_.download(host, dev, bytes);
  bytes_down_ += bytes;
}

void StagedCommunicator::up(void* dev, const void* host, size_t bytes) {
  device_.upload(dev, host, bytes);
  bytes_up_ += bytes;
}

Status StagedCommunicator::all_reduce(const void* send, void* recv, size_t count, DType dtype, comm::ReduceOp op) {
  const size_t n = count * dtype_size(dtype);
  STRATA_ASSIGN_OR_RETURN(const bool sd, on_device(send, n));
  STRATA_ASSIGN_OR_RETURN(const bool rd, on_device(recv, n));
  if (!sd && !rd) return host_->all_reduce(send, recv, count, dtype, op);
  sync();  // the kernels that wrote `send` are done; none still reads `recv`
  STRATA_ASSIGN_OR_RETURN(void* r, incoming(recv, n, rd));
  const void* s = r;
  if (sd && send == recv) {  // in place: the host call runs in place too
    down(r, send, n);
  } else {
    STRATA_ASSIGN_OR_RETURN(s, outgoing(send, n, sd));
  }
  STRATA_RETURN_IF_ERROR(host_->all_reduce(s, r, count, dtype, op));
  if (rd) up(recv, r, n);
  return Status::ok();
}

Status StagedCommunicator::all_gather(const void* send, void* recv, size_t count, DType dtype) {
  const size_t n = count * dtype_size(dtype), all = n * static_cast<size_t>(size());
  STRATA_ASSIGN_OR_RETURN(const bool sd, on_device(send, n));
  STRATA_ASSIGN_OR_RETURN(const bool rd, on_device(recv, all));
  if (!sd && !rd) return host_->all_gather(send, recv, count, dtype);
  sync();
  const size_t mine = n * static_cast<size_t>(rank());
  const bool in_place = send == static_cast<const std::byte*>(recv) + mine;
  STRATA_ASSIGN_OR_RETURN(void* r, incoming(recv, all, rd));
  const void* s = static_cast<std::byte*>(r) + mine;
  if (in_place && rd) {  // this rank's part is already where the host call wants it: in place there too
    down(static_cast<std::byte*>(r) + mine, send, n);
  } else {
    STRATA_ASSIGN_OR_RETURN(s, outgoing(send, n, sd));
  }
  STRATA_RETURN_IF_ERROR(host_->all_gather(s, r, count, dtype));
  if (rd) up(recv, r, all);
  return Status::ok();
}

Status StagedCommunicator::reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                                          comm::ReduceOp op) {
  const size_t n = count * dtype_size(dtype), all = n * static_cast<size_t>(size());
  STRATA_ASSIGN_OR_RETURN(const bool sd, on_device(send, all));
  STRATA_ASSIGN_OR_RETURN(const bool rd, on_device(recv, n));
  if (!sd && !rd) return host_->reduce_scatter(send, recv, count, dtype, op);
  sync();
  STRATA_ASSIGN_OR_RETURN(const void* s, outgoing(send, all, sd));
  STRATA_ASSIGN_OR_RETURN(void* r, incoming(recv, n, rd));
  STRATA_RETURN_IF_ERROR(host_->reduce_scatter(s, r, count, dtype, op));
  if (rd) up(recv, r, n);
  return Status::ok();
}

Status StagedCommunicator::broadcast(void* buf, size_t count, DType dtype, int root) {
  const size_t n = count * dtype_size(dtype);
  STRATA_ASSIGN_OR_RETURN(const bool dev, on_device(buf, n));
  if (!dev) return host_->broadcast(buf, count, dtype, root);
  sync();
  STRATA_ASSIGN_OR_RETURN(std::byte* b, staging(1, n));
  if (rank() == root) down(b, buf, n);
  STRATA_RETURN_IF_ERROR(host_->broadcast(b, count, dtype, root));
  if (rank() != root) up(buf, b, n);
  return Status::ok();
}

Status StagedCommunicator::send(const void* buf, size_t count, DType dtype, int peer, int tag) {
  const size_t n = count * dtype_size(dtype);
  STRATA_ASSIGN_OR_RETURN(const bool dev, on_device(buf, n));
  if (!dev) return host_->send(buf, count, dtype, peer, tag);
  sync();
  STRATA_ASSIGN_OR_RETURN(const void* b, outgoing(buf, n, true));
  return host_->send(b, count, dtype, peer, tag);
}

Status StagedCommunicator::recv(void* buf, size_t count, DType dtype, int peer, int tag) {
  const size_t n = count * dtype_size(dtype);
  STRATA_ASSIGN_OR_RETURN(const bool dev, on_device(buf, n));
  if (!dev) return host_->recv(buf, count, dtype, peer, tag);
  sync();
  STRATA_ASSIGN_OR_RETURN(std::byte* b, staging(1, n));
  STRATA_RETURN_IF_ERROR(host_->recv(b, count, dtype, peer, tag));
  up(buf, b, n);
  return Status::ok();
}

Status StagedCommunicator::send_recv(const void* send, size_t send_count, int dest, void* recv, size_t recv_count,
                                     int src, DType dtype, int tag) {
  const size_t sn = send_count * dtype_size(dtype), rn = recv_count * dtype_size(dtype);
  STRATA_ASSIGN_OR_RETURN(const bool sd, on_device(send, sn));
  STRATA_ASSIGN_OR_RETURN(const bool rd, on_device(recv, rn));
  if (!sd && !rd) return host_->send_recv(send, send_count, dest, recv, recv_count, src, dtype, tag);
  sync();
  STRATA_ASSIGN_OR_RETURN(const void* s, outgoing(send, sn, sd));
  STRATA_ASSIGN_OR_RETURN(void* r, incoming(recv, rn, rd));
  STRATA_RETURN_IF_ERROR(host_->send_recv(s, send_count, dest, r, recv_count, src, dtype, tag));
  if (rd) up(recv, r, rn);
  return Status::ok();
}

Result<std::unique_ptr<comm::Communicator>> StagedCommunicator::split(int color, int key, const std::string& name) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> part, host_->split(color, key, name));
  if (part == nullptr) return part;
  auto staged = std::make_unique<StagedCommunicator>(std::move(part), device_);
  staged->set_caller_fenced(caller_fenced_);
  return std::unique_ptr<comm::Communicator>(std::move(staged));
}

comm::Communicator* staged_if_needed(comm::Communicator* group, kernels::Device& device,
                                     std::unique_ptr<comm::Communicator>* owned) {
  if (group == nullptr || device.host_accessible()) return group;
  *owned = std::make_unique<StagedCommunicator>(*group, device);
  return owned->get();
}

}  // namespace strata::engine
