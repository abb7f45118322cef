// staged_communicator.h — the collectives of a device the host cannot address (CUDA). A call with any of its
// buffers on the device goes over the device's own plane (NCCL) where the group has one: a host buffer of such a
// call is copied to device memory first (ZeRO-3 gathers pinned host shards into a device slot: only this rank's
// shard crosses to the device) and what the plane wrote into device memory is copied back (ZeRO-3's
// reduce-scatter of device gradients into pinned host memory: only this rank's part comes back). Without a
// device plane such a call is carried by the host communicator (MPI): it copies the device buffers it reads to
// host memory, runs the host call, and copies what it wrote back to the device. A call on host buffers alone
// goes over the host communicator either way, so one communicator serves the trainer's scalars and the model's
// device tensors alike.
//
// Which plane a call takes depends only on where its buffers are, which is the same on every rank (the same
// code makes the same call; a message's sender and receiver use buffers of the same kind), so the ranks of a
// group always meet on the same plane. Without a device plane everything on the device is staged: several
// ranks sharing one GPU (NCCL refuses two ranks on one device), a build without NCCL, or
// parallel.distributed_backend "mpi". device_collectives() below chooses.
//
// A buffer is the device's when it starts in a live allocate()d buffer (Device::owns); one that starts there
// and runs past the buffer's end is an error. Before a call touches device memory it waits for the device's
// compute stream (Device::synchronize(), which any thread may call), so the kernels that wrote a send buffer
// have finished and none still reads a receive buffer, unless the caller fences (set_caller_fenced). The copies
// run on the device's copy streams (upload/download), so a call may come from any thread (ZeRO-3's collectives
// thread included), one at a time per communicator, as for every Communicator. The staging memory is this
// communicator's, grown to the largest call: on the host registered with the device (page-locked) and outside
// host_memory_limit (about twice the largest staged call, per group); on the device (the plane's mixed calls)
// within device_memory_limit. NCCL's own device buffers are outside device_memory_limit.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "comm/communicator.h"
#include "common/aligned.h"
#include "kernels/device.h"

namespace strata::comm {

class StagedCommunicator final : public Communicator {
 public:
  // `host` carries the calls (borrowed: it must outlive this; or owned); `device`, which must outlive this
  // too, owns the device buffers. `device_plane`, when given, is the same ranks in the same order on a
  // communicator that takes the device's buffers (NCCL), and carries every call with a buffer there.
  StagedCommunicator(Communicator& host, kernels::Device& device,
                     std::unique_ptr<Communicator> device_plane = nullptr)
      : host_(&host), plane_(std::move(device_plane)), device_(device) {}
  StagedCommunicator(std::unique_ptr<Communicator> host, kernels::Device& device,
                     std::unique_ptr<Communicator> device_plane = nullptr)
      : owned_(std::move(host)), host_(owned_.get()), plane_(std::move(device_plane)), device_(device) {}
  ~StagedCommunicator() override;

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  const std::string& name() const override { return host_->name(); }
  Status all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override;
  Status all_gather(const void* send, void* recv, size_t count, DType dtype) override;
  Status reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override;
  Status broadcast(void* buf, size_t count, DType dtype, int root) override;
  Status send(const void* buf, size_t count, DType dtype, int peer, int tag) override;
  Status recv(void* buf, size_t count, DType dtype, int peer, int tag) override;
  Status send_recv(const void* send, size_t send_count, int dest, void* recv, size_t recv_count, int src,
                   DType dtype, int tag) override;
  Status barrier() override { return host_->barrier(); }
  // The split of the host communicator (and of the device plane), staged through this device too.
  Result<std::unique_ptr<Communicator>> split(int color, int key, const std::string& name) override;
  double timeout() const override { return host_->timeout(); }
  void set_timeout(double seconds) override {  // both planes: a call may go over either
    host_->set_timeout(seconds);
    if (plane_) plane_->set_timeout(seconds);
  }
  // The same, with or without a device plane (without: its calls on device buffers staged through host memory).
  Result<std::unique_ptr<Communicator>> split(int color, int key, const std::string& name,
                                                    bool with_device_plane);

  // The caller waits, before each call, for the kernels that wrote what it sends and those that read what it
  // receives into (a fence, as ZeRO-3's collectives thread does): the calls then skip waiting for the whole
  // compute stream, which would hold each prefetch back until every kernel queued so far had run. Its splits
  // inherit it.
  void set_caller_fenced(bool fenced) { caller_fenced_ = fenced; }
  // With a device plane: the device memory that a reduce-scatter of device buffers into host memory receives
  // into, at least `bytes`, allocated now (ZeRO-3 reserves its largest shard at setup, so that its collectives
  // thread never allocates, nor frees, device memory: a cudaFree waits for the whole device, NCCL's kernels
  // included). Larger calls grow it.
  Status reserve_device_staging(size_t bytes);

  // Bytes copied each way since creation, and the calls the device plane carried (tests; figures for logs).
  size_t bytes_down() const { return bytes_down_; }
  size_t bytes_up() const { return bytes_up_; }
  size_t device_plane_calls() const { return plane_calls_; }
  bool has_device_plane() const { return plane_ != nullptr; }

 private:
  // Staging memory `which` (0: what is sent, 1: what is received) of at least `bytes`.
  Result<std::byte*> staging(int which, size_t bytes);
  // What the host call sends: `send` itself, or (on the device) its bytes copied to the send staging memory.
  Result<const void*> outgoing(const void* send, size_t bytes, bool on_dev);
  // Where the host call receives: `recv` itself, or (on the device) the receive staging memory.
  Result<void*> incoming(void* recv, size_t bytes, bool on_dev);
  // Device memory `which` (0: what is sent, 1: what is received) of at least `bytes`, for the device plane's
  // calls that mix host and device buffers (allocated within device_memory_limit, "collectives.staging").
  Result<std::byte*> device_staging(int which, size_t bytes);
  // A call on the device plane: `call(s, r)` with s = `send` (sd: on the device) or its bytes uploaded to
  // device staging, and r = `recv` (rd) or device staging, downloaded to `recv` after.
  template <typename Call>
  Status over_plane(const void* send, size_t send_bytes, bool sd, void* recv, size_t recv_bytes, bool rd, Call call);
  // Whether [p, p + bytes) is the device's memory (by where it starts); an error if it starts in a device buffer
  // and runs past its end, which MPI would otherwise be handed as host memory.
  Result<bool> on_device(const void* p, size_t bytes) const;
  void sync() {
    if (!caller_fenced_) device_.synchronize();
  }
  void down(void* host, const void* dev, size_t bytes);
  void up(void* dev, const void* host, size_t bytes);

  std::unique_ptr<Communicator> owned_;
  Communicator* host_;
  std::unique_ptr<Communicator> plane_;
  kernels::Device& device_;
  AlignedBuffer stage_[2];
  bool registered_[2] = {false, false};
  kernels::DeviceBuffer device_stage_[2];
  size_t bytes_down_ = 0, bytes_up_ = 0, plane_calls_ = 0;
  bool caller_fenced_ = false;
};

// Whether two GPU places ("host/PCI bus id GPU-uuid", NcclCommunicator::device_place) are one GPU: the same
// host and bus, or the same UUID. Empty places (CUDA could not say) are nobody's.
bool same_gpu(const std::string& a, const std::string& b);

// A group's device plane: the same ranks, in the same order, on a communicator that takes the device's buffers.
using DevicePlaneFactory = std::function<Result<std::unique_ptr<Communicator>>(Communicator& group)>;

// How the groups' collectives travel on `device` (parallel.distributed_backend): `group` itself when the device's
// memory is the host's (nothing to stage); else a StagedCommunicator over `group`, with a device plane unless
// `backend` is "mpi" — NCCL, or what `make_plane` makes (tests: MPI posing as NCCL). "auto" takes NCCL when
// this build has it and no two ranks of the group share a GPU, and says why not otherwise; "nccl" fails where
// "auto" would not take it, naming why. Where the plane fails to start on any rank, "auto" stages the group
// (a warning says why) and "nccl" fails on every rank of the group (ranks of other groups learn of it from the
// caller: the command aborts the job). Collective over `group` (the ranks compare their GPUs and agree on the
// plane). Null stays null; `owned` keeps the wrapper alive.
Result<Communicator*> device_collectives(Communicator* group, kernels::Device& device,
                                               const std::string& backend, const DevicePlaneFactory& make_plane,
                                               std::unique_ptr<Communicator>* owned);

}  // namespace strata::comm
