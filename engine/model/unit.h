// unit.h — a unit: the parameters brought in, updated and saved together (a transformer block, the embedding,
// the final norm), as flat buffers in one layout. Every model is a list of units; the optimizers, the offload
// coordinator, the pipeline and checkpoints see a model only through them (docs/architecture.md "Data model").
#pragma once

#include <string>

#include "common/tensor.h"
#include "kernels/device.h"

namespace strata::engine {

// One unit: its name, layout, parameters and gradients (both laid out by `layout`).
struct Unit {
  std::string name;
  FlatLayout layout;
  kernels::DeviceBuffer params;    // fp32 (layout.numel()), device memory; empty when offloaded
  kernels::DeviceBuffer grads;     // fp32 (layout.numel()), device memory; empty when offloaded
  kernels::DeviceBuffer params16;  // bf16 (layout.numel()): the working copy of params (GPT2::acquire), if kept
  // params16 holds the present params. Mutable as the buffers' contents are: a Unit is a handle, and whoever
  // writes params through it (the optimizers take the units const) says so with p_for_update().
  mutable bool params16_current = false;

  const float* p() const { return params.as<float>(); }
  // params, to be written: the working copy is remade from them at the unit's next use.
  float* p_for_update() const {
    params16_current = false;
    return params.as<float>();
  }
  float* g() const { return grads.as<float>(); }
  size_t numel() const { return layout.numel(); }
};

// The part of the model one pipeline stage runs (the whole model by default).
struct PipelineStage {
  int first = 0, end = -1;  // blocks [first, end); end -1: n_layer
  bool embedding = true;    // runs the token and position embedding (the first stage)
  bool head = true;         // runs the final layernorm, the tied LM head and the loss (the last stage)
};

}  // namespace strata::engine
