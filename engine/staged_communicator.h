// staged_communicator.h — the collectives of a device the host cannot address (CUDA), carried by a host
// communicator (MPI): each call copies the device buffers it reads to host memory, runs the host call, and
// copies what it wrote back to the device. Host buffers pass straight through, so one communicator serves the
// trainer's scalars and the model's device tensors alike, and a call may mix the two (ZeRO-3 gathers pinned
// host shards into a device slot and reduce-scatters device gradients into pinned host memory).
//
// This is the data plane for data, tensor and pipeline parallelism on the GPU where NCCL cannot be used: several
// ranks sharing one GPU (NCCL refuses two ranks on one device), or a build without NCCL. With one GPU per rank,
// NCCL (comm/nccl_communicator.h) is the faster plane; it is not wired into training yet.
//
// A buffer is the device's when it starts in a live allocate()d buffer (Device::owns); one that starts there
// and runs past the buffer's end is an error. Before a call touches device memory it waits for the device's
// compute stream (Device::synchronize(), which any thread may call), so the kernels that wrote a send buffer
// have finished and none still reads a receive buffer, unless the caller fences (set_caller_fenced). The copies
// run on the device's copy streams (upload/download), so a call may come from any thread (ZeRO-3's collectives
// thread included), one at a time per communicator, as for every Communicator. The staging memory is this
// communicator's, grown to the largest call and registered with the device (page-locked); it is outside
// host_memory_limit (about twice the largest call, per group).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include "comm/communicator.h"
#include "common/aligned.h"
#include "kernels/device.h"

namespace strata::engine {

class StagedCommunicator final : public comm::Communicator {
 public:
  // `host` carries the calls (borrowed: it must outlive this; or owned); `device`, which must outlive this
  // too, owns the device buffers.
  StagedCommunicator(comm::Communicator& host, kernels::Device& device) : host_(&host), device_(device) {}
  StagedCommunicator(std::unique_ptr<comm::Communicator> host, kernels::Device& device)
      : owned_(std::move(host)), host_(owned_.get()), device_(device) {}
  ~StagedCommunicator() override;

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  const std::string& name() const override { return host_->name(); }
  Status all_reduce(const void* send, void* recv, size_t count, DType dtype, comm::ReduceOp op) override;
  Status all_gather(const void* send, void* recv, size_t count, DType dtype) override;
  Status reduce_scatter(const void* send, void* recv, size_t count, DType dtype, comm::ReduceOp op) override;
  Status broadcast(void* buf, size_t count, DType dtype, int root) override;
  Status send(const void* buf, size_t count, DType dtype, int peer, int tag) override;
  Status recv(void* buf, size_t count, DType dtype, int peer, int tag) override;
  Status send_recv(const void* send, size_t send_count, int dest, void* recv, size_t recv_count, int src,
                   DType dtype, int tag) override;
  Status barrier() override { return host_->barrier(); }
  // The split of the host communicator, staged through this device too.
  Result<std::unique_ptr<comm::Communicator>> split(int color, int key, const std::string& name) override;

  // The caller waits, before each call, for the kernels that wrote what it sends and those that read what it
  // receives into (a fence, as ZeRO-3's collectives thread does): the calls then skip waiting for the whole
  // compute stream, which would hold each prefetch back until every kernel queued so far had run. Its splits
  // inherit it.
  void set_caller_fenced(bool fenced) { caller_fenced_ = fenced; }

  // Bytes copied each way since creation (tests; a figure for logs).
  size_t bytes_down() const { return bytes_down_; }
  size_t bytes_up() const { return bytes_up_; }

 private:
  // Staging memory `which` (0: what is sent, 1: what is received) of at least `bytes`.
  Result<std::byte*> staging(int which, size_t bytes);
  // What the host call sends: `send` itself, or (on the device) its bytes copied to the send staging memory.
  Result<const void*> outgoing(const void* send, size_t bytes, bool on_dev);
  // Where the host call receives: `recv` itself, or (on the device) the receive staging memory.
  Result<void*> incoming(void* recv, size_t bytes, bool on_dev);
  // Whether [p, p + bytes) is the device's memory (by where it starts); an error if it starts in a device buffer
  // and runs past its end, which MPI would otherwise be handed as host memory.
  Result<bool> on_device(const void* p, size_t bytes) const;
  void sync() {
    if (!caller_fenced_) device_.synchronize();
  }
  void down(void* host, const void* dev, size_t bytes);
  void up(void* dev, const void* host, size_t bytes);

  std::unique_ptr<comm::Communicator> owned_;
  comm::Communicator* host_;
  kernels::Device& device_;
  AlignedBuffer stage_[2];
  bool registered_[2] = {false, false};
  size_t bytes_down_ = 0, bytes_up_ = 0;
  bool caller_fenced_ = false;
};

// `group` itself when the device's memory is the host's (nothing to stage), else `group` staged through
// `device`; null stays null. `owned` keeps the wrapper alive.
comm::Communicator* staged_if_needed(comm::Communicator* group, kernels::Device& device,
                                     std::unique_ptr<comm::Communicator>* owned);

}  // namespace strata::engine
