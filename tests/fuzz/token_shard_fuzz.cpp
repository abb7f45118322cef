// token_shard_fuzz.cpp — an llm.c token shard (.bin) as the data loader opens it. Every input either opens
// with every token below the vocabulary or is refused with a Status. Nothing may crash.
#include <cstdint>

#include "common/check.h"
#include "storage/token_shard.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const strata::fuzz::MemFile file(data, size);
  constexpr int kVocab = 50257;
  auto shard = strata::TokenShard::open(file.path(), kVocab);
  if (!shard.is_ok()) return 0;
  for (size_t i = 0; i < shard->size(); ++i) STRATA_ASSERT((*shard)[i] < static_cast<uint32_t>(kVocab));
  return 0;
}
