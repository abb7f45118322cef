#include "storage/fault_engine.h"

#include <algorithm>
#include <cerrno>
#include <thread>
#include <vector>

#include "common/check.h"

namespace strata {

// A transfer sent to the wrapped engine in place of the caller's, with what to do to its result.
struct FaultEngine::Shadow : RawIo {
  enum class Kind { kShort, kTorn, kFlip } kind;
  RawIo* outer;
  FaultEngine* self;
  uint64_t random;  // picks the bit a flip hits
};

FaultEngine::FaultEngine(IoEngine& inner, const FaultOptions& options)
    : inner_(inner), options_(options), rng_(options.seed) {}

FaultEngine::~FaultEngine() {
  hold_writes(false);
  // Shadows point back at this engine; the wrapped engine finishes them (or cancels them on shutdown).
  while (shadows_.load(std::memory_order_acquire) > 0) std::this_thread::yield();
}

void FaultEngine::set_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(mu_);
  enabled_ = enabled;
}

void FaultEngine::hold_writes(bool hold) {
  std::vector<RawIo*> release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    holding_ = hold;
    if (!hold) release.swap(held_);
  }
  if (!release.empty()) submit(release.data(), release.size());
}

size_t FaultEngine::held_writes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_.size();
}

void FaultEngine::release_writes(size_t n) {
  std::vector<RawIo*> release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    n = std::min(n, held_.size());
    release.assign(held_.begin(), held_.begin() + static_cast<std::ptrdiff_t>(n));
    held_.erase(held_.begin(), held_.begin() + static_cast<std::ptrdiff_t>(n));
  }
  // Past the hold (submit would keep them back again), through the same fault draws as any other transfer.
  if (!release.empty()) pass_on(release.data(), release.size(), /*may_hold=*/false);
}

uint64_t FaultEngine::reads_submitted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reads_;
}

void FaultEngine::shutdown() {
  hold_writes(false);  // the inner engine finishes or cancels them
  inner_.shutdown();
}

FaultCounts FaultEngine::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

void FaultEngine::submit(RawIo* const* ios, size_t n) { pass_on(ios, n, /*may_hold=*/true); }

void FaultEngine::pass_on(RawIo* const* ios, size_t n, bool may_hold) {
  std::vector<RawIo*> pass;
  std::vector<std::pair<RawIo*, int64_t>> failed;
  pass.reserve(n);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < n; ++i) {
      RawIo* io = ios[i];
      if (may_hold && holding_ && io->op == IoOp::kWrite) {
        held_.push_back(io);
        continue;
      }
      if (io->op == IoOp::kRead) ++reads_;
      if (!enabled_) {
        pass.push_back(io);
        continue;
      }
      const bool write = io->op == IoOp::kWrite;
      const uint64_t align = std::max<size_t>(inner_.alignment(io->file), 1);
      const uint64_t blocks = io->len / align;  // a prefix must keep the rest aligned for O_DIRECT
      const double u = rng_.uniform();
      double edge = options_.eio_rate;
      auto shadow = [&](Shadow::Kind kind, uint32_t len) {
        auto* s = new Shadow{};
        static_cast<RawIo&>(*s) = *io;
        s->len = len;
        s->done = &FaultEngine::on_shadow_done;
        s->kind = kind;
        s->outer = io;
        s->self = this;
        s->random = rng_.next_u64();
        shadows_.fetch_add(1, std::memory_order_relaxed);
        pass.push_back(s);
      };
      if (u < edge) {
        ++counts_.eio;
        failed.emplace_back(io, -EIO);
        continue;
      }
      if (write && u < (edge += options_.enospc_rate)) {
        ++counts_.enospc;
        failed.emplace_back(io, -ENOSPC);
        continue;
      }
      if (blocks >= 2 && u < (edge += options_.short_rate)) {
        ++counts_.short_transfers;
        shadow(Shadow::Kind::kShort, static_cast<uint32_t>((1 + rng_.below(blocks - 1)) * align));
        continue;
      }
      if (write && blocks >= 2 && u < (edge += options_.torn_rate)) {
        ++counts_.torn;
        shadow(Shadow::Kind::kTorn, static_cast<uint32_t>((1 + rng_.below(blocks - 1)) * align));
        continue;
      }
      if (!write && u < (edge += options_.flip_rate)) {
        ++counts_.flipped;
        shadow(Shadow::Kind::kFlip, io->len);
        continue;
      }
      pass.push_back(io);
    }
  }
  for (auto& [io, err] : failed) io->done(io, err);
  if (!pass.empty()) inner_.submit(pass.data(), pass.size());
}

void FaultEngine::on_shadow_done(RawIo* io, int64_t res) {
  auto* s = static_cast<Shadow*>(io);
  RawIo* outer = s->outer;
  FaultEngine* self = s->self;
  int64_t report = res;
  if (res > 0) {
    switch (s->kind) {
      case Shadow::Kind::kShort:
        break;  // the truth: fewer bytes than asked; IoQueue resumes the rest
      case Shadow::Kind::kTorn:
        report = outer->len;  // the lie: the rest never reached the disk
        break;
      case Shadow::Kind::kFlip: {
        const uint64_t bit = s->random % (static_cast<uint64_t>(res) * 8);
        static_cast<unsigned char*>(outer->buf)[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
        break;
      }
    }
  }
  delete s;
  outer->done(outer, report);
  self->shadows_.fetch_sub(1, std::memory_order_release);
}

}  // namespace strata
