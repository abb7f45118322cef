#include "engine/train/memory_plan.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>

#include "common/log.h"
#include "common/units.h"
#include "engine/train/offload_runtime.h"
#include "offload/coordinator.h"
#include "offload/optimizer_swap.h"
#include "offload/pinned_pool.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kPage = 4096;  // the pool maps whole pages for every buffer

uint64_t pages(uint64_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }

uint64_t sum(const std::vector<MemoryPlan::Item>& items) {
  uint64_t total = 0;
  for (const MemoryPlan::Item& i : items) total += i.bytes;
  return total;
}

void add(std::vector<MemoryPlan::Item>& items, const std::string& what, uint64_t bytes) {
  if (bytes == 0) return;
  for (MemoryPlan::Item& i : items) {
    if (i.what == what) {
      i.bytes += bytes;
      return;
    }
  }
  items.push_back({what, bytes});
}

// "offload.optimizer 11.20 GiB, offload.params 3.73 GiB, ...": the largest first.
std::string holders(std::vector<MemoryPlan::Item> items) {
  std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.bytes > b.bytes; });
  std::string out;
  for (const MemoryPlan::Item& i : items)
    out += fmt::format("{}{} {}", out.empty() ? "" : ", ", i.what, format_bytes(i.bytes));
  return out;
}

// The free bytes of the filesystem `path` is or will be created on: its nearest existing ancestor's.
std::optional<uint64_t> free_disk_bytes(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::absolute(path, ec);
  if (ec) return std::nullopt;
  while (!fs::exists(p, ec) && p.has_parent_path() && p.parent_path() != p) p = p.parent_path();
  struct statvfs sv {};
  if (::statvfs(p.c_str(), &sv) != 0) return std::nullopt;
  return static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
}

// The keys that name `path`.
std::string nvme_keys(const OffloadConfig& config, const std::string& path) {
  std::string keys;
  if (config.offload_param.device == "nvme" && config.offload_param.nvme_path == path)
    keys = "zero_optimization.offload_param.nvme_path";
  if (config.offload_optimizer.device == "nvme" && config.offload_optimizer.nvme_path == path)
    keys += std::string(keys.empty() ? "" : " and ") + "zero_optimization.offload_optimizer.nvme_path";
  return keys.empty() ? "the gradients' nvme_path" : keys;
}

}  // namespace

uint64_t MemoryPlan::device_bytes() const { return sum(device); }
uint64_t MemoryPlan::host_bytes() const { return sum(host); }
void MemoryPlan::add_device(const std::string& what, uint64_t bytes) { add(device, what, bytes); }
void MemoryPlan::add_host(const std::string& what, uint64_t bytes) { add(host, what, bytes); }

Result<MemoryPlan> plan_memory(const Model& shape, const OffloadConfig& config, const MemoryPlacement& placement) {
  MemoryPlan plan;
  const std::vector<Unit>& units = shape.units();
  if (!placement.offloaded) {
    // The model's parameters and gradients of the units this rank holds, and Adam's moments (AdamW,
    // PipelineAdamW), sharded over the ranks under ZeRO stage 1 or 2 (ShardedAdamW).
    uint64_t held = 0;
    for (size_t u = 0; u < units.size(); ++u) held += shape.holds(u) ? units[u].numel() : 0;
    plan.add_device("gpt2.params", held * sizeof(float));
    plan.add_device("gpt2.grads", held * sizeof(float));
    const uint64_t moments = (held + placement.zero12_ranks - 1) / placement.zero12_ranks;
    plan.add_device("adamw.m", moments * sizeof(float));
    plan.add_device("adamw.v", moments * sizeof(float));
    return plan;
  }

  // The offload stack (OffloadRuntime::create): the units offload_optimizer.ratio keeps whole on the device, then
  // the coordinator's homes and the optimizer's state of the rest.
  std::vector<bool> kept(units.size(), false);
  if (config.offload_optimizer.ratio < 1.0 && config.offload_optimizer.device != "none")
    kept = units_kept_on_device(shape, config.offload_optimizer.ratio);
  std::vector<bool> offloaded(units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    offloaded[u] = shape.holds(u) && !kept[u];
    if (!kept[u]) continue;
    for (const char* what : {"gpt2.params", "gpt2.grads", "adamw.m", "adamw.v"})
      plan.add_device(what, units[u].numel() * sizeof(float));
  }
  const size_t ranks = placement.zero3_ranks;
  STRATA_ASSIGN_OR_RETURN(const OffloadSizing z, size_offload(config, shape, offloaded, ranks));
  const auto threshold = static_cast<size_t>(config.stage3_param_persistence_threshold);
  uint64_t largest_stride = 0, largest_read = 0, largest_write = 0, largest_group = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    if (!offloaded[u]) continue;
    const size_t numel = units[u].numel(), stride = offload::shard_stride(numel, ranks);
    const uint64_t home = stride * sizeof(float);  // room for a padded shard (Coordinator::create)
    largest_stride = std::max<uint64_t>(largest_stride, stride);
    if (z.grad_tier == offload::Tier::kHost) plan.add_host("offload.grads", pages(home));
    const bool persistent = ranks == 1 && (z.param_tier == offload::Tier::kDevice || numel <= threshold);
    if (persistent)
      plan.add_device("offload.persistent", numel * sizeof(float));
    else if (z.param_tier == offload::Tier::kHost)
      plan.add_host("offload.params", pages(home));
    if (!persistent && z.param_tier == offload::Tier::kNvme) largest_read = std::max(largest_read, home);
    if (z.grad_tier == offload::Tier::kNvme) {
      if (ranks == 1) largest_read = std::max(largest_read, home);
      largest_write = std::max(largest_write, home);
    }
    // The optimizer's sub-groups of the unit's shard (the last rank's may be shorter: counted at the stride).
    for (size_t off = 0; off < stride; off += z.group) {
      const uint64_t n = std::min(z.group, stride - off);
      largest_group = std::max(largest_group, n);
      if (z.opt_tier == offload::Tier::kHost) plan.add_host("offload.optimizer", pages(3 * n * sizeof(float)));
    }
  }
  if (ranks > 1) plan.add_host("offload.zero3 reduce-scatter", pages(largest_stride * sizeof(float)));
  const auto buffers = static_cast<uint64_t>(std::max<int64_t>(config.offload_param.buffer_count, 1));
  plan.add_host("offload.nvme read staging", buffers * pages(largest_read));
  plan.add_host("offload.nvme write staging", buffers * pages(largest_write));
  if (z.opt_tier == offload::Tier::kHost && z.grad_tier == offload::Tier::kNvme)
    plan.add_host("offload.optimizer grads", pages(largest_group * sizeof(float)));
  if (z.opt_tier == offload::Tier::kNvme && largest_group > 0) {
    offload::OptimizerSwapOptions so;
    so.slots = std::max<int>(2, static_cast<int>(config.offload_optimizer.buffer_count));
    plan.add_host("offload.optimizer swap slot",
                  offload::OptimizerSwapper::staging_bytes(largest_group, so, z.grad_tier == offload::Tier::kNvme));
  }
  plan.nvme_state = z.nvme_state_bytes;
  plan.nvme_max = z.nvme_max_bytes;
  return plan;
}

MemoryBudgets measure_memory_budgets(const MemoryPlan& plan, const OffloadConfig& config,
                                     const kernels::Device& device) {
  MemoryBudgets b;
  if (config.device_memory_limit > 0) {
    b.device = config.device_memory_limit;
    b.device_source = "memory.device_memory_limit";
  } else if (!device.host_accessible()) {
    b.device = device.free_memory();
    b.device_source = fmt::format("what {} has free", device.name());
  }
  const bool lock = config.offload_param.pin_memory || config.offload_optimizer.pin_memory;
  if (config.host_memory_limit > 0) {
    b.host = config.host_memory_limit;
    b.host_source = "memory.host_memory_limit";
  } else {
    const offload::PinnedPool::AutoBudget a = offload::PinnedPool::auto_budget(lock);
    b.host = a.bytes;
    b.host_source = fmt::format("the host tier's automatic budget ({}; memory.host_memory_limit sets it)", a.source);
  }
  if (device.host_accessible()) {
    const offload::PinnedPool::AutoBudget h = offload::memory_headroom(offload::read_budget_inputs(lock));
    b.shared = h.bytes;
    b.shared_source = h.source;
  }
  for (const auto& entry : plan.nvme_state) {
    if (const std::optional<uint64_t> free = free_disk_bytes(entry.first)) b.disk_free[entry.first] = *free;
  }
  return b;
}

Status check_memory_fits(const MemoryPlan& plan, const MemoryBudgets& budgets, const OffloadConfig& config) {
  const uint64_t device = plan.device_bytes(), host = plan.host_bytes();
  const bool offloaded = config.offload_optimizer.device != "none" || config.offload_param.device != "none" ||
                         !plan.host.empty();
  const std::string to_nvme =
      "put it on nvme: zero_optimization.offload_optimizer.device and offload_param.device = \"nvme\" with an "
      "nvme_path";
  if (budgets.device > 0 && device > budgets.device) {
    std::string fix;
    if (!offloaded)
      fix = "offload it: zero_optimization.offload_optimizer.device = \"cpu\" or \"nvme\" (and offload_param.device "
            "for the parameters)";
    else if (config.offload_param.device == "none")
      fix = "offload the parameters too: zero_optimization.offload_param.device = \"cpu\" or \"nvme\"";
    else
      fix = "keep less on the device: a lower zero_optimization.stage3_param_persistence_threshold, or "
            "offload_optimizer.ratio nearer 1";
    return Status::out_of_memory(
        "the model's state needs at least {} of device memory ({}) but {} is {}: {}, or raise "
        "memory.device_memory_limit",
        format_bytes(device), holders(plan.device), budgets.device_source, format_bytes(budgets.device), fix);
  }
  if (!plan.host.empty() && budgets.host > 0 && host > budgets.host) {
    return Status::out_of_memory("the model's offloaded state needs at least {} of host memory ({}) but {} is {}: {}, "
                                 "or raise memory.host_memory_limit",
                                 format_bytes(host), holders(plan.host), budgets.host_source, format_bytes(budgets.host),
                                 to_nvme);
  }
  if (budgets.shared > 0 && device + host > budgets.shared) {
    std::vector<MemoryPlan::Item> all = plan.device;
    for (const MemoryPlan::Item& i : plan.host) all.push_back(i);
    return Status::out_of_memory("the model's state needs at least {} of this machine's memory ({}) but it has {} free "
                                 "({}): {}",
                                 format_bytes(device + host), holders(all), format_bytes(budgets.shared),
                                 budgets.shared_source,
                                 offloaded ? to_nvme : "offload it to nvme: zero_optimization.offload_optimizer.device "
                                                       "and offload_param.device = \"nvme\" with an nvme_path");
  }
  for (const auto& [path, state] : plan.nvme_state) {
    const auto free = budgets.disk_free.find(path);
    if (free == budgets.disk_free.end()) continue;
    if (state > free->second)
      return Status::out_of_memory("{} = {}: the state swapped there needs at least {} but its filesystem has {} free",
                                   nvme_keys(config, path), path, format_bytes(state), format_bytes(free->second));
    if (const uint64_t most = plan.nvme_max.at(path); most > free->second)
      STRATA_LOG_WARN("{} = {}: the swap store there may grow to {} (two versions of a key while it is rewritten) and "
                      "its filesystem has {} free; the run stops with a clear error if the disk fills",
                      nvme_keys(config, path), path, format_bytes(most), format_bytes(free->second));
  }
  return Status::ok();
}

}  // namespace strata::engine
