// unit.h — a unit: the parameters brought in, updated and saved together (a transformer block, the embedding,
// the final norm), as flat buffers in one layout, with its role in the model. Every model is a list of units; the
// optimizers, the offload coordinator, the pipeline and checkpoints see a model only through them and their roles
// (docs/architecture.md "Data model").
#pragma once

#include <cstdint>
#include <string>

#include "common/tensor.h"
#include "kernels/device.h"

namespace strata::engine {

// What a unit is to the model. Pipeline, offload, optimizer and checkpoint code ask a unit's role and its ties,
// never its index: a family lists its units in its forward's order, and may have an untied head, or no position
// embedding, without a change outside its own folder.
enum class UnitRole : uint8_t {
  kEmbedding,  // the input embedding (the token table, and positions where the family has them): the first stage
  kBlock,      // a transformer block (UnitSpec::block says which)
  kFinalNorm,  // the norm after the last block: the last stage
  kHead,       // an LM head of its own (an untied one): the last stage
};

// A unit as its family describes it, before anything is allocated: its name, whole layout and role.
struct UnitSpec {
  std::string name;
  FlatLayout layout;
  UnitRole role = UnitRole::kBlock;
  int block = -1;          // kBlock: which block, 0 .. n_layer-1
  bool ties_head = false;  // kEmbedding: its token table is the LM head's weight too, so the last stage uses it
};

// One unit: its spec, and its parameters and gradients (both laid out by `layout`, this rank's slices of the
// spec's under tensor parallelism).
struct Unit : UnitSpec {
  kernels::DeviceBuffer params;    // fp32 (layout.numel()), device memory; empty when offloaded
  kernels::DeviceBuffer grads;     // fp32 (layout.numel()), device memory; empty when offloaded
  kernels::DeviceBuffer params16;  // bf16 (layout.numel()): the working copy of params (Model::acquire), if kept
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
  bool embedding = true;    // runs the embedding (the first stage)
  bool head = true;         // runs the final norm, the LM head and the loss (the last stage)

  // Whether this stage holds (runs and stores) the unit: its blocks; the embedding on the first stage; the final
  // norm and an untied head on the last, and there too an embedding that ties the head (end resolved, not -1).
  bool holds(const UnitSpec& u) const {
    switch (u.role) {
      case UnitRole::kEmbedding: return embedding || (u.ties_head && head);
      case UnitRole::kBlock: return u.block >= first && u.block < end;
      case UnitRole::kFinalNorm:
      case UnitRole::kHead: return head;
    }
    return false;
  }
};

// A family's forward FLOPs per token of one block and of the head (with the final norm), by which the pipeline
// balances its stages (engine/parallel/pipeline.h).
struct PipelineCosts {
  double block = 0, head = 0;
};

}  // namespace strata::engine
