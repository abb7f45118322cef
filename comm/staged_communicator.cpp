#include "comm/staged_communicator.h"

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/log.h"
#if STRATA_HAVE_NCCL
#include "comm/nccl_communicator.h"
#endif

namespace strata::comm {
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

Status StagedCommunicator::reserve_device_staging(size_t bytes) {
  if (plane_ == nullptr) return Status::ok();
  return device_staging(1, bytes).status();
}

Result<std::byte*> StagedCommunicator::device_staging(int which, size_t bytes) {
  kernels::DeviceBuffer& b = device_stage_[which];
  if (b.size() < bytes) {
    const size_t want = std::max(bytes, 2 * b.size());  // grown geometrically, as the host staging
    b.reset();
    STRATA_ASSIGN_OR_RETURN(b, device_.allocate(want, which == 0 ? "collectives.staging (send)"
                                                                  : "collectives.staging (receive)"));
  }
  return b.as<std::byte>();
}

template <typename Call>
Status StagedCommunicator::over_plane(const void* send, size_t send_bytes, bool sd, void* recv, size_t recv_bytes,
                                      bool rd, Call call) {
  ++plane_calls_;
  const void* s = send;
  if (!sd) {
    STRATA_ASSIGN_OR_RETURN(std::byte* st, device_staging(0, send_bytes));
    up(st, send, send_bytes);
    s = st;
  }
  void* r = recv;
  if (!rd) {
    STRATA_ASSIGN_OR_RETURN(r, device_staging(1, recv_bytes));
  }
  STRATA_RETURN_IF_ERROR(call(s, r));
  if (!rd) down(recv, r, recv_bytes);
  return Status::ok();
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

Status StagedCommunicator::all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  const size_t n = count * dtype_size(dtype);
  STRATA_ASSIGN_OR_RETURN(const bool sd, on_device(send, n));
  STRATA_ASSIGN_OR_RETURN(const bool rd, on_device(recv, n));
  if (!sd && !rd) return host_->all_reduce(send, recv, count, dtype, op);
  sync();  // the kernels that wrote `send` are done; none still reads `recv`
  if (plane_ != nullptr) {
    return over_plane(send, n, sd, recv, n, rd,
                      [&](const void* s, void* r) { return plane_->all_reduce(s, r, count, dtype, op); });
  }
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
  // Host shards into device memory (ZeRO-3): this rank's goes where the gather leaves it, which runs in place.
  if (plane_ != nullptr && !sd) {
    ++plane_calls_;
    std::byte* at = static_cast<std::byte*>(recv) + mine;
    up(at, send, n);
    return plane_->all_gather(at, recv, count, dtype);
  }
  if (plane_ != nullptr) {
    return over_plane(send, n, sd, recv, all, rd,
                      [&](const void* s, void* r) { return plane_->all_gather(s, r, count, dtype); });
  }
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
                                          ReduceOp op) {
  const size_t n = count * dtype_size(dtype), all = n * static_cast<size_t>(size());
  STRATA_ASSIGN_OR_RETURN(const bool sd, on_device(send, all));
  STRATA_ASSIGN_OR_RETURN(const bool rd, on_device(recv, n));
  if (!sd && !rd) return host_->reduce_scatter(send, recv, count, dtype, op);
  sync();
  if (plane_ != nullptr) {
    return over_plane(send, all, sd, recv, n, rd,
                      [&](const void* s, void* r) { return plane_->reduce_scatter(s, r, count, dtype, op); });
  }
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
  if (plane_ != nullptr) {
    ++plane_calls_;
    return plane_->broadcast(buf, count, dtype, root);
  }
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
  if (plane_ != nullptr) {
    ++plane_calls_;
    return plane_->send(buf, count, dtype, peer, tag);
  }
  STRATA_ASSIGN_OR_RETURN(const void* b, outgoing(buf, n, true));
  return host_->send(b, count, dtype, peer, tag);
}

Status StagedCommunicator::recv(void* buf, size_t count, DType dtype, int peer, int tag) {
  const size_t n = count * dtype_size(dtype);
  STRATA_ASSIGN_OR_RETURN(const bool dev, on_device(buf, n));
  if (!dev) return host_->recv(buf, count, dtype, peer, tag);
  sync();
  if (plane_ != nullptr) {
    ++plane_calls_;
    return plane_->recv(buf, count, dtype, peer, tag);
  }
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
  if (plane_ != nullptr) {
    return over_plane(send, sn, sd, recv, rn, rd, [&](const void* s, void* r) {
      return plane_->send_recv(s, send_count, dest, r, recv_count, src, dtype, tag);
    });
  }
  STRATA_ASSIGN_OR_RETURN(const void* s, outgoing(send, sn, sd));
  STRATA_ASSIGN_OR_RETURN(void* r, incoming(recv, rn, rd));
  STRATA_RETURN_IF_ERROR(host_->send_recv(s, send_count, dest, r, recv_count, src, dtype, tag));
  if (rd) up(recv, r, rn);
  return Status::ok();
}

Result<std::unique_ptr<Communicator>> StagedCommunicator::split(int color, int key, const std::string& name) {
  return split(color, key, name, true);
}

Result<std::unique_ptr<Communicator>> StagedCommunicator::split(int color, int key, const std::string& name,
                                                                      bool with_device_plane) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> part, host_->split(color, key, name));
  if (part == nullptr) return part;
  std::unique_ptr<Communicator> plane;
  if (plane_ != nullptr && with_device_plane) {
    STRATA_ASSIGN_OR_RETURN(plane, plane_->split(color, key, name));
  }
  auto staged = std::make_unique<StagedCommunicator>(std::move(part), device_, std::move(plane));
  staged->set_caller_fenced(caller_fenced_);
  return std::unique_ptr<Communicator>(std::move(staged));
}

namespace {

// Where this rank's device is, as "host/PCI bus id GPU-uuid", for telling ranks that share a GPU apart (empty:
// unknown).
std::string device_place(kernels::Device& device) {
#if STRATA_HAVE_NCCL
  device.synchronize();  // binds this thread to the device's GPU, whose bus id the NCCL side reads
  return NcclCommunicator::device_place();
#else
  (void)device;
  return {};
#endif
}

// The ranks of `group` that share a GPU with an earlier rank: "ranks 0 and 2 share host/0000:1b:00.0 GPU-...;
// ...", or empty. Collective (every rank sees every rank's place, so every rank decides alike).
Result<std::string> shared_gpus(Communicator& group, kernels::Device& device) {
  constexpr size_t kPlace = 512;  // bytes per rank, zero-padded (a host name may be 255)
  std::string mine = device_place(device);
  mine.resize(kPlace - 1, '\0');
  std::vector<char> all(kPlace * static_cast<size_t>(group.size()));
  // Bytes travel as 16-bit words (copied, never converted).
  STRATA_RETURN_IF_ERROR(group.all_gather(mine.c_str(), all.data(), kPlace / 2, DType::kBF16)
                             .with_context("comparing the ranks' GPUs"));
  std::string shared;
  for (int a = 0; a < group.size(); ++a) {
    const std::string pa(&all[kPlace * static_cast<size_t>(a)]);
    for (int b = a + 1; b < group.size(); ++b) {
      if (!same_gpu(pa, std::string(&all[kPlace * static_cast<size_t>(b)]))) continue;
      shared += fmt::format("{}ranks {} and {} share {}", shared.empty() ? "" : "; ", a, b, pa);
      break;
    }
  }
  return shared;
}

// Every rank's plane, or none: the group agrees whether all of its ranks made theirs (NCCL's set-up can fail on
// one rank alone: a device or network it cannot use), so that no rank sends over a plane a peer lacks; then a
// plane made here is dropped where another rank failed. Under "auto" the group goes on without a plane (its
// device buffers staged over MPI), saying why; under "nccl" every rank fails, naming the group and the error.
Result<std::unique_ptr<Communicator>> agree_on_plane(Communicator& group,
                                                           Result<std::unique_ptr<Communicator>> made,
                                                           const std::string& backend, std::string* why_not) {
  const float failed_here = made.is_ok() ? 0.0f : 1.0f;
  float failed = 0.0f;
  STRATA_RETURN_IF_ERROR(group.all_reduce(&failed_here, &failed, 1, DType::kF32, ReduceOp::kMax)
                             .with_context(fmt::format("group '{}' agreeing on its device plane", group.name())));
  if (failed == 0.0f) return std::move(made).value();
  const std::string what = made.is_ok() ? fmt::format("the device plane (NCCL) of group '{}' failed to start on "
                                                      "another of its ranks",
                                                      group.name())
                                        : made.status().to_string();
  if (backend == "nccl") {
    return Status::internal("parallel.distributed_backend \"nccl\": {} (\"auto\" stages the device's buffers "
                            "through host memory over MPI instead)",
                            what);
  }
  STRATA_LOG_WARN("group '{}': no device plane, so its device buffers go through host memory over MPI (slower): {}",
                  group.name(), what);
  *why_not = fmt::format("the device plane failed to start: {}", what);
  return std::unique_ptr<Communicator>();
}

}  // namespace

bool same_gpu(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  const size_t sa = a.find(' '), sb = b.find(' ');
  if (sa == std::string::npos || sb == std::string::npos) return a == b;
  return a.compare(0, sa, b, 0, sb) == 0 || a.compare(sa, std::string::npos, b, sb, std::string::npos) == 0;
}

Result<Communicator*> device_collectives(Communicator* group, kernels::Device& device,
                                               const std::string& backend, const DevicePlaneFactory& make_plane,
                                               std::unique_ptr<Communicator>* owned) {
  if (group != nullptr && device.host_accessible() && backend == "nccl")
    STRATA_LOG_WARN("parallel.distributed_backend \"nccl\": the {} device's memory is the host's, so MPI carries "
                    "group '{}'",
                    device.name(), group->name());
  if (group == nullptr || device.host_accessible()) return group;
  std::unique_ptr<Communicator> plane;
  std::string why_not;  // why the device's buffers are staged through host memory
  if (backend == "mpi") {
    why_not = "parallel.distributed_backend is \"mpi\"";
  } else if (make_plane) {
    STRATA_ASSIGN_OR_RETURN(plane, agree_on_plane(*group, make_plane(*group), backend, &why_not));
  } else if (std::string(device.name()) != "cuda") {
    why_not = fmt::format("NCCL carries CUDA buffers, not the {} device's", device.name());
  } else {
#if STRATA_HAVE_NCCL
    STRATA_ASSIGN_OR_RETURN(const std::string shared, shared_gpus(*group, device));
    if (shared.empty()) {
      auto start_nccl = [&]() -> Result<std::unique_ptr<Communicator>> {  // its errors name the group
        STRATA_ASSIGN_OR_RETURN(auto nccl, NcclCommunicator::create(*group, group->name()));
        return std::unique_ptr<Communicator>(std::move(nccl));
      };
      STRATA_ASSIGN_OR_RETURN(plane, agree_on_plane(*group, start_nccl(), backend, &why_not));
    } else {
      why_not = fmt::format("NCCL needs a GPU per rank, and {}", shared);
    }
#else
    why_not = "this build has no NCCL (built without the CUDA backend)";
#endif
  }
  if (plane == nullptr && backend == "nccl")
    return Status::invalid_argument("parallel.distributed_backend \"nccl\" for group '{}': {}; \"auto\" stages the "
                                    "device's buffers through host memory over MPI instead",
                                    group->name(), why_not);
  if (plane != nullptr) {
    STRATA_LOG_INFO("collectives of group '{}': calls on the {} device's buffers over its own plane (NCCL; a host "
                    "buffer among them copied through device memory), calls on host buffers alone over MPI",
                    group->name(), device.name());
  } else {
    STRATA_LOG_INFO("collectives of group '{}': the {} device's buffers staged through host memory over MPI ({})",
                    group->name(), device.name(), why_not);
  }
  *owned = std::make_unique<StagedCommunicator>(*group, device, std::move(plane));
  return owned->get();
}

}  // namespace strata::comm
