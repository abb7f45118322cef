#include "engine/train/offload_runtime.h"

#include <algorithm>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "comm/mpi_communicator.h"
#include "comm/staged_communicator.h"
#include "common/log.h"

namespace strata::engine {
namespace {

std::string short_bytes(uint64_t b) {
  if (b >= (uint64_t{1} << 30)) return fmt::format("{:.1f}G", b / double(uint64_t{1} << 30));
  if (b >= (uint64_t{1} << 20)) return fmt::format("{:.0f}M", b / double(uint64_t{1} << 20));
  return fmt::format("{:.0f}K", b / 1024.0);
}

offload::Tier tier_of(const std::string& device) {
  return device == "nvme" ? offload::Tier::kNvme : device == "cpu" ? offload::Tier::kHost : offload::Tier::kDevice;
}

}  // namespace

void register_pool_buffers(offload::PinnedPool& pool, kernels::Device& device, IoEngine* io) {
  const bool gpu = !device.host_accessible();
  if (!gpu && io == nullptr) return;
  // Hook calls are serialised by the pool, so the state needs no lock of its own.
  struct State {
    std::set<void*> on_device, on_engine;
    bool device_warned = false, engine_told = false;
  };
  auto state = std::make_shared<State>();
  pool.set_hooks(
      [state, &device, io, gpu](void* p, size_t bytes, const std::string& purpose) {
        if (gpu) {
          if (Status st = device.register_host(p, bytes); st.is_ok()) {
            state->on_device.insert(p);
          } else if (!std::exchange(state->device_warned, true)) {
            STRATA_LOG_WARN("host buffer '{}' is not registered with the GPU, so its copies are staged and "
                            "slower: {}", purpose, st.message());
          }
        }
        if (io != nullptr) {
          if (Status st = io->add_buffer(p, bytes); st.is_ok()) {
            state->on_engine.insert(p);
          } else if (!std::exchange(state->engine_told, true)) {
            STRATA_LOG_INFO("host buffer '{}' is not registered with the I/O engine, so its NVMe transfers pin "
                            "their pages each time: {}", purpose, st.message());
          }
        }
      },
      [state, &device, io](void* p, size_t, const std::string&) {
        if (state->on_device.erase(p) == 1) device.unregister_host(p);
        if (state->on_engine.erase(p) == 1) io->remove_buffer(p);
      });
}

bool offload_enabled(const OffloadConfig& c) {
  return c.offload_optimizer.device != "none" || c.offload_param.device != "none";
}

nlohmann::json OffloadStepReport::to_json() const {
  return {{"stall_ms", stall_s * 1e3},
          {"optimizer_ms", optimizer_s * 1e3},
          {"grads_wait_ms", grads_wait_s * 1e3},
          {"update_wait_ms", update_wait_s * 1e3},
          {"h2d_bytes", h2d_bytes},
          {"d2h_bytes", d2h_bytes},
          {"nvme_read_bytes", nvme_read_bytes},
          {"nvme_write_bytes", nvme_write_bytes},
          {"h2d_busy_ms", h2d_busy_s * 1e3},
          {"d2h_busy_ms", d2h_busy_s * 1e3},
          {"nvme_busy_ms", nvme_busy_s * 1e3},
          {"gather_bytes", gather_bytes},
          {"reduce_scatter_bytes", reduce_bytes},
          {"collectives_busy_ms", collectives_busy_s * 1e3},
          {"fetches", fetches},
          {"prefetch_hits", prefetch_hits},
          {"evictions", evictions},
          {"write_backs", write_backs},
          {"retraces", retraces},
          {"norms_early", norms_early},
          {"working_copies", working_copies},
          {"early_start", early_start},
          {"early_groups", early_groups},
          {"early_reads", early_reads},
          {"redone", redone},
          {"device_bytes", device.live},
          {"device_peak_bytes", device.peak},
          {"host_bytes", host.live},
          {"host_peak_bytes", host.peak},
          {"nvme_bytes", nvme.live},
          {"nvme_peak_bytes", nvme.peak}};
}

std::string OffloadStepReport::summary() const {
  std::string s = fmt::format("dev {} host {} nvme {} | stall {:.0f} ms opt {:.0f} ms", short_bytes(device.live),
                              short_bytes(host.live), short_bytes(nvme.live), stall_s * 1e3, optimizer_s * 1e3);
  if (early_start > 0) s += fmt::format(" ({} in backward{})", early_groups, redone ? ", redone" : "");
  if (gather_bytes > 0)
    s += fmt::format(" | gather {} reduce {} comm {:.0f} ms", short_bytes(gather_bytes), short_bytes(reduce_bytes),
                     collectives_busy_s * 1e3);
  return s;
}

OffloadRuntime::~OffloadRuntime() = default;

std::vector<bool> units_kept_on_device(const Model& model, double ratio) {
  // By the whole units' sizes, so that every rank of a tensor-parallel group keeps the same units.
  const std::vector<Unit>& units = model.units();
  std::vector<bool> kept(units.size(), false);
  size_t total = 0;
  for (size_t u = 0; u < units.size(); ++u) total += model.holds(u) ? model.whole_layout(u).numel() : 0;
  const double room = (1.0 - ratio) * static_cast<double>(total);
  size_t taken = 0;
  for (size_t u = 0; u < units.size(); ++u) {  // the forward's order: the embedding, the blocks, ln_f
    if (!model.holds(u)) continue;
    if (static_cast<double>(taken + model.whole_layout(u).numel()) > room) break;
    taken += model.whole_layout(u).numel();
    kept[u] = true;
  }
  // At least the last unit stays offloaded (a ratio so small that (1 - ratio) rounds to 1).
  for (size_t u = units.size(); u-- > 0;) {
    if (!model.holds(u)) continue;
    kept[u] = false;
    break;
  }
  return kept;
}

Result<std::pair<EngineOptions, IoQueueOptions>> nvme_io_options(const AioConfig& aio) {
  if (aio.block_size < 4096 || aio.block_size % 4096 != 0 || aio.block_size > (int64_t{1} << 30) ||
      aio.queue_depth < 1 || aio.queue_depth > 4096 || aio.intra_op_parallelism < 1 || aio.intra_op_parallelism > 64)
    return Status::invalid_argument("aio: block_size {} (a multiple of 4096 up to 1 GiB), queue_depth {} ([1, 4096]) "
                                    "or intra_op_parallelism {} ([1, 64]) out of range",
                                    aio.block_size, aio.queue_depth, aio.intra_op_parallelism);
  EngineOptions e;
  e.kind = EngineKind::kAuto;
  e.lanes = static_cast<uint32_t>(aio.intra_op_parallelism);
  e.queue_depth = static_cast<uint32_t>(aio.queue_depth);
  IoQueueOptions q;
  q.block_size = static_cast<size_t>(aio.block_size);
  q.max_write_bytes_in_flight = kNvmeWriteBytesInFlight;
  return std::pair{e, q};
}

Result<OffloadSizing> size_offload(const OffloadConfig& config, const Model& model, const std::vector<bool>& offloaded,
                                   size_t ranks) {
  OffloadSizing z;
  z.ranks = ranks;
  z.opt_tier = tier_of(config.offload_optimizer.device);
  z.param_tier = tier_of(config.offload_param.device);
  if (ranks > 1) {  // ZeRO-3: the shards live in host memory unless placed on nvme
    if (z.opt_tier == offload::Tier::kDevice) z.opt_tier = offload::Tier::kHost;
    if (z.param_tier == offload::Tier::kDevice) z.param_tier = offload::Tier::kHost;
  }
  if (z.opt_tier == offload::Tier::kDevice) {
    return Status::invalid_argument(
        "zero_optimization.offload_param.device = {} needs zero_optimization.offload_optimizer.device = cpu or nvme: "
        "the fp32 master weights would otherwise stay on the device",
        config.offload_param.device);
  }
  // The sub-group size: optimizer state and nvme parameter chunks share it, so an optimizer sub-group's new
  // parameters are whole chunks. Under ZeRO-3 a unit's state here is its shard (at most the coordinator's padded
  // stride), which is what its stores and host memory hold.
  z.group = static_cast<size_t>((config.sub_group_size + 1023) / 1024 * 1024);
  for (size_t i = 0; i < model.units().size(); ++i) {
    if (!offloaded[i]) continue;
    const size_t held = offload::shard_stride(model.units()[i].numel(), ranks);
    z.largest_key = std::max<uint64_t>(z.largest_key, std::min(z.group, held) * sizeof(float));
    z.state_bytes += held * sizeof(float);
  }
  const bool have_nvme = z.param_tier == offload::Tier::kNvme || z.opt_tier == offload::Tier::kNvme;
  const bool grads_over_half = config.host_memory_limit > 0 && z.state_bytes > config.host_memory_limit / 2;
  z.grad_tier = config.gradients == "nvme" || (config.gradients == "auto" && have_nvme && grads_over_half)
                    ? offload::Tier::kNvme
                    : offload::Tier::kHost;
  z.file_bytes =
      (std::max<uint64_t>(z.largest_key + 4096, std::min<uint64_t>(uint64_t{1} << 30, 2 * 3 * z.state_bytes)) + 4095) /
      4096 * 4096;
  z.grad_path =
      z.opt_tier == offload::Tier::kNvme ? config.offload_optimizer.nvme_path : config.offload_param.nvme_path;
  auto place = [&](const std::string& path, uint64_t classes) {
    z.nvme_state_bytes[path] += classes * z.state_bytes;
    z.nvme_max_bytes[path] += 2 * classes * z.state_bytes;
  };
  if (z.param_tier == offload::Tier::kNvme) place(config.offload_param.nvme_path, 1);
  if (z.opt_tier == offload::Tier::kNvme) place(config.offload_optimizer.nvme_path, 3);  // master weights, m, v
  if (z.grad_tier == offload::Tier::kNvme) place(z.grad_path, 1);
  return z;
}

uint32_t OffloadSizing::files(const std::string& path) const {
  const uint64_t bytes = nvme_max_bytes.at(path);
  return static_cast<uint32_t>((bytes + file_bytes - 4096 - 1) / (file_bytes - 4096) + 1);
}

Status OffloadRuntime::open_store(const std::string& path, uint64_t file_bytes, uint32_t max_files,
                                  const AioConfig& aio) {
  if (!io_engine_) {
    STRATA_ASSIGN_OR_RETURN(const auto options, nvme_io_options(aio));
    STRATA_ASSIGN_OR_RETURN(io_engine_, make_io_engine(options.first));
    io_queue_ = std::make_unique<IoQueue>(*io_engine_, options.second);
  }
  SwapStoreOptions so;
  so.dir = path;
  so.file_bytes = file_bytes;
  so.max_files = max_files;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SwapStore> store, SwapStore::open(*io_queue_, so));
  stores_.emplace(path, std::move(store));
  return Status::ok();
}

Result<std::unique_ptr<OffloadRuntime>> OffloadRuntime::create(const OffloadConfig& config, const AdamWConfig& adam,
                                                              kernels::Device& device, Model& model,
                                                              comm::Communicator* dp, comm::Communicator* pp,
                                                              const PipelinePlan* plan) {
  // Stages 1 and 2 shard the optimizer state, and an offloaded one is the coordinator's business: they run as
  // stage 3, the parameters gathered at their first use after a step instead of all-gathered after it (the
  // same bytes when the model fits on the device).
  const bool zero3 = config.stage >= 1 && dp != nullptr && dp->size() > 1;
  if (zero3 && config.stage < 3)
    STRATA_LOG_INFO("zero_optimization.stage {} with offload_optimizer over {} ranks: each rank offloads its shard of "
                    "the optimizer state, with the parameters sharded as in stage 3",
                    config.stage, dp->size());
  std::unique_ptr<OffloadRuntime> rt(new OffloadRuntime());
  rt->device_ = &device;
  std::string kept_note;
  if (const double ratio = config.offload_optimizer.ratio; ratio < 1.0 && config.offload_optimizer.device != "none") {
    if (pp != nullptr && pp->size() > 1)
      return Status(StatusCode::kUnimplemented,
                    fmt::format("zero_optimization.offload_optimizer.ratio = {} is not supported under pipeline "
                                "parallelism yet (leave it out, or at 1)",
                                ratio));
    const std::vector<bool> kept = units_kept_on_device(model, ratio);
    size_t n = 0, elements = 0;
    for (size_t u = 0; u < kept.size(); ++u) {
      n += kept[u];
      elements += kept[u] ? model.whole_layout(u).numel() : 0;
    }
    if (n == 0) {
      STRATA_LOG_WARN("zero_optimization.offload_optimizer.ratio = {}: even the first unit ('{}', {} elements) is "
                      "over the {:.0f} elements left to the device, so all the optimizer state is offloaded",
                      ratio, model.units()[0].name, model.whole_layout(0).numel(),
                      (1.0 - ratio) * static_cast<double>(model.whole_num_params()));
    } else {
      STRATA_RETURN_IF_ERROR(model.keep_on_device(kept).with_context("zero_optimization.offload_optimizer.ratio"));
      kept_note = fmt::format("; the first {} units ('{}' to '{}', {:.1f}% of the parameters) whole on the device", n,
                              model.units()[0].name, model.units()[n - 1].name,
                              100.0 * static_cast<double>(elements) / static_cast<double>(model.whole_num_params()));
    }
  }
  std::vector<bool> offloaded(model.units().size());
  for (size_t u = 0; u < offloaded.size(); ++u) offloaded[u] = model.holds(u) && !model.on_device(u);
  STRATA_ASSIGN_OR_RETURN(const OffloadSizing sizing,
                          size_offload(config, model, offloaded, zero3 ? static_cast<size_t>(dp->size()) : 1));
  const offload::Tier param_tier = sizing.param_tier, opt_tier = sizing.opt_tier, grad_tier = sizing.grad_tier;
  const size_t group = sizing.group;
  rt->placements_ = fmt::format("{}parameters on {}, optimizer state on {}, gradients to {}",
                                zero3 ? fmt::format("ZeRO-3 over {} ranks: shards of ", dp->size()) : "",
                                offload::tier_name(param_tier), offload::tier_name(opt_tier),
                                offload::tier_name(grad_tier)) +
                    kept_note;
  if (zero3) {
    size_t small = 0;
    for (const Unit& u : model.units()) small += u.numel() <= static_cast<size_t>(config.stage3_param_persistence_threshold);
    if (small > 0)
      STRATA_LOG_INFO("zero_optimization.stage 3: {} unit(s) under stage3_param_persistence_threshold stay gathered "
                      "on the device between uses (sharded at home, never evicted, outside "
                      "stage3_max_live_parameters)",
                      small);
    // The coordinator issues its collectives from its own thread: on a communicator of its own, while this
    // thread uses others — which MPI allows only at MPI_THREAD_MULTIPLE.
    if (comm::mpi_initialized() && !comm::mpi_thread_multiple())
      return Status(StatusCode::kUnimplemented,
                    "zero_optimization.stage 3 over several ranks needs an MPI library with MPI_THREAD_MULTIPLE; this "
                    "one gives less");
    // On a GPU (a StagedCommunicator) its collectives go over NCCL, or are staged through host memory. NCCL's
    // kernels wait on the GPU for their peers, and two communicators driven from two threads at once can
    // deadlock when the ranks launch their calls in different orders (NCCL's documentation): with tensor or
    // pipeline parallelism, whose groups this thread drives meanwhile, the shard group stays off NCCL.
    auto* staged_dp = dynamic_cast<comm::StagedCommunicator*>(dp);
    const bool nccl_shards = staged_dp != nullptr && pp == nullptr && !model.tensor_parallel();
    if (staged_dp != nullptr) {
      STRATA_ASSIGN_OR_RETURN(rt->shard_group_, staged_dp->split(0, dp->rank(), "dp.zero3", nccl_shards));
      if (staged_dp->has_device_plane() && !nccl_shards)
        STRATA_LOG_INFO("collectives of group 'dp.zero3': staged through host memory over MPI (driven from the offload "
                        "coordinator's thread while this one drives the {} group over NCCL)",
                        pp != nullptr ? "pipeline" : "tensor-parallel");
    } else {
      STRATA_ASSIGN_OR_RETURN(rt->shard_group_, dp->split(0, dp->rank(), "dp.zero3"));
    }
    if (auto* staged = dynamic_cast<comm::StagedCommunicator*>(rt->shard_group_.get())) {
      // The coordinator fences every call (the slot's last use before a gather, backward's gradients before a
      // reduce-scatter), so they need not wait for the compute stream to drain, which would keep prefetches
      // from overlapping the kernels.
      staged->set_caller_fenced(true);
      // Over NCCL, a reduce-scatter into a host shard receives in device memory first: sized now for the
      // largest shard, so the collectives thread never allocates device memory (nor frees it, which waits for
      // the whole GPU).
      size_t largest = 0;
      for (const Unit& u : model.units())
        largest = std::max(largest, offload::shard_stride(u.numel(), static_cast<size_t>(dp->size())));
      STRATA_RETURN_IF_ERROR(staged->reserve_device_staging(largest * sizeof(float))
                                 .with_context("ZeRO-3's reduce-scatter into host shards"));
    }
  }

  // One store per folder, sized for what goes there (size_offload).
  for (const auto& store : sizing.nvme_max_bytes) {
    const std::string& path = store.first;
    STRATA_RETURN_IF_ERROR(rt->open_store(path, sizing.file_bytes, sizing.files(path), config.aio)
                               .with_context("zero_optimization nvme_path " + path));
  }
  SwapStore* param_store =
      param_tier == offload::Tier::kNvme ? rt->stores_.at(config.offload_param.nvme_path).get() : nullptr;
  SwapStore* opt_store =
      opt_tier == offload::Tier::kNvme ? rt->stores_.at(config.offload_optimizer.nvme_path).get() : nullptr;
  SwapStore* grad_store = grad_tier == offload::Tier::kNvme ? rt->stores_.at(sizing.grad_path).get() : nullptr;

  offload::PinnedPoolOptions po;
  po.budget_bytes = config.host_memory_limit;
  po.budget_name = "memory.host_memory_limit";
  po.lock = config.offload_param.pin_memory || config.offload_optimizer.pin_memory;
  STRATA_ASSIGN_OR_RETURN(rt->pool_, offload::PinnedPool::create(po));
  register_pool_buffers(*rt->pool_, device, rt->io_engine_.get());
  rt->copies_ = std::make_unique<offload::CopyEngine>();

  std::vector<offload::CoordinatorUnit> units;
  const NormShares& shares = model.norm_shares();
  for (size_t i = 0; i < model.units().size(); ++i) {
    units.push_back({model.units()[i].name, model.units()[i].numel(), model.holds(i) && !model.on_device(i),
                     shares.active() ? shares.excluded[i] : Ranges{}});
  }
  offload::CoordinatorOptions co;
  co.param_home = param_tier;
  co.grad_home = grad_tier;
  co.persistence_threshold = static_cast<size_t>(config.stage3_param_persistence_threshold);
  co.prefetch_elements = static_cast<size_t>(config.stage3_prefetch_bucket_size);
  co.max_live_elements = static_cast<size_t>(config.stage3_max_live_parameters);
  co.nvme_chunk_elements = group;
  co.nvme_buffers = static_cast<int>(config.offload_param.buffer_count);
  STRATA_ASSIGN_OR_RETURN(rt->coordinator_, offload::Coordinator::create(device, *rt->copies_, rt->pool_.get(),
                                                                         param_store, std::move(units), co,
                                                                         grad_store, rt->shard_group_.get()));
  model.set_coordinator(rt->coordinator_.get());

  offload::OffloadedAdamWOptions oo;
  oo.placement = opt_tier;
  oo.sub_group_size = group;
  oo.swap_slots = static_cast<int>(config.offload_optimizer.buffer_count);
  oo.overlap_backward = config.offload_optimizer.overlap_backward;
  oo.speculative_sub_groups = static_cast<size_t>(config.offload_optimizer.speculative_sub_groups);
  STRATA_ASSIGN_OR_RETURN(rt->optimizer_, offload::OffloadedAdamW::create(model, *rt->coordinator_, *rt->pool_,
                                                                          opt_store, adam, oo, grad_store));
  // Each step's update overlaps the next forward: a unit's new parameters are published before its first use.
  offload::OffloadedAdamW* opt = rt->optimizer_.get();
  if (zero3) STRATA_RETURN_IF_ERROR(opt->set_gradient_reducer(dp));
  if (pp != nullptr && pp->size() > 1) {
    if (plan == nullptr) return Status::internal("offload: a pipeline without its plan");
    STRATA_RETURN_IF_ERROR(opt->set_pipeline(*plan, *pp));
  }
  rt->coordinator_->set_before_use([opt](size_t unit) { return opt->publish_through(unit); });
  rt->coordinator_->set_params_pending([opt](size_t unit) { return opt->will_publish(unit); });
  // And with the optimizer on nvme, updates start in the last backward as units' gradients are complete.
  model.set_on_grads_done([opt](size_t unit) { opt->grads_done(unit); });
  return rt;
}

OffloadStepReport OffloadRuntime::take_report() {
  OffloadStepReport r;
  const offload::CoordinatorStats cs = coordinator_->take_stats();
  r.stall_s = cs.stall_s;
  r.h2d_bytes = cs.h2d_bytes;
  r.d2h_bytes = cs.d2h_bytes;
  r.nvme_read_bytes = cs.nvme_read_bytes;
  r.nvme_write_bytes = cs.nvme_write_bytes;
  r.fetches = cs.fetches;
  r.prefetch_hits = cs.prefetch_hits;
  r.evictions = cs.evictions;
  r.write_backs = cs.write_backs;
  r.retraces = cs.retraces;
  r.norms_early = cs.norms_early;
  r.working_copies = cs.working_copies;
  const offload::OffloadedStepStats& os = optimizer_->last_step_stats();
  r.optimizer_s = os.update_s;
  r.grads_wait_s = os.grads_wait_s;
  r.update_wait_s = os.update_wait_s;
  r.nvme_read_bytes += os.nvme_read_bytes;
  r.nvme_write_bytes += os.nvme_write_bytes;
  r.early_start = optimizer_->last_speculation().started ? 1 : 0;
  r.early_groups = optimizer_->last_speculation().early_groups;
  r.early_reads = optimizer_->last_speculation().early_reads ? 1 : 0;
  r.redone = optimizer_->last_speculation().redone ? 1 : 0;
  auto delta = [](const offload::CopyQueueStats& now, offload::CopyQueueStats* last) {
    const double d = now.busy_s - last->busy_s;
    *last = now;
    return d;
  };
  r.h2d_busy_s = delta(copies_->h2d.stats(), &last_h2d_);
  r.d2h_busy_s = delta(copies_->d2h.stats(), &last_d2h_);
  if (io_queue_) {
    const double busy = io_queue_->stats().busy_s;
    r.nvme_busy_s = busy - last_disk_busy_s_;
    last_disk_busy_s_ = busy;
  }
  r.collectives_busy_s = delta(coordinator_->collective_stats(), &last_collectives_);
  r.gather_bytes = cs.gather_bytes;
  r.reduce_bytes = cs.reduce_bytes;
  r.device = offload::TierUsage{device_->live_bytes(), device_->peak_bytes(), device_->memory_limit()};
  r.host = offload::TierUsage{pool_->used_bytes(), pool_->peak_bytes(), pool_->budget_bytes()};
  uint64_t nvme = 0;
  for (const auto& [path, store] : stores_) nvme += store->stats().used_bytes;
  nvme_peak_ = std::max(nvme_peak_, nvme);
  r.nvme = offload::TierUsage{nvme, nvme_peak_, 0};
  return r;
}

std::string OffloadRuntime::describe() const {
  std::string out = fmt::format("offload: {}; host tier: {}", placements_, pool_->budget_source());
  for (const auto& [path, store] : stores_)
    out += fmt::format("; nvme tier: {} ({} file(s) of {} MiB)", path, store->options().max_files,
                       store->options().file_bytes >> 20);
  return out;
}

}  // namespace strata::engine
