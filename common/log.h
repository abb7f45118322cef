// log.h — logging through spdlog: one process-wide logger writing to stderr.
//
// STRATA_LOG_INFO("loaded {} tokens from {}", n, path). Thread-safe (spdlog's mt sink). The level comes from
// STRATA_LOG_LEVEL (trace, debug, info, warn, error) and defaults to info.
#pragma once

#include <spdlog/spdlog.h>

namespace strata {
spdlog::logger& logger();
}

#define STRATA_LOG_DEBUG(...) ::strata::logger().debug(__VA_ARGS__)
#define STRATA_LOG_INFO(...) ::strata::logger().info(__VA_ARGS__)
#define STRATA_LOG_WARN(...) ::strata::logger().warn(__VA_ARGS__)
#define STRATA_LOG_ERROR(...) ::strata::logger().error(__VA_ARGS__)
