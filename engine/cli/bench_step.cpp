#include "engine/cli/bench_step.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <tbb/info.h>

#include "common/rng.h"
#include "common/timer.h"
#include "engine/train/session.h"

namespace strata::engine {

namespace fs = std::filesystem;

void add_bench_step_command(CLI::App& bench, BenchStepOptions& o) {
  CLI::App* cmd = bench.add_subcommand("step", "Time training steps (forward, backward, AdamW) on random tokens");
  cmd->add_option("--family", o.family, "gpt2, or llama (a tied Llama: RMSNorm, RoPE, SwiGLU, grouped-query attention)")
      ->check(CLI::IsMember({"gpt2", "llama"}))
      ->capture_default_str();
  cmd->add_option("--kv-heads", o.kv_heads, "llama: key/value heads (dividing --heads)")->capture_default_str();
  cmd->add_option("--intermediate", o.intermediate, "llama: the SwiGLU MLP's width")->capture_default_str();
  cmd->add_option("--layers", o.n_layer, "Transformer blocks")->capture_default_str();
  cmd->add_option("--heads", o.n_head, "Attention heads")->capture_default_str();
  cmd->add_option("--width", o.n_embd, "Model width (n_embd)")->capture_default_str();
  cmd->add_option("--vocab", o.vocab_size, "Vocabulary size")->capture_default_str();
  cmd->add_option("--context", o.seq_len, "Sequence length T (also the model's block_size)")->capture_default_str();
  cmd->add_option("--batch", o.batch_size, "Sequences per step B")->capture_default_str();
  cmd->add_option("--steps", o.steps, "Timed steps")->capture_default_str();
  cmd->add_option("--warmup", o.warmup, "Untimed steps first")->capture_default_str();
  cmd->add_option("--precision", o.precision, "Matmul inputs: fp32 or bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--kernels", o.kernels, "fast or reference")
      ->check(CLI::IsMember({"fast", "reference"}))
      ->capture_default_str();
  cmd->add_option("--device", o.device, "cpu, cuda, or auto (cuda where a GPU is usable)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--grad-accum", o.grad_accum, "Micro-batches of --batch sequences per optimizer step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--threads", o.threads, "Worker threads (0: all)")->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed for weights and tokens")->capture_default_str();
  cmd->add_flag("--json", o.json, "Print one JSON object instead of text");
  cmd->add_flag("--no-working-copies", o.no_working_copies,
                "bf16: keep no bf16 working copies of the weights; every linear rounds its fp32 weight at each use "
                "(the same numbers; for measuring what the copies save)");
  cmd->add_option("--offload-param", o.offload_param, "Parameters' home: none, cpu or nvme")
      ->check(CLI::IsMember({"none", "cpu", "nvme"}))
      ->capture_default_str();
  cmd->add_option("--offload-optimizer", o.offload_optimizer, "Optimizer state: none, cpu or nvme")
      ->check(CLI::IsMember({"none", "cpu", "nvme"}))
      ->capture_default_str();
  cmd->add_option("--nvme-path", o.nvme_path, "Folder for swap files (default: a temporary one)");
  cmd->add_option("--host-limit", o.host_limit, "memory.host_memory_limit, e.g. 4G (0: automatic)")
      ->capture_default_str();
  cmd->add_option("--sub-group", o.sub_group_size, "zero_optimization.sub_group_size (elements)")
      ->capture_default_str();
  cmd->add_option("--buffer-count", o.buffer_count,
                  "zero_optimization.offload_optimizer.buffer_count: staging slots of the optimizer on nvme")
      ->check(CLI::Range(int64_t{2}, int64_t{64}))
      ->capture_default_str();
  cmd->add_option("--max-live", o.max_live, "zero_optimization.stage3_max_live_parameters (elements)")
      ->capture_default_str();
  cmd->add_option("--checkpointing", o.checkpointing, "Activation checkpoints: none, device or host")
      ->check(CLI::IsMember({"none", "device", "host"}))
      ->capture_default_str();
  cmd->add_option("--grad-clip", o.grad_clip, "Global-norm gradient clip (0: none)")->capture_default_str();
  cmd->add_flag("--no-overlap-backward", o.no_overlap_backward,
                "Do not start updates during backward (offload_optimizer.overlap_backward)");
  cmd->add_option("--speculative-sub-groups", o.speculative_sub_groups,
                  "Optimizer on cpu: sub-groups that may be updated during backward into spare buffers "
                  "(offload_optimizer.speculative_sub_groups; 12 bytes per element each)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->capture_default_str();
  cmd->add_option("--offload-ratio", o.offload_ratio,
                  "offload_optimizer.ratio: the share of the parameters whose optimizer state is offloaded; the "
                  "model's first units hold the rest, whole on the device (0, 1]")
      ->check(CLI::Range(1e-9, 1.0))
      ->capture_default_str();
  cmd->add_option("--rounds", o.rounds,
                  "Offloaded step: alternate plain and offloaded steps in this many blocks, so that the machine's "
                  "drift reaches both terms (keeps both models in memory; 1: all plain steps first)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  cmd->add_option("--trace", o.trace_path,
                  "Offloaded step: write the steps' timeline (threads, waits, transfers) here as Chrome trace JSON, "
                  "for ui.perfetto.dev");
  cmd->add_flag("--pipeline", o.pipeline,
                "Under mpirun -np P: one pipeline stage per rank; print the schedules' bubble against (p-1)/(m+p-1)");
  cmd->add_option("--micro-batches", o.micro_batches, "With --pipeline: micro-batch counts m, comma-separated")
      ->capture_default_str();
}

void random_batch(int B, int T, int vocab_size, uint64_t seed, std::vector<int32_t>* x, std::vector<int32_t>* y) {
  x->resize(static_cast<size_t>(B) * T);
  y->resize(x->size());
  Rng rng(seed);
  for (size_t i = 0; i < x->size(); ++i) {
    (*x)[i] = static_cast<int32_t>(rng.below(vocab_size));
    (*y)[i] = static_cast<int32_t>(rng.below(vocab_size));
  }
}

BenchFolder::BenchFolder(const std::string& given) : path_(given), temporary_(given.empty()) {
  if (temporary_) path_ = (fs::temp_directory_path() / fmt::format("strata-bench-step-{}", getpid())).string();
}

BenchFolder::~BenchFolder() {
  std::error_code ec;
  if (temporary_) fs::remove_all(path_, ec);
}

Result<RunConfig> bench_run_config(const BenchStepOptions& o, bool offloaded, const std::string& dir) {
  nlohmann::json j;
  if (o.family == "llama") {
    j["model"] = {{"family", "llama"},
                  {"hidden_size", o.n_embd},
                  {"intermediate_size", o.intermediate},
                  {"num_hidden_layers", o.n_layer},
                  {"num_attention_heads", o.n_head},
                  {"num_key_value_heads", o.kv_heads},
                  {"vocab_size", o.vocab_size},
                  {"max_position_embeddings", std::max(o.block_size, o.seq_len)},
                  {"rope_theta", 500000.0},
                  {"tie_word_embeddings", true}};
  } else {
    j["model"] = {{"n_layer", o.n_layer},       {"n_head", o.n_head},
                  {"n_embd", o.n_embd},         {"vocab_size", o.vocab_size},
                  {"block_size", std::max(o.block_size, o.seq_len)}};
  }
  j["training"] = {{"batch_size", o.batch_size},
                   {"seq_len", o.seq_len},
                   {"grad_accum_steps", o.grad_accum},
                   {"max_steps", o.warmup + o.steps},
                   {"lr", 1e-4},
                   {"lr_schedule", "constant"},
                   {"warmup_steps", 0},
                   {"grad_clip", o.grad_clip},
                   {"seed", o.seed},
                   {"checkpoint_dir", (fs::path(dir) / "checkpoints").string()}};
  j["compute"] = {{"device", o.device},
                  {"kernels", o.kernels},
                  {"matmul_precision", o.precision},
                  {"threads", o.threads},
                  {"bf16_working_copies", !o.no_working_copies}};
  if (o.checkpointing != "none")
    j["activation_checkpointing"] = {{"enabled", true}, {"cpu_checkpointing", o.checkpointing == "host"}};
  if (offloaded) {
    j["zero_optimization"] = {{"stage", 3},
                              {"offload_param", {{"device", o.offload_param}, {"nvme_path", dir + "/param"}}},
                              {"offload_optimizer",
                               {{"device", o.offload_optimizer},
                                {"nvme_path", dir + "/optimizer"},
                                {"buffer_count", o.buffer_count},
                                {"overlap_backward", !o.no_overlap_backward},
                                {"speculative_sub_groups", o.speculative_sub_groups},
                                {"ratio", o.offload_ratio}}},
                              {"sub_group_size", o.sub_group_size},
                              {"stage3_param_persistence_threshold", 0},
                              {"stage3_max_live_parameters", o.max_live}};
    j["memory"] = {{"host_memory_limit", o.host_limit}};
  }
  return parse_run_config(j, "strata bench step");
}

int run_bench_step(const BenchStepOptions& o) {
  if (o.offload_ratio < 1.0 && o.offload_optimizer == "none") {
    std::fprintf(stderr,
                 "strata bench step: --offload-ratio %g needs --offload-optimizer cpu or nvme (it is the share of "
                 "the optimizer state offloaded)\n",
                 o.offload_ratio);
    return 2;
  }
  if (o.pipeline) return run_bench_pipeline(o);
  if (o.offload_param != "none" || o.offload_optimizer != "none" || o.checkpointing != "none")
    return run_bench_step_offload(o);
  if (o.steps <= 0 || o.batch_size <= 0 || o.seq_len <= 0) {
    std::fprintf(stderr, "strata bench step: --steps, --batch and --context must be positive\n");
    return 2;
  }
  auto fail = [](const Status& st, int code) {
    std::fprintf(stderr, "strata bench step: %s\n", st.to_string().c_str());
    return code;
  };
  const BenchFolder folder("");
  auto config = bench_run_config(o, false, folder.path());
  if (!config.is_ok()) return fail(config.status(), 2);
  const int B = o.batch_size, T = o.seq_len;
  std::vector<int32_t> x, y;
  random_batch(B, T, o.vocab_size, o.seed, &x, &y);
  TrainOptions options;
  options.batches = [&](int32_t* xi, int32_t* yi) {
    std::copy(x.begin(), x.end(), xi);
    std::copy(y.begin(), y.end(), yi);
    return Status::ok();
  };
  auto session = TrainSession::create(*config, options);
  if (!session.is_ok()) return fail(session.status(), 2);
  Decoder& m = session.value()->model();
  std::vector<double> times;
  float loss = 0;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    Timer t;
    auto r = session.value()->step();
    if (!r.is_ok()) return fail(r.status(), 2);
    m.device().synchronize();  // the GPU's optimizer kernels are still running when step() returns
    loss = r->loss;
    if (s >= o.warmup) times.push_back(t.seconds());
    if (!o.json) std::fprintf(stderr, "  step %d/%d: %.1f ms%s\n", s + 1, o.warmup + o.steps, t.millis(),
                              s < o.warmup ? " (warmup)" : "");
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  const double tokens = static_cast<double>(B) * T * o.grad_accum;
  const double gflop = m.flops_per_step(B, T) * o.grad_accum / 1e9;
  const int nthreads = o.threads > 0 ? o.threads : tbb::info::default_concurrency();
  if (o.json) {
    nlohmann::json j = {{"bench", "step"},         {"family", o.family},       {"n_layer", o.n_layer},
                        {"n_head", o.n_head},
                        {"n_embd", o.n_embd},      {"vocab_size", o.vocab_size}, {"batch", B},
                        {"context", T},            {"grad_accum", o.grad_accum},
                        {"precision", o.precision}, {"kernels", m.kernels().name},
                        {"threads", nthreads},     {"params", m.num_params()}, {"steps", o.steps},
                        {"step_ms", median * 1e3}, {"tokens_per_s", tokens / median},
                        {"gflop_per_step", gflop}, {"gflop_per_s", gflop / median}, {"loss", loss},
                        {"device", m.device().description()}, {"working_copies", m.keeps_working_copies()}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    const std::string threads = m.device().host_accessible() ? fmt::format(", {} threads", nthreads) : "";
    const std::string model = o.family == "llama" ? fmt::format("Llama (tied, {} KV heads, MLP {})", o.kv_heads,
                                                                o.intermediate)
                                                  : std::string("GPT-2");
    std::printf("%s L=%d H=%d C=%d V=%d, B=%d T=%d x %d micro-batches, %s matmuls%s, %s%s, %.2fM params\n",
                model.c_str(), o.n_layer, o.n_head, o.n_embd, o.vocab_size, B, T, o.grad_accum, o.precision.c_str(),
                m.keeps_working_copies() ? " (bf16 working copies of the weights)" : "",
                m.device().description().c_str(), threads.c_str(), m.num_params() / 1e6);
    std::printf("median of %d steps: %.1f ms/step, %.0f tokens/s, %.1f GFLOP/s (%.1f GFLOP/step)\n", o.steps,
                median * 1e3, tokens / median, gflop / median, gflop);
  }
  return 0;
}

}  // namespace strata::engine
