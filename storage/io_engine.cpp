#include "storage/io_engine.h"

#include <atomic>

#include "common/log.h"
#include "storage/posix_engine.h"
#include "storage/uring_engine.h"

namespace strata {

const char* io_op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

const char* engine_kind_name(EngineKind kind) {
  switch (kind) {
    case EngineKind::kAuto: return "auto";
    case EngineKind::kUring: return "io_uring";
    case EngineKind::kPosix: return "posix";
  }
  return "?";
}

Result<EngineKind> parse_engine_kind(const std::string& name) {
  if (name == "auto") return EngineKind::kAuto;
  if (name == "io_uring" || name == "uring") return EngineKind::kUring;
  if (name == "posix") return EngineKind::kPosix;
  return Status::invalid_argument("unknown I/O engine '{}' (valid: auto, io_uring, posix)", name);
}

Result<std::unique_ptr<IoEngine>> make_io_engine(const EngineOptions& options) {
  if (options.lanes == 0 || options.queue_depth == 0)
    return Status::invalid_argument("I/O engine: lanes and queue_depth must be positive, got {} and {}",
                                    options.lanes, options.queue_depth);
  if (options.kind != EngineKind::kPosix) {
    auto uring = UringEngine::create(options);
    if (uring.is_ok()) return std::unique_ptr<IoEngine>(std::move(uring).value());
    if (options.kind == EngineKind::kUring || uring.status().code() == StatusCode::kInvalidArgument)
      return uring.status();
    static std::atomic<bool> warned{false};  // once per process, however many engines are made
    if (!warned.exchange(true))
      STRATA_LOG_WARN("io_uring is unavailable here ({}); using the POSIX pread/pwrite engine with {} threads",
                      uring.status().message(), options.lanes);
  }
  return std::unique_ptr<IoEngine>(std::make_unique<PosixEngine>(options.lanes, options.queue_depth));
}

}  // namespace strata
