// cudnn_graph.h — cuDNN's graph (backend) API, loaded on first use, and an owning, error-collecting handle for its
// descriptors, operation graphs built from them, and their plans: what cudnn_attention.cpp uses.
//
// cuDNN is optional: the CUDA backend runs without it (flash_attention.cu). It is not linked: load() dlopen's
// libcudnn.so.<major of the headers built against> on first use: the file STRATA_CUDNN_LIBRARY names if set, else
// the soname through the usual search (RUNPATH, LD_LIBRARY_PATH, the ld.so cache), else the toolkit's library
// folder found at build time. A Python wheel's copy (nvidia-cudnn-cu13: site-packages/nvidia/cudnn/lib) is found
// through either variable. Only built where CMake found cuDNN's headers (STRATA_HAVE_CUDNN); elsewhere load() says
// so.
//
// Threading: one host thread drives the CUDA backend at a time (cuda_context.h); nothing here locks but load().
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

#ifdef STRATA_HAVE_CUDNN
#include <cudnn_graph.h>

namespace strata::kernels::cuda::cudnn {

// The library's entry points this backend uses, typed by the headers' own declarations.
struct Api {
  decltype(&::cudnnGetVersion) GetVersion;
  decltype(&::cudnnGetErrorString) GetErrorString;
  decltype(&::cudnnGetLastErrorString) GetLastErrorString;
  decltype(&::cudnnCreate) Create;
  decltype(&::cudnnSetStream) SetStream;
  decltype(&::cudnnBackendCreateDescriptor) BackendCreateDescriptor;
  decltype(&::cudnnBackendDestroyDescriptor) BackendDestroyDescriptor;
  decltype(&::cudnnBackendSetAttribute) BackendSetAttribute;
  decltype(&::cudnnBackendGetAttribute) BackendGetAttribute;
  decltype(&::cudnnBackendFinalize) BackendFinalize;
  decltype(&::cudnnBackendExecute) BackendExecute;
};

// Loads the library once: its entry points, or NotFound naming every place tried and why each failed (or the
// version found, when it is older than the one built against's major release).
Result<const Api*> load();

// "CUDNN_STATUS_...: <cuDNN's last error message>" for a failed call.
std::string describe(cudnnStatus_t status);

// One backend descriptor, owned (destroyed with it). Its setters record the first failure (with the attribute's
// number and what the descriptor is, for the message) and do nothing after one; finalize() returns it, or the
// finalize's own failure. So a graph is written as a list of settings with one check per descriptor.
class Descriptor {
 public:
  Descriptor() = default;
  Descriptor(cudnnBackendDescriptorType_t type, std::string what);  // needs load() to have succeeded
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  Descriptor(Descriptor&& o) noexcept { *this = std::move(o); }
  Descriptor& operator=(Descriptor&& o) noexcept;
  ~Descriptor();

  cudnnBackendDescriptor_t get() const { return desc_; }
  const std::string& what() const { return what_; }

  Descriptor& set(cudnnBackendAttributeName_t name, int64_t v) { return raw(name, CUDNN_TYPE_INT64, 1, &v); }
  Descriptor& set(cudnnBackendAttributeName_t name, bool v) { return raw(name, CUDNN_TYPE_BOOLEAN, 1, &v); }
  Descriptor& set(cudnnBackendAttributeName_t name, float v) { return raw(name, CUDNN_TYPE_FLOAT, 1, &v); }
  Descriptor& set(cudnnBackendAttributeName_t name, double v) { return raw(name, CUDNN_TYPE_DOUBLE, 1, &v); }
  Descriptor& set(cudnnBackendAttributeName_t name, cudnnDataType_t v) {
    return raw(name, CUDNN_TYPE_DATA_TYPE, 1, &v);
  }
  Descriptor& set(cudnnBackendAttributeName_t name, cudnnPointwiseMode_t v) {
    return raw(name, CUDNN_TYPE_POINTWISE_MODE, 1, &v);
  }
  Descriptor& set(cudnnBackendAttributeName_t name, cudnnReduceTensorOp_t v) {
    return raw(name, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &v);
  }
  Descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendHeurMode_t v) {
    return raw(name, CUDNN_TYPE_HEUR_MODE, 1, &v);
  }
  Descriptor& set(cudnnBackendAttributeName_t name, cudnnHandle_t v) { return raw(name, CUDNN_TYPE_HANDLE, 1, &v); }
  Descriptor& set(cudnnBackendAttributeName_t name, const Descriptor& d) {
    cudnnBackendDescriptor_t p = d.get();
    return raw(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &p);
  }
  Descriptor& set(cudnnBackendAttributeName_t name, const std::vector<int64_t>& v) {
    return raw(name, CUDNN_TYPE_INT64, static_cast<int64_t>(v.size()), v.data());
  }
  Descriptor& set(cudnnBackendAttributeName_t name, const std::vector<const Descriptor*>& v);
  Descriptor& set(cudnnBackendAttributeName_t name, const std::vector<void*>& v) {
    return raw(name, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(v.size()), v.data());
  }
  Descriptor& set_pointer(cudnnBackendAttributeName_t name, void* p) { return raw(name, CUDNN_TYPE_VOID_PTR, 1, &p); }
  Descriptor& raw(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
                  const void* values);

  // The first setter's failure, else the finalize's.
  Status finalize();
  // cuDNN's status of that failure (CUDNN_STATUS_SUCCESS while there is none).
  cudnnStatus_t failure() const { return failure_; }
  // An int64 attribute of a finalized descriptor (a plan's workspace size).
  Result<int64_t> get_int64(cudnnBackendAttributeName_t name) const;

 private:
  cudnnBackendDescriptor_t desc_ = nullptr;
  std::string what_;
  Status status_;
  cudnnStatus_t failure_ = CUDNN_STATUS_SUCCESS;
};

// The process's cuDNN handle on the CUDA backend's device, bound to its compute stream (created once).
Result<cudnnHandle_t> handle();

// The backend's GPU as cuDNN describes it (JSON; cuDNN 9.8 on). Needs the GPU. With device_properties(), what lets
// a machine without that GPU have cuDNN choose engines and build plans for it (nothing can run them there).
Result<std::string> device_properties_json();
// A finalized device-properties descriptor from that JSON.
Result<Descriptor> device_properties(const std::string& json);

using Dims = std::vector<int64_t>;

// One operation graph under construction: its tensors and operations, kept alive with it, and the first failure.
// Its virtual tensors are numbered from `first_virtual` (above the uids a variant pack names).
class Graph {
 public:
  Graph(std::string what, int64_t first_virtual) : what_(std::move(what)), next_virtual_(first_virtual) {}

  const Descriptor& tensor(int64_t uid, const Dims& dims, const Dims& strides, cudnnDataType_t type,
                           bool is_virtual = false, bool by_value = false);
  // A virtual intermediate, fp32 unless said.
  const Descriptor& temp(const Dims& dims, const Dims& strides, cudnnDataType_t type = CUDNN_DATA_FLOAT) {
    return tensor(next_virtual_++, dims, strides, type, /*is_virtual=*/true);
  }
  // An fp32 scalar passed by value (a host pointer in the variant pack).
  const Descriptor& scalar(int64_t uid) {
    return tensor(uid, {1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, /*is_virtual=*/false, /*by_value=*/true);
  }

  // y = mode(x[, b[, t]]) elementwise (GEN_INDEX: y = the index along `axis`).
  void pointwise(cudnnPointwiseMode_t mode, const Descriptor& x, const Descriptor* b, const Descriptor* t,
                 const Descriptor& y, cudnnDataType_t precision = CUDNN_DATA_FLOAT, int64_t axis = -1);
  // c = a · b over the last two dimensions, batched over the first two.
  void matmul(const Descriptor& a, const Descriptor& b, const Descriptor& c);
  // y = the reduction of x over the dimensions where y has size 1.
  void reduction(cudnnReduceTensorOp_t reduce, const Descriptor& x, const Descriptor& y);
  // y = x seen with y's dimensions and strides (a transpose).
  void reshape(const Descriptor& x, const Descriptor& y);

  // A descriptor the graph keeps alive, for an operation of a kind the builders above do not cover.
  Descriptor& keep(cudnnBackendDescriptorType_t type, std::string what) {
    return descriptors_.emplace_back(type, std::move(what));
  }
  void check(const Status& s) {
    if (status_.is_ok() && !s.is_ok()) status_ = s;
  }
  void add(Descriptor& op) {  // finalizes op and appends it to the graph's operations
    check(op.finalize());
    ops_.push_back(&op);
  }
  const std::vector<const Descriptor*>& ops() const { return ops_; }
  const Status& status() const { return status_; }
  const std::string& what() const { return what_; }

 private:
  std::string what_;
  std::deque<Descriptor> descriptors_;  // stable addresses: operations refer to tensors
  std::vector<const Descriptor*> ops_;
  int64_t next_virtual_;
  Status status_;
};

// A finalized execution plan and what it needs besides the tensors: cuDNN's workspace, and on the attention
// backward's accumulating form the frontend's own fp32 tensors (dQ's accumulator and the rows' dO·O) placed before
// it.
struct Plan {
  std::unique_ptr<Graph> graph;  // the descriptors the plan was built from
  Descriptor op_graph, config, plan;
  int64_t workspace = 0;
  bool accumulates_dq = false;  // the attention backward's non-deterministic form
  std::string how;              // for the log: which form, which engine configuration
};

// The finalized operation graph of g's operations (or of `only_op`), on handle h (null: none, for a check
// without a device).
Result<Descriptor> operation_graph(const Graph& g, const Descriptor* only_op, cudnnHandle_t h);

// What plans are built for: this process's GPU (a handle), or one described by its properties (a machine
// without it: the plans can be built, not run).
struct Target {
  cudnnHandle_t handle = nullptr;
  const Descriptor* device = nullptr;  // when there is no handle
};

// Builds the operation graph and the first of the heuristic's engine configurations that finalizes. Without the
// GPU (a Target of device properties), the first configuration that compiles its kernels and fails only at
// loading them (against the driver's stub) is returned, with no plan.
Result<Plan> build_plan(std::unique_ptr<Graph> g, const Target& target, const Descriptor* only_op = nullptr);

}  // namespace strata::kernels::cuda::cudnn

#else  // built without cuDNN's headers

namespace strata::kernels::cuda::cudnn {
struct Api;
inline Result<const Api*> load() {
  return Status::not_found("this build has no cuDNN: CMake did not find its headers (cudnn_graph.h)");
}
}  // namespace strata::kernels::cuda::cudnn

#endif
