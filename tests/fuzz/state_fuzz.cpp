// state_fuzz.cpp — a checkpoint's state.json as a resume reads it (engine/checkpoint/checkpoint_state.h). Every input
// either gives a TrainState or a Status; whatever it gives is written back and must read back the same.
#include <cstdint>
#include <string_view>

#include "common/check.h"
#include "engine/checkpoint/checkpoint_state.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  int64_t adam_steps = 0;
  auto st = strata::engine::parse_train_state(text, "state.json", &adam_steps);
  if (!st.is_ok()) return 0;
  int64_t again_steps = -1;
  auto again = strata::engine::parse_train_state(strata::engine::train_state_json(*st, adam_steps), "again", &again_steps);
  STRATA_ASSERT(again.is_ok() && again->step == st->step && again_steps == adam_steps &&
                again->train_pos.offset == st->train_pos.offset && again->train_shards == st->train_shards);
  return 0;
}
