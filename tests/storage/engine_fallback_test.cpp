// The automatic POSIX fallback, in child processes where io_uring is refused the two ways users meet:
// a seccomp filter answering io_uring_setup with ENOSYS (Docker's default profile) or EPERM (as
// kernel.io_uring_disabled=2 does). kAuto must hand back a working POSIX engine and warn once, naming why;
// kUring must fail with the kernel's reason instead of falling back.
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "common/aligned.h"
#include "common/log.h"
#include "storage/io_engine.h"
#include "storage/io_queue.h"

namespace strata {
namespace {

// Makes io_uring_setup fail with `err` for this process from now on; everything else is allowed.
void refuse_io_uring(int err) {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (static_cast<unsigned>(err) & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
    std::fprintf(stderr, "seccomp: %s\n", std::strerror(errno));
    std::_Exit(3);
  }
}

// In the child: kAuto twice (one warning), a direct round trip through the engine it gave, and kUring refused.
[[noreturn]] void fallback_child(int err) {
  refuse_io_uring(err);
  // Capture stderr around the two kAuto calls to count the warnings, then pass it on for the parent to match.
  const std::string log = std::filesystem::temp_directory_path() / ("strata_fallback_" + std::to_string(::getpid()) + ".log");
  std::fflush(stderr);
  const int saved = ::dup(2);
  FILE* capture = std::fopen(log.c_str(), "w+");
  if (saved < 0 || capture == nullptr) std::_Exit(13);
  ::dup2(::fileno(capture), 2);
  auto first = make_io_engine(EngineOptions{.kind = EngineKind::kAuto, .lanes = 2, .queue_depth = 4});
  auto second = make_io_engine(EngineOptions{.kind = EngineKind::kAuto});
  logger().flush();
  std::fflush(stderr);
  ::dup2(saved, 2);
  std::string text;
  std::rewind(capture);
  for (int c; (c = std::fgetc(capture)) != EOF;) text += static_cast<char>(c);
  std::fclose(capture);
  std::remove(log.c_str());
  std::fputs(text.c_str(), stderr);
  size_t warnings = 0;
  for (size_t at = 0; (at = text.find("io_uring is unavailable", at)) != std::string::npos; ++at) ++warnings;
  if (warnings != 1) std::_Exit(14);
  if (!first.is_ok() || !second.is_ok()) std::_Exit(4);
  IoEngine& engine = *first.value();
  if (engine.name() != "posix" || engine.lanes() != 2 || second.value()->name() != "posix") std::_Exit(5);

  const std::string dir = std::filesystem::temp_directory_path() / ("strata_fallback_" + std::to_string(::getpid()));
  if (!engine.create_dirs(dir).is_ok()) std::_Exit(6);
  auto file = engine.open(dir + "/f", OpenOptions{.create = true, .truncate = true, .direct = true});
  if (!file.is_ok()) std::_Exit(7);
  auto src = AlignedBuffer::allocate(1 << 20, "test.src", 4096);
  auto dst = AlignedBuffer::allocate(1 << 20, "test.dst", 4096);
  if (!src.is_ok() || !dst.is_ok()) std::_Exit(8);
  for (size_t i = 0; i < src->size(); ++i) src->as<unsigned char>()[i] = static_cast<unsigned char>(i * 131 + 7);
  {
    IoQueue queue(engine);
    if (!queue.write(*file, 0, src->data(), src->size()).is_ok()) std::_Exit(9);
    if (!queue.read(*file, 0, dst->data(), dst->size()).is_ok()) std::_Exit(10);
  }
  if (std::memcmp(src->data(), dst->data(), src->size()) != 0) std::_Exit(11);
  (void)engine.close(*file);
  std::filesystem::remove_all(dir);

  auto strict = make_io_engine(EngineOptions{.kind = EngineKind::kUring});
  if (strict.is_ok()) std::_Exit(12);
  std::fprintf(stderr, "strict: %s\n", strict.status().to_string().c_str());
  std::_Exit(0);
}

TEST(EngineFallbackDeathTest, SeccompEnosysGivesPosixWithOneWarning) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The child exits 14 unless it warned exactly once; the regex checks the warning names the reason.
  EXPECT_EXIT(fallback_child(ENOSYS), ::testing::ExitedWithCode(0),
              "io_uring is unavailable here \\([^\n]*ENOSYS[^\n]*\\); using the POSIX pread/pwrite engine with 2 "
              "threads\n(.|\n)*strict: [^\n]*ENOSYS");
}

TEST(EngineFallbackDeathTest, SeccompEpermGivesPosix) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(fallback_child(EPERM), ::testing::ExitedWithCode(0),
              "io_uring is unavailable here \\([^\n]*EPERM[^\n]*\\)(.|\n)*strict: [^\n]*EPERM");
}

}  // namespace
}  // namespace strata
