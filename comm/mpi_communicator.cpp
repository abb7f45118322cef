#include "comm/mpi_communicator.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "common/timer.h"

namespace strata::comm {
namespace {

MPI_Datatype mpi_type(DType t) { return t == DType::kF32 ? MPI_FLOAT : MPI_UINT16_T; }

constexpr int kRollCallQuery = 1, kRollCallAnswer = 2;  // tags on the roll-call twin
MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kSum ? MPI_SUM : MPI_MAX; }

}  // namespace

Status mpi_init(int* argc, char*** argv) {
  if (mpi_initialized()) return Status::ok();
  int provided = 0;
  const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
  if (rc != MPI_SUCCESS) return Status::internal("MPI_Init_thread failed (error {})", rc);
  if (provided < MPI_THREAD_SERIALIZED)
    return Status::internal("the MPI library gives thread level {}; strata needs MPI_THREAD_SERIALIZED or more",
                            provided);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  return Status::ok();
}

bool mpi_initialized() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

bool mpi_thread_multiple() {
  int level = MPI_THREAD_SINGLE;
  if (mpi_initialized()) MPI_Query_thread(&level);
  return level == MPI_THREAD_MULTIPLE;
}

void mpi_finalize() {
  if (mpi_initialized()) MPI_Finalize();
}

void mpi_abort(const Status& why) {
  int rank = 0;
  if (mpi_initialized()) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "strata: rank %d: %s; stopping every rank\n", rank, why.to_string().c_str());
  std::fflush(stderr);
  if (mpi_initialized()) MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
         std::getenv("PMIX_RANK") != nullptr;
}

Result<std::unique_ptr<MpiCommunicator>> MpiCommunicator::world(const MpiOptions& options) {
  if (!mpi_initialized()) return Status::internal("MPI is not initialized (mpi_init first)");
  MPI_Comm dup;
  if (int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup); rc != MPI_SUCCESS)
    return Status::internal("MPI_Comm_dup of the world failed (error {})", rc);
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(dup, "world", options));
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, const MpiOptions& options)
    : comm_(comm), name_(std::move(name)), options_(options) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_dup(comm_, &roll_call_comm_);  // collective, as creating the communicator is
  MPI_Comm_set_errhandler(roll_call_comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
}

MpiCommunicator::~MpiCommunicator() {
  // Requests given up on complete if the late ranks arrive after all; wait for that a bounded time, and leave
  // the communicator to the job's end otherwise (freeing it under an active request is not allowed).
  Timer t;
  const double patience = std::max(options_.timeout_s, 10.0);
  for (Answer& a : answers_) abandoned_.push_back(a.req);  // their texts live until this returns
  for (MPI_Request& r : abandoned_) {
    int done = 0;
    while (!done && t.seconds() < patience) {
      MPI_Test(&r, &done, MPI_STATUS_IGNORE);
      if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!done) {
      // MPI may still read or write what those requests point at: the buffers this communicator owns are left
      // to the process's end (the job is stopping anyway), never freed under a live request.
      (void)new std::vector<Answer>(std::move(answers_));
      (void)new std::vector<float>(std::move(pack_));
      return;
    }
  }
  MPI_Comm_free(&roll_call_comm_);
  MPI_Comm_free(&comm_);
}

Status MpiCommunicator::mpi_error(int code, const char* what) const {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return Status::internal("{} on group '{}' (rank {} of {}, world rank {}): {}", what, name_, rank_, size_,
                          world_rank_, std::string(text, len));
}

Status MpiCommunicator::check(int count_ok, const char* what) const {
  if (poisoned_)
    return Status::deadline_exceeded("{} on group '{}': an earlier call timed out, so the group's state is unknown",
                                     what, name_);
  if (!count_ok)
    return Status::invalid_argument("{} on group '{}': more than {} elements in one call", what, name_, INT_MAX);
  return Status::ok();
}

Status MpiCommunicator::wait(MPI_Request* req, const char* what, size_t count) {
  ++calls_;
  Timer t;
  int done = 0;
  for (int spins = 0;; ++spins) {
    if (int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) return mpi_error(rc, what);
    if (done) return Status::ok();
    if (t.seconds() > options_.timeout_s) break;
    // Non-blocking collectives advance only inside MPI calls (Open MPI's libnbc), so keep testing: spin, then
    // yield the core between tests (the tests oversubscribe two cores), and sleep only once the call has been
    // waiting long enough to be a straggler rather than a transfer (a 1 ms sleep per round made a 64 MiB
    // reduce-scatter 900x slower).
    if (spins > 1000) {
      if (t.seconds() < 1.0) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    // A rank that gave up may be asking where everyone is (only after a while here: queries come at a timeout).
    if ((spins & 63) == 0 && t.seconds() > 0.1) answer_roll_calls(fmt::format("{} of {} elements", what, count));
  }
  poisoned_ = true;
  abandoned_.push_back(*req);
  const std::string where = roll_call(fmt::format("{} of {} elements", what, count));
  return Status::deadline_exceeded(
      "{} of {} elements (call {}) on group '{}' did not complete within {} s (this is rank {} of {}, world rank "
      "{}): {}",
      what, count, calls_, name_, options_.timeout_s, rank_, size_, world_rank_, where);
}

void MpiCommunicator::answer_roll_calls(const std::string& waiting_in) {
  // Answers already sent let their texts go.
  std::erase_if(answers_, [](Answer& a) {
    int done = 0;
    MPI_Test(&a.req, &done, MPI_STATUS_IGNORE);
    return done != 0;
  });
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kRollCallQuery, roll_call_comm_, &flag, &st) != MPI_SUCCESS || !flag) return;
    char query = 0;
    MPI_Recv(&query, 1, MPI_CHAR, st.MPI_SOURCE, kRollCallQuery, roll_call_comm_, MPI_STATUS_IGNORE);
    Answer a{MPI_REQUEST_NULL, std::make_shared<std::string>(waiting_in)};
    if (MPI_Isend(a.text->data(), static_cast<int>(a.text->size()), MPI_CHAR, st.MPI_SOURCE, kRollCallAnswer,
                  roll_call_comm_, &a.req) == MPI_SUCCESS)
      answers_.push_back(std::move(a));
  }
}

std::string MpiCommunicator::roll_call(const std::string& waiting_in) {
  std::vector<MPI_Request> queries;
  static const char query = 1;  // static: a query to a silent rank stays pending after this returns
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    MPI_Request r;
    if (MPI_Isend(&query, 1, MPI_CHAR, q, kRollCallQuery, roll_call_comm_, &r) == MPI_SUCCESS) queries.push_back(r);
  }
  std::vector<std::optional<std::string>> answered(static_cast<size_t>(size_));
  answered[static_cast<size_t>(rank_)] = waiting_in;
  int pending = size_ - 1;
  Timer t;
  while (pending > 0 && t.seconds() < options_.roll_call_s) {
    answer_roll_calls(waiting_in);  // the others time out too, and ask
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kRollCallAnswer, roll_call_comm_, &flag, &st) == MPI_SUCCESS && flag) {
      int n = 0;
      MPI_Get_count(&st, MPI_CHAR, &n);
      std::string text(static_cast<size_t>(std::max(n, 0)), '\0');
      MPI_Recv(text.data(), n, MPI_CHAR, st.MPI_SOURCE, kRollCallAnswer, roll_call_comm_, MPI_STATUS_IGNORE);
      if (!answered[static_cast<size_t>(st.MPI_SOURCE)]) --pending;
      answered[static_cast<size_t>(st.MPI_SOURCE)] = std::move(text);
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  // The queries to ranks that never took them stay queued: sent eagerly (one byte), they complete locally.
  for (MPI_Request& r : queries) abandoned_.push_back(r);
  std::string silent, elsewhere;
  for (int q = 0; q < size_; ++q) {
    const auto& a = answered[static_cast<size_t>(q)];
    if (!a) {
      silent += fmt::format("{}{}", silent.empty() ? "" : ", ", q);
    } else if (*a != waiting_in) {
      elsewhere += fmt::format("{}rank {} waits in {}", elsewhere.empty() ? "" : "; ", q, *a);
    }
  }
  std::string out;
  if (!silent.empty())
    out = fmt::format("rank(s) {} of group '{}' did not answer within {} s (hung outside the group's calls, or dead)",
                      silent, name_, options_.roll_call_s);
  if (!elsewhere.empty()) out += fmt::format("{}{}", out.empty() ? "" : "; ", elsewhere);
  return out.empty() ? fmt::format("every rank of group '{}' waits in this call (a rank outside it hung?)", name_)
                     : out;
}

Status MpiCommunicator::all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  STRATA_RETURN_IF_ERROR(check(count <= INT_MAX, "all_reduce"));
  if (dtype != DType::kF32)
    return Status::invalid_argument("all_reduce on group '{}': reductions are fp32 only, got {}", name_,
                                    dtype_name(dtype));
  MPI_Request req;
  const void* in = send == recv ? MPI_IN_PLACE : send;
  if (int rc = MPI_Iallreduce(in, recv, static_cast<int>(count), MPI_FLOAT, mpi_op(op), comm_, &req);
      rc != MPI_SUCCESS)
    return mpi_error(rc, "all_reduce");
  return wait(&req, op == ReduceOp::kSum ? "all_reduce(sum)" : "all_reduce(max)", count);
}

Status MpiCommunicator::all_gather(const void* send, void* recv, size_t count, DType dtype) {
  STRATA_RETURN_IF_ERROR(check(count <= INT_MAX, "all_gather"));
  MPI_Request req;
  const int n = static_cast<int>(count);
  const void* mine = static_cast<const char*>(recv) + static_cast<size_t>(rank_) * count * dtype_size(dtype);
  const void* in = send == mine ? MPI_IN_PLACE : send;
  if (int rc = MPI_Iallgather(in, n, mpi_type(dtype), recv, n, mpi_type(dtype), comm_, &req); rc != MPI_SUCCESS)
    return mpi_error(rc, "all_gather");
  return wait(&req, "all_gather", count);
}

Status MpiCommunicator::reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  STRATA_RETURN_IF_ERROR(check(count <= INT_MAX, "reduce_scatter"));
  if (dtype != DType::kF32)
    return Status::invalid_argument("reduce_scatter on group '{}': reductions are fp32 only, got {}", name_,
                                    dtype_name(dtype));
  const char* what = op == ReduceOp::kSum ? "reduce_scatter(sum)" : "reduce_scatter(max)";
  MPI_Request req;
  if (count <= kReducePiece) {
    if (int rc = MPI_Ireduce_scatter_block(send, recv, static_cast<int>(count), MPI_FLOAT, mpi_op(op), comm_, &req);
        rc != MPI_SUCCESS)
      return mpi_error(rc, what);
    return wait(&req, what, count);
  }
  // Piece by piece: rank q's part of piece [a, a + k) is send[q * count + a, + k).
  const auto* in = static_cast<const float*>(send);
  pack_.resize(static_cast<size_t>(size_) * kReducePiece);
  for (size_t a = 0; a < count; a += kReducePiece) {
    const size_t k = std::min(kReducePiece, count - a);
    for (size_t q = 0; q < static_cast<size_t>(size_); ++q)
      std::memcpy(pack_.data() + q * k, in + q * count + a, k * sizeof(float));
    if (int rc = MPI_Ireduce_scatter_block(pack_.data(), static_cast<float*>(recv) + a, static_cast<int>(k), MPI_FLOAT,
                                           mpi_op(op), comm_, &req);
        rc != MPI_SUCCESS)
      return mpi_error(rc, what);
    STRATA_RETURN_IF_ERROR(wait(&req, what, k));
  }
  return Status::ok();
}

Status MpiCommunicator::broadcast(void* buf, size_t count, DType dtype, int root) {
  STRATA_RETURN_IF_ERROR(check(count <= INT_MAX, "broadcast"));
  if (root < 0 || root >= size_)
    return Status::invalid_argument("broadcast on group '{}': root {} is not one of its {} ranks", name_, root, size_);
  MPI_Request req;
  if (int rc = MPI_Ibcast(buf, static_cast<int>(count), mpi_type(dtype), root, comm_, &req); rc != MPI_SUCCESS)
    return mpi_error(rc, "broadcast");
  return wait(&req, "broadcast", count);
}

Status MpiCommunicator::check_peer(size_t count, int peer, const char* what) const {
  STRATA_RETURN_IF_ERROR(check(count <= INT_MAX, what));
  if (peer < 0 || peer >= size_ || peer == rank_)
    return Status::invalid_argument("{} on group '{}': peer {} is not another of its {} ranks", what, name_, peer, size_);
  return Status::ok();
}

Status MpiCommunicator::send(const void* buf, size_t count, DType dtype, int peer, int tag) {
  STRATA_RETURN_IF_ERROR(check_peer(count, peer, "send"));
  MPI_Request req;
  if (int rc = MPI_Isend(buf, static_cast<int>(count), mpi_type(dtype), peer, tag, comm_, &req); rc != MPI_SUCCESS)
    return mpi_error(rc, "send");
  return wait(&req, "send", count);
}

Status MpiCommunicator::recv(void* buf, size_t count, DType dtype, int peer, int tag) {
  STRATA_RETURN_IF_ERROR(check_peer(count, peer, "recv"));
  MPI_Request req;
  if (int rc = MPI_Irecv(buf, static_cast<int>(count), mpi_type(dtype), peer, tag, comm_, &req); rc != MPI_SUCCESS)
    return mpi_error(rc, "recv");
  return wait(&req, "recv", count);
}

Status MpiCommunicator::send_recv(const void* send, size_t send_count, int dest, void* recv, size_t recv_count,
                                  int src, DType dtype, int tag) {
  STRATA_RETURN_IF_ERROR(check_peer(send_count, dest, "send_recv"));
  STRATA_RETURN_IF_ERROR(check_peer(recv_count, src, "send_recv"));
  MPI_Request reqs[2];
  if (int rc = MPI_Irecv(recv, static_cast<int>(recv_count), mpi_type(dtype), src, tag, comm_, &reqs[0]);
      rc != MPI_SUCCESS)
    return mpi_error(rc, "send_recv");
  if (int rc = MPI_Isend(send, static_cast<int>(send_count), mpi_type(dtype), dest, tag, comm_, &reqs[1]);
      rc != MPI_SUCCESS) {
    // The receive is posted: it must complete (or be abandoned) before its buffer goes.
    (void)wait(&reqs[0], "send_recv (receive)", recv_count);
    return mpi_error(rc, "send_recv");
  }
  // Both advance while either is polled.
  if (Status st = wait(&reqs[0], "send_recv (receive)", recv_count); !st.is_ok()) {
    abandoned_.push_back(reqs[1]);  // completed (bounded) at destruction, like the receive
    return st;
  }
  return wait(&reqs[1], "send_recv (send)", send_count);
}

Status MpiCommunicator::barrier() {
  STRATA_RETURN_IF_ERROR(check(1, "barrier"));
  MPI_Request req;
  if (int rc = MPI_Ibarrier(comm_, &req); rc != MPI_SUCCESS) return mpi_error(rc, "barrier");
  return wait(&req, "barrier", 0);
}

Result<std::unique_ptr<Communicator>> MpiCommunicator::split(int color, int key, const std::string& name) {
  STRATA_RETURN_IF_ERROR(check(1, "split"));
  MPI_Comm out;
  if (int rc = MPI_Comm_split(comm_, color, key, &out); rc != MPI_SUCCESS) return mpi_error(rc, "split");
  return std::unique_ptr<Communicator>(new MpiCommunicator(out, name, options_));
}

}  // namespace strata::comm
