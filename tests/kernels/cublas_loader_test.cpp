// cublas_loader_test.cpp — cuBLAS is loaded on first use (kernels/cuda/cublas_loader.cpp), not linked: on a
// machine with the CUDA toolkit, GPU or not, both libraries load, every entry point the backend calls resolves,
// and a call goes through to the real library; and a binary with the CUDA backend does not need them to start.
#include "kernels/cuda/cublas_loader.h"

#include <elf.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <gtest/gtest.h>

namespace strata::kernels::cuda {
namespace {

TEST(CublasLoaderTest, BothLibrariesLoadAndEveryEntryPointResolves) {
  const Status st = cublas_load_status();
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  // Answered by the real library (the loader's own text, naming the library, is only for a failed load).
  EXPECT_STREQ(cublasGetStatusString(CUBLAS_STATUS_SUCCESS), "success");
  EXPECT_STREQ(cublasGetStatusString(CUBLAS_STATUS_NOT_INITIALIZED), "the library was not initialized");
}

// The libraries the dynamic loader maps before main (DT_NEEDED of the ELF file at `path`), read from the file.
std::vector<std::string> needed_libraries(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  const std::string elf((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::string> out;
  if (elf.size() < sizeof(Elf64_Ehdr)) return out;
  Elf64_Ehdr eh;
  std::memcpy(&eh, elf.data(), sizeof eh);
  std::vector<Elf64_Shdr> sections(eh.e_shnum);
  std::memcpy(sections.data(), elf.data() + eh.e_shoff, eh.e_shnum * sizeof(Elf64_Shdr));
  for (const Elf64_Shdr& sh : sections) {
    if (sh.sh_type != SHT_DYNAMIC) continue;
    const Elf64_Shdr& strtab = sections[sh.sh_link];
    for (size_t off = 0; off + sizeof(Elf64_Dyn) <= sh.sh_size; off += sizeof(Elf64_Dyn)) {
      Elf64_Dyn d;
      std::memcpy(&d, elf.data() + sh.sh_offset + off, sizeof d);
      if (d.d_tag == DT_NULL) break;
      if (d.d_tag == DT_NEEDED) out.emplace_back(elf.data() + strtab.sh_offset + d.d_un.d_val);
    }
  }
  return out;
}

TEST(CublasLoaderTest, BinariesWithTheBackendStartWithoutThem) {
  // This test binary contains the CUDA backend.
  const std::vector<std::string> needed = needed_libraries("/proc/self/exe");
  ASSERT_FALSE(needed.empty()) << "no DT_NEEDED entries read from /proc/self/exe";
  bool libc = false;
  for (const std::string& n : needed) {
    libc = libc || n.rfind("libc.so", 0) == 0;
    EXPECT_EQ(n.find("cublas"), std::string::npos) << "linked at start: " << n;
  }
  EXPECT_TRUE(libc) << "the reader found the dynamic section (libc among the needed libraries)";
}

}  // namespace
}  // namespace strata::kernels::cuda
