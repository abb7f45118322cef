// foreign_weights_export.cpp — `strata export` (engine/checkpoint/foreign_weights.h): a WeightsFile written in
// llm.c's, Hugging Face's or our layout.
#include <cstring>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/dtype.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/foreign_formats.h"
#include "engine/checkpoint/foreign_weights.h"
#include "storage/safetensors.h"
#include "storage/token_shard.h"

namespace strata::engine {

namespace fs = std::filesystem;
using namespace foreign;  // NOLINT: the formats' layouts, shared with the reader

namespace {

// Every tensor of the model `c`, by our name.
std::map<std::string, TensorSpec> specs_by_name(const GPT2Config& c) {
  std::map<std::string, TensorSpec> out;
  for (const UnitSpec& unit : gpt2_unit_specs(c))
    for (const TensorSpec& s : unit.layout.specs()) out.emplace(s.name, s);
  return out;
}

Status write_llmc(const WeightsFile& src, DType dtype, const std::string& out) {
  const GPT2Config& c = src.config();
  const size_t V = static_cast<size_t>(c.vocab_size), C = static_cast<size_t>(c.n_embd);
  const size_t Vp = (V + kLlmcVocabMultiple - 1) / kLlmcVocabMultiple * kLlmcVocabMultiple;
  int32_t h[kLlmcHeaderInts] = {};
  h[0] = kLlmcMagic;
  h[1] = dtype == DType::kBF16 ? kLlmcBf16 : kLlmcF32;
  h[2] = c.block_size;
  h[3] = c.vocab_size;
  h[4] = c.n_layer;
  h[5] = c.n_head;
  h[6] = c.n_embd;
  h[7] = static_cast<int32_t>(Vp);
  const std::map<std::string, TensorSpec> specs = specs_by_name(c);
  return write_file_atomic(out, [&](const AppendFn& append) -> Status {
    STRATA_RETURN_IF_ERROR(append(std::as_bytes(std::span<const int32_t>(h))));
    std::vector<float> buf;
    std::vector<std::byte> stored;
    auto put = [&]() {
      stored.resize(buf.size() * dtype_size(dtype));
      from_f32_n(dtype, buf.data(), stored.data(), buf.size());
      return append(stored);
    };
    for (size_t i = 0; i < kLlmcTensors.size(); ++i) {
      const size_t blocks = llmc_per_block(i) ? static_cast<size_t>(c.n_layer) : 1;
      for (size_t l = 0; l < blocks; ++l) {
        const std::string name =
            llmc_per_block(i) ? fmt::format("h.{}.{}", l, kLlmcTensors[i]) : std::string(kLlmcTensors[i]);
        const TensorSpec& s = specs.at(name);
        buf.assign(s.numel(), 0.0f);
        STRATA_RETURN_IF_ERROR(src.read(s, buf.data()));
        STRATA_RETURN_IF_ERROR(put());
      }
      if (i == 0 && Vp > V) {  // the padding rows
        buf.assign((Vp - V) * C, 0.0f);
        STRATA_RETURN_IF_ERROR(put());
      }
    }
    return Status::ok();
  });
}

// Hugging Face's GPT2LMHeadModel config for `c`; no dropout (Strata trains without it).
nlohmann::json hf_config(const GPT2Config& c, DType dtype) {
  nlohmann::json j = {{"architectures", {"GPT2LMHeadModel"}},
                      {"model_type", "gpt2"},
                      {"vocab_size", c.vocab_size},
                      {"n_positions", c.block_size},
                      {"n_ctx", c.block_size},
                      {"n_embd", c.n_embd},
                      {"n_layer", c.n_layer},
                      {"n_head", c.n_head},
                      {"n_inner", nullptr},
                      {"activation_function", "gelu_new"},
                      {"layer_norm_epsilon", 1e-5},
                      {"resid_pdrop", 0.0},
                      {"embd_pdrop", 0.0},
                      {"attn_pdrop", 0.0},
                      {"initializer_range", 0.02},
                      {"tie_word_embeddings", true},
                      {"torch_dtype", dtype == DType::kBF16 ? "bfloat16" : "float32"}};
  // GPT-2's <|endoftext|>; a smaller vocabulary has no such token (transformers would default to 50256).
  j["bos_token_id"] = c.vocab_size > 50256 ? nlohmann::json(50256) : nlohmann::json(nullptr);
  j["eos_token_id"] = j["bos_token_id"];
  return j;
}

Status write_safetensors_weights(const WeightsFile& src, WeightsFormat format, DType dtype,
                                 const std::string& path) {
  const bool hf = format == WeightsFormat::kHuggingFace;
  std::vector<SafetensorsTensor> tensors;
  for (const UnitSpec& unit : gpt2_unit_specs(src.config())) {
    for (const TensorSpec& s : unit.layout.specs()) {
      SafetensorsTensor t{hf ? hf_name(s.name) : s.name, dtype, hf ? hf_shape(s) : s.shape, nullptr, {}};
      t.fill = [&src, s, dtype, transposed = hf && hf_transposed(s.name)](void* dst) -> Status {
        std::vector<float> ours(s.numel());
        STRATA_RETURN_IF_ERROR(src.read(s, ours.data()));
        if (transposed) {  // stored (in, out): the transpose of our (out, in)
          std::vector<float> stored(ours.size());
          transpose(ours.data(), stored.data(), static_cast<size_t>(s.shape[1]), static_cast<size_t>(s.shape[0]));
          ours.swap(stored);
        }
        from_f32_n(dtype, ours.data(), dst, ours.size());
        return Status::ok();
      };
      tensors.push_back(std::move(t));
    }
  }
  const std::map<std::string, std::string> metadata =
      hf ? std::map<std::string, std::string>{{"format", "pt"}} : gpt2_metadata(src.config());
  return write_safetensors(path, tensors, metadata);
}

}  // namespace

Status export_weights(const std::string& from, WeightsFormat format, const std::string& out, DType dtype,
                      const WeightsOpenOptions& options, uint64_t max_shard_bytes) {
  if (dtype != DType::kF32 && (dtype != DType::kBF16 || format == WeightsFormat::kStrata)) {
    return Status::invalid_argument("export as {}: {} files are written in fp32{}", dtype_name(dtype),
                                    weights_format_name(format), format == WeightsFormat::kStrata ? "" : " or bf16");
  }
  if (!family_of_weights(from).empty())
    return export_family_weights(from, format, out, dtype, options, max_shard_bytes);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<WeightsFile> src, WeightsFile::open(from, options));
  const GPT2Config& c = src->config();
  if (c.n_head == 0) {
    return Status::invalid_argument(
        "{}: the file does not say how many attention heads its model has, which {} needs: put the model's "
        "config.json (with n_head) beside it",
        from, weights_format_name(format));
  }
  STRATA_RETURN_IF_ERROR(c.validate().with_context(from));
  STRATA_RETURN_IF_ERROR(src->check(c));
  switch (format) {
    case WeightsFormat::kLlmc: return write_llmc(*src, dtype, out);
    case WeightsFormat::kStrata: return write_safetensors_weights(*src, format, dtype, out);
    case WeightsFormat::kHuggingFace: {
      std::error_code ec;
      fs::create_directories(out, ec);
      if (ec) return Status::io_error("{}: cannot create the folder: {}", out, ec.message());
      STRATA_RETURN_IF_ERROR(
          write_safetensors_weights(*src, format, dtype, (fs::path(out) / "model.safetensors").string()));
      return write_text_atomic((fs::path(out) / "config.json").string(), hf_config(c, dtype).dump(2) + "\n");
    }
  }
  return Status::internal("weights format {}", static_cast<int>(format));
}

}  // namespace strata::engine
