// units.h — the sizes users type: byte counts ("512M", "4G", binary units) and element counts ("100M", "1.5G",
// decimal). Pure functions, thread-safe.
#pragma once

#include <cstdint>
#include <string>

namespace strata {

// "1G", "512M", "4k", "4KiB", "4096" -> bytes (binary units); 0 when malformed or out of range.
uint64_t parse_bytes(const std::string& text);

// The inverse, for messages: 812 -> "812 B", 12800 -> "12.5 KiB", then MiB, GiB and TiB, with 3 significant
// digits ("768 GiB", "15.0 TiB").
std::string format_bytes(uint64_t bytes);

// "100M" -> 100000000, "1.5G" -> 1500000000, "2k" -> 2000, "1B" -> 1e9, "12345" -> 12345 (decimal units, as
// parameter counts are written); 0 when malformed, not a positive whole number, or above 1e13.
uint64_t parse_count(const std::string& text);

}  // namespace strata
