// multi_rank_helpers.h — what the multi-rank training tests share: comparing checkpoint files within a
// tolerance, and a checkpoint folder every rank can read.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "storage/safetensors.h"

namespace strata::engine {

// ZeRO-3 with parameters and optimizer state on NVMe under `swap`, in sub-groups of 3000 elements and with a
// live-parameter cap of 20000 that evicts within a step (the tiny test model's units are 3616-12704 elements).
inline nlohmann::json zero3_on_nvme(const std::filesystem::path& swap) {
  return {{"stage", 3},
          {"offload_param", {{"device", "nvme"}, {"nvme_path", swap.string()}}},
          {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", swap.string()}}},
          {"sub_group_size", 3000},
          {"stage3_max_live_parameters", 20000},
          {"stage3_param_persistence_threshold", 0}};
}

// Largest absolute difference between the same tensors of two safetensors files (infinite, with a failure
// recorded, when they do not have the same tensors), and the tensor it is in (into `where`, when given).
inline double max_difference(const std::filesystem::path& a, const std::filesystem::path& b,
                             std::string* where = nullptr) {
  auto fa = SafetensorsFile::open(a.string());
  auto fb = SafetensorsFile::open(b.string());
  EXPECT_TRUE(fa.is_ok() && fb.is_ok()) << a << " " << b;
  if (!fa.is_ok() || !fb.is_ok()) return INFINITY;
  EXPECT_EQ(fa->tensors().size(), fb->tensors().size());
  double worst = 0;
  for (const SafetensorsEntry& t : fa->tensors()) {
    const SafetensorsEntry* u = fb->find(t.name);
    if (u == nullptr || u->numel() != t.numel()) {
      ADD_FAILURE() << t.name << " differs in shape or is missing";
      return INFINITY;
    }
    const float* x = reinterpret_cast<const float*>(t.data);
    const float* y = reinterpret_cast<const float*>(u->data);
    for (size_t i = 0; i < t.numel(); ++i) {
      const double d = std::abs(static_cast<double>(x[i]) - y[i]);
      if (!(d <= worst)) {  // a NaN difference wins (std::max would drop it)
        worst = d;
        if (where != nullptr) *where = fmt::format("{}[{}]: {} vs {}", t.name, i, x[i], y[i]);
      }
    }
  }
  return worst;
}

// Two runs that do the same sums in another association: `steps` losses and norms each (a, b) within 1e-5
// relative, and the weights and moments of their final checkpoints (step directories) within 2e-5 absolute.
inline void expect_within_rounding(const std::vector<std::pair<double, double>>& a,
                                   const std::vector<std::pair<double, double>>& b, size_t steps,
                                   const std::filesystem::path& checkpoint_a, const std::filesystem::path& checkpoint_b) {
  ASSERT_EQ(a.size(), steps);
  ASSERT_EQ(b.size(), steps);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i].first, b[i].first, 1e-5 * std::abs(a[i].first)) << "loss of step " << i + 1;
    EXPECT_NEAR(a[i].second, b[i].second, 1e-5 * std::abs(a[i].second)) << "norm of step " << i + 1;
  }
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    std::string where;
    EXPECT_LE(max_difference(checkpoint_a / f, checkpoint_b / f, &where), 2e-5) << f << ", largest at " << where;
  }
}

// A checkpoint folder the ranks share, as they share a file system in a real job (a resume reads it on every
// rank): named by rank 0's pid, removed by rank 0. Empty path if the ranks could not agree on it.
struct SharedDir {
  SharedDir(comm::Communicator& world, const char* prefix) : rank0(world.rank() == 0) {
    float pid = static_cast<float>(::getpid());  // < 2^22: exact in fp32
    if (world.broadcast(&pid, 1, DType::kF32, 0).is_ok())
      path = std::filesystem::temp_directory_path() / fmt::format("{}_{}", prefix, static_cast<long>(pid));
  }
  ~SharedDir() {
    if (rank0 && !path.empty()) std::filesystem::remove_all(path);
  }
  SharedDir(const SharedDir&) = delete;
  SharedDir& operator=(const SharedDir&) = delete;
  std::filesystem::path path;
  bool rank0;
};

}  // namespace strata::engine
