// status.h — Status and Result<T>: errors a user or the machine can cause (bad input, I/O, out of memory).
//
// Broken invariants are not Statuses: they are STRATA_ASSERT (check.h) and abort. A Status message names the
// thing at fault: the file, offset, config field, token index. Status and Result are cheap to move and are
// [[nodiscard]], so an ignored error is a compiler warning. Thread-safe as values (no shared state).
#pragma once

#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace strata {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // bad input: a config field, a flag, a shape
  kNotFound,         // a file or key that is not there
  kCorruption,       // bytes that fail a format or checksum check
  kIOError,          // the OS refused a read, write, open, rename
  kOutOfMemory,      // a budget or allocation that cannot be met
  kUnimplemented,    // a configuration that is accepted by name but not built yet
  kInternal,         // a foreign library returned an error we cannot attribute to input
  kDeadlineExceeded, // a peer (another rank) did not answer within the timeout
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return Status(); }
  template <typename... Args>
  static Status invalid_argument(fmt::format_string<Args...> f, Args&&... args) {
    return Status(StatusCode::kInvalidArgument, fmt::format(f, std::forward<Args>(args)...));
  }
  template <typename... Args>
  static Status not_found(fmt::format_string<Args...> f, Args&&... args) {
    return Status(StatusCode::kNotFound, fmt::format(f, std::forward<Args>(args)...));
  }
  template <typename... Args>
  static Status corruption(fmt::format_string<Args...> f, Args&&... args) {
    return Status(StatusCode::kCorruption, fmt::format(f, std::forward<Args>(args)...));
  }
  template <typename... Args>
  static Status io_error(fmt::format_string<Args...> f, Args&&... args) {
    return Status(StatusCode::kIOError, fmt::format(f, std::forward<Args>(args)...));
  }
  template <typename... Args>
  static Status out_of_memory(fmt::format_string<Args...> f, Args&&... args) {
    return Status(StatusCode::kOutOfMemory, fmt::format(f, std::forward<Args>(args)...));
  }
  template <typename... Args>
  static Status unimplemented(fmt::format_string<Args...> f, Args&&... args) {
    return Status(StatusCode::kUnimplemented, fmt::format(f, std::forward<Args>(args)...));
  }
  template <typename... Args>
  static Status internal(fmt::format_string<Args...> f, Args&&... args) {
    return Status(StatusCode::kInternal, fmt::format(f, std::forward<Args>(args)...));
  }
  template <typename... Args>
  static Status deadline_exceeded(fmt::format_string<Args...> f, Args&&... args) {
    return Status(StatusCode::kDeadlineExceeded, fmt::format(f, std::forward<Args>(args)...));
  }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "InvalidArgument: config.json: model.n_layer must be an integer"
  std::string to_string() const;

  // Prefixes context ("while loading checkpoint ckpt/step_000100: ") to an error; ok stays ok.
  Status with_context(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Result<T>: a T or the Status explaining why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  // An OK Status has no value to stand for, so it becomes an Internal error rather than a Result that is
  // neither a value nor a failure (absl::StatusOr's rule).
  Result(Status status)  // NOLINT(google-explicit-constructor)
      : v_(status.is_ok() ? Status(StatusCode::kInternal, "Result constructed from an OK Status without a value")
                          : std::move(status)) {}

  bool is_ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace strata

// Returns early from a function returning Status or Result<U> when `expr` (a Status) is not ok.
#define STRATA_RETURN_IF_ERROR(expr)                \
  do {                                              \
    ::strata::Status _strata_st = (expr);           \
    if (!_strata_st.is_ok()) return _strata_st;     \
  } while (0)

#define STRATA_CONCAT_INNER(a, b) a##b
#define STRATA_CONCAT(a, b) STRATA_CONCAT_INNER(a, b)
// `STRATA_ASSIGN_OR_RETURN(auto x, make_x());` — unwraps a Result or returns its Status.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL(STRATA_CONCAT(_strata_res_, __LINE__), lhs, expr)
#define STRATA_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.is_ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
