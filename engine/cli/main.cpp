// main.cpp — `strata`, the one command: train, tokenize, export, sample, bench.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "comm/grid.h"
#include "comm/mpi_communicator.h"
#include "common/trace.h"
#include "common/units.h"

#include "engine/checkpoint/foreign_weights.h"
#include "engine/model/llama/llama.h"
#include "engine/cli/bench_adam.h"
#include "engine/cli/bench_comm.h"
#include "engine/cli/bench_kernels.h"
#include "engine/cli/bench_nvme.h"
#include "engine/cli/bench_step.h"
#include "engine/cli/sample_cmd.h"
#include "engine/cli/tokenize_cmd.h"
#include "engine/text/tokenizer.h"
#include "engine/train/config.h"
#include "engine/train/trainer.h"
#include "storage/safetensors_shards.h"

namespace {

// oneDNN's matmuls run on OpenMP threads (Debian's libdnnl uses libgomp), which by default spin after every
// parallel region, and that spinning takes the cores from what runs between matmuls: the TBB kernels, the AdamW pass,
// and the offload's copies, checksums and CPU Adam. Waiting passively measured 3-7% faster plain steps and less CPU
// time per offloaded step on the 2-core CI machine (docs/benchmarks.md, "make demo"). libgomp reads its settings once,
// when it is loaded, before main() runs (and an executable's pre-init function cannot set them either: libc
// resets the environment after it), so `train` and `bench` start themselves again with the setting; the other
// commands run no matmul. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT stays as it is. Under valgrind (which
// would not follow the exec and check the rest natively) it is skipped, and if the exec fails the run goes on
// with libgomp's default and the environment as it was.
void default_omp_wait_policy(int argc, char** argv) {
  if (argc < 2 || (std::string(argv[1]) != "train" && std::string(argv[1]) != "bench")) return;
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr) return;
  const char* preload = std::getenv("LD_PRELOAD");
  if (preload != nullptr && std::string(preload).find("vgpreload") != std::string::npos) return;
  // The binary's own path rather than /proc/self/exe, which would rename the process "exe" in ps and top.
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0 || n == static_cast<ssize_t>(sizeof self) - 1) return;  // none, or perhaps cut short
  self[n] = '\0';
  if (::setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
  ::execv(self, argv);
  ::unsetenv("OMP_WAIT_POLICY");
}

struct ExportArgs {
  std::string from, format, out, dtype = "f32";
  std::string encoder, vocab;  // the tokenizer put beside an hf export
  std::string max_shard_size = "5GB";
  bool allow_non_finite = false;
};

// `strata export`: a model.safetensors (or a checkpoint folder's), Hugging Face's GPT-2 or an llm.c file, written
// in another of those layouts.
int run_export(const ExportArgs& a) {
  auto fail = [](const strata::Status& st) {
    fmt::print(stderr, "strata export: {}\n", st.to_string());
    return 1;
  };
  auto from = strata::engine::weights_path(a.from);
  if (!from.is_ok()) return fail(from.status());
  auto format = strata::engine::parse_weights_format(a.format);
  if (!format.is_ok()) return fail(format.status());
  const strata::DType dtype = a.dtype == "bf16" ? strata::DType::kBF16 : strata::DType::kF32;
  // transformers' spelling ("5GB": decimal) or ours ("4G": binary).
  const std::string& m = a.max_shard_size;
  const uint64_t shard = m.ends_with("GB") || m.ends_with("MB")
                             ? strata::parse_count(m.substr(0, m.size() - 1))
                             : strata::parse_bytes(m);
  if (shard == 0)
    return fail(strata::Status::invalid_argument("--max-shard-size {}: not a size (\"5GB\", \"4G\", \"500MB\")", m));
  if (const strata::Status st =
          strata::engine::export_weights(*from, *format, a.out, dtype, {a.allow_non_finite}, shard);
      !st.is_ok())
    return fail(st);
  fmt::print("wrote {} ({} layout) from {}\n", a.out, a.format, *from);
  if (*format != strata::engine::WeightsFormat::kHuggingFace) return 0;
  std::error_code ec;
  if (!std::filesystem::exists(a.encoder, ec) || !std::filesystem::exists(a.vocab, ec)) {
    fmt::print("no tokenizer added: {} or {} is missing (scripts/fetch_data.sh fetches GPT-2's; --encoder and --vocab "
               "name others)\n",
               a.encoder, a.vocab);
    return 0;
  }
  // The model's vocabulary and context, for the tokenizer's check and its model_max_length.
  int vocab = 0, context = 0;
  strata::Status st;
  if (strata::engine::family_of_weights(*from) == "llama") {
    auto shards = strata::SafetensorsShards::open(*from);
    auto c = shards.is_ok() ? strata::engine::llama_config_from_metadata(shards->files().front().metadata(), *from)
                            : strata::Result<strata::engine::LlamaConfig>(shards.status());
    if (c.is_ok()) vocab = c->vocab_size, context = c->max_position_embeddings;
    st = c.status();
  } else {
    auto file = strata::engine::WeightsFile::open(*from);
    if (file.is_ok()) vocab = (*file)->config().vocab_size, context = (*file)->config().block_size;
    st = file.status();
  }
  if (st.is_ok() && vocab != 50257) {  // GPT-2's BPE is the one tokenizer Strata writes
    fmt::print("no tokenizer added: the model's vocabulary ({} tokens) is not GPT-2's\n", vocab);
    return 0;
  }
  if (st.is_ok()) st = strata::engine::export_hf_tokenizer(a.encoder, a.vocab, a.out, vocab, context);
  if (!st.is_ok()) return fail(st.with_context("the tokenizer beside the model"));
  fmt::print("with the tokenizer of {} (vocab.json, merges.txt, tokenizer_config.json)\n", a.encoder);
  return 0;
}

struct TrainArgs {
  std::string config;
  std::vector<std::string> sets;
  std::string metrics;
  std::string resume;
  std::string trace;  // Chrome trace JSON of the run's timeline (common/trace.h); one file per rank
  bool resume_flag = false;
  bool quiet = false;
  // Shortcuts for the most-changed fields; each becomes a --set.
  std::optional<int> max_steps, batch_size, seq_len, grad_accum, threads;
  std::optional<double> lr;
  std::optional<std::string> checkpoint_dir, kernels, precision, init_from, device;
};

// Under an MPI launcher: MPI, the world communicator and the rank grid of parallel.tensor_parallel_size x
// data x parallel.pipeline_parallel_size, after every rank checked that it runs the same config (the effective
// one, --set overrides applied) and binary as rank 0. Empty when not launched by MPI.
struct Ranks {
  std::unique_ptr<strata::comm::MpiCommunicator> world;
  std::unique_ptr<strata::comm::RankGrid> grid;
};
strata::Result<Ranks> join_ranks(const strata::engine::RunConfig& config) {
  const strata::engine::ParallelConfig& parallel = config.parallel;
  namespace comm = strata::comm;
  Ranks r;
  if (!comm::launched_by_mpi()) return r;
  STRATA_RETURN_IF_ERROR(comm::mpi_init(nullptr, nullptr));
  STRATA_ASSIGN_OR_RETURN(r.world, comm::MpiCommunicator::world());
  STRATA_RETURN_IF_ERROR(comm::check_same_run(*r.world, config.json.dump()));
  STRATA_ASSIGN_OR_RETURN(r.grid, comm::RankGrid::create(*r.world, parallel.tensor_parallel_size,
                                                         parallel.pipeline_parallel_size));
  return r;
}

int run_train(TrainArgs& a) {
  using strata::engine::TrainOptions;
  std::vector<std::string> sets = a.sets;
  if (a.max_steps) sets.push_back("training.max_steps=" + std::to_string(*a.max_steps));
  if (a.batch_size) sets.push_back("training.batch_size=" + std::to_string(*a.batch_size));
  if (a.seq_len) sets.push_back("training.seq_len=" + std::to_string(*a.seq_len));
  if (a.grad_accum) sets.push_back("training.grad_accum_steps=" + std::to_string(*a.grad_accum));
  if (a.threads) sets.push_back("compute.threads=" + std::to_string(*a.threads));
  if (a.lr) sets.push_back("training.lr=" + fmt::format("{}", *a.lr));
  // Strings are JSON-quoted so that a path like "1e3" stays a string.
  auto quoted = [](const std::string& s) { return nlohmann::json(s).dump(); };
  if (a.checkpoint_dir) sets.push_back("training.checkpoint_dir=" + quoted(*a.checkpoint_dir));
  if (a.kernels) sets.push_back("compute.kernels=" + quoted(*a.kernels));
  if (a.device) sets.push_back("compute.device=" + quoted(*a.device));
  if (a.precision) sets.push_back("compute.matmul_precision=" + quoted(*a.precision));
  if (a.init_from) sets.push_back("training.init_from=" + quoted(*a.init_from));

  auto cfg = strata::engine::load_run_config(a.config, sets);
  if (!cfg.is_ok()) {
    std::fprintf(stderr, "strata train: %s\n", cfg.status().to_string().c_str());
    return 2;
  }
  auto ranks = join_ranks(cfg.value());
  if (!ranks.is_ok()) {
    std::fprintf(stderr, "strata train: %s\n", ranks.status().to_string().c_str());
    strata::comm::mpi_finalize();
    return 2;
  }
  auto& world = ranks.value().world;
  strata::comm::Communicator* dp_group = ranks.value().grid ? &ranks.value().grid->dp() : nullptr;
  TrainOptions opts;
  opts.metrics_path = a.metrics;
  opts.progress = !a.quiet;
  if (a.resume_flag) opts.resume = a.resume.empty() ? cfg->training.checkpoint_dir : a.resume;
  opts.data_parallel = dp_group;
  opts.pipeline = ranks.value().grid ? &ranks.value().grid->pp() : nullptr;
  opts.tensor_parallel = ranks.value().grid ? &ranks.value().grid->tp() : nullptr;
  const bool several = world && world->size() > 1;
  const int rank = world ? world->rank() : 0;
  const std::string trace_path = several ? fmt::format("{}.rank{}", a.trace, rank) : a.trace;
  if (!a.trace.empty()) {
    // A path that cannot be written fails now, not after the run whose timeline it was to hold.
    if (!std::ofstream(trace_path, std::ios::app)) {
      std::fprintf(stderr, "strata train: --trace %s cannot be written: %s\n", trace_path.c_str(),
                   std::strerror(errno));
      if (several) strata::comm::mpi_abort(strata::Status::invalid_argument("--trace {}", trace_path));
      ranks.value().grid.reset();
      ranks.value().world.reset();
      strata::comm::mpi_finalize();
      return 2;
    }
    strata::trace::start();
    strata::trace::name_thread("training");
  }
  auto summary = strata::engine::run_training(cfg.value(), opts);
  bool trace_lost = false;
  if (!a.trace.empty()) {  // also after a failure: the timeline up to it is what explains it
    const size_t dropped = strata::trace::dropped();
    if (const strata::Status st = strata::trace::write(trace_path); !st.is_ok()) {
      std::fprintf(stderr, "strata train: %s\n", st.to_string().c_str());
      trace_lost = true;
    } else if (dropped > 0) {
      std::fprintf(stderr, "strata train: trace %s: the last %zu events were dropped (its buffer was full)\n",
                   trace_path.c_str(), dropped);
    }
  }
  if (!summary.is_ok()) {
    const strata::StatusCode code = summary.status().code();
    const bool input = code == strata::StatusCode::kInvalidArgument || code == strata::StatusCode::kNotFound ||
                       code == strata::StatusCode::kCorruption || code == strata::StatusCode::kUnimplemented;
    // Even bad input may have hit this rank alone (a checkpoint folder another rank cannot see), and the
    // others would wait for it until their timeout: stop them all now.
    if (several) strata::comm::mpi_abort(summary.status());
    std::fprintf(stderr, "strata train: %s\n", summary.status().to_string().c_str());
    ranks.value().grid.reset();
    ranks.value().world.reset();
    strata::comm::mpi_finalize();
    return input ? 2 : 1;
  }
  ranks.value().grid.reset();
  ranks.value().world.reset();
  strata::comm::mpi_finalize();
  const int code = trace_lost ? 1 : 0;
  if (rank != 0) return code;  // rank 0 reports for the group
  const auto& s = summary.value();
  if (s.steps == 0) {  // a resume at training.max_steps, or max_steps 0
    std::printf("done: no step to run (training.max_steps %d reached)%s%s\n", cfg->training.max_steps,
                s.checkpoint.empty() ? "" : "; checkpoint: ", s.checkpoint.c_str());
    return code;
  }
  std::printf("done: %d steps, final loss %.4f", s.steps, s.last_loss);
  if (s.val_loss >= 0) std::printf(", validation loss %.4f", s.val_loss);
  std::printf(", %.0f tokens/s\ncheckpoint: %s\n", s.tokens_per_s, s.checkpoint.c_str());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  default_omp_wait_policy(argc, argv);
  CLI::App app{"strata — trains transformer language models larger than the memory they run on"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "strata 0.1.0");

  TrainArgs ta;
  CLI::App* train = app.add_subcommand("train", "Train a GPT-2 model from a JSON config");
  train->add_option("--config,-c", ta.config, "Run configuration (JSON)")->required()->check(CLI::ExistingFile);
  train->add_option("--set", ta.sets, "Override a config field: section.key=value (repeatable)");
  train->add_option("--metrics", ta.metrics, "Write one JSON object per step to this file");
  // Given with no value, CLI11 runs no callback on it: whether it was given is its count, read after parsing.
  CLI::Option* resume = train->add_option(
      "--resume", ta.resume,
      "Continue from a checkpoint (a step folder or a checkpoint_dir; no value: training.checkpoint_dir)");
  resume->expected(0, 1);
  train->add_flag("--quiet,-q", ta.quiet, "No per-step progress line");
  train->add_option("--trace", ta.trace,
                    "Write the run's timeline (steps, waits, transfers, the optimizer's work) here as Chrome trace "
                    "JSON, for ui.perfetto.dev; under mpirun one file per rank (FILE.rankN)");
  train->add_option("--max-steps", ta.max_steps, "= --set training.max_steps=N");
  train->add_option("--batch-size", ta.batch_size, "= --set training.batch_size=N");
  train->add_option("--seq-len", ta.seq_len, "= --set training.seq_len=N");
  train->add_option("--grad-accum", ta.grad_accum, "= --set training.grad_accum_steps=N");
  train->add_option("--lr", ta.lr, "= --set training.lr=X");
  train->add_option("--checkpoint-dir", ta.checkpoint_dir, "= --set training.checkpoint_dir=DIR");
  train->add_option("--init-from", ta.init_from,
                    "= --set training.init_from=FILE (model.safetensors; GPT-2: Hugging Face safetensors, llm.c .bin; "
                    "the Llama family: a Hugging Face folder, whose config.json fills the model section)");
  train->add_option("--kernels", ta.kernels, "= --set compute.kernels=fast|reference");
  train->add_option("--device", ta.device, "= --set compute.device=auto|cpu|cuda (auto: the GPU where there is one)");
  train->add_option("--precision", ta.precision, "= --set compute.matmul_precision=fp32|bf16");
  train->add_option("--threads", ta.threads, "= --set compute.threads=N");

  strata::engine::TokenizeOptions tok;
  strata::engine::add_tokenize_command(app, tok);

  ExportArgs ea;
  CLI::App* exp = app.add_subcommand(
      "export", "Write a model's weights for Hugging Face transformers (hf) or llm.c (llmc), or back from them");
  exp->add_option("--from", ea.from,
                  "A model.safetensors or a checkpoint's step folder; also a Hugging Face GPT-2 model.safetensors "
                  "or an llm.c model file")
      ->required();
  exp->add_option("--format", ea.format, "hf: a folder with model.safetensors and config.json; llmc: one .bin file; "
                                         "strata: our model.safetensors")
      ->required();
  exp->add_option("--out", ea.out, "The folder (hf) or file (llmc, strata) to write")->required();
  ea.encoder = strata::engine::default_tokenizer_file("encoder.json");
  ea.vocab = strata::engine::default_tokenizer_file("vocab.bpe");
  exp->add_option("--encoder", ea.encoder, "hf: the GPT-2 encoder.json to put beside the model as vocab.json")
      ->capture_default_str();
  exp->add_option("--vocab", ea.vocab, "hf: the GPT-2 vocab.bpe to put beside the model as merges.txt")
      ->capture_default_str();
  exp->add_option("--max-shard-size", ea.max_shard_size,
                  "hf, the Llama family: the largest shard (transformers' \"5GB\", or bytes: \"4G\", \"512M\")")
      ->capture_default_str();
  exp->add_option("--dtype", ea.dtype, "f32, or bf16 for hf and llmc (llm.c's version 5, its GPU trainer's default)")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  exp->add_flag("--allow-non-finite", ea.allow_non_finite,
                "Copy NaN and inf weights of a file without Strata's checksums instead of refusing it");

  strata::engine::SampleOptions so;
  CLI::App* sample = strata::engine::add_sample_command(app, so);

  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  strata::engine::BenchStepOptions bs;
  strata::engine::add_bench_step_command(*bench, bs);
  strata::engine::BenchNvmeOptions bn;
  strata::engine::add_bench_nvme_command(*bench, bn);
  strata::engine::BenchKernelsOptions bk;
  strata::engine::add_bench_kernels_command(*bench, bk);
  strata::engine::BenchAdamOptions ba;
  strata::engine::add_bench_adam_command(*bench, ba);
  strata::engine::BenchCommOptions bc;
  strata::engine::add_bench_comm_command(*bench, bc);

  CLI11_PARSE(app, argc, argv);
  if (train->parsed()) {
    ta.resume_flag = resume->count() > 0;
    return run_train(ta);
  }
  if (app.got_subcommand("tokenize")) return strata::engine::run_tokenize(tok);
  if (exp->parsed()) return run_export(ea);
  if (sample->parsed()) return strata::engine::run_sample(so);
  if (bench->got_subcommand("step")) return strata::engine::run_bench_step(bs);
  if (bench->got_subcommand("nvme")) return strata::engine::run_bench_nvme(bn);
  if (bench->got_subcommand("kernels")) return strata::engine::run_bench_kernels(bk);
  if (bench->got_subcommand("adam")) return strata::engine::run_bench_adam(ba);
  if (bench->got_subcommand("comm")) return strata::engine::run_bench_comm(bc);
  return 0;
}
