// foreign_weights_test.cpp — GPT-2 weights in Hugging Face's and llm.c's layouts. The files here are written by
// this test's own code from the layouts as those projects define them (Hugging Face: Conv1D weights stored
// (in, out), "wte.weight", the mask buffers, a tied lm_head, names with or without "transformer."; llm.c: the
// 256-int header, 16 tensors stacked over the blocks, wte padded) — not by the code under test — and a model
// loaded from each must hold bitwise the weights they were made from (bf16 ones: those weights rounded). Export
// goes back out to each layout and in again bitwise. Bad input is refused naming the file, tensor or key.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/dtype.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/foreign_weights.h"
#include "engine/model/gpt2/gpt2.h"
#include "engine/text/tokenizer.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/device.h"
#include "storage/safetensors.h"
#include "tests/engine/tiny_gpt2_files.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;

const GPT2Config kConfig{.n_layer = 2, .n_head = 2, .n_embd = 16, .vocab_size = 50, .block_size = 8};

using Weights = std::map<std::string, std::vector<float>>;  // our name -> the tensor, our orientation

bool conv1d(const std::string& name) {
  for (const char* s : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"})
    if (name.ends_with(s)) return true;
  return false;
}

class ForeignWeightsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           fmt::format("strata_foreign_{}_{}", ::getpid(),
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    ASSERT_OK_AND_ASSIGN(device_, kernels::make_device("cpu", *kernels::find_kernel_set("fast")));
    ASSERT_OK_AND_ASSIGN(auto model, make_model(7));
    weights_ = read_weights(*model);
  }
  void TearDown() override { fs::remove_all(dir_); }

  Result<std::unique_ptr<GPT2>> make_model(uint64_t seed, const GPT2Config& c = kConfig) {
    STRATA_ASSIGN_OR_RETURN(auto m, GPT2::create(c, *device_, kernels::MatmulPrecision::kF32));
    STRATA_RETURN_IF_ERROR(m->init_weights(seed));
    return m;
  }
  static Weights read_weights(const GPT2& m) {
    Weights w;
    for (size_t u = 0; u < m.units().size(); ++u) {
      std::vector<float> flat(m.whole_layout(u).numel());
      EXPECT_TRUE(m.read_params(u, flat.data()).is_ok());
      for (const TensorSpec& s : m.whole_layout(u).specs())
        w[s.name] = std::vector<float>(flat.begin() + s.offset, flat.begin() + s.offset + s.numel());
    }
    return w;
  }
  static const TensorSpec& spec(const std::string& name) {
    static const auto specs = [] {
      std::map<std::string, TensorSpec> m;
      for (const UnitSpec& u : gpt2_unit_specs(kConfig))
        for (const TensorSpec& s : u.layout.specs()) m.emplace(s.name, s);
      return m;
    }();
    return specs.at(name);
  }
  // A fresh model (other weights) loaded from `path`: what it then holds.
  Weights load(const std::string& path) {
    auto m = make_model(99);
    EXPECT_TRUE(m.is_ok());
    const Status st = load_model(**m, path);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return read_weights(**m);
  }

  // Hugging Face's layout, written here from its definition. `dtype` F32, BF16 or F16.
  std::string write_hf(const std::string& prefix, DType dtype, bool with_buffers_and_head,
                       const std::string& file = "model.safetensors") {
    std::vector<SafetensorsTensor> tensors;
    std::vector<std::vector<uint16_t>> halves;
    std::vector<std::vector<float>> floats;
    halves.reserve(64);
    floats.reserve(64);
    auto add = [&](const std::string& name, std::vector<int64_t> shape, std::vector<float> v) {
      if (dtype != DType::kF32) {
        halves.emplace_back(v.size());
        if (dtype == DType::kBF16) {
          f32_to_bf16_n(v.data(), halves.back().data(), v.size());
        } else {
          f32_to_f16_n(v.data(), halves.back().data(), v.size());
        }
        tensors.push_back({name, dtype, std::move(shape), halves.back().data(), {}});
      } else {
        floats.push_back(std::move(v));
        tensors.push_back({name, dtype, std::move(shape), floats.back().data(), {}});
      }
    };
    for (const auto& [name, v] : weights_) {
      const TensorSpec& s = spec(name);
      const std::string hf = prefix + (name == "wte" || name == "wpe" ? name + ".weight" : name);
      if (!conv1d(name)) {
        add(hf, s.shape, v);
        continue;
      }
      const int64_t out = s.shape[0], in = s.shape[1];  // Conv1D: weight[i][o], y = x @ weight
      std::vector<float> stored(v.size());
      for (int64_t i = 0; i < in; ++i)
        for (int64_t o = 0; o < out; ++o) stored[i * out + o] = v[o * in + i];
      add(hf, {in, out}, std::move(stored));
    }
    if (with_buffers_and_head) {
      const int64_t T = kConfig.block_size;
      for (int l = 0; l < kConfig.n_layer; ++l) {
        add(fmt::format("{}h.{}.attn.bias", prefix, l), {1, 1, T, T}, std::vector<float>(T * T, 1.0f));
        add(fmt::format("{}h.{}.attn.masked_bias", prefix, l), {}, {-1e4f});
      }
      add("lm_head.weight", spec("wte").shape, weights_.at("wte"));
    }
    const std::string path = (dir_ / file).string();
    EXPECT_TRUE(write_safetensors(path, tensors, {{"format", "pt"}}).is_ok());
    return path;
  }
  void write_hf_config(int n_head) {
    std::ofstream((dir_ / "config.json").string())
        << nlohmann::json{{"model_type", "gpt2"}, {"n_layer", kConfig.n_layer}, {"n_head", n_head},
                          {"n_embd", kConfig.n_embd}, {"n_positions", kConfig.block_size},
                          {"vocab_size", kConfig.vocab_size}}
               .dump();
  }

  // llm.c's layout, written here from its definition: version 3 (fp32) or 5 (bf16), wte padded to Vp rows
  // (the padding filled with garbage, which must not be read).
  std::string write_llmc(int version, int Vp, const std::string& file = "model.bin") {
    const int L = kConfig.n_layer;
    std::vector<float> all;
    auto put = [&](const std::vector<float>& v) { all.insert(all.end(), v.begin(), v.end()); };
    put(weights_.at("wte"));
    all.insert(all.end(), static_cast<size_t>((Vp - kConfig.vocab_size) * kConfig.n_embd), 12345.0f);
    put(weights_.at("wpe"));
    for (const char* t : {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                          "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                          "mlp.c_proj.weight", "mlp.c_proj.bias"})
      for (int l = 0; l < L; ++l) put(weights_.at(fmt::format("h.{}.{}", l, t)));
    put(weights_.at("ln_f.weight"));
    put(weights_.at("ln_f.bias"));
    int32_t header[256] = {};
    header[0] = 20240326;
    header[1] = version;
    header[2] = kConfig.block_size;
    header[3] = kConfig.vocab_size;
    header[4] = L;
    header[5] = kConfig.n_head;
    header[6] = kConfig.n_embd;
    header[7] = Vp;
    const std::string path = (dir_ / file).string();
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header), sizeof header);
    if (version == 5) {
      std::vector<uint16_t> h(all.size());
      f32_to_bf16_n(all.data(), h.data(), all.size());
      out.write(reinterpret_cast<const char*>(h.data()), static_cast<std::streamsize>(h.size() * 2));
    } else {
      out.write(reinterpret_cast<const char*>(all.data()), static_cast<std::streamsize>(all.size() * 4));
    }
    return path;
  }

  Weights rounded_to_bf16() const {
    Weights w = weights_;
    for (auto& [name, v] : w)
      for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
    return w;
  }
  Weights rounded_to_f16() const {
    Weights w = weights_;
    for (auto& [name, v] : w)
      for (float& x : v) x = f16_to_f32(f32_to_f16(x));
    return w;
  }

  fs::path dir_;
  std::unique_ptr<kernels::Device> device_;
  Weights weights_;
};

TEST_F(ForeignWeightsTest, HuggingFaceWeightsLoadTransposedWithTheirBuffersAndTiedHeadSkipped) {
  for (const std::string prefix : {"", "transformer."}) {
    const std::string path = write_hf(prefix, DType::kF32, /*with_buffers_and_head=*/true);
    write_hf_config(kConfig.n_head);
    ASSERT_OK_AND_ASSIGN(auto file, WeightsFile::open(path));
    EXPECT_EQ(file->format(), WeightsFormat::kHuggingFace) << prefix;
    EXPECT_EQ(file->config().n_head, kConfig.n_head);
    EXPECT_EQ(file->config().n_layer, kConfig.n_layer);
    EXPECT_TRUE(load(path) == weights_) << "prefix '" << prefix << "'";
  }
}

// save_pretrained's shards (model-0000i-of-0000N.safetensors and model.safetensors.index.json) load as the one
// file they were cut from, by the folder or by the index (storage/safetensors_shards.h).
TEST_F(ForeignWeightsTest, ShardedHuggingFaceWeightsLoadAsTheOneFile) {
  const std::string whole = write_hf("transformer.", DType::kF32, /*with_buffers_and_head=*/true);
  write_hf_config(kConfig.n_head);
  const Weights want = load(whole);
  {
    ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::open(whole));
    std::vector<SafetensorsTensor> shard[2];
    nlohmann::json map = nlohmann::json::object();
    const std::string names[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
    size_t i = 0;
    for (const SafetensorsEntry& e : f.tensors()) {
      const int k = i++ < f.tensors().size() / 2 ? 0 : 1;
      shard[k].push_back({e.name, e.dtype, e.shape, e.data, {}});
      map[e.name] = names[k];
    }
    for (int k = 0; k < 2; ++k)
      ASSERT_OK(write_safetensors((dir_ / names[k]).string(), shard[k], {{"format", "pt"}}));
    std::ofstream(dir_ / "model.safetensors.index.json")
        << nlohmann::json{{"metadata", {}}, {"weight_map", map}}.dump();
  }
  fs::remove(whole);
  EXPECT_TRUE(load(dir_.string()) == want) << "by the folder";
  EXPECT_TRUE(load((dir_ / "model.safetensors.index.json").string()) == want) << "by the index";
  ASSERT_OK_AND_ASSIGN(auto file, WeightsFile::open((dir_ / "model.safetensors.index.json").string()));
  EXPECT_EQ(file->format(), WeightsFormat::kHuggingFace);
  EXPECT_EQ(file->config().n_head, kConfig.n_head) << "from the config.json beside the index";
}

TEST_F(ForeignWeightsTest, HalfPrecisionHuggingFaceAndLlmcWeightsAreWidenedExactly) {
  const Weights want = rounded_to_bf16();
  EXPECT_TRUE(load(write_hf("", DType::kBF16, false)) == want);
  EXPECT_TRUE(load(write_llmc(5, 64)) == want);
  EXPECT_TRUE(load(write_hf("", DType::kF16, false, "f16.safetensors")) == rounded_to_f16());
}

TEST_F(ForeignWeightsTest, LlmcFilesLoadFromTheirLayerStackedTensors) {
  const std::string path = write_llmc(3, 64);
  ASSERT_OK_AND_ASSIGN(auto file, WeightsFile::open(path));
  EXPECT_EQ(file->format(), WeightsFormat::kLlmc);
  EXPECT_EQ(file->config().n_head, kConfig.n_head);
  EXPECT_TRUE(load(path) == weights_);
  EXPECT_TRUE(load(write_llmc(3, kConfig.vocab_size, "unpadded.bin")) == weights_);
}

// read_range gives every tensor of every layout piece by piece, the same bits as read() — also the Conv1D
// weights Hugging Face stores transposed, whose pieces start and end inside rows — and refuses a range past a
// tensor's end naming it.
TEST_F(ForeignWeightsTest, EveryLayoutReadsATensorInPiecesAsWhole) {
  ASSERT_OK_AND_ASSIGN(auto model, make_model(7));
  const std::string ours = (dir_ / "ours.safetensors").string();
  ASSERT_OK(save_model(*model, ours));
  for (const std::string& path : {ours, write_hf("", DType::kF32, true), write_hf("", DType::kBF16, false, "b.st"),
                                  write_llmc(3, 64), write_llmc(5, 64, "b.bin")}) {
    ASSERT_OK_AND_ASSIGN(auto file, WeightsFile::open(path));
    for (const UnitSpec& unit : gpt2_unit_specs(kConfig)) {
      for (const TensorSpec& s : unit.layout.specs()) {
        std::vector<float> whole(s.numel());
        ASSERT_OK(file->read(s, whole.data()));
        for (const size_t piece : {size_t{1}, size_t{7}, size_t{33}}) {
          std::vector<float> got(s.numel(), -1.0f);
          for (size_t at = 0; at < s.numel(); at += piece)
            ASSERT_OK(file->read_range(s, at, std::min(piece, s.numel() - at), got.data() + at));
          ASSERT_EQ(got, whole) << path << ": " << s.name << " in pieces of " << piece;
        }
      }
    }
    float x = 0;
    const TensorSpec& wpe = spec("wpe");
    const Status past = file->read_range(wpe, wpe.numel(), 1, &x);
    EXPECT_EQ(past.code(), StatusCode::kInvalidArgument) << past.to_string();
    EXPECT_NE(past.to_string().find("'wpe'"), std::string::npos) << past.to_string();
  }
}

TEST_F(ForeignWeightsTest, ExportWritesEachLayoutAndReadsBackBitwise) {
  ASSERT_OK_AND_ASSIGN(auto model, make_model(7));
  const std::string ours = (dir_ / "ours.safetensors").string();
  ASSERT_OK(save_model(*model, ours));

  // Hugging Face: a folder as the hub has it.
  const fs::path hf = dir_ / "hf";
  ASSERT_OK(export_weights(ours, WeightsFormat::kHuggingFace, hf.string()));
  ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::open((hf / "model.safetensors").string()));
  EXPECT_EQ(f.metadata().at("format"), "pt");  // transformers refuses safetensors without it
  ASSERT_NE(f.find("wte.weight"), nullptr);
  ASSERT_EQ(f.find("wte"), nullptr);
  const SafetensorsEntry* qkv = f.find("h.1.attn.c_attn.weight");
  ASSERT_NE(qkv, nullptr);
  const int64_t C = kConfig.n_embd;
  EXPECT_EQ(qkv->shape, (std::vector<int64_t>{C, 3 * C}));
  const std::vector<float>& w = weights_.at("h.1.attn.c_attn.weight");  // ours: (3C, C)
  std::vector<float> stored(qkv->numel());
  std::memcpy(stored.data(), qkv->data, qkv->nbytes());
  for (int64_t i = 0; i < C; ++i)
    for (int64_t o = 0; o < 3 * C; ++o) ASSERT_EQ(stored[i * 3 * C + o], w[o * C + i]) << i << "," << o;
  std::ifstream cin((hf / "config.json").string());
  const nlohmann::json cfg = nlohmann::json::parse(cin);
  EXPECT_EQ(cfg.at("model_type"), "gpt2");
  EXPECT_EQ(cfg.at("n_head"), kConfig.n_head);
  EXPECT_EQ(cfg.at("n_positions"), kConfig.block_size);
  EXPECT_EQ(cfg.at("activation_function"), "gelu_new");  // the tanh GELU, which Strata's kernels compute
  EXPECT_TRUE(load((hf / "model.safetensors").string()) == weights_);

  // llm.c: the header, and the vocabulary padded to 128 rows.
  const std::string bin = (dir_ / "model.bin").string();
  ASSERT_OK(export_weights(ours, WeightsFormat::kLlmc, bin));
  std::ifstream in(bin, std::ios::binary);
  int32_t header[256];
  in.read(reinterpret_cast<char*>(header), sizeof header);
  EXPECT_EQ(header[0], 20240326);
  EXPECT_EQ(header[1], 3);
  EXPECT_EQ(header[5], kConfig.n_head);
  EXPECT_EQ(header[7], 128);
  size_t params = 0;
  for (const auto& [name, v] : weights_) params += v.size();
  params += static_cast<size_t>((128 - kConfig.vocab_size) * kConfig.n_embd);
  EXPECT_EQ(fs::file_size(bin), sizeof header + params * 4);
  EXPECT_TRUE(load(bin) == weights_);

  // bf16: llm.c's version 5 (its GPU trainer's default) and Hugging Face's BF16, the weights rounded.
  const std::string bin16 = (dir_ / "model16.bin").string();
  ASSERT_OK(export_weights(ours, WeightsFormat::kLlmc, bin16, DType::kBF16));
  std::ifstream in16(bin16, std::ios::binary);
  in16.read(reinterpret_cast<char*>(header), sizeof header);
  EXPECT_EQ(header[1], 5);
  EXPECT_EQ(fs::file_size(bin16), sizeof header + params * 2);
  EXPECT_TRUE(load(bin16) == rounded_to_bf16());
  ASSERT_OK(export_weights(ours, WeightsFormat::kHuggingFace, (dir_ / "hf16").string(), DType::kBF16));
  EXPECT_TRUE(load((dir_ / "hf16" / "model.safetensors").string()) == rounded_to_bf16());
  std::ifstream cin16((dir_ / "hf16" / "config.json").string());
  EXPECT_EQ(nlohmann::json::parse(cin16).at("torch_dtype"), "bfloat16");
  EXPECT_FALSE(export_weights(ours, WeightsFormat::kStrata, (dir_ / "x.safetensors").string(), DType::kBF16).is_ok());

  // From one foreign layout to the other, and back to ours.
  ASSERT_OK(export_weights(bin, WeightsFormat::kHuggingFace, (dir_ / "hf2").string()));
  EXPECT_TRUE(load((dir_ / "hf2" / "model.safetensors").string()) == weights_);
  ASSERT_OK(export_weights((dir_ / "hf2" / "model.safetensors").string(), WeightsFormat::kStrata,
                           (dir_ / "back.safetensors").string()));
  EXPECT_TRUE(load((dir_ / "back.safetensors").string()) == weights_);
}

TEST_F(ForeignWeightsTest, OtherModelsAndBadFilesAreRefusedNamingWhatDiffers) {
  const std::string hf = write_hf("", DType::kF32, false);
  auto refused = [&](const std::string& path, const GPT2Config& c) {
    auto m = make_model(1, c);
    EXPECT_TRUE(m.is_ok());
    const Status st = load_model(**m, path);
    EXPECT_FALSE(st.is_ok());
    return st.to_string();
  };
  GPT2Config deeper = kConfig;
  deeper.n_layer = 3;
  EXPECT_NE(refused(hf, deeper).find("model.n_layer is 3, the file's 2"), std::string::npos) << refused(hf, deeper);
  GPT2Config longer = kConfig;
  longer.block_size = 16;
  EXPECT_NE(refused(hf, longer).find("training.seq_len may stay below model.block_size"), std::string::npos);
  write_hf_config(4);
  EXPECT_NE(refused(hf, kConfig).find("model.n_head is 2, the file's 4"), std::string::npos);
  fs::remove(dir_ / "config.json");

  // An untied head, and a tensor a GPT-2 does not have.
  {
    std::vector<float> head(weights_.at("wte"));
    head[3] += 1.0f;
    std::vector<SafetensorsTensor> t;
    std::vector<float> extra(4, 0.0f);
    ASSERT_OK_AND_ASSIGN(SafetensorsFile base, SafetensorsFile::open(hf));
    for (const SafetensorsEntry& e : base.tensors()) t.push_back({e.name, e.dtype, e.shape, e.data, {}});
    t.push_back({"lm_head.weight", DType::kF32, spec("wte").shape, head.data(), {}});
    ASSERT_OK(write_safetensors((dir_ / "untied.safetensors").string(), t));
    EXPECT_NE(refused((dir_ / "untied.safetensors").string(), kConfig).find("untied"), std::string::npos);
    t.back() = {"h.0.attn.rotary", DType::kF32, {4}, extra.data(), {}};
    ASSERT_OK(write_safetensors((dir_ / "extra.safetensors").string(), t));
    EXPECT_NE(refused((dir_ / "extra.safetensors").string(), kConfig).find("h.0.attn.rotary"), std::string::npos);
  }

  // Not a GPT-2; llm.c files of another version or cut short.
  std::vector<float> x(4, 1.0f);
  const std::vector<SafetensorsTensor> other = {{"encoder.weight", DType::kF32, {2, 2}, x.data(), {}}};
  ASSERT_OK(write_safetensors((dir_ / "other.safetensors").string(), other));
  EXPECT_NE(refused((dir_ / "other.safetensors").string(), kConfig).find("no token embedding"), std::string::npos);
  const std::string v2 = write_llmc(2, 64, "v2.bin");
  EXPECT_NE(refused(v2, kConfig).find("version 2"), std::string::npos);
  const std::string cut = write_llmc(3, 64, "cut.bin");
  fs::resize_file(cut, fs::file_size(cut) - 4);
  EXPECT_NE(refused(cut, kConfig).find("bytes, but the model its header describes takes"), std::string::npos);
  EXPECT_NE(refused((dir_ / "missing.bin").string(), kConfig).find("no such file"), std::string::npos);
  {  // a header whose sizes would overflow the tensor sizes: refused before anything is read
    const std::string huge = write_llmc(3, 64, "huge.bin");
    std::fstream f(huge, std::ios::in | std::ios::out | std::ios::binary);
    const int32_t width = 1 << 30;
    f.seekp(6 * sizeof(int32_t));
    f.write(reinterpret_cast<const char*>(&width), sizeof width);
    f.close();
    EXPECT_NE(refused(huge, kConfig).find("past what Strata reads"), std::string::npos) << refused(huge, kConfig);
  }

  // Hugging Face's weights alone do not give the head count that llm.c's header needs.
  const Status st = export_weights(hf, WeightsFormat::kLlmc, (dir_ / "x.bin").string());
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.to_string().find("config.json"), std::string::npos) << st.to_string();
}

// An exported Hugging Face folder carries the tokenizer as transformers names its files, once it is known to be
// the model's (here the tests' miniature GPT-2 tokenizer: the 256 bytes and <|endoftext|>).
TEST_F(ForeignWeightsTest, TheTokenizerGoesBesideAHuggingFaceExportUnderTransformersNames) {
  const std::string encoder = strata::testing::write_tiny_encoder(dir_);
  const std::string merges = strata::testing::write_text_file(dir_ / "vocab.bpe", "#version: 0.2\n");
  GPT2Config c = kConfig;
  c.vocab_size = 257;
  ASSERT_OK_AND_ASSIGN(auto model, make_model(3, c));
  ASSERT_OK(save_model(*model, (dir_ / "ours.safetensors").string()));
  ASSERT_OK(export_weights((dir_ / "ours.safetensors").string(), WeightsFormat::kHuggingFace, (dir_ / "hf").string()));
  ASSERT_OK(export_hf_tokenizer(encoder, merges, (dir_ / "hf").string(), c.vocab_size, c.block_size));
  auto bytes = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  EXPECT_EQ(bytes(dir_ / "hf" / "vocab.json"), bytes(encoder));
  EXPECT_EQ(bytes(dir_ / "hf" / "merges.txt"), bytes(merges));
  std::ifstream in(dir_ / "hf" / "tokenizer_config.json");
  const nlohmann::json t = nlohmann::json::parse(in);
  EXPECT_EQ(t.at("eos_token"), "<|endoftext|>");
  EXPECT_EQ(t.at("model_max_length"), c.block_size);
  // Not the model's tokenizer: refused, naming both sizes.
  const Status st = export_hf_tokenizer(encoder, merges, (dir_ / "hf").string(), kConfig.vocab_size,
                                        kConfig.block_size);
  EXPECT_NE(st.to_string().find("has 257 tokens, the model 50"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace strata::engine

namespace strata::engine {
namespace {

// `path` rewritten without Strata's checksums and with `edit` applied to its header: a file as another project
// (or Strata before them) writes it.
void rewrite_header(const std::string& path, void (*edit)(nlohmann::json&)) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t len = 0;
  std::memcpy(&len, bytes.data(), 8);
  nlohmann::json h = nlohmann::json::parse(bytes.substr(8, len));
  h["__metadata__"].erase(kSafetensorsChecksumKey);
  edit(h);
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t n = text.size();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << text << bytes.substr(8 + len);
}

// Files without checksums are checked for finite values instead (they trained to NaN and exited 0 at 82c4702),
// naming the file, the tensor and the element, unless the options allow them.
TEST_F(ForeignWeightsTest, NonFiniteWeightsInFilesWithoutChecksumsAreRefusedUnlessAllowed) {
  const std::string llmc = write_llmc(3, 64);
  {
    std::fstream f(llmc, std::ios::in | std::ios::out | std::ios::binary);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    f.seekp(1024 + 5 * 4);  // wte element 5
    f.write(reinterpret_cast<const char*>(&nan), 4);
  }
  auto m = make_model(1);
  ASSERT_TRUE(m.is_ok());
  const Status st = load_model(**m, llmc);
  ASSERT_FALSE(st.is_ok());
  ::strata::testing::expect_error(st, StatusCode::kCorruption, {"model.bin", "'wte' element 5 is nan", "allow-non-finite"});
  ASSERT_OK_AND_ASSIGN(auto allowed, WeightsFile::open(llmc, {.allow_non_finite = true}));
  std::vector<float> wte(spec("wte").numel());
  ASSERT_OK(allowed->read(spec("wte"), wte.data()));
  EXPECT_TRUE(std::isnan(wte[5]));

  const std::string hf = write_hf("", DType::kF32, false);
  rewrite_header(hf, [](nlohmann::json&) {});
  {
    std::fstream f(hf, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-4, std::ios::end);  // the last tensor's last element
    const float inf = std::numeric_limits<float>::infinity();
    f.write(reinterpret_cast<const char*>(&inf), 4);
  }
  ASSERT_OK_AND_ASSIGN(auto file, WeightsFile::open(hf));
  EXPECT_FALSE(file->checksummed());
  auto m2 = make_model(1);
  const Status inf_st = load_model(**m2, hf);
  ASSERT_FALSE(inf_st.is_ok());
  ::strata::testing::expect_error(inf_st, StatusCode::kCorruption, {"model.safetensors", "is inf"});
}

// Our own metadata names the config: a size that contradicts the tensors (n_layer "5" beside 2 blocks) or is not
// a number is a Corruption.
TEST_F(ForeignWeightsTest, MetadataThatContradictsTheTensorsIsRefused) {
  ASSERT_OK_AND_ASSIGN(auto model, make_model(3));
  const std::string ours = (dir_ / "ours.safetensors").string();
  ASSERT_OK(save_model(*model, ours));
  ASSERT_OK_AND_ASSIGN(auto checked, WeightsFile::open(ours));
  EXPECT_TRUE(checked->checksummed());
  rewrite_header(ours, [](nlohmann::json& h) { h["__metadata__"]["n_layer"] = "5"; });
  auto r = WeightsFile::open(ours);
  ASSERT_FALSE(r.is_ok());
  ::strata::testing::expect_error(r.status(), StatusCode::kCorruption, {"ours.safetensors", "n_layer 5", "hold 2"});
  rewrite_header(ours, [](nlohmann::json& h) { h["__metadata__"]["n_layer"] = "2"; h["__metadata__"]["n_head"] = "x"; });
  auto r2 = WeightsFile::open(ours);
  ASSERT_FALSE(r2.is_ok());
  ::strata::testing::expect_error(r2.status(), StatusCode::kCorruption, {"n_head is 'x'"});
}

}  // namespace
}  // namespace strata::engine
