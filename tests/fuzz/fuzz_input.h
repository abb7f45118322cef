// fuzz_input.h — what the fuzz targets share: the input as a file the parsers can open by path.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/check.h"

namespace strata::fuzz {

// The bytes as an anonymous in-memory file (memfd), reachable by path through /proc/self/fd, closed on
// destruction. Nothing touches the disk, so a run does millions of inputs.
class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) : fd_(::memfd_create("strata-fuzz", MFD_CLOEXEC)) {
    STRATA_ASSERT(fd_ >= 0);
    for (size_t done = 0; done < size;) {
      const ssize_t w = ::write(fd_, data + done, size - done);
      STRATA_ASSERT(w > 0);
      done += static_cast<size_t>(w);
    }
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

}  // namespace strata::fuzz
