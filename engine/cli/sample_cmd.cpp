#include "engine/cli/sample_cmd.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "common/rng.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/foreign_weights.h"
#include "engine/cli/tokenize_cmd.h"
#include "engine/text/tokenizer.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/device.h"

namespace strata::engine {

namespace {

// The next token from one position's logits (V values).
int32_t draw(const float* logits, int V, const SampleParams& p, Rng& rng) {
  if (p.temperature == 0.0) return static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  const size_t k = p.top_k > 0 && p.top_k < V ? static_cast<size_t>(p.top_k) : order.size();
  // The k most likely first (ties by id, so the draw depends on the seed alone).
  auto before = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(), before);
  std::vector<double> weight(k);
  const double top = logits[order[0]];
  double sum = 0;
  for (size_t i = 0; i < k; ++i) sum += weight[i] = std::exp((logits[order[i]] - top) / p.temperature);
  double u = rng.uniform() * sum;
  for (size_t i = 0; i < k; ++i) {
    if (u < weight[i]) return order[i];
    u -= weight[i];
  }
  return order[k - 1];  // u rounded past the last weight
}

}  // namespace

size_t utf8_whole_prefix(std::string_view text, size_t from) {
  size_t lead = text.size();
  while (lead > from && (static_cast<unsigned char>(text[lead - 1]) & 0xC0) == 0x80) --lead;  // continuations
  if (lead == from) return text.size();  // no character starts after `from`: nothing to wait for
  const unsigned char c = static_cast<unsigned char>(text[lead - 1]);  // starts the last character
  const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
  return text.size() - (lead - 1) < need ? lead - 1 : text.size();
}

Status sample_tokens(GPT2& model, const SampleParams& p, std::vector<int32_t>* ids,
                     const std::function<void(int32_t)>& on_token) {
  if (ids->empty()) return Status::invalid_argument("sample: no context to continue (an empty prompt)");
  if (p.tokens < 0 || p.temperature < 0 || !std::isfinite(p.temperature) || p.top_k < 0) {
    return Status::invalid_argument("sample: tokens {}, temperature {}, top_k {}: none may be negative", p.tokens,
                                    p.temperature, p.top_k);
  }
  const int V = model.config().vocab_size, window = model.config().block_size;
  for (int32_t id : *ids) {
    if (id < 0 || id >= V)
      return Status::invalid_argument("sample: token {} is outside the model's vocabulary of {}", id, V);
  }
  Rng rng(p.seed);
  for (int n = 0; n < p.tokens; ++n) {
    const int T = std::min(static_cast<int>(ids->size()), window);
    STRATA_RETURN_IF_ERROR(model.forward(ids->data() + ids->size() - T, nullptr, 1, T).status());
    const float* row = model.logits() + static_cast<size_t>(T - 1) * V;
    if (!std::all_of(row, row + V, [](float x) { return std::isfinite(x); }))
      return Status::invalid_argument("sample: the model's logits are not finite (token {} of the sample)", n + 1);
    const int32_t next = draw(row, V, p, rng);
    ids->push_back(next);
    if (on_token) on_token(next);
    if (next == p.stop_token) break;
  }
  return Status::ok();
}

CLI::App* add_sample_command(CLI::App& app, SampleOptions& o) {
  o.encoder_path = default_tokenizer_file("encoder.json");
  o.vocab_path = default_tokenizer_file("vocab.bpe");
  CLI::App* cmd = app.add_subcommand("sample", "Generate text from a trained model (on the CPU)");
  cmd->add_option("--model", o.model,
                  "A model.safetensors or a checkpoint's step folder; also Hugging Face's GPT-2 or an llm.c file")
      ->required();
  cmd->add_option("--prompt", o.prompt, "Text to continue (empty: start from <|endoftext|>)");
  cmd->add_option("--tokens", o.params.tokens, "Tokens to generate")->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--temperature", o.params.temperature, "Divides the logits; 0 takes the most likely token")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--top-k", o.params.top_k, "Draw among the k most likely tokens (0: all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--seed", o.params.seed, "Seed of the draws")->capture_default_str();
  cmd->add_option("--encoder", o.encoder_path, "GPT-2 encoder.json")->capture_default_str();
  cmd->add_option("--vocab", o.vocab_path, "GPT-2 vocab.bpe")->capture_default_str();
  cmd->add_flag("--allow-non-finite", o.allow_non_finite,
                "Load NaN and inf from a weights file without checksums (Hugging Face's, llm.c's) instead of "
                "refusing it");
  return cmd;
}

int run_sample(const SampleOptions& o) {
  auto fail = [](const Status& st) {
    fmt::print(stderr, "strata sample: {}\n", st.to_string());
    return 1;
  };
  auto found = weights_path(o.model);
  if (!found.is_ok()) return fail(found.status());
  const std::string path = *found;
  auto file = WeightsFile::open(path);
  if (!file.is_ok()) return fail(file.status());
  const GPT2Config config = (*file)->config();
  if (config.n_head == 0) {
    return fail(Status::invalid_argument("{}: the file does not say how many attention heads its model has: put the "
                                         "model's config.json (with n_head) beside it",
                                         path));
  }
  auto tokenizer = Tokenizer::load(o.encoder_path, o.vocab_path);
  if (!tokenizer.is_ok()) {
    return fail(tokenizer.status().with_context("the GPT-2 tokenizer (scripts/fetch_data.sh fetches it; --encoder and "
                                                "--vocab name other files)"));
  }
  if (tokenizer->vocab_size() > config.vocab_size) {
    return fail(Status::invalid_argument("{}: a vocabulary of {} tokens, smaller than the tokenizer's {}", path,
                                         config.vocab_size, tokenizer->vocab_size()));
  }
  auto model = GPT2::create(config, *kernels::find_kernel_set("fast"), kernels::MatmulPrecision::kF32);
  if (!model.is_ok()) return fail(model.status().with_context(path));
  if (const Status st = load_model(**model, path, {o.allow_non_finite}); !st.is_ok()) return fail(st);

  std::vector<int32_t> ids = tokenizer->encode(o.prompt);
  if (ids.empty()) ids.push_back(tokenizer->eot_token());
  SampleParams p = o.params;
  p.stop_token = tokenizer->eot_token();
  fmt::print("{}", o.prompt);
  std::fflush(stdout);
  // Printed as the bytes grow: a character split over two tokens shows once both are there.
  const size_t start = ids.size();
  size_t shown = 0;
  auto on_token = [&](int32_t) {
    const std::string text = tokenizer->decode(std::span<const int32_t>(ids).subspan(start));
    const size_t end = utf8_whole_prefix(text, shown);
    fmt::print("{}", text.substr(shown, end - shown));
    std::fflush(stdout);
    shown = end;
  };
  const Status st = sample_tokens(**model, p, &ids, on_token);
  const std::string text = tokenizer->decode(std::span<const int32_t>(ids).subspan(start));
  fmt::print("{}\n", text.substr(shown));
  return st.is_ok() ? 0 : fail(st);
}

}  // namespace strata::engine
