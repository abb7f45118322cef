// cudnn_graph.cpp — loading cuDNN and owning its backend descriptors (cudnn_graph.h).
#include "kernels/cuda/cudnn_graph.h"

#ifdef STRATA_HAVE_CUDNN

#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <cudnn_version.h>
#include <fmt/format.h>

#include "common/check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/cuda_kernels.h"

namespace strata::kernels::cuda::cudnn {
namespace {

struct Loaded {
  Api api{};
  Status status;
};

// Where to look, in order (cudnn_graph.h).
std::vector<std::string> candidates() {
  const std::string soname = fmt::format("libcudnn.so.{}", CUDNN_MAJOR);
  std::vector<std::string> paths;
  if (const char* env = std::getenv("STRATA_CUDNN_LIBRARY"); env != nullptr && *env != '\0') paths.emplace_back(env);
  paths.push_back(soname);
#ifdef STRATA_CUDA_LIBRARY_DIR
  paths.push_back(std::string(STRATA_CUDA_LIBRARY_DIR) + "/" + soname);
#endif
  return paths;
}

// *out = the entry point `name`; the first one missing is named in *missing.
template <typename F>
void resolve(void* lib, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(::dlsym(lib, name));
  if (*out == nullptr && missing->empty()) *missing = name;
}

Loaded open_cudnn() {
  Loaded r;
  std::string tried;
  for (const std::string& path : candidates()) {
    void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      tried += fmt::format("{}{}", tried.empty() ? "" : "; ", ::dlerror());
      continue;
    }
    Api& a = r.api;
    std::string missing;
    resolve(lib, "cudnnGetVersion", &a.GetVersion, &missing);
    resolve(lib, "cudnnGetErrorString", &a.GetErrorString, &missing);
    resolve(lib, "cudnnGetLastErrorString", &a.GetLastErrorString, &missing);
    resolve(lib, "cudnnCreate", &a.Create, &missing);
    resolve(lib, "cudnnSetStream", &a.SetStream, &missing);
    resolve(lib, "cudnnBackendCreateDescriptor", &a.BackendCreateDescriptor, &missing);
    resolve(lib, "cudnnBackendDestroyDescriptor", &a.BackendDestroyDescriptor, &missing);
    resolve(lib, "cudnnBackendSetAttribute", &a.BackendSetAttribute, &missing);
    resolve(lib, "cudnnBackendGetAttribute", &a.BackendGetAttribute, &missing);
    resolve(lib, "cudnnBackendFinalize", &a.BackendFinalize, &missing);
    resolve(lib, "cudnnBackendExecute", &a.BackendExecute, &missing);
    std::string why;
    if (!missing.empty()) {
      why = fmt::format("{} has no {}", path, missing);
    } else if (const size_t version = a.GetVersion(); version / 10000 != CUDNN_MAJOR) {  // 9.19.0 is 91900
      why = fmt::format("{} is version {}, not {}.x", path, version, CUDNN_MAJOR);
    } else {
      return r;
    }
    tried += fmt::format("{}{}", tried.empty() ? "" : "; ", why);
    ::dlclose(lib);
  }
  r.status = Status::not_found("cuDNN could not be loaded (set STRATA_CUDNN_LIBRARY to its libcudnn.so.{}): {}",
                               CUDNN_MAJOR, tried);
  return r;
}

// Never destroyed: descriptors left in static objects (cudnn_attention.cpp's plans) are destroyed with them, if
// ever, and need the entry points.
const Loaded& loaded() {
  static const Loaded& l = *new Loaded(open_cudnn());
  return l;
}

}  // namespace

Result<const Api*> load() {
  const Loaded& l = loaded();
  if (!l.status.is_ok()) return l.status;
  return &l.api;
}

std::string describe(cudnnStatus_t status) {
  const Api& a = loaded().api;
  char last[512] = {0};
  a.GetLastErrorString(last, sizeof last);
  return last[0] != '\0' ? fmt::format("{}: {}", a.GetErrorString(status), last) : a.GetErrorString(status);
}

Descriptor::Descriptor(cudnnBackendDescriptorType_t type, std::string what) : what_(std::move(what)) {
  const Api& a = loaded().api;
  STRATA_ASSERT_MSG(loaded().status.is_ok(), "cudnn::Descriptor before cudnn::load() succeeded");
  if (const cudnnStatus_t s = a.BackendCreateDescriptor(type, &desc_); s != CUDNN_STATUS_SUCCESS) {
    desc_ = nullptr;
    failure_ = s;
    status_ = Status::internal("cuDNN: creating the {} (descriptor type {}): {}", what_, static_cast<int>(type),
                               describe(s));
  }
}

Descriptor& Descriptor::operator=(Descriptor&& o) noexcept {
  if (this != &o) {
    if (desc_ != nullptr) loaded().api.BackendDestroyDescriptor(desc_);
    desc_ = o.desc_;
    what_ = std::move(o.what_);
    status_ = std::move(o.status_);
    failure_ = o.failure_;
    o.desc_ = nullptr;
  }
  return *this;
}

Descriptor::~Descriptor() {
  if (desc_ != nullptr) loaded().api.BackendDestroyDescriptor(desc_);
}

Descriptor& Descriptor::raw(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
                            const void* values) {
  if (!status_.is_ok()) return *this;
  const cudnnStatus_t s = loaded().api.BackendSetAttribute(desc_, name, type, count, values);
  if (s != CUDNN_STATUS_SUCCESS) {
    failure_ = s;
    status_ = Status::internal("cuDNN: setting attribute {} of the {}: {}", static_cast<int>(name), what_,
                               describe(s));
  }
  return *this;
}

Descriptor& Descriptor::set(cudnnBackendAttributeName_t name, const std::vector<const Descriptor*>& v) {
  std::vector<cudnnBackendDescriptor_t> raw_descs;
  raw_descs.reserve(v.size());
  for (const Descriptor* d : v) raw_descs.push_back(d->get());
  return raw(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(raw_descs.size()), raw_descs.data());
}

Status Descriptor::finalize() {
  if (!status_.is_ok()) return status_;
  if (const cudnnStatus_t s = loaded().api.BackendFinalize(desc_); s != CUDNN_STATUS_SUCCESS) {
    failure_ = s;
    status_ = Status::internal("cuDNN: finalizing the {}: {}", what_, describe(s));
  }
  return status_;
}

Result<int64_t> Descriptor::get_int64(cudnnBackendAttributeName_t name) const {
  int64_t v = 0, count = 0;
  if (const cudnnStatus_t s = loaded().api.BackendGetAttribute(desc_, name, CUDNN_TYPE_INT64, 1, &count, &v);
      s != CUDNN_STATUS_SUCCESS)
    return Status::internal("cuDNN: reading attribute {} of the {}: {}", static_cast<int>(name), what_, describe(s));
  return v;
}

Result<cudnnHandle_t> handle() {
  static const Result<cudnnHandle_t> h = []() -> Result<cudnnHandle_t> {
    STRATA_ASSIGN_OR_RETURN(const Api* a, load());
    STRATA_RETURN_IF_ERROR(cuda_available());
    const CudaContext& ctx = cuda_context();  // makes the backend's device current
    cudnnHandle_t created = nullptr;
    if (const cudnnStatus_t s = a->Create(&created); s != CUDNN_STATUS_SUCCESS)
      return Status::internal("cudnnCreate: {}", describe(s));
    if (const cudnnStatus_t s = a->SetStream(created, ctx.compute); s != CUDNN_STATUS_SUCCESS)
      return Status::internal("cudnnSetStream: {}", describe(s));
    return created;
  }();
  return h;
}

Result<std::string> device_properties_json() {
  STRATA_ASSIGN_OR_RETURN(const Api* a, load());
  STRATA_ASSIGN_OR_RETURN(cudnnHandle_t h, handle());
  Descriptor props(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, "device properties");
  props.set(CUDNN_ATTR_DEVICEPROP_HANDLE, h);
  STRATA_RETURN_IF_ERROR(props.finalize());
  int64_t size = 0;
  if (const cudnnStatus_t s = a->BackendGetAttribute(props.get(), CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION,
                                                     CUDNN_TYPE_CHAR, 0, &size, nullptr);
      s != CUDNN_STATUS_SUCCESS)
    return Status::internal("cuDNN: sizing the device properties' JSON: {}", describe(s));
  std::string json(static_cast<size_t>(size), '\0');
  if (const cudnnStatus_t s = a->BackendGetAttribute(props.get(), CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION,
                                                     CUDNN_TYPE_CHAR, size, &size, json.data());
      s != CUDNN_STATUS_SUCCESS)
    return Status::internal("cuDNN: reading the device properties' JSON: {}", describe(s));
  json.resize(static_cast<size_t>(size));
  while (!json.empty() && json.back() == '\0') json.pop_back();
  return json;
}

Result<Descriptor> device_properties(const std::string& json) {
  STRATA_RETURN_IF_ERROR(load().status());
  Descriptor props(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, "device properties from JSON");
  props.raw(CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR, static_cast<int64_t>(json.size()),
            json.data());
  STRATA_RETURN_IF_ERROR(props.finalize());
  return Result<Descriptor>(std::move(props));
}

const Descriptor& Graph::tensor(int64_t uid, const Dims& dims, const Dims& strides, cudnnDataType_t type,
                                     bool is_virtual, bool by_value) {
  Descriptor& t = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR, fmt::format("tensor {} of the {}", uid, what_));
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, type)
      .set(CUDNN_ATTR_TENSOR_DIMENSIONS, dims)
      .set(CUDNN_ATTR_TENSOR_STRIDES, strides)
      .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, uid)
      .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, int64_t{16});
  if (is_virtual) t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, true);
  if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, true);
  check(t.finalize());
  return t;
}

void Graph::pointwise(cudnnPointwiseMode_t mode, const Descriptor& x, const Descriptor* b, const Descriptor* t,
                      const Descriptor& y, cudnnDataType_t precision, int64_t axis) {
  Descriptor& pw = keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, fmt::format("pointwise mode {} of the {}",
                                                                       static_cast<int>(mode), what_));
  pw.set(CUDNN_ATTR_POINTWISE_MODE, mode).set(CUDNN_ATTR_POINTWISE_MATH_PREC, precision);
  if (axis >= 0) pw.set(CUDNN_ATTR_POINTWISE_AXIS, axis);
  check(pw.finalize());
  Descriptor& op = keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, fmt::format("{} operation", pw.what()));
  op.set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw)
      .set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)
      .set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y)
      .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, 1.0f)
      .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, 1.0f);
  if (b != nullptr) op.set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
  if (t != nullptr) op.set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t);
  add(op);
}

void Graph::matmul(const Descriptor& a, const Descriptor& b, const Descriptor& c) {
  Descriptor& mm = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR, fmt::format("matmul of the {}", what_));
  mm.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_DATA_FLOAT).set(CUDNN_ATTR_MATMUL_PADDING_VALUE, 0.0);
  check(mm.finalize());
  Descriptor& op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, fmt::format("matmul operation of the {}", what_));
  op.set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)
      .set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b)
      .set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)
      .set(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm);
  add(op);
}

void Graph::reduction(cudnnReduceTensorOp_t reduce, const Descriptor& x, const Descriptor& y) {
  Descriptor& r = keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, fmt::format("reduction of the {}", what_));
  r.set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_DATA_FLOAT)
      .set(CUDNN_ATTR_REDUCTION_OPERATOR, reduce)
      .set(CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, false);
  check(r.finalize());
  Descriptor& op =
      keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, fmt::format("reduction operation of the {}", what_));
  op.set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, r)
      .set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x)
      .set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
  add(op);
}

void Graph::reshape(const Descriptor& x, const Descriptor& y) {
  Descriptor& op = keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, fmt::format("reshape of the {}", what_));
  op.set(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x).set(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
  add(op);
}

Result<Descriptor> operation_graph(const Graph& g, const Descriptor* only_op, cudnnHandle_t h) {
  STRATA_RETURN_IF_ERROR(g.status());
  Descriptor op_graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, g.what() + " operation graph");
  op_graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, only_op != nullptr ? std::vector<const Descriptor*>{only_op} : g.ops());
  if (h != nullptr) op_graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, h);
  STRATA_RETURN_IF_ERROR(op_graph.finalize());
  return Result<Descriptor>(std::move(op_graph));
}

Result<Plan> build_plan(std::unique_ptr<Graph> g, const Target& target, const Descriptor* only_op) {
  const Api& api = *load().value();
  Plan p;
  STRATA_ASSIGN_OR_RETURN(p.op_graph, operation_graph(*g, only_op, target.handle));
  Descriptor heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, g->what() + " heuristics");
  heur.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, p.op_graph).set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_HEUR_MODE_A);
  if (target.device != nullptr) heur.set(CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, *target.device);
  STRATA_RETURN_IF_ERROR(heur.finalize());
  int64_t count = 0;
  if (const cudnnStatus_t s =
          api.BackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                  nullptr);
      s != CUDNN_STATUS_SUCCESS)
    return Status::internal("cuDNN: counting the {}'s engine configurations: {}", g->what(), describe(s));
  if (count == 0) return Status::not_found("cuDNN has no engine for the {}", g->what());
  std::vector<Descriptor> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, fmt::format("engine configuration {}", i));
    raw.push_back(configs.back().get());
  }
  int64_t got = 0;
  if (const cudnnStatus_t s = api.BackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                      CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data());
      s != CUDNN_STATUS_SUCCESS)
    return Status::internal("cuDNN: reading the {}'s engine configurations: {}", g->what(), describe(s));
  std::string refusals;
  for (int64_t i = 0; i < got; ++i) {
    Descriptor plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, fmt::format("{} plan {} of {}", g->what(), i + 1, got));
    plan.set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, configs[static_cast<size_t>(i)]);
    if (target.device != nullptr) plan.set(CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, *target.device);
    if (Status s = plan.finalize(); !s.is_ok()) {
      if (target.device != nullptr && plan.failure() == CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER) {
        // Without the GPU: the engine took the graph and compiled its kernels, and only loading them failed
        // (against the driver's stub). As far as a machine without the GPU can go.
        auto workspace = configs[static_cast<size_t>(i)].get_int64(CUDNN_ATTR_ENGINECFG_WORKSPACE_SIZE);
        p.workspace = workspace.is_ok() ? workspace.value() : -1;
        p.how = fmt::format("engine configuration {} of {} compiled (loading it needs the GPU), workspace {:.1f} MiB",
                            i + 1, got, static_cast<double>(p.workspace) / (1 << 20));
        p.graph = std::move(g);
        return Result<Plan>(std::move(p));
      }
      refusals += fmt::format("; {}", s.message());
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(p.workspace, plan.get_int64(CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE));
    p.plan = std::move(plan);
    p.config = std::move(configs[static_cast<size_t>(i)]);
    p.how = fmt::format("engine configuration {} of {}, workspace {:.1f} MiB", i + 1, got,
                        static_cast<double>(p.workspace) / (1 << 20));
    p.graph = std::move(g);
    return Result<Plan>(std::move(p));
  }
  return Status::not_found("cuDNN finalized none of the {} engine configurations for the {}{}", got, g->what(),
                           refusals);
}

}  // namespace strata::kernels::cuda::cudnn

#endif  // STRATA_HAVE_CUDNN
