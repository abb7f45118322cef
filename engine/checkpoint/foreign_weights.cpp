#include "engine/checkpoint/foreign_weights.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/dtype.h"
#include "common/json_parse.h"
#include "common/log.h"
#include "engine/checkpoint/foreign_formats.h"
#include "storage/safetensors.h"
#include "storage/safetensors_shards.h"
#include "storage/token_shard.h"

namespace strata::engine {

namespace fs = std::filesystem;
using namespace foreign;  // NOLINT: the formats' layouts, shared with the writer

namespace {

// Sizes a file may claim, far above any GPT-2 yet low enough that no product of them overflows 64 bits.
constexpr int64_t kMaxWidth = 1 << 17, kMaxLayers = 1 << 12, kMaxPositions = 1 << 22, kMaxVocab = 1 << 22;

// That the sizes a file claims are within the limits above (which keep its tensor sizes from overflowing).
Status check_claimed(const std::string& path, const GPT2Config& c, int64_t padded_vocab) {
  if (c.n_embd > kMaxWidth || c.n_layer > kMaxLayers || c.block_size > kMaxPositions || c.vocab_size > kMaxVocab ||
      padded_vocab > kMaxVocab) {
    return Status::corruption("{}: width {}, {} blocks, {} positions, vocabulary {} (padded {}): past what Strata "
                              "reads (width {}, {} blocks, {} positions, vocabulary {})",
                              path, c.n_embd, c.n_layer, c.block_size, c.vocab_size, padded_vocab, kMaxWidth,
                              kMaxLayers, kMaxPositions, kMaxVocab);
  }
  return Status::ok();
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The number of blocks "h.0.", "h.1.", ... a file has tensors of (names under `prefix`).
int count_blocks(const SafetensorsShards& f, const std::string& prefix) {
  int n = 0;
  while (f.find(fmt::format("{}h.{}.ln_1.weight", prefix, n)) != nullptr) ++n;
  return n;
}

// A safetensors file, ours, or Hugging Face's (names under `prefix_`) in one file or in shards with their index.
class SafetensorsWeights final : public WeightsFile {
 public:
  static Result<std::unique_ptr<WeightsFile>> open(const std::string& path, SafetensorsShards file) {
    std::string prefix;
    WeightsFormat format = WeightsFormat::kStrata;
    if (file.find("wte") == nullptr) {
      format = WeightsFormat::kHuggingFace;
      if (file.find("wte.weight") != nullptr) {
        prefix = "";
      } else if (file.find("transformer.wte.weight") != nullptr) {
        prefix = "transformer.";
      } else {
        std::vector<std::string> names = file.names();
        std::string some;
        for (size_t i = 0; i < names.size() && i < 4; ++i) some += (i ? ", " : "") + names[i];
        return Status::invalid_argument(
            "{}: not a GPT-2's weights: no token embedding ('wte' as Strata writes it, 'wte.weight' or "
            "'transformer.wte.weight' as Hugging Face does) among its {} tensors ({}{})",
            path, names.size(), some, names.size() > 4 ? ", ..." : "");
      }
    }
    std::unique_ptr<SafetensorsWeights> w(new SafetensorsWeights(format, path, std::move(file), prefix));
    STRATA_RETURN_IF_ERROR(w->infer_config());
    return std::unique_ptr<WeightsFile>(std::move(w));
  }

  Status check(const GPT2Config& want) const override {
    STRATA_RETURN_IF_ERROR(check_sizes(want));
    std::set<std::string> expected;
    for (const UnitSpec& unit : gpt2_unit_specs(want)) {
      for (const TensorSpec& s : unit.layout.specs()) {
        const std::string name = file_name(s.name);
        const SafetensorsEntry* e = file_.find(name);
        if (e == nullptr) return Status::invalid_argument("{}: no tensor '{}' (of unit {})", path_, name, unit.name);
        if (e->shape != file_shape(s)) {
          return Status::invalid_argument("{}: tensor '{}' is {}, a GPT-2 of this config needs {}", path_, name,
                                          shape_text(e->shape), shape_text(file_shape(s)));
        }
        expected.insert(name);
      }
    }
    if (format_ != WeightsFormat::kHuggingFace) return Status::ok();  // ours: other tensors are not weights
    std::vector<std::string> unknown;
    for (const SafetensorsEntry* t : file_.tensors()) {
      const SafetensorsEntry& e = *t;
      if (expected.count(e.name) != 0) continue;
      const std::string_view n(e.name);
      if (n.starts_with(prefix_ + "h.") && (n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias")))
        continue;  // the causal mask, a buffer
      if (e.name == "lm_head.weight") {
        STRATA_RETURN_IF_ERROR(check_tied_head(e));
        continue;
      }
      unknown.push_back(e.name);
    }
    if (!unknown.empty()) {
      std::string some;
      for (size_t i = 0; i < unknown.size() && i < 5; ++i) some += (i ? ", " : "") + unknown[i];
      return Status::invalid_argument("{}: {} tensor(s) that a GPT-2 does not have: {}{}", path_, unknown.size(), some,
                                      unknown.size() > 5 ? ", ..." : "");
    }
    return Status::ok();
  }

  bool checksummed() const override { return file_.checksummed(); }

 protected:
  Status read_stored(const TensorSpec& spec, size_t offset, size_t n, float* dst) const override {
    STRATA_ASSIGN_OR_RETURN(const SafetensorsEntry* e, entry(spec));
    STRATA_RETURN_IF_ERROR(check_range(spec, offset, n));
    const size_t esize = dtype_size(e->dtype);
    if (format_ != WeightsFormat::kHuggingFace || !hf_transposed(spec.name)) {
      STRATA_RETURN_IF_ERROR(file_.verify(*e, offset * esize, (offset + n) * esize));
      to_f32_n(e->dtype, e->data + offset * esize, dst, n);
      release_mapped_pages(e->data + offset * esize, n * esize);  // read once: need not stay resident
      return Status::ok();
    }
    STRATA_RETURN_IF_ERROR(file_.verify(*e, 0, e->nbytes()));  // a transposed range touches all of it
    if (offset == 0 && n == spec.numel()) {  // the whole tensor: transposed in cache-sized tiles
      std::vector<float> stored(n);
      to_f32_n(e->dtype, e->data, stored.data(), n);
      transpose(stored.data(), dst, static_cast<size_t>(spec.shape[0]), static_cast<size_t>(spec.shape[1]));
      release_mapped_pages(e->data, e->nbytes());
      return Status::ok();
    }
    // Rows [r0, r1) of ours are columns of the file's (cols, rows): read column by column of ours, each a
    // contiguous run of the file's row c.
    const size_t rows = static_cast<size_t>(spec.shape[0]), cols = static_cast<size_t>(spec.shape[1]);
    const size_t r0 = offset / cols, r1 = (offset + n + cols - 1) / cols;
    std::vector<float> run(r1 - r0);
    for (size_t c = 0; c < cols; ++c) {
      const std::byte* src = e->data + (c * rows + r0) * esize;
      to_f32_n(e->dtype, src, run.data(), run.size());
      release_mapped_pages(src, run.size() * esize);  // a neighbour's page comes back from the page cache
      for (size_t r = r0; r < r1; ++r) {
        const size_t at = r * cols + c;
        if (at >= offset && at < offset + n) dst[at - offset] = run[r - r0];
      }
    }
    return Status::ok();
  }

 private:
  SafetensorsWeights(WeightsFormat format, std::string path, SafetensorsShards file, std::string prefix)
      : WeightsFile(format, std::move(path)), file_(std::move(file)), prefix_(std::move(prefix)) {}

  std::string file_name(const std::string& ours) const {
    return format_ == WeightsFormat::kHuggingFace ? prefix_ + hf_name(ours) : ours;
  }
  // The file's tensor for ours, with the shape `spec` wants.
  Result<const SafetensorsEntry*> entry(const TensorSpec& spec) const {
    const std::string name = file_name(spec.name);
    const SafetensorsEntry* e = file_.find(name);
    if (e == nullptr) return Status::not_found("{}: no tensor '{}'", path_, name);
    if (e->shape != file_shape(spec)) {
      return Status::invalid_argument("{}: tensor '{}' is {}, wanted {}", path_, name, shape_text(e->shape),
                                      shape_text(file_shape(spec)));
    }
    return e;
  }
  std::vector<int64_t> file_shape(const TensorSpec& s) const {
    return format_ == WeightsFormat::kHuggingFace ? hf_shape(s) : s.shape;
  }

  // From the shapes, and what the metadata (ours) or a config.json beside the file (Hugging Face's) says.
  Status infer_config() {
    const SafetensorsEntry* wte = file_.find(file_name("wte"));
    const SafetensorsEntry* wpe = file_.find(file_name("wpe"));
    if (wte->shape.size() != 2 || wpe == nullptr || wpe->shape.size() != 2) {
      return Status::invalid_argument("{}: '{}' is {} and '{}' {}: a GPT-2's embeddings are (vocabulary, width) and "
                                      "(positions, width)",
                                      path_, file_name("wte"), shape_text(wte->shape), file_name("wpe"),
                                      wpe ? shape_text(wpe->shape) : "missing");
    }
    if (wte->shape[0] > kMaxVocab || wte->shape[1] > kMaxWidth || wpe->shape[0] > kMaxPositions) {
      return Status::corruption("{}: embeddings {} and {}: past what Strata reads (vocabulary {}, width {}, {} "
                                "positions)",
                                path_, shape_text(wte->shape), shape_text(wpe->shape), kMaxVocab, kMaxWidth,
                                kMaxPositions);
    }
    config_.vocab_size = static_cast<int>(wte->shape[0]);
    config_.n_embd = static_cast<int>(wte->shape[1]);
    config_.block_size = static_cast<int>(wpe->shape[0]);
    config_.n_layer = count_blocks(file_, prefix_);
    config_.n_head = 0;
    if (format_ == WeightsFormat::kStrata) {
      // The metadata names the config (gpt2_metadata); each size it gives must be a number, and the shapes'.
      const auto& md = file_.files().front().metadata();  // ours is one file
      const std::pair<const char*, int*> sizes[] = {{"n_layer", &config_.n_layer},   {"n_embd", &config_.n_embd},
                                                    {"vocab_size", &config_.vocab_size},
                                                    {"block_size", &config_.block_size}, {"n_head", &config_.n_head}};
      for (const auto& [key, have] : sizes) {
        auto it = md.find(key);
        if (it == md.end()) continue;
        int v = 0;
        const auto [p, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), v);
        if (ec != std::errc() || p != it->second.data() + it->second.size() || v <= 0) {
          return Status::corruption("{}: __metadata__ {} is '{:.40}', not a positive integer", path_, key, it->second);
        }
        if (std::string_view(key) == "n_head") {
          if (config_.n_embd % v != 0)
            return Status::corruption("{}: __metadata__ n_head {} does not divide the width {}", path_, v,
                                      config_.n_embd);
          config_.n_head = v;
        } else if (v != *have) {
          return Status::corruption("{}: __metadata__ says {} {}, but its tensors hold {}: the file contradicts itself",
                                    path_, key, v, *have);
        }
      }
      return Status::ok();
    }
    const fs::path beside = fs::path(path_).parent_path() / "config.json";
    std::error_code ec;
    if (!fs::exists(beside, ec)) return Status::ok();
    STRATA_ASSIGN_OR_RETURN(const std::string text, read_whole_file(beside.string()));
    STRATA_ASSIGN_OR_RETURN(const nlohmann::json j, parse_json(text, beside.string()));
    if (!j.is_object())
      return Status::invalid_argument("{}: not a JSON object (the model's config beside {})", beside.string(), path_);
    auto field = [&](const char* key, int have) -> Status {
      auto it = j.find(key);
      if (it == j.end() || !it->is_number_integer()) return Status::ok();
      if (have != 0 && it->get<int64_t>() != have) {
        return Status::invalid_argument("{} says {} = {}, but {} holds {}: they are not the same model",
                                        beside.string(), key, json_excerpt(*it), path_, have);
      }
      return Status::ok();
    };
    STRATA_RETURN_IF_ERROR(field("n_layer", config_.n_layer));
    STRATA_RETURN_IF_ERROR(field("n_embd", config_.n_embd));
    STRATA_RETURN_IF_ERROR(field("vocab_size", config_.vocab_size));
    STRATA_RETURN_IF_ERROR(field("n_positions", config_.block_size));
    if (auto it = j.find("n_head"); it != j.end() && it->is_number_integer()) {
      if (it->get<int64_t>() <= 0 || it->get<int64_t>() > config_.n_embd)
        return Status::invalid_argument("{}: n_head = {} does not divide a width of {}", beside.string(),
                                        json_excerpt(*it), config_.n_embd);
      config_.n_head = it->get<int>();
    }
    return Status::ok();
  }

  // Hugging Face files from save_pretrained may keep the tied head; Strata's is wte itself.
  Status check_tied_head(const SafetensorsEntry& head) const {
    const SafetensorsEntry* wte = file_.find(file_name("wte"));
    STRATA_RETURN_IF_ERROR(file_.verify(head, 0, head.nbytes()));
    STRATA_RETURN_IF_ERROR(file_.verify(*wte, 0, wte->nbytes()));
    const bool same = head.shape == wte->shape && head.dtype == wte->dtype && head.nbytes() == wte->nbytes() &&
                      std::memcmp(head.data, wte->data, head.nbytes()) == 0;
    release_mapped_pages(head.data, head.nbytes());
    release_mapped_pages(wte->data, wte->nbytes());
    if (same) return Status::ok();
    return Status::invalid_argument(
        "{}: 'lm_head.weight' differs from '{}': an untied LM head, which Strata's GPT-2 (its head is the token "
        "embedding) cannot hold",
        path_, file_name("wte"));
  }

  SafetensorsShards file_;
  std::string prefix_;
};

// Elements of each of llm.c's tensors (all blocks together) for a model of `c` with Vp vocabulary rows.
std::array<size_t, 16> llmc_sizes(const GPT2Config& c, size_t Vp) {
  const size_t C = static_cast<size_t>(c.n_embd), L = static_cast<size_t>(c.n_layer);
  const size_t maxT = static_cast<size_t>(c.block_size);
  return {Vp * C,     maxT * C,     L * C, L * C,     L * 3 * C * C, L * 3 * C, L * C * C, L * C,
          L * C,      L * C,        L * 4 * C * C,    L * 4 * C,     L * C * 4 * C,       L * C, C, C};
}

// Which of llm.c's tensors holds ours, and which block (0 for the others).
Result<std::pair<size_t, size_t>> llmc_place(const std::string& ours) {
  std::string_view rest(ours);
  size_t block = 0;
  if (rest.starts_with("h.")) {
    rest.remove_prefix(2);
    const auto [p, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), block);
    if (ec != std::errc() || p == rest.data() + rest.size() || *p != '.')
      return Status::internal("'{}' is not a block tensor's name", ours);
    rest.remove_prefix(static_cast<size_t>(p - rest.data()) + 1);
  }
  for (size_t i = 0; i < kLlmcTensors.size(); ++i) {
    if (kLlmcTensors[i] == rest && llmc_per_block(i) == ours.starts_with("h.")) return std::pair{i, block};
  }
  return Status::internal("'{}' has no place in llm.c's layout", ours);
}

class LlmcWeights final : public WeightsFile {
 public:
  LlmcWeights(const LlmcWeights&) = delete;  // owns the mapping
  LlmcWeights& operator=(const LlmcWeights&) = delete;
  ~LlmcWeights() override {
    if (map_ != nullptr) ::munmap(map_, bytes_);
  }

  static Result<std::unique_ptr<WeightsFile>> open(const std::string& path, int fd, size_t bytes) {
    std::unique_ptr<LlmcWeights> w(new LlmcWeights(path));
    int32_t h[kLlmcHeaderInts];
    if (bytes < sizeof(h)) {
      return Status::corruption("{}: {} bytes, shorter than llm.c's {}-byte header", path, bytes, sizeof(h));
    }
    if (::pread(fd, h, sizeof(h), 0) != static_cast<ssize_t>(sizeof(h)))
      return Status::io_error("{}: cannot read the header: {}", path, std::strerror(errno));
    if (h[1] != kLlmcF32 && h[1] != kLlmcBf16) {
      return Status::invalid_argument("{}: llm.c model file version {}: Strata reads versions {} (fp32) and {} (bf16)",
                                      path, h[1], kLlmcF32, kLlmcBf16);
    }
    w->bf16_ = h[1] == kLlmcBf16;
    w->config_ = GPT2Config{.n_layer = h[4], .n_head = h[5], .n_embd = h[6], .vocab_size = h[3], .block_size = h[2]};
    const int32_t Vp = h[7];
    if (h[2] <= 0 || h[3] <= 0 || h[4] <= 0 || h[5] <= 0 || h[6] <= 0 || Vp < h[3]) {
      return Status::corruption(
          "{}: header: max_seq_len {}, vocab_size {}, num_layers {}, num_heads {}, channels {}, padded_vocab_size "
          "{}: each must be positive and the padded vocabulary at least the vocabulary",
          path, h[2], h[3], h[4], h[5], h[6], Vp);
    }
    STRATA_RETURN_IF_ERROR(check_claimed(path, w->config_, Vp));
    w->padded_vocab_ = static_cast<size_t>(Vp);
    size_t total = 0;
    const std::array<size_t, 16> sizes = llmc_sizes(w->config_, w->padded_vocab_);
    for (size_t i = 0; i < sizes.size(); ++i) {
      w->offset_[i] = total;
      total += sizes[i];
    }
    const size_t want = sizeof(h) + total * w->element_bytes();
    if (bytes != want) {
      return Status::corruption("{}: {} bytes, but the model its header describes takes {} ({} parameters in {})",
                                path, bytes, want, total, w->bf16_ ? "bf16" : "fp32");
    }
    void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) return Status::io_error("{}: cannot map: {}", path, std::strerror(errno));
    w->map_ = p;
    w->bytes_ = bytes;
    return std::unique_ptr<WeightsFile>(std::move(w));
  }

  Status check(const GPT2Config& want) const override { return check_sizes(want); }
  bool checksummed() const override { return false; }

 protected:
  Status read_stored(const TensorSpec& spec, size_t offset, size_t n, float* dst) const override {
    STRATA_ASSIGN_OR_RETURN(auto place, llmc_place(spec.name));
    const auto [i, block] = place;
    const std::array<size_t, 16> sizes = llmc_sizes(config_, padded_vocab_);
    const size_t per = llmc_per_block(i) ? sizes[i] / static_cast<size_t>(config_.n_layer) : sizes[i];
    if (block >= static_cast<size_t>(config_.n_layer) || spec.numel() > per) {  // wte: the first V of Vp rows
      return Status::invalid_argument("{}: tensor '{}' ({} values) is not in this llm.c model", path_, spec.name,
                                      spec.numel());
    }
    STRATA_RETURN_IF_ERROR(check_range(spec, offset, n));
    const std::byte* src = static_cast<const std::byte*>(map_) + kLlmcHeaderInts * sizeof(int32_t) +
                           (offset_[i] + block * per + offset) * element_bytes();
    to_f32_n(bf16_ ? DType::kBF16 : DType::kF32, src, dst, n);
    release_mapped_pages(src, n * element_bytes());  // read once: the file need not stay in the resident set
    return Status::ok();
  }

 private:
  explicit LlmcWeights(std::string path) : WeightsFile(WeightsFormat::kLlmc, std::move(path)) {}
  size_t element_bytes() const { return bf16_ ? 2 : 4; }

  void* map_ = nullptr;
  size_t bytes_ = 0;
  bool bf16_ = false;
  size_t padded_vocab_ = 0;
  std::array<size_t, 16> offset_{};  // elements from the end of the header
};

}  // namespace

const char* weights_format_name(WeightsFormat f) {
  switch (f) {
    case WeightsFormat::kStrata: return "strata";
    case WeightsFormat::kHuggingFace: return "hf";
    case WeightsFormat::kLlmc: return "llmc";
  }
  return "?";
}

Result<WeightsFormat> parse_weights_format(const std::string& name) {
  for (WeightsFormat f : {WeightsFormat::kStrata, WeightsFormat::kHuggingFace, WeightsFormat::kLlmc})
    if (name == weights_format_name(f)) return f;
  return Status::invalid_argument("weights format '{}': one of strata, hf (Hugging Face transformers), llmc (llm.c)",
                                  name);
}

// The file at `path` in whichever format its content says.
static Result<std::unique_ptr<WeightsFile>> open_any(const std::string& path);

Result<std::unique_ptr<WeightsFile>> WeightsFile::open(const std::string& path, const WeightsOpenOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<WeightsFile> w, open_any(path));
  w->allow_non_finite_ = options.allow_non_finite;
  return w;
}

Status WeightsFile::read_range(const TensorSpec& spec, size_t offset, size_t n, float* dst) const {
  STRATA_RETURN_IF_ERROR(read_stored(spec, offset, n, dst));
  if (checksummed() || allow_non_finite_) return Status::ok();
  const size_t i = first_non_finite(dst, n);
  if (i == n) return Status::ok();
  return Status::corruption("{}: tensor '{}' element {} is {}: the file holds non-finite weights, which train to NaN "
                            "(it has no checksums to tell damage from what its writer meant; "
                            "--allow-non-finite, or training.init_from_allow_non_finite, loads them anyway)",
                            path_, spec.name, offset + i, dst[i]);
}

static Result<std::unique_ptr<WeightsFile>> open_any(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::not_found("{}: no such file", path);
    return Status::io_error("{}: cannot open: {}", path, std::strerror(errno));
  }
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    const Status st_error = Status::io_error("{}: fstat failed: {}", path, std::strerror(errno));
    ::close(fd);
    return st_error;
  }
  int32_t start[2] = {};
  const bool magic = ::pread(fd, start, sizeof(start), 0) == sizeof(start) && start[0] == kLlmcMagic;
  if (magic) {
    auto out = LlmcWeights::open(path, fd, static_cast<size_t>(st.st_size));
    ::close(fd);  // the mapping stays
    // The same 4 bytes could begin a safetensors file (its header's length): an llm.c file of no version we
    // read is taken for one if it opens as one.
    if (out.is_ok() || (start[1] == kLlmcF32 || start[1] == kLlmcBf16)) return out;
    auto file = SafetensorsShards::open(path);
    if (!file.is_ok()) return out;
    return SafetensorsWeights::open(path, std::move(file).value());
  }
  ::close(fd);
  auto file = SafetensorsShards::open(path);  // one file, or an index of shards
  if (!file.is_ok()) {
    return file.status().with_context(
        "not an llm.c model file (no magic number 20240326 at its start), nor a readable safetensors file");
  }
  return SafetensorsWeights::open(path, std::move(file).value());
}

Status WeightsFile::check_range(const TensorSpec& spec, size_t offset, size_t n) const {
  if (offset <= spec.numel() && n <= spec.numel() - offset) return Status::ok();
  return Status::invalid_argument("{}: elements [{}, {}) of tensor '{}', which has {}", path_, offset, offset + n,
                                  spec.name, spec.numel());
}

Status WeightsFile::check_sizes(const GPT2Config& want) const {
  struct Field {
    const char* key;
    int want, have;
  };
  const Field fields[] = {{"n_layer", want.n_layer, config_.n_layer},
                          {"n_head", want.n_head, config_.n_head},
                          {"n_embd", want.n_embd, config_.n_embd},
                          {"vocab_size", want.vocab_size, config_.vocab_size},
                          {"block_size", want.block_size, config_.block_size}};
  std::string differ;
  bool positions = false;
  for (const Field& f : fields) {
    if (f.have == 0 || f.have == f.want) continue;  // 0: the file does not say
    differ += fmt::format("{}model.{} is {}, the file's {}", differ.empty() ? "" : "; ", f.key, f.want, f.have);
    positions = positions || std::string_view(f.key) == "block_size";
  }
  if (differ.empty()) {
    if (config_.n_head == 0) {
      STRATA_LOG_WARN("{} does not say how many attention heads its model has (a config.json beside it would): "
                      "taking model.n_head = {}; with another count the weights mean another model",
                      path_, want.n_head);
    }
    return Status::ok();
  }
  return Status::invalid_argument("{} ({} weights) holds another model: {}. Set the model section to the file's "
                                  "values{}",
                                  path_, weights_format_name(format_), differ,
                                  positions ? " (training.seq_len may stay below model.block_size)" : "");
}

Result<std::string> weights_path(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return path;
  const std::string file = (fs::path(path) / "model.safetensors").string();
  if (fs::exists(file, ec)) return file;
  const std::string index = (fs::path(path) / "model.safetensors.index.json").string();
  if (fs::exists(index, ec)) return index;  // save_pretrained's shards
  return Status::not_found("{} holds no model.safetensors (a checkpoint's step folder does) nor a "
                           "model.safetensors.index.json of shards",
                           path);
}

}  // namespace strata::engine
