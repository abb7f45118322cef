// config_fuzz.cpp — a training config's text as `strata train --config` reads it: parsed (bounded), then
// every section and key checked. Every input either gives a RunConfig or a Status. Nothing may crash.
#include <cstdint>
#include <string_view>

#include "common/json_parse.h"
#include "engine/train/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto j = strata::parse_json(text, "fuzz.json");
  if (!j.is_ok()) return 0;
  (void)strata::engine::parse_run_config(*j, "fuzz.json");
  return 0;
}
