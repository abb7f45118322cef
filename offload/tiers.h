// tiers.h — the three memory tiers of the offload manager and the state classes placed on them.
#pragma once

#include <cstdint>

namespace strata::offload {

enum class Tier : uint8_t { kDevice, kHost, kNvme };
inline const char* tier_name(Tier t) {
  switch (t) {
    case Tier::kDevice: return "device";
    case Tier::kHost: return "host";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

// The training state of one unit, per docs/architecture.md's "Data model".
enum class StateClass : uint8_t { kParams, kGrads, kMaster, kMomentM, kMomentV };

// Where one state class of one unit lives: its home tier, and which tiers hold a valid copy right now (a copy
// that differs from the home copy is dirty: it must be written home before it is dropped).
struct Residency {
  Tier home = Tier::kDevice;
  bool on_device = false, on_host = false, on_nvme = false;
  bool dirty = false;
};

// Live and peak bytes of one tier, and its budget (0: none set).
struct TierUsage {
  uint64_t live = 0, peak = 0, limit = 0;
};

}  // namespace strata::offload
