// foreign_weights.h — GPT-2 weights in the layouts of the projects Strata's users come from: read into a model
// to fine-tune it (training.init_from takes any of them) and written by `strata export`.
//
//   strata  Our model.safetensors: the canonical names of gpt2_unit_specs ("wte", "wpe", "h.0.attn.c_attn.weight"
//           ...), F32, linear weights (out, in); its metadata names the config.
//   hf      Hugging Face transformers' GPT-2 in safetensors: openai-community/gpt2's model.safetensors, or what
//           save_pretrained writes (names under "transformer.", which Strata also accepts). "wte.weight",
//           "wpe.weight", the rest as ours; its Conv1D weights (c_attn, c_proj, c_fc) are stored (in, out), so
//           they are transposed on the way; F32, BF16 or F16. The attention-mask buffers ("attn.bias",
//           "attn.masked_bias") are skipped, and an "lm_head.weight" must equal wte (Strata's head is tied).
//           The weights do not say the head count: a config.json beside the file (as the hub has it) does.
//   llmc    llm.c's model files (gpt2_124M.bin, and what its trainers write): a header of 256 int32 (magic
//           20240326; version 3 for fp32, 5 for bf16; max_seq_len, vocab_size, num_layers, num_heads,
//           channels, padded_vocab_size), then 16 tensors each stacked over the layers, in llm.c's order, with
//           wte padded to padded_vocab_size rows (the padding rows are not read, and written as zeros).
//
// Reading goes one tensor at a time from a read-only mapping, so a model larger than RAM converts or loads
// with one tensor's worth of memory at a time. Errors name the file, the tensor, and the config key that
// differs. Threading: a WeightsFile is immutable once opened.
#pragma once

#include <memory>
#include <string>

#include "common/dtype.h"
#include "common/status.h"
#include "common/tensor.h"
#include "engine/model/gpt2/gpt2.h"
#include "engine/model/model.h"

namespace strata::engine {

enum class WeightsFormat { kStrata, kHuggingFace, kLlmc };

// "strata", "hf", "llmc"; and back (InvalidArgument listing the names).
const char* weights_format_name(WeightsFormat f);
Result<WeightsFormat> parse_weights_format(const std::string& name);

struct WeightsOpenOptions {
  // Files without Strata's checksums (other projects', and ours from before them) are checked for finite
  // values as they are read instead; this loads NaN and inf as they are.
  bool allow_non_finite = false;
};

class WeightsFile {
 public:
  // Opens `path` and tells its format from its content (llm.c's magic number, else safetensors with our
  // names or Hugging Face's). NotFound for a missing file; InvalidArgument naming the file and what it holds
  // for safetensors that are not a GPT-2's, or an llm.c version Strata does not read; Corruption for a
  // malformed file, for one that is neither format (saying so), for sizes past what Strata reads, and for
  // metadata that contradicts the tensors.
  static Result<std::unique_ptr<WeightsFile>> open(const std::string& path, const WeightsOpenOptions& options = {});
  virtual ~WeightsFile() = default;

  WeightsFormat format() const { return format_; }
  const std::string& path() const { return path_; }
  // The model the file holds, from its header, metadata, config.json or tensor shapes; n_head is 0 where the
  // file does not say.
  const GPT2Config& config() const { return config_; }

  // That the file holds exactly a model of `want`'s sizes: every tensor with its shape, nothing unaccounted
  // for. The error names the config key ("model.n_layer is 6, but FILE holds 12 blocks"). Reads no weights
  // except a tied head's, which it compares.
  virtual Status check(const GPT2Config& want) const = 0;
  // The tensor Strata names spec.name (a spec of gpt2_unit_specs(config())), as fp32 in Strata's orientation.
  Status read(const TensorSpec& spec, float* dst) const { return read_range(spec, 0, spec.numel(), dst); }
  // Elements [offset, offset + n) of that tensor (row-major, in Strata's orientation) into dst[0..n): a tensor
  // read in pieces, each piece's pages released as it is read (InvalidArgument for a range past its end).
  // Corruption naming the file, the tensor and the bytes when they fail their checksum; in a file without
  // checksums, naming the element when it is not finite (unless the options allow it).
  Status read_range(const TensorSpec& spec, size_t offset, size_t n, float* dst) const;
  // Whether the file's bytes are checked against checksums as they are read (Strata's files).
  virtual bool checksummed() const = 0;

 protected:
  WeightsFile(WeightsFormat format, std::string path) : format_(format), path_(std::move(path)) {}
  // read_range without the finite check.
  virtual Status read_stored(const TensorSpec& spec, size_t offset, size_t n, float* dst) const = 0;
  Status check_sizes(const GPT2Config& want) const;  // the config fields the file knows against `want`
  Status check_range(const TensorSpec& spec, size_t offset, size_t n) const;  // [offset, offset + n) inside it

  WeightsFormat format_;
  std::string path_;
  GPT2Config config_;
  bool allow_non_finite_ = false;
};

// The weights of a model whose files name the tensors as its units do — the Llama family's: Strata's
// model.safetensors, whose metadata holds the model section (Model::metadata), and a Hugging Face checkpoint
// (one file, or shards with their index; F32, BF16 or F16) alike — checked against `want` before any weight is
// read: a Strata file's metadata key by key (the error names the model section's key and both values), every
// tensor of every unit at its whole shape (naming the tensor), and no tensor the model does not have (a tied
// model's lm_head.weight is taken when it equals the embedding). format() says which kind it is. The
// GPT2Config overload of check() refuses it: it is not a GPT-2's.
Result<std::unique_ptr<WeightsFile>> open_named_weights(const std::string& path, const Model& want,
                                                        const WeightsOpenOptions& options = {});

// `path` itself, or for a folder (a checkpoint's step folder) its model.safetensors; NotFound when it has none.
Result<std::string> weights_path(const std::string& path);

// Writes the model of `from` (a file WeightsFile opens, whose head count is known) in `format`: kHuggingFace,
// a folder `out` holding model.safetensors (names as openai-community/gpt2 has them, metadata format "pt") and
// config.json (GPT2LMHeadModel); kLlmc, the file `out` (vocabulary padded to a multiple of 128: version 3 in
// fp32, which llm.c's CPU trainer and fp32 builds read, or version 5 in bf16, its GPU trainer's default);
// kStrata, the file `out` (fp32 only). `dtype` F32 or BF16 (rounded to nearest even). Each file is written
// atomically (storage/token_shard.h's write_file_atomic).
//
// A Llama-family model (our model.safetensors, metadata format "strata-llama") goes to kHuggingFace as
// save_pretrained writes it: config.json (LlamaForCausalLM, Qwen3ForCausalLM, ... by model_type), and
// model.safetensors, or shards of at most `max_shard_bytes` each (a tensor larger than that alone in one)
// named model-00001-of-0000N.safetensors with their model.safetensors.index.json; an earlier export's index and
// shards in `out` that this one does not write are removed, so the folder reads as this model. To kStrata it
// is copied in our format; llm.c's files hold GPT-2s only.
inline constexpr uint64_t kHfMaxShardBytes = 5000000000;  // transformers' default max_shard_size, "5GB"
Status export_weights(const std::string& from, WeightsFormat format, const std::string& out,
                      DType dtype = DType::kF32, const WeightsOpenOptions& options = {},
                      uint64_t max_shard_bytes = kHfMaxShardBytes);
// The same for a file whose metadata says it holds a model of another family than GPT-2 (format
// "strata-<family>"): export_weights's second half. Whether `from` is one: family_of_weights.
Status export_family_weights(const std::string& from, WeightsFormat format, const std::string& out, DType dtype,
                             const WeightsOpenOptions& options, uint64_t max_shard_bytes);
// "llama" for our file of a Llama-family model (its metadata's format), "" for anything else (GPT-2's files of any
// layout, a file that does not open as safetensors).
std::string family_of_weights(const std::string& path);

}  // namespace strata::engine
