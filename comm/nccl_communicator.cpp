#include "comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "common/timer.h"

namespace strata::comm {
namespace {

ncclDataType_t nccl_type(DType t) { return t == DType::kF32 ? ncclFloat32 : ncclBfloat16; }
ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclMax; }

// Polls a non-blocking communicator until its pending initialisation or split has finished: its state, or why
// the state could not be read.
ncclResult_t settle(ncclComm_t comm, double timeout_s) {
  Timer t;
  for (;;) {
    ncclResult_t state = ncclInProgress;
    if (ncclResult_t r = ncclCommGetAsyncError(comm, &state); r != ncclSuccess) return r;
    if (state != ncclInProgress || t.seconds() >= timeout_s) return state;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace

struct NcclCommunicator::Impl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  float* scratch = nullptr;  // one float on the device, for barrier()
  bool aborted = false;       // ncclCommAbort freed the communicator
  double timeout_s = 300;

  // A communicator whose set-up failed or did not finish: aborted, not finalized (ncclCommFinalize and
  // ncclCommDestroy wait for peers, and for a pending initialisation, that may never come).
  void abandon() {
    if (comm != nullptr && !aborted) ncclCommAbort(comm);
    aborted = true;
  }

  ~Impl() {
    if (comm != nullptr && !aborted) {
      ncclCommFinalize(comm);
      (void)settle(comm, timeout_s);
      ncclCommDestroy(comm);
    }
    if (scratch != nullptr) cudaFree(scratch);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  // The stream and scratch float of a communicator about to be created.
  Status prepare() {
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess)
      return Status::internal("cudaStreamCreate: {}", cudaGetErrorString(e));
    if (cudaError_t e = cudaMalloc(&scratch, sizeof(float)); e != cudaSuccess)
      return Status::internal("cudaMalloc: {}", cudaGetErrorString(e));
    return Status::ok();
  }
};

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

NcclCommunicator::~NcclCommunicator() = default;

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create(Communicator& bootstrap, const std::string& name,
                                                                   double timeout_s) {
  auto impl = std::make_unique<Impl>();
  impl->timeout_s = timeout_s;
  // Rank 0's unique id, and whether it has one: it broadcasts either way, so that a failure there fails every
  // rank now instead of leaving the others waiting.
  struct {
    ncclUniqueId id;
    uint16_t made;
  } shared;
  std::memset(&shared, 0, sizeof(shared));
  ncclResult_t made = ncclSuccess;
  if (bootstrap.rank() == 0) {
    made = ncclGetUniqueId(&shared.id);
    shared.made = made == ncclSuccess ? 1 : 0;
  }
  // The bytes travel as 16-bit words (copied, never converted).
  static_assert(sizeof(shared) % 2 == 0);
  STRATA_RETURN_IF_ERROR(
      bootstrap.broadcast(&shared, sizeof(shared) / 2, DType::kBF16, 0).with_context("NCCL unique id"));
  if (shared.made == 0) {
    return Status::internal("NCCL communicator '{}': rank 0 could not make NCCL's unique id{}", name,
                            bootstrap.rank() == 0 ? fmt::format(" ({})", ncclGetErrorString(made)) : "");
  }
  const ncclUniqueId& id = shared.id;
  // Every rank's stream and scratch, agreed on before the initialisation, which is collective: a rank that
  // returned here alone would leave its peers in it until their timeout. The highest failing rank is named.
  const Status prepared = impl->prepare();
  const float failed_here = prepared.is_ok() ? 0.0f : static_cast<float>(bootstrap.rank() + 1);
  float failed = 0.0f;
  STRATA_RETURN_IF_ERROR(bootstrap.all_reduce(&failed_here, &failed, 1, DType::kF32, ReduceOp::kMax)
                             .with_context(fmt::format("NCCL communicator '{}': agreeing on its set-up", name)));
  if (!prepared.is_ok()) {
    return Status::internal("NCCL communicator '{}' (rank {} of {}): {}", name, bootstrap.rank(), bootstrap.size(),
                            prepared.message());
  }
  if (failed != 0.0f) {
    return Status::internal("NCCL communicator '{}': rank {} could not set up its stream and buffer", name,
                            static_cast<int>(failed) - 1);
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t r = ncclCommInitRankConfig(&impl->comm, bootstrap.size(), id, bootstrap.rank(), &config);
  if (r == ncclInProgress) r = settle(impl->comm, timeout_s);
  if (r != ncclSuccess) {
    impl->abandon();
    return Status(r == ncclInProgress ? StatusCode::kDeadlineExceeded : StatusCode::kInternal,
                  fmt::format("NCCL communicator '{}' (rank {} of {}): {}", name, bootstrap.rank(), bootstrap.size(),
                              r == ncclInProgress ? "initialisation did not finish in time" : ncclGetErrorString(r)));
  }
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(std::move(impl)));
  c->name_ = name;
  c->rank_ = bootstrap.rank();
  c->size_ = bootstrap.size();
  c->timeout_s_ = timeout_s;
  return c;
}

std::string NcclCommunicator::device_place() {
  int device = 0;
  char bus[64] = {};
  cudaDeviceProp p{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetPCIBusId(bus, sizeof(bus), device) != cudaSuccess ||
      cudaGetDeviceProperties(&p, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) return {};
  std::string uuid = "GPU";  // as nvidia-smi writes it: GPU-8-4-4-4-12 hex digits
  for (int i = 0; i < 16; ++i)
    uuid += fmt::format("{}{:02x}", i == 0 || i == 4 || i == 6 || i == 8 || i == 10 ? "-" : "",
                        static_cast<unsigned char>(p.uuid.bytes[i]));
  return fmt::format("{}/{} {}", host, bus, uuid);
}

Status NcclCommunicator::check(const char* what) const {
  if (poisoned_)
    return Status::deadline_exceeded("{} on NCCL group '{}': an earlier call timed out, so the group's state is unknown",
                                     what, name_);
  return Status::ok();
}

Status NcclCommunicator::check_reduction(DType dtype, const char* what) const {
  STRATA_RETURN_IF_ERROR(check(what));
  if (dtype != DType::kF32)
    return Status::invalid_argument("{} on NCCL group '{}': reductions are fp32 only, got {}", what, name_,
                                    dtype_name(dtype));
  return Status::ok();
}

Status NcclCommunicator::check_peer(int peer, const char* what) const {
  STRATA_RETURN_IF_ERROR(check(what));
  if (peer < 0 || peer >= size_ || peer == rank_)
    return Status::invalid_argument("{} on NCCL group '{}': peer {} is not another of its {} ranks", what, name_, peer,
                                    size_);
  return Status::ok();
}

Status NcclCommunicator::enqueued(int result, const char* what) {
  const auto r = static_cast<ncclResult_t>(result);
  if (r == ncclSuccess || r == ncclInProgress) return Status::ok();
  return Status::internal("{} on NCCL group '{}' (rank {} of {}): {}", what, name_, rank_, size_,
                          ncclGetErrorString(r));
}

Status NcclCommunicator::wait(const char* what, size_t count) {
  Timer t;
  for (;;) {
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(impl_->comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      poisoned_ = true;
      return Status::internal("{} of {} elements on NCCL group '{}' (rank {} of {}): {}", what, count, name_, rank_,
                              size_, ncclGetErrorString(async));
    }
    const cudaError_t e = cudaStreamQuery(impl_->stream);
    if (e == cudaSuccess && async == ncclSuccess) return Status::ok();
    if (e != cudaSuccess && e != cudaErrorNotReady)
      return Status::internal("{} on NCCL group '{}': {}", what, name_, cudaGetErrorString(e));
    if (t.seconds() > timeout_s_) break;
    if (t.seconds() > 0.001) std::this_thread::yield();
  }
  poisoned_ = true;
  impl_->aborted = true;
  ncclCommAbort(impl_->comm);
  return Status::deadline_exceeded(
      "{} of {} elements on NCCL group '{}' did not complete within {} s: a rank of the group died or hung (this is "
      "rank {} of {}); the communicator is aborted",
      what, count, name_, timeout_s_, rank_, size_);
}

Status NcclCommunicator::all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  STRATA_RETURN_IF_ERROR(check_reduction(dtype, "all_reduce"));
  STRATA_RETURN_IF_ERROR(enqueued(
      ncclAllReduce(send, recv, count, ncclFloat32, nccl_op(op), impl_->comm, impl_->stream), "all_reduce"));
  return wait("all_reduce", count);
}

Status NcclCommunicator::all_gather(const void* send, void* recv, size_t count, DType dtype) {
  STRATA_RETURN_IF_ERROR(check("all_gather"));
  // In place when send is this rank's part of recv, which NCCL handles itself.
  STRATA_RETURN_IF_ERROR(
      enqueued(ncclAllGather(send, recv, count, nccl_type(dtype), impl_->comm, impl_->stream), "all_gather"));
  return wait("all_gather", count);
}

Status NcclCommunicator::reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  STRATA_RETURN_IF_ERROR(check_reduction(dtype, "reduce_scatter"));
  STRATA_RETURN_IF_ERROR(enqueued(
      ncclReduceScatter(send, recv, count, ncclFloat32, nccl_op(op), impl_->comm, impl_->stream), "reduce_scatter"));
  return wait("reduce_scatter", count);
}

Status NcclCommunicator::broadcast(void* buf, size_t count, DType dtype, int root) {
  STRATA_RETURN_IF_ERROR(check("broadcast"));
  if (root < 0 || root >= size_)
    return Status::invalid_argument("broadcast on NCCL group '{}': root {} is not one of its {} ranks", name_, root,
                                    size_);
  STRATA_RETURN_IF_ERROR(
      enqueued(ncclBroadcast(buf, buf, count, nccl_type(dtype), root, impl_->comm, impl_->stream), "broadcast"));
  return wait("broadcast", count);
}

// NCCL matches point-to-point messages in order per peer: `tag` is not needed (nor used).
Status NcclCommunicator::send(const void* buf, size_t count, DType dtype, int peer, int tag) {
  (void)tag;
  STRATA_RETURN_IF_ERROR(check_peer(peer, "send"));
  STRATA_RETURN_IF_ERROR(enqueued(ncclSend(buf, count, nccl_type(dtype), peer, impl_->comm, impl_->stream), "send"));
  return wait("send", count);
}

Status NcclCommunicator::recv(void* buf, size_t count, DType dtype, int peer, int tag) {
  (void)tag;
  STRATA_RETURN_IF_ERROR(check_peer(peer, "recv"));
  STRATA_RETURN_IF_ERROR(enqueued(ncclRecv(buf, count, nccl_type(dtype), peer, impl_->comm, impl_->stream), "recv"));
  return wait("recv", count);
}

Status NcclCommunicator::send_recv(const void* send, size_t send_count, int dest, void* recv, size_t recv_count,
                                   int src, DType dtype, int tag) {
  (void)tag;
  STRATA_RETURN_IF_ERROR(check_peer(dest, "send_recv"));
  STRATA_RETURN_IF_ERROR(check_peer(src, "send_recv"));
  // One group: both are posted before either waits.
  STRATA_RETURN_IF_ERROR(enqueued(ncclGroupStart(), "send_recv"));
  const ncclResult_t s = ncclSend(send, send_count, nccl_type(dtype), dest, impl_->comm, impl_->stream);
  const ncclResult_t r = ncclRecv(recv, recv_count, nccl_type(dtype), src, impl_->comm, impl_->stream);
  STRATA_RETURN_IF_ERROR(enqueued(ncclGroupEnd(), "send_recv"));
  STRATA_RETURN_IF_ERROR(enqueued(s, "send_recv (send)"));
  STRATA_RETURN_IF_ERROR(enqueued(r, "send_recv (receive)"));
  return wait("send_recv", send_count + recv_count);
}

void NcclCommunicator::set_timeout(double seconds) {
  timeout_s_ = seconds;
  impl_->timeout_s = seconds;
}

Status NcclCommunicator::barrier() { return all_reduce(impl_->scratch, impl_->scratch, 1, DType::kF32, ReduceOp::kSum); }

Result<std::unique_ptr<Communicator>> NcclCommunicator::split(int color, int key, const std::string& name) {
  STRATA_RETURN_IF_ERROR(check("split"));
  auto impl = std::make_unique<Impl>();
  impl->timeout_s = timeout_s_;
  STRATA_RETURN_IF_ERROR(impl->prepare());
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  // A non-blocking split runs as a job of the parent and writes the child's handle only once it has finished
  // (NULL until then), so wait on the parent first, then on the child.
  ncclResult_t r = ncclCommSplit(impl_->comm, color, key, &impl->comm, &config);
  if (r == ncclInProgress || r == ncclSuccess) r = settle(impl_->comm, timeout_s_);
  if (r == ncclInProgress) {
    // The job may still write the child's handle into impl: leave it to the job (a leak on a path that has
    // already failed), and this group's state is unknown.
    (void)impl.release();
    poisoned_ = true;
    return Status::deadline_exceeded("split of NCCL group '{}' into '{}': did not finish in time", name_, name);
  }
  if (r == ncclSuccess) r = impl->comm == nullptr ? ncclInternalError : settle(impl->comm, timeout_s_);
  if (r != ncclSuccess) {
    impl->abandon();
    return Status(r == ncclInProgress ? StatusCode::kDeadlineExceeded : StatusCode::kInternal,
                  fmt::format("split of NCCL group '{}' into '{}': {}", name_, name,
                              r == ncclInProgress ? "the new group did not finish in time" : ncclGetErrorString(r)));
  }
  int rank = 0, size = 1;
  ncclCommUserRank(impl->comm, &rank);
  ncclCommCount(impl->comm, &size);
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(std::move(impl)));
  c->name_ = name;
  c->rank_ = rank;
  c->size_ = size;
  c->timeout_s_ = timeout_s_;
  return std::unique_ptr<Communicator>(std::move(c));
}

}  // namespace strata::comm
