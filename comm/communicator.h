// communicator.h — the collectives and point-to-point messages the parallel logic (ZeRO, tensor and pipeline
// parallelism) is written against, once, whatever carries them: MPI on host buffers (comm/mpi_communicator.h:
// the CPU backend's data plane and every backend's bootstrap; on the GPU, staged through host memory by
// comm/staged_communicator.h) or NCCL on device buffers (comm/nccl_communicator.h).
//
// Every call is collective over the communicator's ranks (send/recv: over the pair) and blocks until its
// buffers may be reused. Reductions are over fp32 only (the host data plane reduces gradients in fp32); data
// movement takes any dtype. Counts are elements.
//
// Failure: a peer that died or hung makes the call fail within the communicator's timeout with a
// DeadlineExceeded status naming the call, the group and the ranks that had not arrived where that is known;
// the caller then stops the job (MpiRuntime::abort) instead of hanging forever.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "common/dtype.h"
#include "common/status.h"

namespace strata::comm {

enum class ReduceOp : uint8_t { kSum, kMax };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The group's name in messages: "world", "dp", "tp", "pp".
  virtual const std::string& name() const = 0;

  // recv[i] = op over ranks of send[i], on every rank; send may equal recv (in place).
  virtual Status all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) = 0;
  // recv holds size() * count elements: rank r's `send` at r * count. In place when send is this rank's part
  // of recv (recv + rank() * count elements).
  virtual Status all_gather(const void* send, void* recv, size_t count, DType dtype) = 0;
  // send holds size() * count elements; recv[i] = op over ranks of send[rank() * count + i].
  virtual Status reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) = 0;
  virtual Status broadcast(void* buf, size_t count, DType dtype, int root) = 0;
  virtual Status send(const void* buf, size_t count, DType dtype, int peer, int tag) = 0;
  virtual Status recv(void* buf, size_t count, DType dtype, int peer, int tag) = 0;
  // Sends `send` to `dest` while receiving from `src` (tag `tag` both ways), as one exchange: two ranks that
  // each send to the other at once do not wait on each other (pipeline stages passing activations one way and
  // gradients the other).
  virtual Status send_recv(const void* send, size_t send_count, int dest, void* recv, size_t recv_count, int src,
                           DType dtype, int tag) = 0;
  virtual Status barrier() = 0;

  // The ranks with the same `color` form a new communicator, ordered by `key` (then by rank here). Collective.
  virtual Result<std::unique_ptr<Communicator>> split(int color, int key, const std::string& name) = 0;

  // How long a call waits for the other ranks before it fails (seconds), and changing that for waits known to
  // be long (the ranks waiting while one of them writes a checkpoint). Each rank sets its own; not collective.
  virtual double timeout() const = 0;
  virtual void set_timeout(double seconds) = 0;
};

}  // namespace strata::comm
