#include "common/units.h"

#include <cmath>
#include <iterator>

#include <fmt/format.h>

namespace strata {

uint64_t parse_bytes(const std::string& text) {
  size_t pos = 0;
  uint64_t v = 0;
  while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') {
    if (v > (UINT64_MAX - 9) / 10) return 0;
    v = v * 10 + static_cast<uint64_t>(text[pos++] - '0');
  }
  if (pos == 0) return 0;
  std::string unit = text.substr(pos);
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();
  if (!unit.empty() && unit.back() == 'i') unit.pop_back();
  if (unit.empty()) return v;
  if (unit.size() != 1) return 0;
  int shift = 0;
  switch (unit[0]) {
    case 'k': case 'K': shift = 10; break;
    case 'm': case 'M': shift = 20; break;
    case 'g': case 'G': shift = 30; break;
    case 't': case 'T': shift = 40; break;
    default: return 0;
  }
  return v > (UINT64_MAX >> shift) ? 0 : v << shift;
}

std::string format_bytes(uint64_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes) / 1024;
  size_t unit = 0;
  while (v >= 999.95 && unit + 1 < std::size(kUnits)) {
    v /= 1024;
    ++unit;
  }
  return v >= 99.95 ? fmt::format("{:.0f} {}", v, kUnits[unit])
         : v >= 9.995 ? fmt::format("{:.1f} {}", v, kUnits[unit])
                      : fmt::format("{:.2f} {}", v, kUnits[unit]);
}

uint64_t parse_count(const std::string& text) {
  if (text.empty()) return 0;
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (...) {
    return 0;
  }
  double scale = 1;
  const std::string suffix = text.substr(used);
  if (suffix == "k" || suffix == "K") scale = 1e3;
  else if (suffix == "M" || suffix == "m") scale = 1e6;
  else if (suffix == "G" || suffix == "g" || suffix == "B" || suffix == "b") scale = 1e9;
  else if (!suffix.empty()) return 0;
  const double n = value * scale;
  if (!(n >= 1) || n > 1e13 || n != std::floor(n)) return 0;
  return static_cast<uint64_t>(n);
}

}  // namespace strata
