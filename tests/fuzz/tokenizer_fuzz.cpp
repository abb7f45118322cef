// tokenizer_fuzz.cpp — GPT-2's encoder.json and vocab.bpe as Tokenizer::load reads them (engine/text/tokenizer.h),
// and text through what loads. The input is encoder.json, a NUL byte, then vocab.bpe (no NUL: vocab.bpe is
// empty). Every pair either loads or is refused with a Status; a loaded tokenizer encodes the input itself and
// decodes it back byte for byte, as the header promises for every byte string.
#include <cstdint>
#include <cstring>
#include <string_view>

#include "common/check.h"
#include "engine/text/tokenizer.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* nul = static_cast<const uint8_t*>(std::memchr(data, 0, size));
  const size_t split = nul != nullptr ? static_cast<size_t>(nul - data) : size;
  const strata::fuzz::MemFile encoder(data, split);
  const strata::fuzz::MemFile vocab(nul != nullptr ? nul + 1 : data + size, nul != nullptr ? size - split - 1 : 0);
  auto t = strata::engine::Tokenizer::load(encoder.path(), vocab.path());
  if (!t.is_ok()) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::vector<int32_t> ids = t->encode(text);
  STRATA_ASSERT(t->decode(ids) == text);
  for (int32_t id : ids) STRATA_ASSERT(id >= 0 && id < t->vocab_size());
  return 0;
}
