// tensor.h — non-owning views of named tensors inside flat buffers.
//
// A unit's parameters (and its gradients, and Adam's moments) live in one flat buffer; each named tensor is a
// TensorSpec (name, shape, offset in elements) and a TensorView is that spec applied to a base pointer. Views
// never own memory; the buffer's owner (an AlignedBuffer, a tier allocation) must outlive them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/dtype.h"

namespace strata {

struct TensorSpec {
  std::string name;            // e.g. "h.3.attn.c_attn.weight"
  std::vector<int64_t> shape;  // row-major
  size_t offset = 0;           // in elements from the start of the flat buffer
  bool decay = false;          // AdamW weight decay applies (2-D weights); not biases, norms

  size_t numel() const {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    return n;
  }
};

// Lays tensors out back to back in a flat buffer, in the order they are added (the canonical order).
class FlatLayout {
 public:
  // Adds a tensor and returns its offset. 2-D and larger tensors are weight-decayed by default.
  size_t add(std::string name, std::initializer_list<int64_t> shape) {
    return add(std::move(name), std::vector<int64_t>(shape));
  }
  size_t add(std::string name, std::vector<int64_t> shape) {
    const bool decay = shape.size() >= 2;
    TensorSpec s{std::move(name), std::move(shape), numel_, decay};
    numel_ += s.numel();
    specs_.push_back(std::move(s));
    return specs_.back().offset;
  }
  const std::vector<TensorSpec>& specs() const { return specs_; }
  size_t numel() const { return numel_; }
  const TensorSpec* find(const std::string& name) const {
    for (const auto& s : specs_)
      if (s.name == name) return &s;
    return nullptr;
  }

 private:
  std::vector<TensorSpec> specs_;
  size_t numel_ = 0;
};

template <typename T>
struct TensorView {
  T* data = nullptr;
  std::vector<int64_t> shape;

  size_t numel() const {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    return n;
  }
  T& operator[](size_t i) const { return data[i]; }
};

template <typename T>
TensorView<T> view_of(T* base, const TensorSpec& spec) {
  return TensorView<T>{base + spec.offset, spec.shape};
}

}  // namespace strata
