// safetensors_fuzz.cpp — a safetensors file (header and data) as SafetensorsFile::open reads it: every input
// either opens and then reads and verifies every tensor, or is refused with a Status. Nothing may crash.
#include <cstdint>
#include <vector>

#include "storage/safetensors.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const strata::fuzz::MemFile file(data, size);
  auto f = strata::SafetensorsFile::open(file.path());
  if (!f.is_ok()) return 0;
  (void)f->verify_all();
  std::vector<std::byte> out;
  for (const strata::SafetensorsEntry& e : f->tensors()) {
    out.resize(e.nbytes());
    (void)f->read_into(e.name, e.dtype, e.shape, out.data());
  }
  return 0;
}
