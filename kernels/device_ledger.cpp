// device_ledger.cpp — Device::allocate's budget and per-purpose ledger, shared by every backend.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "kernels/device.h"

namespace strata::kernels {
namespace {

std::string purpose_group(const std::string& purpose) { return purpose.substr(0, purpose.find(' ')); }
double gib(uint64_t bytes) { return static_cast<double>(bytes) / (uint64_t{1} << 30); }

std::string holders(const std::map<std::string, uint64_t>& by_purpose) {
  std::vector<std::pair<uint64_t, std::string>> sorted;
  for (const auto& [k, v] : by_purpose)
    if (v > 0) sorted.emplace_back(v, k);
  std::sort(sorted.rbegin(), sorted.rend());
  std::string out;
  for (const auto& [v, k] : sorted) out += fmt::format("{}{} {:.3f} GiB", out.empty() ? "" : ", ", k, gib(v));
  return out.empty() ? "nothing" : out;
}

}  // namespace

Result<DeviceBuffer> Device::allocate(size_t bytes, std::string purpose) {
  const std::string group = purpose_group(purpose);
  {
    std::lock_guard<std::mutex> lock(ledger_->mu);
    if (ledger_->limit != 0 && ledger_->live + bytes > ledger_->limit) {
      return Status::out_of_memory(
          "{} memory budget exceeded: {:.3f} GiB for {} on top of {:.3f} GiB live would pass memory.device_memory_limit "
          "= {:.3f} GiB (held: {})",
          name(), gib(bytes), purpose, gib(ledger_->live), gib(ledger_->limit), holders(ledger_->by_purpose));
    }
    ledger_->live += bytes;  // reserved before the backend allocates, so two threads cannot both fit
    ledger_->peak = std::max(ledger_->peak, ledger_->live);
    ledger_->by_purpose[group] += bytes;
  }
  auto unreserve = [ledger = ledger_, group, bytes] {
    std::lock_guard<std::mutex> lock(ledger->mu);
    ledger->live -= bytes;
    ledger->by_purpose[group] -= bytes;
  };
  Result<DeviceBuffer> raw = allocate_impl(bytes, purpose);
  if (!raw.is_ok()) {
    unreserve();
    return raw.status();
  }
  // Rewrap so that releasing the buffer also returns its bytes to the ledger.
  auto inner = std::make_shared<DeviceBuffer>(std::move(raw).value());
  void* data = inner->data();
  const auto start = reinterpret_cast<uintptr_t>(data);
  if (data != nullptr && bytes > 0) {
    std::lock_guard<std::mutex> lock(ledger_->mu);
    ledger_->buffers[start] = bytes;
  }
  return DeviceBuffer(data, bytes, std::move(purpose), [inner, unreserve, ledger = ledger_, start]() mutable {
    {
      std::lock_guard<std::mutex> lock(ledger->mu);
      ledger->buffers.erase(start);
    }
    inner->reset();
    unreserve();
  });
}

bool Device::owns(const void* p, size_t bytes) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(ledger_->mu);
  auto it = ledger_->buffers.upper_bound(a);  // the first buffer starting after p
  if (it == ledger_->buffers.begin()) return false;
  --it;
  const uintptr_t end = it->first + it->second;
  return a < end && bytes <= end - a;
}

uint64_t Device::live_bytes() const {
  std::lock_guard<std::mutex> lock(ledger_->mu);
  return ledger_->live;
}

uint64_t Device::peak_bytes() const {
  std::lock_guard<std::mutex> lock(ledger_->mu);
  return ledger_->peak;
}

std::string Device::memory_report() const {
  std::lock_guard<std::mutex> lock(ledger_->mu);
  const std::string limit = ledger_->limit ? fmt::format(", limit {:.3f} GiB", gib(ledger_->limit)) : "";
  return fmt::format("{:.3f} GiB live (peak {:.3f}){}: {}", gib(ledger_->live), gib(ledger_->peak), limit,
                     holders(ledger_->by_purpose));
}

}  // namespace strata::kernels
