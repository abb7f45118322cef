// safetensors: round trips of every dtype with metadata, tensors produced while writing (copied or in place),
// and a Corruption naming file and tensor for every malformed header or data layout.
#include "storage/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/rng.h"
#include "tests/test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

using ::strata::testing::expect_error;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::temp_directory_path() / "strata_safetensors_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr) << std::strerror(errno);
    dir_ = templ;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const char* name) const { return (dir_ / name).string(); }

  // A file with the given header text (length-prefixed) and `data_bytes` bytes of data.
  std::string write_raw(const char* name, const std::string& header, size_t data_bytes) {
    const std::string p = path(name);
    std::ofstream out(p, std::ios::binary);
    const uint64_t len = header.size();
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << header;
    out << std::string(data_bytes, '\x5a');
    return p;
  }

  fs::path dir_;
};

TEST_F(SafetensorsTest, RoundTripsAllDtypesAndMetadata) {
  Rng rng(42);
  std::vector<float> w(3 * 7);
  for (auto& x : w) x = static_cast<float>(rng.uniform(-2, 2));
  std::vector<uint16_t> b(5), h(2 * 3 * 5);
  for (auto& x : b) x = f32_to_bf16(static_cast<float>(rng.normal()));
  for (auto& x : h) x = f32_to_f16(static_cast<float>(rng.normal()));
  const float scalar = 0.125f;
  const std::vector<SafetensorsTensor> tensors = {
      {"h.0.attn.c_attn.weight", DType::kF32, {3, 7}, w.data(), {}},
      {"bias", DType::kBF16, {5}, b.data(), {}},  // 10 bytes: the next tensor starts unaligned, which is allowed
      {"cube", DType::kF16, {2, 3, 5}, h.data(), {}},
      {"empty", DType::kF32, {0, 4}, nullptr, {}},
      {"scalar", DType::kF32, {}, &scalar, {}},
  };
  const std::string p = path("model.safetensors");
  ASSERT_TRUE(write_safetensors(p, tensors, {{"format", "pt"}, {"step", "100"}}).is_ok());
  EXPECT_FALSE(fs::exists(p + ".tmp"));

  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->metadata().at("step"), "100");
  const std::vector<std::string> want_names = {"h.0.attn.c_attn.weight", "bias", "cube", "empty", "scalar"};
  EXPECT_EQ(f->names(), want_names);
  for (const auto& t : tensors) {
    const SafetensorsEntry* e = f->find(t.name);
    ASSERT_NE(e, nullptr) << t.name;
    EXPECT_EQ(e->dtype, t.dtype) << t.name;
    EXPECT_EQ(e->shape, t.shape) << t.name;
    if (e->nbytes() > 0) {
      EXPECT_EQ(std::memcmp(e->data, t.data, e->nbytes()), 0) << t.name;
    }
  }
  EXPECT_EQ(f->find("cube")->numel(), 30u);
  // The data section starts 8-byte aligned.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f->find("h.0.attn.c_attn.weight")->data) % 8, 0u);

  const int64_t shape[] = {3, 7};
  auto bytes = f->expect("h.0.attn.c_attn.weight", DType::kF32, shape);
  ASSERT_TRUE(bytes.is_ok()) << bytes.status().to_string();
  EXPECT_EQ(bytes->size(), w.size() * 4);
  expect_error(f->expect("h.0.attn.c_attn.weight", DType::kBF16, shape).status(), StatusCode::kInvalidArgument,
               {"model.safetensors", "h.0.attn.c_attn.weight", "F32 [3, 7]", "want BF16 [3, 7]"});
  expect_error(f->expect("missing", DType::kF32, shape).status(), StatusCode::kNotFound, {"'missing'"});

  // A moved-from file keeps the mapping alive in the new owner.
  SafetensorsFile moved = std::move(*f);
  EXPECT_EQ(std::memcmp(moved.find("cube")->data, h.data(), h.size() * 2), 0);
}

TEST_F(SafetensorsTest, EmptyFileOfTensors) {
  ASSERT_TRUE(write_safetensors(path("none.safetensors"), {}).is_ok());
  auto f = SafetensorsFile::open(path("none.safetensors"));
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_TRUE(f->tensors().empty());
}

TEST_F(SafetensorsTest, WriterRejectsBadInput) {
  const float x[2] = {1, 2};
  const std::vector<SafetensorsTensor> dup = {{"a", DType::kF32, {2}, x, {}}, {"a", DType::kF32, {1}, x, {}}};
  expect_error(write_safetensors(path("d.safetensors"), dup), StatusCode::kInvalidArgument, {"'a'", "twice"});
  const std::vector<SafetensorsTensor> reserved = {{"__metadata__", DType::kF32, {2}, x, {}}};
  expect_error(write_safetensors(path("r.safetensors"), reserved), StatusCode::kInvalidArgument, {"reserved"});
  const std::vector<SafetensorsTensor> neg = {{"n", DType::kF32, {-1, 2}, x, {}}};
  expect_error(write_safetensors(path("n.safetensors"), neg), StatusCode::kInvalidArgument, {"'n'", "[-1, 2]"});
  EXPECT_FALSE(fs::exists(path("d.safetensors")));
}

// Tensors produced while the file is written, copied into the writer's buffer (fill) or written from where they
// are (view, whole or piece by piece): the same file as from data pointers. A piece that is empty or runs past
// the tensor fails the write, naming the tensor.
TEST_F(SafetensorsTest, ProducedTensorsWriteTheSameFile) {
  const float a[3] = {1, 2, 3}, b[2] = {-4, 5};
  const std::vector<SafetensorsTensor> plain = {{"a", DType::kF32, {3}, a, {}}, {"b", DType::kF32, {2}, b, {}}};
  std::vector<SafetensorsTensor> produced = {{"a", DType::kF32, {3}, nullptr, {}},
                                             {"b", DType::kF32, {2}, nullptr, {}}};
  produced[0].fill = [&](void* dst) {
    std::memcpy(dst, a, sizeof a);
    return Status::ok();
  };
  produced[1].view = [&](size_t offset) -> Result<std::span<const std::byte>> {
    return std::as_bytes(std::span<const float>(b)).subspan(offset);
  };
  ASSERT_TRUE(write_safetensors(path("plain.safetensors"), plain).is_ok());
  ASSERT_TRUE(write_safetensors(path("produced.safetensors"), produced).is_ok());
  auto bytes = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  EXPECT_EQ(bytes(path("produced.safetensors")), bytes(path("plain.safetensors")));
  // Three bytes at a time, each piece from a buffer of its own that the next call overwrites.
  std::vector<size_t> asked;
  std::array<std::byte, 3> piece{};
  produced[1].view = [&](size_t offset) -> Result<std::span<const std::byte>> {
    asked.push_back(offset);
    const auto all = std::as_bytes(std::span<const float>(b));
    const size_t n = std::min<size_t>(3, all.size() - offset);
    std::copy_n(all.begin() + static_cast<ptrdiff_t>(offset), n, piece.begin());
    return std::span<const std::byte>(piece.data(), n);
  };
  ASSERT_TRUE(write_safetensors(path("pieces.safetensors"), produced).is_ok());
  EXPECT_EQ(bytes(path("pieces.safetensors")), bytes(path("plain.safetensors")));
  EXPECT_EQ(asked, (std::vector<size_t>{0, 3, 6}));
  produced[1].view = [&](size_t offset) -> Result<std::span<const std::byte>> {
    if (offset > 0) return std::span<const std::byte>();  // nothing after the first float
    return std::as_bytes(std::span<const float>(b, 1));
  };
  expect_error(write_safetensors(path("short.safetensors"), produced), StatusCode::kInternal,
               {"'b'", "0 bytes at byte 4", "needs 8"});
  EXPECT_FALSE(fs::exists(path("short.safetensors")));
  produced[1].view = [&](size_t) -> Result<std::span<const std::byte>> {
    return std::as_bytes(std::span<const float>(a));  // 12 bytes for 8
  };
  expect_error(write_safetensors(path("long.safetensors"), produced), StatusCode::kInternal, {"'b'", "12 bytes"});
  EXPECT_FALSE(fs::exists(path("long.safetensors")));
}

// The process's resident set in bytes (/proc/self/statm).
size_t resident_bytes() {
  std::ifstream in("/proc/self/statm");
  size_t total = 0, resident = 0;
  in >> total >> resident;
  return resident * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

// read_into copies a tensor out and drops its pages from the resident set: reading a file of 8 tensors of 8 MiB
// leaves the resident set where it was (the pages stay in the page cache, not in the process), and the copies
// hold the file's values, also when read again.
TEST_F(SafetensorsTest, ReadIntoLeavesTheFileOutOfTheResidentSet) {
  constexpr size_t kTensors = 8, kFloats = size_t{2} << 20;
  std::vector<std::vector<float>> data(kTensors, std::vector<float>(kFloats));
  const auto name = [](size_t t) { return fmt::format("t{}", t); };
  std::vector<SafetensorsTensor> tensors;
  for (size_t t = 0; t < kTensors; ++t) {
    for (size_t i = 0; i < kFloats; ++i) data[t][i] = static_cast<float>(t * kFloats + i);
    tensors.push_back({name(t), DType::kF32, {static_cast<int64_t>(kFloats)}, data[t].data(), {}});
  }
  ASSERT_TRUE(write_safetensors(path("big.safetensors"), tensors).is_ok());
  auto f = SafetensorsFile::open(path("big.safetensors"));
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  std::vector<float> dst(kFloats, -1.0f);  // touched before the measurement
  const std::vector<int64_t> shape = {static_cast<int64_t>(kFloats)};
  const size_t before = resident_bytes();
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t t = 0; t < kTensors; ++t) {
      ASSERT_TRUE(f->read_into(name(t), DType::kF32, shape, dst.data()).is_ok());
      ASSERT_EQ(dst, data[t]) << "tensor " << t << ", pass " << pass;
    }
  }
  const size_t after = resident_bytes();  // read once: the set may shrink between two reads
  const size_t grown = after > before ? after - before : 0;
  expect_error(f->read_into("t0", DType::kF32, std::vector<int64_t>{1}, dst.data()), StatusCode::kInvalidArgument,
               {"'t0'"});
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer keeps shadow memory for every page of the file's mapping that was read (4 bytes of it a
  // byte), in the process's resident set: the bound holds for the normal and ASan builds, which check it.
  GTEST_SKIP() << "resident set under ThreadSanitizer: " << grown << " bytes grown, its shadow of the mapping";
#endif
  EXPECT_LT(grown, size_t{8} << 20) << "of a 64 MiB file read twice";
}

// read_range hands a tensor over in pieces (also of bf16 tensors, whose elements are 2 bytes): every piece holds
// the file's elements, pieces that share a page read correctly after the one before dropped it, and a range past
// the tensor's end is refused naming it.
TEST_F(SafetensorsTest, ReadRangeReadsATensorPieceByPiece) {
  constexpr size_t kFloats = 10'000, kHalves = 3'001;
  std::vector<float> a(kFloats);
  std::vector<uint16_t> b(kHalves);
  for (size_t i = 0; i < kFloats; ++i) a[i] = static_cast<float>(i) * 0.5f;
  for (size_t i = 0; i < kHalves; ++i) b[i] = static_cast<uint16_t>(i * 7);
  const std::vector<int64_t> sa = {100, 100}, sb = {static_cast<int64_t>(kHalves)};
  const std::vector<SafetensorsTensor> tensors = {{"a", DType::kF32, sa, a.data(), {}},
                                                  {"b", DType::kBF16, sb, b.data(), {}}};
  ASSERT_TRUE(write_safetensors(path("r.safetensors"), tensors).is_ok());
  auto f = SafetensorsFile::open(path("r.safetensors"));
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  for (const size_t piece : {size_t{1}, size_t{999}, size_t{4096}, kFloats}) {
    std::vector<float> got(kFloats, -1.0f);
    for (size_t at = 0; at < kFloats; at += piece) {
      const size_t n = std::min(piece, kFloats - at);
      ASSERT_TRUE(f->read_range("a", DType::kF32, sa, at, n, got.data() + at).is_ok()) << at;
    }
    EXPECT_EQ(got, a) << "pieces of " << piece;
  }
  std::vector<uint16_t> halves(kHalves, 0xFFFF);
  ASSERT_TRUE(f->read_range("b", DType::kBF16, sb, 0, 1000, halves.data()).is_ok());
  ASSERT_TRUE(f->read_range("b", DType::kBF16, sb, 1000, kHalves - 1000, halves.data() + 1000).is_ok());
  EXPECT_EQ(halves, b);
  std::vector<float> dst(2);
  expect_error(f->read_range("a", DType::kF32, sa, kFloats - 1, 2, dst.data()), StatusCode::kInvalidArgument,
               {"'a'", "[9999, 10001)", "10000"});
  expect_error(f->read_range("a", DType::kBF16, sa, 0, 1, dst.data()), StatusCode::kInvalidArgument, {"'a'"});
}

TEST_F(SafetensorsTest, MissingFile) {
  expect_error(SafetensorsFile::open(path("nope.safetensors")).status(), StatusCode::kNotFound, {"nope.safetensors"});
}

TEST_F(SafetensorsTest, ShorterThanLengthField) {
  const std::string p = path("tiny.safetensors");
  std::ofstream(p) << "abc";
  expect_error(SafetensorsFile::open(p).status(), StatusCode::kCorruption, {"tiny.safetensors", "3 bytes"});
}

TEST_F(SafetensorsTest, TruncatedFile) {
  const std::vector<float> w(64, 1.5f);
  const std::vector<SafetensorsTensor> tensors = {{"w", DType::kF32, {8, 8}, w.data(), {}}};
  const std::string p = path("trunc.safetensors");
  ASSERT_TRUE(write_safetensors(p, tensors).is_ok());
  fs::resize_file(p, fs::file_size(p) - 10);
  expect_error(SafetensorsFile::open(p).status(), StatusCode::kCorruption,
               {"trunc.safetensors", "'w'", "[0, 256]", "run past the data section (246 bytes"});
}

TEST_F(SafetensorsTest, HeaderLengthPastEndOfFile) {
  const std::string p = write_raw("hlen.safetensors", "{}", 0);
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  const uint64_t len = 1000;
  f.write(reinterpret_cast<const char*>(&len), 8);
  f.close();
  expect_error(SafetensorsFile::open(p).status(), StatusCode::kCorruption,
               {"hlen.safetensors", "header length 1000", "10 bytes"});
}

TEST_F(SafetensorsTest, HeaderNotJson) {
  expect_error(SafetensorsFile::open(write_raw("json.safetensors", "{\"w\": {\"dtype\": ", 0)).status(),
               StatusCode::kCorruption, {"json.safetensors", "not valid JSON"});
  expect_error(SafetensorsFile::open(write_raw("arr.safetensors", "[1, 2]", 0)).status(), StatusCode::kCorruption,
               {"arr.safetensors", "not an object"});
}

TEST_F(SafetensorsTest, OverlappingOffsets) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                        R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  expect_error(SafetensorsFile::open(write_raw("overlap.safetensors", h, 16)).status(), StatusCode::kCorruption,
               {"overlap.safetensors", "'a' [0, 16]", "'b' [8, 16]", "overlap"});
}

TEST_F(SafetensorsTest, OutOfRangeOffsets) {
  const std::string h = R"({"a":{"dtype":"F16","shape":[4],"data_offsets":[100,108]}})";
  expect_error(SafetensorsFile::open(write_raw("range.safetensors", h, 16)).status(), StatusCode::kCorruption,
               {"range.safetensors", "'a'", "[100, 108]", "16 bytes"});
}

TEST_F(SafetensorsTest, GapAndTrailingBytes) {
  const std::string gap = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  expect_error(SafetensorsFile::open(write_raw("gap.safetensors", gap, 8)).status(), StatusCode::kCorruption,
               {"gap.safetensors", "4 unclaimed bytes", "'a'"});
  const std::string tail = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  expect_error(SafetensorsFile::open(write_raw("tail.safetensors", tail, 12)).status(), StatusCode::kCorruption,
               {"tail.safetensors", "8 trailing bytes"});
}

TEST_F(SafetensorsTest, ShapeDisagreesWithDtypeSize) {
  // 6 elements of BF16 are 12 bytes, not the 24 of F32.
  const std::string h = R"({"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,24]}})";
  expect_error(SafetensorsFile::open(write_raw("size.safetensors", h, 24)).status(), StatusCode::kCorruption,
               {"size.safetensors", "'a'", "[2, 3] of BF16 needs 12 bytes", "span 24"});
}

TEST_F(SafetensorsTest, MalformedEntries) {
  const std::string no_dtype = R"({"a":{"shape":[1],"data_offsets":[0,4]}})";
  expect_error(SafetensorsFile::open(write_raw("m1.safetensors", no_dtype, 4)).status(), StatusCode::kCorruption,
               {"m1.safetensors", "'a'", "dtype"});
  const std::string neg = R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})";
  expect_error(SafetensorsFile::open(write_raw("m2.safetensors", neg, 4)).status(), StatusCode::kCorruption,
               {"m2.safetensors", "'a'", "dimension"});
  const std::string backwards = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})";
  expect_error(SafetensorsFile::open(write_raw("m3.safetensors", backwards, 4)).status(), StatusCode::kCorruption,
               {"m3.safetensors", "backwards"});
  const std::string meta = R"({"__metadata__":{"k":3}})";
  expect_error(SafetensorsFile::open(write_raw("m4.safetensors", meta, 0)).status(), StatusCode::kCorruption,
               {"m4.safetensors", "'k'"});
}

TEST_F(SafetensorsTest, UnsupportedDtypeIsNamed) {
  const std::string h = R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})";
  expect_error(SafetensorsFile::open(write_raw("f64.safetensors", h, 8)).status(), StatusCode::kUnimplemented,
               {"f64.safetensors", "'a'", "F64"});
}

TEST_F(SafetensorsTest, ProducedTensorsAreWrittenAsTheyAreReachedAndTheirErrorsRemoveTheFile) {
  std::vector<float> a(21), b(6);
  Rng rng(4);
  for (auto& x : a) x = static_cast<float>(rng.normal());
  for (auto& x : b) x = static_cast<float>(rng.normal());
  std::vector<std::string> order;
  auto produce = [&](const std::string& name, const std::vector<float>& src) {
    return [&order, &src, name](void* dst) {
      order.push_back(name);
      std::memcpy(dst, src.data(), src.size() * sizeof(float));
      return Status::ok();
    };
  };
  const std::vector<SafetensorsTensor> tensors = {{"a", DType::kF32, {3, 7}, nullptr, produce("a", a)},
                                                  {"b", DType::kF32, {6}, b.data(), {}},
                                                  {"c", DType::kF32, {6}, nullptr, produce("c", b)}};
  const std::string p = path("produced.safetensors");
  ASSERT_TRUE(write_safetensors(p, tensors).is_ok());
  EXPECT_EQ(order, (std::vector<std::string>{"a", "c"}));
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  const std::vector<int64_t> shape_a = {3, 7}, shape_c = {6};
  auto got_a = f->expect("a", DType::kF32, shape_a);
  auto got_c = f->expect("c", DType::kF32, shape_c);
  ASSERT_TRUE(got_a.is_ok() && got_c.is_ok());
  EXPECT_EQ(std::memcmp(got_a->data(), a.data(), a.size() * 4), 0);
  EXPECT_EQ(std::memcmp(got_c->data(), b.data(), b.size() * 4), 0);

  const std::vector<SafetensorsTensor> failing = {
      {"ok", DType::kF32, {6}, b.data(), {}},
      {"bad", DType::kF32, {6}, nullptr, [](void*) { return Status::io_error("swap read failed"); }}};
  const std::string q = path("failing.safetensors");
  expect_error(write_safetensors(q, failing), StatusCode::kIOError, {"'bad'", "swap read failed"});
  EXPECT_FALSE(fs::exists(q));
  EXPECT_FALSE(fs::exists(q + ".tmp"));
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Hostile headers, each found by hand or by fuzzing a checkpoint's file at 82c4702, where each crashed the
// process: now a Corruption naming the file.
TEST_F(SafetensorsTest, AHeaderNested200000DeepIsACorruptionNotASegfault) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":)" + std::string(200000, '[') +
                        std::string(200000, ']') + "}}";
  expect_error(SafetensorsFile::open(write_raw("deep.safetensors", h, 4)).status(), StatusCode::kCorruption,
               {"deep.safetensors", "nested more than 8 deep"});
}

TEST_F(SafetensorsTest, ANumberPastADoublesRangeIsACorruptionNotAnAbort) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}})";
  expect_error(SafetensorsFile::open(write_raw("inf.safetensors", h, 4)).status(), StatusCode::kCorruption,
               {"inf.safetensors", "not valid JSON"});
}

TEST_F(SafetensorsTest, DuplicateTensorNamesAreRefused) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                        R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  expect_error(SafetensorsFile::open(write_raw("dup.safetensors", h, 8)).status(), StatusCode::kCorruption,
               {"dup.safetensors", "key 'a' appears twice"});
}

TEST_F(SafetensorsTest, BytesAfterTheHeaderJsonAreRefused) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}   xyz)";
  expect_error(SafetensorsFile::open(write_raw("after.safetensors", h, 4)).status(), StatusCode::kCorruption,
               {"after.safetensors", "not valid JSON"});
  // Spaces (the writer's padding) are fine.
  EXPECT_TRUE(SafetensorsFile::open(write_raw("pad.safetensors", R"({"a":{"dtype":"F32","shape":[1],)"
                                                                  R"("data_offsets":[0,4]}}     )",
                                              4))
                  .is_ok());
}

// A tensor of two and a bit chunks, written in odd-sized pieces (hashed as a stream), and a small one.
class SafetensorsChecksumTest : public SafetensorsTest {
 protected:
  void SetUp() override {
    SafetensorsTest::SetUp();
    big_.resize(kSafetensorsChecksumChunk / 4 * 2 + 12345);
    Rng rng(7);
    for (float& x : big_) x = static_cast<float>(rng.normal());
    const std::vector<SafetensorsTensor> tensors = {
        {"small", DType::kF32, {3}, small_, {}},
        {"big", DType::kF32, {static_cast<int64_t>(big_.size())}, nullptr, {},
         [this](size_t offset) -> Result<std::span<const std::byte>> {
           const auto all = std::as_bytes(std::span<const float>(big_));
           return all.subspan(offset, std::min<size_t>(all.size() - offset, 3'000'017));
         }},
    };
    ASSERT_TRUE(write_safetensors(path("c.safetensors"), tensors, {{"format", "pt"}}).is_ok());
  }
  // The file with bit `bit` of byte `at` flipped, as a new file.
  std::string flipped(size_t at, int bit) {
    const std::string p = path("flipped.safetensors");
    fs::copy_file(path("c.safetensors"), p, fs::copy_options::overwrite_existing);
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(at));
    char c = 0;
    f.get(c);
    c = static_cast<char>(c ^ (1 << bit));
    f.seekp(static_cast<std::streamoff>(at));
    f.put(c);
    return p;
  }
  // Reads every tensor whole; the first error.
  Status read_all(const std::string& p) {
    STRATA_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open(p));
    std::vector<float> out(big_.size());
    for (const SafetensorsEntry& e : f.tensors())
      STRATA_RETURN_IF_ERROR(f.read_into(e.name, DType::kF32, e.shape, out.data()));
    return Status::ok();
  }
  const float small_[3] = {1.5f, -2.0f, 0.25f};
  std::vector<float> big_;
};

TEST_F(SafetensorsChecksumTest, StrataFilesCarryChecksumsThatReadBack) {
  ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::open(path("c.safetensors")));
  EXPECT_TRUE(f.checksummed());
  EXPECT_EQ(f.metadata().at("format"), "pt");  // the caller's metadata is kept beside the checksums
  EXPECT_TRUE(f.metadata().at(kSafetensorsChecksumKey).starts_with("v1 chunk=16777216 header="));
  ASSERT_OK(f.verify_all());
  std::vector<float> out(big_.size());
  ASSERT_OK(f.read_into("big", DType::kF32, f.find("big")->shape, out.data()));
  EXPECT_EQ(out, big_);
  // Files from elsewhere have none, and read as before.
  ASSERT_OK_AND_ASSIGN(SafetensorsFile raw, SafetensorsFile::open(write_raw(
                                                "raw.safetensors", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4)));
  EXPECT_FALSE(raw.checksummed());
  ASSERT_OK(raw.verify_all());
}

// One flipped bit anywhere in the file is refused, naming the file, and in the data the tensor and offset.
TEST_F(SafetensorsChecksumTest, OneFlippedBitAnywhereIsACorruption) {
  uint64_t header_len = 0;
  {
    std::ifstream in(path("c.safetensors"), std::ios::binary);
    in.read(reinterpret_cast<char*>(&header_len), 8);
  }
  const size_t data0 = 8 + header_len, big0 = data0 + 12;
  struct Case {
    size_t at;
    std::vector<std::string> words;
  };
  const std::string header = [&] {
    std::ifstream in(path("c.safetensors"), std::ios::binary);
    std::string h(8 + header_len, '\0');
    in.read(h.data(), static_cast<std::streamsize>(h.size()));
    return h;
  }();
  const std::vector<Case> cases = {
      {header.find("\"format\"") + 2, {"fails its XXH3 checksum"}},  // the caller's metadata
      {header.find("\"shape\"") + 9, {}},                            // a shape: the layout check or the checksum
      {header.find("header=") + 9, {"checksum"}},  // the stored header hash: another, or no longer hex
      {header.find("data=") + 7, {"checksum"}},    // a stored data hash
      {header.size() - 1, {}},                                        // the padding, or the closing brace
      {data0 + 5, {"'small'", fmt::format("file offset {}", data0)}},
      {big0 + 100, {"'big'", "bytes [0, 16777216)"}},
      {big0 + kSafetensorsChecksumChunk + 7, {"'big'", "bytes [16777216, 33554432)"}},
      {big0 + big_.size() * 4 - 1, {"'big'", fmt::format("bytes [33554432, {})", big_.size() * 4)}},
  };
  for (const Case& c : cases) {
    for (int bit : {0, 6}) {
      SCOPED_TRACE(fmt::format("byte {} bit {}", c.at, bit));
      const Status st = read_all(flipped(c.at, bit));
      ASSERT_FALSE(st.is_ok());
      EXPECT_TRUE(st.code() == StatusCode::kCorruption || st.code() == StatusCode::kUnimplemented) << st.to_string();
      EXPECT_NE(st.message().find("flipped.safetensors"), std::string::npos) << st.message();
      for (const std::string& w : c.words) EXPECT_NE(st.message().find(w), std::string::npos) << st.message();
    }
  }
}

TEST_F(SafetensorsChecksumTest, TheChecksumKeyIsTheWritersOwn) {
  const float x = 1;
  const std::vector<SafetensorsTensor> t = {{"a", DType::kF32, {1}, &x, {}}};
  expect_error(write_safetensors(path("k.safetensors"), t, {{kSafetensorsChecksumKey, "v1"}}),
               StatusCode::kInvalidArgument, {"k.safetensors", "strata.xxh3", "writer's own"});
}

}  // namespace
}  // namespace strata
