// Building the family's model (family.h create_model); apart from the config's code, which the parsers' fuzz
// targets link without the models.
#include "engine/model/family/family.h"

namespace strata::engine {

Result<std::unique_ptr<Decoder>> create_model(const ModelConfig& c, kernels::Device& device,
                                              kernels::MatmulPrecision precision, bool offloaded, PipelineStage stage,
                                              comm::Communicator* tp, bool sequence_parallel) {
  if (c.llama_family()) {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Llama> m,
                            Llama::create(c.llama, device, precision, offloaded, stage, tp, sequence_parallel));
    return std::unique_ptr<Decoder>(std::move(m));
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<GPT2> m,
                          GPT2::create(c.gpt2, device, precision, offloaded, stage, tp, sequence_parallel));
  return std::unique_ptr<Decoder>(std::move(m));
}

}  // namespace strata::engine
