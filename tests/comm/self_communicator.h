// self_communicator.h — a world of one in this process, for tests that need a bootstrap or host communicator
// without an MPI runtime (the NCCL tests on one GPU): every collective is a copy, or nothing; messages to
// another rank are refused.
#pragma once

#include <cstring>
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace strata::comm::testing {

class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& name() const override { return name_; }
  Status all_reduce(const void* s, void* r, size_t n, DType t, ReduceOp) override { return copy(s, r, n, t); }
  Status all_gather(const void* s, void* r, size_t n, DType t) override { return copy(s, r, n, t); }
  Status reduce_scatter(const void* s, void* r, size_t n, DType t, ReduceOp) override { return copy(s, r, n, t); }
  Status broadcast(void*, size_t, DType, int) override { return Status::ok(); }
  Status send(const void*, size_t, DType, int, int) override { return Status::invalid_argument("a world of one"); }
  Status recv(void*, size_t, DType, int, int) override { return Status::invalid_argument("a world of one"); }
  Status send_recv(const void*, size_t, int, void*, size_t, int, DType, int) override {
    return Status::invalid_argument("a world of one");
  }
  Status barrier() override { return Status::ok(); }
  Result<std::unique_ptr<Communicator>> split(int, int, const std::string&) override {
    return std::unique_ptr<Communicator>(new SelfCommunicator());
  }
  double timeout() const override { return timeout_s_; }  // nothing to wait for; kept for the interface
  void set_timeout(double seconds) override { timeout_s_ = seconds; }

 private:
  static Status copy(const void* s, void* r, size_t n, DType t) {
    if (s != r) std::memmove(r, s, n * dtype_size(t));
    return Status::ok();
  }
  std::string name_ = "self";
  double timeout_s_ = 300;
};

}  // namespace strata::comm::testing
