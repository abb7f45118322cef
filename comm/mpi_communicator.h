// mpi_communicator.h — the Communicator over MPI (Open MPI) on host buffers, and the process's MPI runtime.
//
// Jobs start with `mpirun -np N strata ...`; mpi_init() is called once at start-up (also in a process that was
// not started by mpirun: a world of one). Collectives are issued non-blocking and polled, so a peer that died
// or hung turns into a DeadlineExceeded status after `timeout_s` instead of a hang; the communicator is then
// poisoned (every later call fails at once: the group's state is unknown) and the job must stop, normally by
// mpi_abort(), which brings every rank down.
//
// Naming the rank: every communicator has a twin for a roll call. A rank whose wait times out asks every
// other rank of the group, on the twin, what it is waiting in, and listens for `roll_call_s`; a rank that is
// itself waiting in any call of the group (past its first 0.1 s) answers with the call. The error then names
// the ranks that did not answer (hung outside the group's calls, or dead) and where the others wait when that
// is another call than this one (the ranks' calls fell out of step, or a pipeline's send meets no receive).
//
// Large reductions: Open MPI's reduce-scatter of more than a few MiB per rank ran at 0.13 GB/s on the CI
// machine (against 2.6-3.0 GB/s up to 4 MiB; `strata bench comm`), so reduce_scatter cuts a larger one into
// pieces of kReducePiece elements per rank, each packed into a buffer of the communicator's (the copy costs a
// memcpy of the input; the reduction is elementwise, so the result is the same).
//
// Threading: MPI is initialized with MPI_THREAD_MULTIPLE where the library provides it (else SERIALIZED); a
// communicator is used by one thread at a time.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace strata::comm {

struct MpiOptions {
  double timeout_s = 300;   // a collective or message not complete by then is an error
  double roll_call_s = 2;   // after a timeout, how long to wait for the other ranks to say where they are
};

// Initializes MPI once (later calls do nothing); true world size and rank from then on.
Status mpi_init(int* argc, char*** argv);
bool mpi_initialized();
// Whether MPI lets several threads call it at once (ZeRO-3's collectives thread needs it).
bool mpi_thread_multiple();
void mpi_finalize();
// Prints `why` (naming this rank) and stops every rank of the job with exit code 1.
[[noreturn]] void mpi_abort(const Status& why);
// True when this process was started by an MPI launcher (Open MPI's or a PMI one).
bool launched_by_mpi();

class MpiCommunicator final : public Communicator {
 public:
  // MPI_COMM_WORLD (a duplicate: the library's own traffic stays apart). mpi_init() first.
  static Result<std::unique_ptr<MpiCommunicator>> world(const MpiOptions& options = {});
  ~MpiCommunicator() override;

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
  double timeout() const override { return options_.timeout_s; }
  void set_timeout(double seconds) override { options_.timeout_s = seconds; }

 private:
  MpiCommunicator(MPI_Comm comm, std::string name, const MpiOptions& options);
  Status check(int count_ok, const char* what) const;     // not poisoned, count fits an int
  Status check_peer(size_t count, int peer, const char* what) const;  // and peer is another rank
  Status wait(MPI_Request* req, const char* what, size_t count);  // polls until done or the timeout
  Status mpi_error(int code, const char* what) const;
  void answer_roll_calls(const std::string& waiting_in);  // queries from ranks whose wait timed out
  std::string roll_call(const std::string& waiting_in);   // after this rank's timeout: who is where

  MPI_Comm comm_;
  MPI_Comm roll_call_comm_;  // the twin the roll call uses, so it never mixes with the group's own messages
  std::string name_;
  MpiOptions options_;
  int rank_ = 0, size_ = 1, world_rank_ = 0;
  uint64_t calls_ = 0;
  bool poisoned_ = false;
  std::vector<MPI_Request> abandoned_;  // requests a timeout gave up on; completed (bounded) at destruction
  struct Answer {
    MPI_Request req;
    std::shared_ptr<std::string> text;
  };
  std::vector<Answer> answers_;  // roll-call answers on their way (their text must live until sent)
  std::vector<float> pack_;              // one piece of a large reduce-scatter: size() x kReducePiece

 public:
  static constexpr size_t kReducePiece = size_t{1} << 20;  // elements per rank per reduce-scatter call
};

}  // namespace strata::comm
