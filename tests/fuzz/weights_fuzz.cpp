// weights_fuzz.cpp — a GPT-2 weights file as `export`, `sample` and training.init_from open it
// (engine/checkpoint/foreign_weights.h): llm.c's header and tensors, or safetensors with our names or Hugging Face's.
// Every input either opens, holds the model it claims and reads every tensor (whole, and a middle range, which
// takes the column-by-column path of Hugging Face's transposed weights), or is refused with a Status.
#include <cstdint>
#include <vector>

#include "common/log.h"
#include "engine/checkpoint/foreign_weights.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = [] {  // a file that does not name its head count is warned of, every input
    strata::logger().set_level(spdlog::level::err);
    return true;
  }();
  (void)quiet;
  const strata::fuzz::MemFile file(data, size);
  auto w = strata::engine::WeightsFile::open(file.path());
  if (!w.is_ok()) return 0;
  strata::engine::GPT2Config c = (*w)->config();
  if (c.n_head == 0) c.n_head = 1;
  // After check(), every tensor of c is in the file, so what is read is bounded by the input's size.
  if (!c.validate().is_ok() || !(*w)->check(c).is_ok()) return 0;
  std::vector<float> out;
  for (const strata::engine::UnitSpec& unit : strata::engine::gpt2_unit_specs(c)) {
    for (const strata::TensorSpec& s : unit.layout.specs()) {
      out.resize(s.numel());
      (void)(*w)->read(s, out.data());
      (void)(*w)->read_range(s, s.numel() / 3, s.numel() / 2, out.data());
    }
  }
  return 0;
}
