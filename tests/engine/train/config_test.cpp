#include "engine/train/config.h"

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace strata::engine {
namespace {

using nlohmann::json;

// Every config in examples/configs reads, and the Llama-family ones users bring weights for have the shapes of
// the models they are named after: the parameter counts the model cards publish.
TEST(ConfigTest, EveryExampleConfigReadsAndTheRealShapesHaveTheirModelsSizes) {
  const std::filesystem::path dir = std::filesystem::path(STRATA_SOURCE_DIR) / "examples" / "configs";
  int read = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != ".json") continue;
    auto c = load_run_config(e.path().string(), {});
    EXPECT_TRUE(c.is_ok()) << c.status().to_string();
    ++read;
  }
  EXPECT_GE(read, 8);
  const std::pair<const char*, int64_t> sizes[] = {{"llama3.2_1b.json", 1235814400},
                                                   {"llama3.2_3b.json", 3212749824},
                                                   {"llama3.1_8b.json", 8030261248},
                                                   {"qwen3_0.6b.json", 596049920}};
  for (const auto& [file, params] : sizes) {
    ASSERT_OK_AND_ASSIGN(RunConfig c, load_run_config((dir / file).string(), {}));
    EXPECT_TRUE(c.model.llama_family()) << file;
    int64_t n = 0;
    for (const UnitSpec& u : c.model.unit_specs()) n += static_cast<int64_t>(u.layout.numel());
    EXPECT_EQ(n, params) << file;
  }
}

TEST(ConfigTest, DefaultsParseAndOverridesApply) {
  json j = {{"model", {{"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}, {"vocab_size", 97}, {"block_size", 16}}},
            {"training", {{"seq_len", 16}}}};
  ASSERT_TRUE(apply_overrides(&j, {"training.lr=1e-3", "training.checkpoint_dir=runs/x", "compute.kernels=\"reference\""})
                  .is_ok());
  auto c = parse_run_config(j, "cfg.json");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_DOUBLE_EQ(c->training.lr, 1e-3);
  EXPECT_EQ(c->training.checkpoint_dir, "runs/x");
  EXPECT_EQ(c->compute.kernels, "reference");
  EXPECT_EQ(c->model.gpt2.n_layer, 2);
  EXPECT_DOUBLE_EQ(c->training.min_lr, 1e-4) << "not set: a tenth of the rate, whatever the rate";

  // A value a double cannot hold: a string to the override (then the field's type check names it), and an
  // error naming the key that is not a section.
  json k = j;
  ASSERT_TRUE(apply_overrides(&k, {"training.lr=1e400"}).is_ok());
  auto huge = parse_run_config(k, "cfg.json");
  ASSERT_FALSE(huge.is_ok());
  EXPECT_NE(huge.status().message().find("training.lr must be a number"), std::string::npos)
      << huge.status().to_string();
  const Status deeper = apply_overrides(&k, {"training.seq_len.x=1"});
  EXPECT_NE(deeper.message().find("training.seq_len is a value, not a section"), std::string::npos)
      << deeper.to_string();
  // A constant schedule after the warmup; a min_lr beside it, or another schedule, named.
  json constant = j;
  constant["training"]["lr_schedule"] = "constant";
  ASSERT_OK_AND_ASSIGN(RunConfig cc, parse_run_config(constant, "cfg.json"));
  EXPECT_DOUBLE_EQ(cc.training.min_lr, 1e-3);
  constant["training"]["min_lr"] = 1e-5;
  EXPECT_NE(parse_run_config(constant, "cfg.json").status().message().find("no meaning"), std::string::npos);
  constant["training"]["lr_schedule"] = "linear";
  EXPECT_NE(parse_run_config(constant, "cfg.json").status().message().find("training.lr_schedule must be"),
            std::string::npos);
}

// A number past a double's range in the file is an error naming the file, not an uncaught exception.
TEST(ConfigTest, ANumberPastADoublesRangeNamesTheFile) {
  const std::string path = ::testing::TempDir() + "strata_huge_config.json";
  std::ofstream(path) << R"({"training": {"lr": 1e400}})";
  auto r = load_run_config(path, {});
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find(path + ": not valid JSON"), std::string::npos) << r.status().to_string();
  std::remove(path.c_str());
}

TEST(ConfigTest, UnknownKeyListsTheValidKeys) {
  json j = {{"training", {{"learning_rate", 1e-3}}}};
  auto c = parse_run_config(j, "cfg.json");
  ASSERT_FALSE(c.is_ok());
  const std::string msg = c.status().message();
  EXPECT_NE(msg.find("cfg.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'learning_rate'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lr"), std::string::npos) << msg;
  EXPECT_NE(msg.find("warmup_steps"), std::string::npos) << msg;

  auto top = parse_run_config(json{{"modle", json::object()}}, "cfg.json");
  ASSERT_FALSE(top.is_ok());
  EXPECT_NE(top.status().message().find("'modle'"), std::string::npos) << top.status().message();
}

TEST(ConfigTest, WrongTypeNamesTheField) {
  auto c = parse_run_config(json{{"model", {{"n_layer", "six"}}}}, "cfg.json");
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("model.n_layer"), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("integer"), std::string::npos) << c.status().message();
}

TEST(ConfigTest, ContextLongerThanTheModelIsRejected) {
  auto c = parse_run_config(json{{"model", {{"block_size", 64}}}, {"training", {{"seq_len", 128}}}}, "cfg.json");
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("training.seq_len"), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("block_size"), std::string::npos) << c.status().message();
}

TEST(ConfigTest, Bf16WorkingCopiesAreOnUnlessTurnedOff) {
  auto on = parse_run_config(json::object(), "cfg.json");
  ASSERT_TRUE(on.is_ok()) << on.status().to_string();
  EXPECT_TRUE(on->compute.bf16_working_copies);
  json j = json::object();
  ASSERT_TRUE(apply_overrides(&j, {"compute.bf16_working_copies=false"}).is_ok());
  auto off = parse_run_config(j, "cfg.json");
  ASSERT_TRUE(off.is_ok()) << off.status().to_string();
  EXPECT_FALSE(off->compute.bf16_working_copies);
}

TEST(ConfigTest, BadValuesAreRejectedByName) {
  for (const auto& [over, field] : std::vector<std::pair<std::string, std::string>>{
           {"model.n_head=5", "n_head"},
           {"compute.matmul_precision=\"fp8\"", "matmul_precision"},
           {"compute.kernels=\"gpu\"", "compute.kernels"},
           {"compute.bf16_working_copies=\"no\"", "compute.bf16_working_copies"},
           {"training.beta2=1.5", "beta2"},
           {"training.batch_size=0", "batch_size"},
           {"parallel.tensor_parallel_size=0", "parallel.tensor_parallel_size"},
           {"parallel.pipeline_parallel_size=-1", "pipeline_parallel_size"},
           {"parallel.distributed_backend=\"gloo\"", "parallel.distributed_backend must be"}}) {
    json j = json::object();
    ASSERT_TRUE(apply_overrides(&j, {over}).is_ok());
    auto c = parse_run_config(j, "cfg.json");
    ASSERT_FALSE(c.is_ok()) << over;
    EXPECT_NE(c.status().message().find(field), std::string::npos) << over << ": " << c.status().message();
  }
  json j = json::object();
  EXPECT_FALSE(apply_overrides(&j, {"no_equals_sign"}).is_ok());
  // NCCL carries GPU buffers: asked for on the CPU device it is an error, not ignored.
  ASSERT_TRUE(apply_overrides(&j, {"parallel.distributed_backend=\"nccl\"", "compute.device=\"cpu\""}).is_ok());
  auto nccl_on_cpu = parse_run_config(j, "cfg.json");
  ASSERT_FALSE(nccl_on_cpu.is_ok());
  EXPECT_NE(nccl_on_cpu.status().message().find("distributed_backend \"nccl\" carries GPU buffers"), std::string::npos)
      << nccl_on_cpu.status().message();
  auto defaults = parse_run_config(json::object(), "cfg.json");
  ASSERT_TRUE(defaults.is_ok());
  EXPECT_EQ(defaults->parallel.distributed_backend, "auto");
}

// A DeepSpeed ZeRO-Infinity config, as users write it (scientific notation, "auto", nested offload sections),
// parses with the same meanings; every value set away from its default is listed as not acted on yet.
TEST(ConfigTest, DeepSpeedOffloadSectionsCarryOver) {
  const json j = json::parse(R"({
    "zero_optimization": {
      "stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true, "buffer_count": 5,
                        "buffer_size": 1e8, "max_in_cpu": 1e9},
      "offload_optimizer": {"device": "cpu", "pin_memory": true, "pipeline_read": true},
      "sub_group_size": 1e9, "stage3_prefetch_bucket_size": "auto", "stage3_max_live_parameters": 2e9,
      "stage3_max_reuse_distance": 1e9, "stage3_param_persistence_threshold": "auto",
      "overlap_comm": true, "contiguous_gradients": true, "reduce_scatter": true, "allgather_partitions": true,
      "reduce_bucket_size": 2e8, "allgather_bucket_size": "auto"
    },
    "aio": {"block_size": 262144, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": true,
            "overlap_events": true},
    "memory": {"host_memory_limit": "4G", "device_memory_limit": 8589934592}
  })");
  auto c = parse_run_config(j, "ds.json");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  const OffloadConfig& o = c->offload;
  EXPECT_EQ(o.stage, 3);
  EXPECT_EQ(o.offload_param.device, "nvme");
  EXPECT_EQ(o.offload_param.nvme_path, "/local_nvme");
  EXPECT_EQ(o.offload_param.buffer_size, 100000000);
  EXPECT_EQ(o.offload_optimizer.device, "cpu");
  EXPECT_EQ(o.offload_optimizer.buffer_count, 4) << "DeepSpeed's default for the optimizer";
  EXPECT_TRUE(o.offload_optimizer.pipeline_read);
  EXPECT_EQ(o.stage3_prefetch_bucket_size, 50000000) << "\"auto\" keeps the default";
  EXPECT_EQ(o.stage3_max_live_parameters, 2000000000);
  EXPECT_EQ(o.aio.block_size, 262144);
  EXPECT_EQ(o.aio.queue_depth, 8);
  EXPECT_EQ(o.aio.intra_op_parallelism, 1);
  EXPECT_EQ(o.host_memory_limit, uint64_t{4} << 30);
  EXPECT_EQ(o.device_memory_limit, uint64_t{8} << 30);
  std::string listed;
  for (const auto& k : o.not_acted_on) listed += k + "\n";
  // Set away from their defaults: the ones nothing acts on yet are listed, the acted-on ones are not.
  EXPECT_EQ(o.reduce_bucket_size, 200000000);
  EXPECT_TRUE(o.overlap_comm);
  for (const char* key : {"zero_optimization.offload_optimizer.pipeline_read = true", "aio.single_submit = true",
                          "zero_optimization.reduce_bucket_size = 200000000"})
    EXPECT_NE(listed.find(key), std::string::npos) << key << " not in:\n" << listed;
  for (const char* key : {"zero_optimization.stage", "offload_param.device", "offload_optimizer.device",
                          "host_memory_limit", "device_memory_limit", "overlap_comm", "contiguous_gradients",
                          "reduce_scatter", "allgather", "aio.block_size", "aio.queue_depth",
                          "aio.intra_op_parallelism"})
    EXPECT_EQ(listed.find(key), std::string::npos) << key << " is acted on, yet listed in:\n" << listed;
  EXPECT_EQ(listed.find("sub_group_size"), std::string::npos) << "a default value is not worth a warning";
  // reduce_scatter = false: stage 3 reduce-scatters anyway (it was listed only under stage 2); stage 1
  // all-reduces, as false asks.
  for (int stage : {1, 2, 3}) {
    auto rs = parse_run_config(
        json::parse(fmt::format(R"({{"zero_optimization": {{"stage": {}, "reduce_scatter": false}}}})", stage)),
        "rs.json");
    ASSERT_TRUE(rs.is_ok()) << rs.status().to_string();
    std::string all;
    for (const std::string& k : rs->offload.not_acted_on) all += k + "\n";
    EXPECT_EQ(all.find("reduce_scatter") != std::string::npos, stage >= 2) << "stage " << stage << ":\n" << all;
  }
  // Stages 1 and 2 without offload cut their collectives by the buckets: not listed there.
  auto z2 = parse_run_config(json::parse(R"({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6,
                                                                     "allgather_bucket_size": 2e6}})"),
                             "z2.json");
  ASSERT_TRUE(z2.is_ok()) << z2.status().to_string();
  for (const std::string& k : z2->offload.not_acted_on)
    EXPECT_EQ(k.find("bucket"), std::string::npos) << k << " is acted on under stage 2";

  auto plain = parse_run_config(json::object(), "empty.json");
  ASSERT_TRUE(plain.is_ok());
  EXPECT_TRUE(plain->offload.not_acted_on.empty());
}

// offload_optimizer.speculative_sub_groups (ours) is acted on with the optimizer in host memory and
// overlap_backward on; elsewhere it is listed as not acted on, and a negative count is refused by name.
TEST(ConfigTest, SpeculativeSubGroupsAreForTheOptimizerInHostMemory) {
  auto parse = [](const std::string& device, bool overlap, int64_t n) {
    json j = {{"zero_optimization",
               {{"stage", 3},
                {"offload_optimizer", {{"device", device}, {"overlap_backward", overlap},
                                       {"speculative_sub_groups", n}}}}}};
    if (device == "nvme") j["zero_optimization"]["offload_optimizer"]["nvme_path"] = "/tmp/x";
    return parse_run_config(j, "spec.json");
  };
  auto listed = [](const RunConfig& c) {
    std::string all;
    for (const std::string& k : c.offload.not_acted_on) all += k + "\n";
    return all.find("speculative_sub_groups = 8") != std::string::npos;
  };
  auto cpu = parse("cpu", true, 8);
  ASSERT_TRUE(cpu.is_ok()) << cpu.status().to_string();
  EXPECT_EQ(cpu->offload.offload_optimizer.speculative_sub_groups, 8);
  EXPECT_FALSE(listed(*cpu));
  for (auto [device, overlap] : {std::pair{"nvme", true}, std::pair{"cpu", false}}) {
    auto c = parse(device, overlap, 8);
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    EXPECT_TRUE(listed(*c)) << device << " overlap_backward " << overlap;
  }
  auto negative = parse("cpu", true, -1);
  ASSERT_FALSE(negative.is_ok());
  EXPECT_NE(negative.status().message().find("speculative_sub_groups must be >= 0"), std::string::npos)
      << negative.status().message();
}

// DeepSpeed's top-level training keys land where they mean the same here; what has no counterpart, and a
// setting that contradicts ours, is refused by name; an override of the key they map to wins.
TEST(ConfigTest, DeepSpeedTrainingKeysCarryOver) {
  const json model = {{"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}, {"vocab_size", 97}, {"block_size", 16}};
  json ds = json::parse(R"({
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5, "steps_per_print": 10, "bf16": {"enabled": true}, "fp16": {"enabled": false},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.01}}
  })");
  ds["model"] = model;
  ds["training"] = {{"seq_len", 16}};
  auto c = parse_run_config(ds, "ds.json");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  const TrainingConfig& t = c->training;
  EXPECT_EQ(t.batch_size, 4);
  EXPECT_EQ(t.grad_accum_steps, 2);
  EXPECT_EQ(t.global_batch_size, 32);
  EXPECT_DOUBLE_EQ(t.grad_clip, 0.5);
  EXPECT_EQ(t.log_every, 10);
  EXPECT_DOUBLE_EQ(t.lr, 3e-4);
  EXPECT_DOUBLE_EQ(t.beta1, 0.8);
  EXPECT_DOUBLE_EQ(t.beta2, 0.99);
  EXPECT_DOUBLE_EQ(t.eps, 1e-6);
  EXPECT_DOUBLE_EQ(t.weight_decay, 0.01);
  EXPECT_EQ(c->compute.matmul_precision, kernels::MatmulPrecision::kBF16);
  // No scheduler in DeepSpeed means a constant rate: no warmup, no decay, unless the file sets them.
  EXPECT_DOUBLE_EQ(t.min_lr, 3e-4);
  EXPECT_EQ(t.warmup_steps, 0);

  // Hugging Face's "auto" leaves our setting; a disabled dtype's other settings do not matter; the optimizer's
  // type is case-insensitive.
  json hf = json::parse(R"({
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": false, "loss_scale": 0, "initial_scale_power": 16},
    "optimizer": {"type": "ADAMW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": 0.05}}
  })");
  hf["model"] = model;
  hf["training"] = {{"seq_len", 16}};
  auto h = parse_run_config(hf, "hf.json");
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  const TrainingConfig defaults;
  EXPECT_EQ(h->training.batch_size, defaults.batch_size);
  EXPECT_EQ(h->training.global_batch_size, 0);
  EXPECT_DOUBLE_EQ(h->training.grad_clip, defaults.grad_clip);
  EXPECT_DOUBLE_EQ(h->training.lr, defaults.lr);
  EXPECT_DOUBLE_EQ(h->training.min_lr, defaults.min_lr) << "no lr given: our schedule stands";
  EXPECT_DOUBLE_EQ(h->training.weight_decay, 0.05);
  EXPECT_EQ(h->compute.matmul_precision, kernels::MatmulPrecision::kF32);

  auto refused = [&](json j, const std::string& words) {
    j["model"] = model;
    if (!j.contains("training")) j["training"] = {{"seq_len", 16}};
    const auto r = parse_run_config(j, "ds.json");
    ASSERT_FALSE(r.is_ok()) << j.dump();
    EXPECT_NE(r.status().message().find(words), std::string::npos) << r.status().to_string();
  };
  refused({{"gradient_clipping", 0.5}, {"training", {{"seq_len", 16}, {"grad_clip", 1.0}}}},
          "gradient_clipping = 0.5 and training.grad_clip = 1.0 say different things");
  refused({{"fp16", {{"enabled", true}}}}, "fp16.enabled = true is not supported");
  refused({{"bf16", {{"enabled", true}, {"loss_scale", 0}}}}, "bf16.loss_scale is not supported");
  refused({{"bf16", {{"enabled", 1}}}}, "bf16.enabled must be true, false or \"auto\"");
  refused({{"optimizer", {{"type", "SGD"}}}}, "optimizer.type \"SGD\" is not supported");
  refused({{"optimizer", {{"type", "Adam"}, {"params", {{"amsgrad", true}}}}}}, "unknown key 'optimizer.params.amsgrad'");
  refused({{"optimizer", {{"type", "Adam"}, {"params", {{"adam_w_mode", false}}}}}}, "adam_w_mode = false");
  refused({{"scheduler", {{"type", "WarmupLR"}}}}, "scheduler is not supported");
  refused({{"train_batch_size", 30}, {"train_micro_batch_size_per_gpu", 4}}, "30 is not a multiple of batch_size 4");
  refused({{"wall_clock_breakdown", true}}, "unknown key 'wall_clock_breakdown'");

  // From a file: an override of the key a DeepSpeed setting maps to wins over it.
  const std::string path = ::testing::TempDir() + "strata_ds_config.json";
  {
    json file = ds;
    std::ofstream(path) << file.dump();
  }
  auto loaded = load_run_config(path, {"training.lr=1e-3"});
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_DOUBLE_EQ(loaded->training.lr, 1e-3);
  EXPECT_DOUBLE_EQ(loaded->training.min_lr, 1e-3) << "still constant: the rate given replaces the file's";
  // Below the file's rate too (a min_lr taken from the file's rate refused it).
  auto lower = load_run_config(path, {"training.lr=1e-5"});
  ASSERT_TRUE(lower.is_ok()) << lower.status().to_string();
  EXPECT_DOUBLE_EQ(lower->training.min_lr, 1e-5);
  std::remove(path.c_str());
}

// The aio section acts on the NVMe tier's engine: with nothing on nvme a value set there is warned about.
TEST(ConfigTest, AioWithoutAnNvmeTierIsNotActedOn) {
  auto c = parse_run_config(json::parse(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                            "aio": {"queue_depth": 8}})"),
                            "cpu.json");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  std::string listed;
  for (const auto& k : c->offload.not_acted_on) listed += k + "\n";
  EXPECT_NE(listed.find("aio.queue_depth = 8"), std::string::npos) << listed;
}

TEST(ConfigTest, BadOffloadValuesAreRejectedByName) {
  auto expect_error = [](const json& j, const char* needle) {
    auto c = parse_run_config(j, "ds.json");
    ASSERT_FALSE(c.is_ok()) << j.dump();
    EXPECT_NE(c.status().message().find(needle), std::string::npos) << c.status().message();
    EXPECT_NE(c.status().message().find("ds.json"), std::string::npos) << c.status().message();
  };
  expect_error(json::parse(R"({"zero_optimization": {"stage": 4}})"), "zero_optimization.stage");
  expect_error(json::parse(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})"),
               "zero_optimization.offload_param.device");
  expect_error(json::parse(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})"),
               "zero_optimization.offload_param.nvme_path");
  expect_error(json::parse(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})"),
               "stage = 3");
  expect_error(json::parse(R"({"zero_optimization": {"offload_optimizer": {"buffer_size": 5}}})"), "buffer_size");
  expect_error(json::parse(R"({"zero_optimization": {"offload_optimizer": {"buffer_count": 0}}})"), "buffer_count");
  expect_error(json::parse(R"({"zero_optimization": {"sub_group_size": 0}})"), "zero_optimization.sub_group_size");
  // Near 2^63 the rounding to whole chunks overflowed (and the optimizer's split into sub-groups never ended).
  expect_error(json::parse(R"({"zero_optimization": {"sub_group_size": 9223372036854775807}})"),
               "zero_optimization.sub_group_size must be at most");
  expect_error(json::parse(R"({"aio": {"block_size": 1000}})"), "aio.block_size");
  expect_error(json::parse(R"({"aio": {"block_size": 2147483648}})"), "aio.block_size");
  expect_error(json::parse(R"({"aio": {"queue_depth": 0}})"), "aio.queue_depth");
  expect_error(json::parse(R"({"aio": {"intra_op_parallelism": 1000}})"), "aio.intra_op_parallelism");
  expect_error(json::parse(R"({"aio": {"depth": 8}})"), "queue_depth");  // unknown key lists the valid ones
  expect_error(json::parse(R"({"memory": {"host_memory_limit": "lots"}})"), "memory.host_memory_limit");
}

}  // namespace
}  // namespace strata::engine

namespace strata::engine {
namespace {

// n_layer 10^6 hung in plan_pipeline, 10^9 was an uncaught bad_alloc and 10^5 failed after 24 s and 11.5 GB
// (82c4702): sizes past a sane bound are refused as the config is read, naming the key.
TEST(ConfigTest, ModelSizesPastTheBoundsAreRefusedAtOnce) {
  auto refused = [](const json& j, const std::string& needle) {
    auto c = parse_run_config(j, "big.json");
    ASSERT_FALSE(c.is_ok()) << j.dump();
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().to_string();
    EXPECT_NE(c.status().message().find(needle), std::string::npos) << c.status().message();
  };
  refused({{"model", {{"n_layer", 1000000}}}}, "model.n_layer is 1000000, past the 4096");
  refused({{"model", {{"n_layer", 1000000000}}}}, "model.n_layer is 1000000000");
  refused({{"model", {{"n_embd", 1000000000}}}}, "model.n_embd is 1000000000");
  refused({{"model", {{"block_size", 100000000}}}}, "model.block_size is 100000000");
  refused({{"model", {{"n_layer", 4096}, {"n_embd", 65536}, {"n_head", 64}}}}, "parameters, past the");
  refused({{"model", {{"vocab_size", 5000000}}}}, "model.vocab_size is 5000000, past the 4194304");
  // lr 1e308 trained to NaN and exited 0: the optimizer computes in float.
  refused({{"training", {{"lr", 1e308}}}}, "training.lr");
  // Within the bounds: a 4096-layer model is a config, not an error.
  EXPECT_TRUE(parse_run_config({{"model", {{"n_layer", 4096}, {"n_embd", 64}, {"n_head", 2}}}}, "ok.json").is_ok());
  // Nor is a vocabulary past uint16's: token shards hold uint32 ids for it (storage/token_shard.h).
  EXPECT_TRUE(parse_run_config({{"model", {{"vocab_size", 151936}}}}, "qwen_vocab.json").is_ok());
}

}  // namespace
}  // namespace strata::engine
