#include "offload/pinned_pool.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cctype>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "common/check.h"
#include "common/log.h"

namespace strata::offload {
namespace {

std::string bytes_str(uint64_t b) {
  return fmt::format("{} bytes ({:.1f} MiB)", b, static_cast<double>(b) / (1 << 20));
}

std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Calls fn(line) for each line of `text` until fn returns true.
template <typename Fn>
void for_each_line(std::string_view text, Fn fn) {
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    if (fn(text.substr(0, nl))) return;
    if (nl == std::string_view::npos) return;
    text.remove_prefix(nl + 1);
  }
}

std::optional<uint64_t> memlock_limit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return std::nullopt;
  return static_cast<uint64_t>(rl.rlim_cur);
}

std::string memlock_str() {
  const auto lim = memlock_limit();
  return lim ? bytes_str(*lim) : std::string("unlimited");
}

}  // namespace

// --- parsers --------------------------------------------------------------------------------------------------

std::optional<uint64_t> parse_meminfo_available(std::string_view meminfo) {
  std::optional<uint64_t> out;
  for_each_line(meminfo, [&](std::string_view line) {
    constexpr std::string_view kKey = "MemAvailable:";
    if (line.substr(0, kKey.size()) != kKey) return false;
    const std::string_view v = trim(line.substr(kKey.size()));
    uint64_t kib = 0;
    if (std::from_chars(v.data(), v.data() + v.size(), kib).ec == std::errc()) out = kib * 1024;  // always kB
    return true;
  });
  return out;
}

std::optional<uint64_t> parse_cgroup_bytes(std::string_view text) {
  const std::string_view v = trim(text);
  uint64_t b = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), b);
  if (v == "max" || ec != std::errc() || end != v.data() + v.size()) return std::nullopt;
  // cgroup v1 writes "no limit" as the largest page-aligned long (9223372036854771712).
  if (b >= (uint64_t{1} << 62)) return std::nullopt;
  return b;
}

std::optional<std::string> parse_cgroup_path(std::string_view proc_self_cgroup, bool v2) {
  std::optional<std::string> out;
  for_each_line(proc_self_cgroup, [&](std::string_view line) {
    const size_t a = line.find(':');
    const size_t b = a == std::string_view::npos ? a : line.find(':', a + 1);
    if (b == std::string_view::npos) return false;
    const std::string_view id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1);
    bool match = v2 && id == "0" && controllers.empty();
    for (size_t p = 0; !v2 && p <= controllers.size();) {
      const size_t comma = std::min(controllers.find(',', p), controllers.size());
      match = match || controllers.substr(p, comma - p) == "memory";
      p = comma + 1;
    }
    if (match) out = std::string(trim(line.substr(b + 1)));
    return match;
  });
  return out;
}

bool parse_cap_ipc_lock(std::string_view proc_status) {
  bool has = false;
  for_each_line(proc_status, [&](std::string_view line) {
    constexpr std::string_view kKey = "CapEff:";
    if (line.substr(0, kKey.size()) != kKey) return false;
    const std::string_view v = trim(line.substr(kKey.size()));
    uint64_t caps = 0;
    if (std::from_chars(v.data(), v.data() + v.size(), caps, 16).ec == std::errc()) has = (caps >> 14) & 1;
    return true;
  });
  return has;
}

std::optional<uint64_t> read_cgroup_headroom(const std::string& root, std::string_view proc_self_cgroup,
                                             std::string* where) {
  for (const bool v2 : {true, false}) {
    auto rel = parse_cgroup_path(proc_self_cgroup, v2);
    if (!rel) continue;
    const std::string base = v2 ? root : root + "/memory";
    const char* limit_file = v2 ? "memory.max" : "memory.limit_in_bytes";
    const char* usage_file = v2 ? "memory.current" : "memory.usage_in_bytes";
    // In a cgroup namespace, or a container that mounts its own cgroup at the root, the path is not there.
    if (rel->empty() || rel->front() != '/' || !std::filesystem::exists(base + *rel)) rel = "";
    bool found = false;
    std::optional<uint64_t> best;
    // Every ancestor's limit applies too (a systemd slice's MemoryMax over a unit with none).
    for (std::string r = *rel;; r = r.substr(0, r.rfind('/'))) {
      if (r == "/") r = "";
      const std::string dir = base + r;
      if (auto limit_text = read_text(dir + "/" + limit_file)) {
        found = true;
        if (const auto limit = parse_cgroup_bytes(*limit_text)) {
          const uint64_t usage = parse_cgroup_bytes(read_text(dir + "/" + usage_file).value_or("0")).value_or(0);
          const uint64_t headroom = *limit > usage ? *limit - usage : 0;
          if (!best || headroom < *best) {
            best = headroom;
            if (where) *where = fmt::format("{}/{} {} - {} {}", dir, limit_file, *limit, usage_file, usage);
          }
        }
      }
      if (r.empty()) break;
    }
    if (found) return best;
  }
  return std::nullopt;
}

PinnedPool::AutoBudget memory_headroom(const BudgetInputs& in) {
  PinnedPool::AutoBudget h;
  if (in.mem_available) {
    h.bytes = *in.mem_available;
    h.source = fmt::format("MemAvailable {}", bytes_str(*in.mem_available));
  }
  if (in.cgroup_headroom && (!in.mem_available || *in.cgroup_headroom < *in.mem_available)) {
    h.bytes = *in.cgroup_headroom;
    h.source = fmt::format("cgroup headroom {} ({})", bytes_str(*in.cgroup_headroom), in.cgroup_where);
  }
  return h;
}

PinnedPool::AutoBudget compute_auto_budget(const BudgetInputs& in) {
  const PinnedPool::AutoBudget base = memory_headroom(in);
  if (base.source.empty()) return {0, "no MemAvailable in /proc/meminfo and no cgroup limit to derive a budget from"};
  uint64_t budget = base.bytes / 5 * 4;
  std::string source = fmt::format("80% of {}", base.source);
  if (in.lock && !in.cap_ipc_lock && in.memlock_limit && *in.memlock_limit < budget) {
    budget = *in.memlock_limit;
    source = fmt::format("RLIMIT_MEMLOCK {} (no CAP_IPC_LOCK; {} would allow more)", bytes_str(budget), source);
  }
  budget -= budget % in.page_size;
  return {static_cast<size_t>(budget), std::move(source)};
}

BudgetInputs read_budget_inputs(bool lock) {
  BudgetInputs in;
  in.page_size = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  in.mem_available = parse_meminfo_available(read_text("/proc/meminfo").value_or(""));
  if (!in.mem_available) in.mem_available = uint64_t(::sysconf(_SC_AVPHYS_PAGES)) * in.page_size;
  in.cgroup_headroom = read_cgroup_headroom("/sys/fs/cgroup", read_text("/proc/self/cgroup").value_or(""),
                                            &in.cgroup_where);
  in.lock = lock;
  in.cap_ipc_lock = parse_cap_ipc_lock(read_text("/proc/self/status").value_or(""));
  in.memlock_limit = memlock_limit();
  return in;
}

PinnedPool::AutoBudget PinnedPool::auto_budget(bool lock) { return compute_auto_budget(read_budget_inputs(lock)); }

// --- the pool -------------------------------------------------------------------------------------------------

Result<std::unique_ptr<PinnedPool>> PinnedPool::create(const PinnedPoolOptions& options) {
  AutoBudget b{options.budget_bytes, options.budget_name};
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  // A budget the machine cannot hold would only fail later, under memory pressure, far from the setting.
  const uint64_t physical = uint64_t(::sysconf(_SC_PHYS_PAGES)) * page;
  if (b.bytes > physical) {
    return Status::invalid_argument("{} is {}, more than this machine's {} of memory", options.budget_name,
                                    bytes_str(b.bytes), bytes_str(physical));
  }
  if (b.bytes == 0) b = auto_budget(options.lock);
  if (b.bytes < page) return Status::out_of_memory("pinned pool: budget {} is below one page: {}", b.bytes, b.source);
  STRATA_LOG_INFO("pinned pool: budget {} from {}{}", bytes_str(b.bytes), b.source, options.lock ? "" : ", not locked");
  const auto memlock = memlock_limit();
  if (options.lock && memlock && b.bytes > *memlock &&
      !parse_cap_ipc_lock(read_text("/proc/self/status").value_or(""))) {
    STRATA_LOG_WARN("pinned pool: budget {} is above RLIMIT_MEMLOCK {} and there is no CAP_IPC_LOCK, so acquires "
                    "past that will fail; raise it with `ulimit -l`", bytes_str(b.bytes), bytes_str(*memlock));
  }
  return std::unique_ptr<PinnedPool>(new PinnedPool(b.bytes, std::move(b.source), options.lock));
}

PinnedPool::PinnedPool(size_t budget, std::string source, bool lock)
    : budget_(budget), budget_source_(std::move(source)), lock_(lock),
      page_(static_cast<size_t>(::sysconf(_SC_PAGESIZE))) {}

PinnedPool::~PinnedPool() {
  std::lock_guard<std::mutex> lk(mu_);
  if (live_.empty()) return;
  std::string held;
  for (const auto& [p, l] : live_) held += fmt::format(" '{}' ({} bytes)", l.purpose, l.mapped);
  const std::string msg = fmt::format("pinned pool destroyed with {} live buffer(s):{}", live_.size(), held);
  STRATA_ASSERT_MSG(live_.empty(), msg.c_str());
}

Result<PinnedBuffer> PinnedPool::acquire(size_t bytes, std::string purpose) {
  return acquire_impl(bytes, std::move(purpose), Wait::kForever, {});
}
Result<PinnedBuffer> PinnedPool::acquire_for(size_t bytes, std::string purpose, std::chrono::milliseconds timeout) {
  return acquire_impl(bytes, std::move(purpose), Wait::kUntil, timeout);
}
Result<PinnedBuffer> PinnedPool::try_acquire(size_t bytes, std::string purpose) {
  return acquire_impl(bytes, std::move(purpose), Wait::kNo, {});
}

Result<PinnedBuffer> PinnedPool::acquire_impl(size_t bytes, std::string purpose, Wait wait,
                                              std::chrono::milliseconds timeout) {
  // Clamped so that milliseconds::max() means "a very long time" rather than an overflowed deadline.
  const auto deadline =
      std::chrono::steady_clock::now() + std::min<std::chrono::milliseconds>(timeout, std::chrono::hours(24 * 365));
  if (bytes == 0) return Status::invalid_argument("pinned pool: '{}' asks for 0 bytes", purpose);
  if (bytes > budget_ - budget_ % page_) {  // rounded up to pages, it would not fit in the whole budget
    return Status::out_of_memory(
        "pinned pool: '{}' asks for {} bytes ({} pages of {}), more than the whole budget of {}, which is {}", purpose,
        bytes, bytes / page_ + (bytes % page_ != 0), page_, bytes_str(budget_), budget_source_);
  }
  const size_t mapped = (bytes + page_ - 1) / page_ * page_;
  {
    std::unique_lock<std::mutex> lk(mu_);
    auto spent = [&](const std::string& how) {
      return Status::out_of_memory("pinned pool: '{}' asks for {} {}: {} of the budget of {} in use, {} waiting",
                                   purpose, bytes_str(mapped), how, bytes_str(used_), bytes_str(budget_),
                                   waiters_.size());
    };
    if (wait == Wait::kNo) {
      if (!waiters_.empty() || used_ + mapped > budget_) return spent("and the budget is spent");
    } else {
      const uint64_t ticket = next_ticket_++;
      waiters_.push_back(ticket);
      auto ready = [&] { return waiters_.front() == ticket && used_ + mapped <= budget_; };
      if (wait == Wait::kForever) {
        cv_.wait(lk, ready);
      } else if (!cv_.wait_until(lk, deadline, ready)) {
        waiters_.remove(ticket);
        cv_.notify_all();  // the next waiter may now be at the front
        return spent(fmt::format("and timed out after {} ms", timeout.count()));
      }
      waiters_.pop_front();
      cv_.notify_all();  // the next waiter may fit in what is left
    }
    used_ += mapped;
    peak_ = std::max(peak_, used_);
  }
  auto data = map_pages(mapped, purpose);
  if (!data.is_ok()) {
    unreserve(mapped);
    return data.status();
  }
  {
    std::lock_guard<std::mutex> hk(hook_mu_);
    if (on_map_) on_map_(*data, mapped, purpose);
    std::lock_guard<std::mutex> lk(mu_);
    live_.emplace(*data, Live{mapped, purpose});
  }
  return PinnedBuffer(this, *data, bytes, mapped, std::move(purpose));
}

Result<void*> PinnedPool::map_pages(size_t mapped, const std::string& purpose) const {
  // Without mlock, MAP_POPULATE makes the pages resident up front; with it, mlock faults them in itself.
  void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | (lock_ ? 0 : MAP_POPULATE),
                   -1, 0);
  if (p == MAP_FAILED) {
    return Status::out_of_memory("pinned pool: mmap of {} for '{}' failed: {}", bytes_str(mapped), purpose,
                                 std::strerror(errno));
  }
  if (lock_ && ::mlock(p, mapped) != 0) {
    const int err = errno;
    ::munmap(p, mapped);
    return Status::out_of_memory(
        "pinned pool: mlock of {} for '{}' failed: {}; RLIMIT_MEMLOCK is {} (without CAP_IPC_LOCK all locked "
        "memory of the process counts against it). Raise it (`ulimit -l unlimited`, LimitMEMLOCK= in systemd, "
        "`--ulimit memlock=-1` in docker), or set a lower budget_bytes, or lock=false",
        bytes_str(mapped), purpose, std::strerror(err), memlock_str());
  }
  // A fork (a tokenizer subprocess, say) must not make these pages copy-on-write under a DMA engine's feet.
  (void)::madvise(p, mapped, MADV_DONTFORK);
  return p;
}

void PinnedPool::release(void* data, size_t mapped) {
  {
    std::lock_guard<std::mutex> hk(hook_mu_);
    std::unique_lock<std::mutex> lk(mu_);
    auto it = live_.find(data);
    STRATA_ASSERT(it != live_.end());
    const std::string purpose = std::move(it->second.purpose);
    live_.erase(it);
    lk.unlock();
    if (on_unmap_) on_unmap_(data, mapped, purpose);
  }
  if (lock_) POSIX_CHECK(::munlock(data, mapped));
  POSIX_CHECK(::munmap(data, mapped));
  unreserve(mapped);
}

void PinnedPool::unreserve(size_t mapped) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    STRATA_ASSERT(used_ >= mapped);
    used_ -= mapped;
  }
  cv_.notify_all();
}

void PinnedBuffer::reset() {
  if (data_ == nullptr) return;
  pool_->release(data_, mapped_);
  pool_ = nullptr;
  data_ = nullptr;
  size_ = mapped_ = 0;
  purpose_.clear();
}

size_t PinnedPool::used_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return used_;
}
size_t PinnedPool::peak_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return peak_;
}

size_t PinnedPool::waiting() const {
  std::lock_guard<std::mutex> lk(mu_);
  return waiters_.size();
}

std::string PinnedPool::report() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::map<std::string, std::pair<size_t, size_t>> by_purpose;  // purpose -> (bytes, buffers)
  for (const auto& [p, l] : live_) {
    by_purpose[l.purpose].first += l.mapped;
    by_purpose[l.purpose].second += 1;
  }
  std::string out = fmt::format("pinned pool: {} used of {}, peak {}, {}; budget: {}\n", bytes_str(used_),
                                bytes_str(budget_), bytes_str(peak_), lock_ ? "locked" : "not locked", budget_source_);
  for (const auto& [purpose, v] : by_purpose)
    out += fmt::format("  {}: {} in {} buffer(s)\n", purpose, bytes_str(v.first), v.second);
  return out;
}

void PinnedPool::for_each_live(const std::function<void(void*, size_t, const std::string&)>& fn) const {
  std::vector<std::pair<void*, Live>> snapshot;
  {
    std::lock_guard<std::mutex> lk(mu_);
    snapshot.assign(live_.begin(), live_.end());
  }
  for (const auto& [p, l] : snapshot) fn(p, l.mapped, l.purpose);
}

void PinnedPool::set_hooks(PinnedHook on_map, PinnedHook on_unmap) {
  std::lock_guard<std::mutex> hk(hook_mu_);  // live_ cannot change while we hold this
  std::vector<std::pair<void*, Live>> live;
  {
    std::lock_guard<std::mutex> lk(mu_);
    live.assign(live_.begin(), live_.end());
  }
  if (on_unmap_)
    for (const auto& [p, l] : live) on_unmap_(p, l.mapped, l.purpose);
  on_map_ = std::move(on_map);
  on_unmap_ = std::move(on_unmap);
  if (on_map_)
    for (const auto& [p, l] : live) on_map_(p, l.mapped, l.purpose);
}

}  // namespace strata::offload
