#include "common/aligned.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

namespace strata {
namespace {

struct Ledger {
  std::mutex mu;
  std::map<std::string, size_t> live;  // purpose -> bytes
  size_t total = 0;
};
Ledger& ledger() {
  static Ledger* l = new Ledger();  // never destroyed: buffers may be freed during static destruction
  return *l;
}

// Zeroes n bytes; past 64 MiB in 16 MiB pieces over the cores, since zeroing is also the pages' first touch
// (a bench's 40 GB of Adam inputs took many seconds on one core).
void zero_bytes(void* p, size_t n) {
  constexpr size_t kPiece = size_t{16} << 20;
  if (n <= 4 * kPiece) {
    std::memset(p, 0, n);
    return;
  }
  auto* b = static_cast<unsigned char*>(p);
  tbb::parallel_for(tbb::blocked_range<size_t>(0, (n + kPiece - 1) / kPiece), [&](const tbb::blocked_range<size_t>& r) {
    for (size_t i = r.begin(); i < r.end(); ++i) std::memset(b + i * kPiece, 0, std::min(kPiece, n - i * kPiece));
  });
}

}  // namespace

Result<AlignedBuffer> AlignedBuffer::allocate(size_t bytes, std::string purpose, size_t alignment) {
  AlignedBuffer b;
  const size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  if (rounded == 0) {
    b.purpose_ = std::move(purpose);
    return b;
  }
  void* p = std::aligned_alloc(alignment, rounded);
  if (p == nullptr) {
    return Status::out_of_memory("cannot allocate {} bytes ({:.1f} MiB) for {}", rounded,
                                 static_cast<double>(rounded) / (1 << 20), purpose);
  }
  zero_bytes(p, rounded);
  b.data_ = p;
  b.bytes_ = rounded;
  b.purpose_ = std::move(purpose);
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mu);
  l.live[b.purpose_] += rounded;
  l.total += rounded;
  return b;
}

void AlignedBuffer::reset() {
  if (data_ == nullptr) return;
  std::free(data_);
  {
    Ledger& l = ledger();
    std::lock_guard<std::mutex> lock(l.mu);
    auto it = l.live.find(purpose_);
    if (it != l.live.end()) {
      it->second -= bytes_;
      if (it->second == 0) l.live.erase(it);
    }
    l.total -= bytes_;
  }
  data_ = nullptr;
  bytes_ = 0;
}

std::string memory_report() {
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mu);
  std::string out;
  for (const auto& [purpose, bytes] : l.live)
    out += fmt::format("{}: {:.1f} MiB\n", purpose, static_cast<double>(bytes) / (1 << 20));
  return out;
}

size_t memory_live_bytes() {
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mu);
  return l.total;
}

}  // namespace strata
