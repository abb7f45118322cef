// tokenizer_export.cpp — the GPT-2 tokenizer's files beside a Hugging Face model (`strata export --encoder`):
// transformers' names for them, and the tokenizer_config.json AutoTokenizer reads.
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/text/tokenizer.h"
#include "storage/token_shard.h"

namespace strata::engine {

namespace fs = std::filesystem;

Status export_hf_tokenizer(const std::string& encoder_json, const std::string& vocab_bpe, const std::string& dir,
                           int vocab_size, int max_length) {
  STRATA_ASSIGN_OR_RETURN(Tokenizer tokenizer, Tokenizer::load(encoder_json, vocab_bpe));
  if (tokenizer.vocab_size() != vocab_size) {
    return Status::invalid_argument("the tokenizer ({}) has {} tokens, the model {}: not the model's tokenizer",
                                    encoder_json, tokenizer.vocab_size(), vocab_size);
  }
  auto copy = [&](const std::string& from, const std::string& name) -> Status {
    STRATA_ASSIGN_OR_RETURN(const std::string bytes, read_whole_file(from));
    return write_text_atomic((fs::path(dir) / name).string(), bytes);
  };
  STRATA_RETURN_IF_ERROR(copy(encoder_json, "vocab.json"));
  STRATA_RETURN_IF_ERROR(copy(vocab_bpe, "merges.txt"));
  const std::string eot(tokenizer.token_bytes(tokenizer.eot_token()));
  const nlohmann::json config = {{"tokenizer_class", "GPT2Tokenizer"},
                                 {"model_max_length", max_length},
                                 {"bos_token", eot},
                                 {"eos_token", eot},
                                 {"unk_token", eot},
                                 {"add_prefix_space", false}};
  return write_text_atomic((fs::path(dir) / "tokenizer_config.json").string(), config.dump(2) + "\n");
}

}  // namespace strata::engine
