// nccl_communicator.h — the Communicator over NCCL on device buffers: the CUDA backend's data plane (the MPI
// one stays the bootstrap). Built with the CUDA backend (STRATA_CUDA); every pointer passed is CUDA device
// memory of the device current when the communicator was created.
//
// Creation is collective over a bootstrap communicator (MPI): rank 0 makes NCCL's unique id and broadcasts it,
// and every rank joins on the current CUDA device. The communicator is non-blocking (ncclConfig_t.blocking =
// 0): each call is enqueued on the communicator's own CUDA stream and then polled — the stream, and NCCL's
// asynchronous error — until it completes or `timeout_s` passes; then the communicator is aborted
// (ncclCommAbort) and poisoned, and the call fails with DeadlineExceeded, as the MPI communicator does. Each
// call returns once its buffers may be reused (the stream has drained).
//
// Threading: one thread at a time per communicator.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace strata::comm {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `bootstrap`: the same ranks, in the same order, on NCCL.
  static Result<std::unique_ptr<NcclCommunicator>> create(Communicator& bootstrap, const std::string& name,
                                                          double timeout_s = 300);
  ~NcclCommunicator() override;
  // The current CUDA device's place, "host/PCI bus id GPU-uuid": two ranks share a GPU, which NCCL refuses, when
  // either half is the same for both (the first is what NCCL tells GPUs apart by on one host; the UUID also
  // catches containers that name one host differently). Empty if CUDA cannot say.
  static std::string device_place();

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  Status all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override;
  Status all_gather(const void* send, void* recv, size_t count, DType dtype) override;
  Status reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override;
  Status broadcast(void* buf, size_t count, DType dtype, int root) override;
  Status send(const void* buf, size_t count, DType dtype, int peer, int tag) override;
  Status recv(void* buf, size_t count, DType dtype, int peer, int tag) override;
  Status send_recv(const void* send, size_t send_count, int dest, void* recv, size_t recv_count, int src,
                   DType dtype, int tag) override;
  Status barrier() override;
  Result<std::unique_ptr<Communicator>> split(int color, int key, const std::string& name) override;
  double timeout() const override { return timeout_s_; }
  void set_timeout(double seconds) override;

 private:
  struct Impl;
  explicit NcclCommunicator(std::unique_ptr<Impl> impl);
  Status enqueued(int result, const char* what);          // the status of enqueuing a call
  Status wait(const char* what, size_t count);             // polls until the call completes or the timeout
  Status check(const char* what) const;                    // not poisoned
  Status check_reduction(DType dtype, const char* what) const;  // and fp32
  Status check_peer(int peer, const char* what) const;          // and another rank of the group
  std::unique_ptr<Impl> impl_;
  std::string name_;
  int rank_ = 0, size_ = 1;
  double timeout_s_ = 300;
  bool poisoned_ = false;
};

}  // namespace strata::comm
