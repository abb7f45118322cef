#include "common/log.h"

#include <cstdlib>

#include <spdlog/sinks/stdout_color_sinks.h>

namespace strata {

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> l = [] {
    auto lg = spdlog::stderr_color_mt("strata");
    lg->set_pattern("[%H:%M:%S.%e] %^%l%$ %v");
    const char* level = std::getenv("STRATA_LOG_LEVEL");
    lg->set_level(level ? spdlog::level::from_str(level) : spdlog::level::info);
    return lg;
  }();
  return *l;
}

}  // namespace strata
