// cudnn_graph.cpp — loading cuDNN and owning its backend descriptors (cudnn_graph.h).
#include "kernels/cuda/cudnn_graph.h"

#ifdef STRATA_HAVE_CUDNN

#include <dlfcn.h>

#include <cstdlib>
#include <string>
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

}  // namespace strata::kernels::cuda::cudnn

#endif  // STRATA_HAVE_CUDNN
