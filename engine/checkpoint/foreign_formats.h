// foreign_formats.h — the layouts of other projects' GPT-2 files that both the reader (foreign_weights.cpp) and
// the writer (foreign_weights_export.cpp) of engine/checkpoint/foreign_weights.h follow: llm.c's header and
// tensor order, and how Hugging Face names and orients the tensors. Internal to those two files.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/tensor.h"

namespace strata::engine::foreign {

// llm.c's model file: a header of kLlmcHeaderInts int32 (magic, version, max_seq_len, vocab_size, num_layers,
// num_heads, channels, padded_vocab_size, the rest zero), then kLlmcTensors in order.
inline constexpr int32_t kLlmcMagic = 20240326;
inline constexpr size_t kLlmcHeaderInts = 256;
inline constexpr int32_t kLlmcF32 = 3, kLlmcBf16 = 5;  // the versions: fp32, bf16
inline constexpr int64_t kLlmcVocabMultiple = 128;      // what llm.c pads the vocabulary to

// llm.c's 16 tensors, in its file's order, and ours for each: unit-level names, or a block's suffix.
inline constexpr std::array<std::string_view, 16> kLlmcTensors = {
    "wte",           "wpe",         "ln_1.weight",         "ln_1.bias",        "attn.c_attn.weight", "attn.c_attn.bias",
    "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
    "mlp.c_proj.weight", "mlp.c_proj.bias", "ln_f.weight", "ln_f.bias"};
// Whether llm.c's tensor i is stacked over the blocks.
constexpr bool llmc_per_block(size_t i) { return i >= 2 && i < 14; }

// Hugging Face's GPT-2 keeps these as Conv1D weights, stored (in, out): ours are (out, in).
inline bool hf_transposed(std::string_view ours) {
  return ours.ends_with(".attn.c_attn.weight") || ours.ends_with(".attn.c_proj.weight") ||
         ours.ends_with(".mlp.c_fc.weight") || ours.ends_with(".mlp.c_proj.weight");
}

// Hugging Face's name (without its prefix) for ours.
inline std::string hf_name(const std::string& ours) {
  return ours == "wte" || ours == "wpe" ? ours + ".weight" : ours;
}

// The shape Hugging Face stores our tensor `s` in.
inline std::vector<int64_t> hf_shape(const TensorSpec& s) {
  return hf_transposed(s.name) ? std::vector<int64_t>{s.shape[1], s.shape[0]} : s.shape;
}

// dst (rows, cols) = the transpose of src (cols, rows), in tiles that stay in cache.
inline void transpose(const float* src, float* dst, size_t rows, size_t cols) {
  constexpr size_t kTile = 32;
  for (size_t i0 = 0; i0 < rows; i0 += kTile) {
    for (size_t j0 = 0; j0 < cols; j0 += kTile) {
      const size_t i1 = rows < i0 + kTile ? rows : i0 + kTile, j1 = cols < j0 + kTile ? cols : j0 + kTile;
      for (size_t i = i0; i < i1; ++i)
        for (size_t j = j0; j < j1; ++j) dst[i * cols + j] = src[j * rows + i];
    }
  }
}

}  // namespace strata::engine::foreign
