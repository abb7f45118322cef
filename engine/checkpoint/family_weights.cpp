// The weights of a family whose files name the tensors as its units do (foreign_weights.h open_named_weights):
// Strata's model.safetensors and a Hugging Face checkpoint, one file or sharded, read one tensor range at a time.
#include <algorithm>
#include <filesystem>
#include <memory>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "common/dtype.h"
#include "engine/checkpoint/foreign_weights.h"
#include "engine/model/llama/llama.h"
#include "kernels/cpu/cpu_kernels.h"
#include "storage/safetensors.h"
#include "storage/safetensors_shards.h"
#include "storage/token_shard.h"

namespace strata::engine {

namespace fs = std::filesystem;

namespace {

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

class NamedWeights final : public WeightsFile {
 public:
  NamedWeights(WeightsFormat format, std::string path, SafetensorsShards file, const WeightsOpenOptions& options)
      : WeightsFile(format, std::move(path)), file_(std::move(file)) {
    allow_non_finite_ = options.allow_non_finite;
  }

  Status check(const GPT2Config&) const override {
    return Status::invalid_argument("{}: the weights of a {} model, not a GPT-2's", path_, family_);
  }
  bool checksummed() const override { return file_.checksummed(); }

  // open_named_weights's checks.
  Status check_model(const Model& want) {
    const std::map<std::string, std::string> md = want.metadata();
    family_ = md.at("format");
    STRATA_RETURN_IF_ERROR(check_metadata(md));
    std::set<std::string> expected;
    const SafetensorsEntry* embedding = nullptr;
    for (size_t u = 0; u < want.units().size(); ++u) {
      for (const TensorSpec& s : want.whole_layout(u).specs()) {
        const SafetensorsEntry* e = file_.find(s.name);
        if (e == nullptr)
          return Status::invalid_argument("{}: no tensor '{}' (of unit {})", path_, s.name, want.units()[u].name);
        if (e->shape != s.shape) {
          return Status::invalid_argument("{}: tensor '{}' is {}, this model section's needs {}", path_, s.name,
                                          shape_text(e->shape), shape_text(s.shape));
        }
        expected.insert(s.name);
        if (want.units()[u].ties_head && embedding == nullptr) embedding = e;
      }
    }
    std::vector<std::string> unknown;
    for (const SafetensorsEntry* e : file_.tensors()) {
      if (expected.count(e->name) != 0) continue;
      if (e->name == "lm_head.weight" && embedding != nullptr) {  // save_pretrained may keep a tied head
        STRATA_RETURN_IF_ERROR(check_tied_head(*e, *embedding));
        continue;
      }
      unknown.push_back(e->name);
    }
    if (!unknown.empty()) {
      unknown.resize(std::min<size_t>(unknown.size(), 5));
      return Status::invalid_argument("{}: tensor(s) this model section's model does not have: {}{}", path_,
                                      fmt::join(unknown, ", "), file_.tensors().size() - expected.size() > 5 ? ", ..." : "");
    }
    return Status::ok();
  }

 protected:
  Status read_stored(const TensorSpec& spec, size_t offset, size_t n, float* dst) const override {
    const SafetensorsEntry* e = file_.find(spec.name);
    if (e == nullptr) return Status::not_found("{}: no tensor '{}'", path_, spec.name);
    if (e->shape != spec.shape) {
      return Status::invalid_argument("{}: tensor '{}' is {}, wanted {}", path_, spec.name, shape_text(e->shape),
                                      shape_text(spec.shape));
    }
    STRATA_RETURN_IF_ERROR(check_range(spec, offset, n));
    const size_t esize = dtype_size(e->dtype);
    STRATA_RETURN_IF_ERROR(file_.verify(*e, offset * esize, (offset + n) * esize));
    to_f32_n(e->dtype, e->data + offset * esize, dst, n);
    release_mapped_pages(e->data + offset * esize, n * esize);  // read once: need not stay resident
    return Status::ok();
  }

 private:
  // A Strata file's metadata names the model section it was saved from: each key must be the model's.
  Status check_metadata(const std::map<std::string, std::string>& want) const {
    const std::map<std::string, std::string>& have = file_.files().front().metadata();
    auto format = have.find("format");
    if (format == have.end() || !format->second.starts_with("strata-")) return Status::ok();  // not ours
    if (format->second != want.at("format")) {
      return Status::invalid_argument("{} holds a {} model, not a {} one (model.family)", path_,
                                      format->second.substr(7), want.at("format").substr(7));
    }
    for (const auto& [key, value] : want) {
      auto it = have.find(key);
      if (it != have.end() && it->second != value) {
        return Status::invalid_argument("{} holds another model: model.{} is {}, the file's {}. Set the model section "
                                        "to the file's values",
                                        path_, key, value, it->second);
      }
      if (it == have.end())
        return Status::invalid_argument("{}: its metadata does not say model.{} (this model's is {})", path_, key, value);
    }
    return Status::ok();
  }

  // Elementwise equal to the embedding, in pieces (a vocabulary-sized matrix need not be held twice).
  Status check_tied_head(const SafetensorsEntry& head, const SafetensorsEntry& embedding) const {
    if (head.shape != embedding.shape) {
      return Status::invalid_argument("{}: 'lm_head.weight' is {}, the embedding {}: an untied head, which a model "
                                      "with tie_word_embeddings cannot hold",
                                      path_, shape_text(head.shape), shape_text(embedding.shape));
    }
    const size_t numel = static_cast<size_t>(head.numel()), piece = size_t{1} << 20;
    std::vector<float> a(std::min(numel, piece)), b(a.size());
    for (size_t at = 0; at < numel; at += piece) {
      const size_t n = std::min(piece, numel - at);
      for (auto [e, dst] : {std::pair{&head, a.data()}, std::pair{&embedding, b.data()}}) {
        const size_t esize = dtype_size(e->dtype);
        STRATA_RETURN_IF_ERROR(file_.verify(*e, at * esize, (at + n) * esize));
        to_f32_n(e->dtype, e->data + at * esize, dst, n);
        release_mapped_pages(e->data + at * esize, n * esize);
      }
      if (std::memcmp(a.data(), b.data(), n * sizeof(float)) != 0) {
        return Status::invalid_argument("{}: 'lm_head.weight' differs from the embedding: an untied head, which a "
                                        "model with tie_word_embeddings cannot hold (set it false)",
                                        path_);
      }
    }
    return Status::ok();
  }

  SafetensorsShards file_;
  std::string family_;
};

}  // namespace

Result<std::unique_ptr<WeightsFile>> open_named_weights(const std::string& path, const Model& want,
                                                        const WeightsOpenOptions& options) {
  STRATA_ASSIGN_OR_RETURN(SafetensorsShards file, SafetensorsShards::open(path));
  const auto& md = file.files().front().metadata();
  const auto format = md.find("format");
  const bool ours = format != md.end() && format->second.starts_with("strata-");
  auto w = std::make_unique<NamedWeights>(ours ? WeightsFormat::kStrata : WeightsFormat::kHuggingFace, path,
                                          std::move(file), options);
  STRATA_RETURN_IF_ERROR(w->check_model(want));
  return std::unique_ptr<WeightsFile>(std::move(w));
}

std::string family_of_weights(const std::string& path) {
  auto file = SafetensorsShards::open(path);
  if (!file.is_ok()) return "";
  const auto& md = file->files().front().metadata();
  auto format = md.find("format");
  return format != md.end() && format->second == "strata-llama" ? "llama" : "";
}

namespace {

// The tensors of `model` read from `src`, stored as `dtype`, in the units' order.
std::vector<SafetensorsTensor> tensors_of(const Model& model, const WeightsFile& src, DType dtype) {
  std::vector<SafetensorsTensor> tensors;
  for (size_t u = 0; u < model.units().size(); ++u) {
    for (const TensorSpec& s : model.whole_layout(u).specs()) {
      SafetensorsTensor t{s.name, dtype, s.shape, nullptr, {}};
      t.fill = [&src, s, dtype](void* dst) -> Status {
        std::vector<float> v(s.numel());
        STRATA_RETURN_IF_ERROR(src.read(s, v.data()));
        from_f32_n(dtype, v.data(), dst, v.size());
        return Status::ok();
      };
      tensors.push_back(std::move(t));
    }
  }
  return tensors;
}

// save_pretrained's layout in `out`: one model.safetensors, or shards of at most max_shard_bytes with their index.
Status write_hf_shards(std::vector<SafetensorsTensor> tensors, const std::string& out, uint64_t max_shard_bytes) {
  std::vector<std::vector<SafetensorsTensor>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (SafetensorsTensor& t : tensors) {
    uint64_t bytes = dtype_size(t.dtype);
    for (int64_t d : t.shape) bytes *= static_cast<uint64_t>(d);
    if (in_shard > 0 && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    in_shard += bytes;
    total += bytes;
    shards.back().push_back(std::move(t));
  }
  const size_t n = shards.size();
  const fs::path dir(out);
  std::set<std::string> written;
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", nlohmann::json::object()}};
  for (size_t i = 0; i < n; ++i) {
    const std::string name = n == 1 ? "model.safetensors" : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
    for (const SafetensorsTensor& t : shards[i]) index["weight_map"][t.name] = name;
    STRATA_RETURN_IF_ERROR(write_safetensors((dir / name).string(), shards[i], {{"format", "pt"}}));
    written.insert(name);
  }
  if (n > 1) {
    STRATA_RETURN_IF_ERROR(write_text_atomic((dir / "model.safetensors.index.json").string(), index.dump(2) + "\n"));
    written.insert("model.safetensors.index.json");
  }
  // An earlier export's files that this one replaces: left, they would make the folder read as that model.
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string f = e.path().filename().string();
    const bool ours = f == "model.safetensors" || f == "model.safetensors.index.json" ||
                      (f.starts_with("model-") && f.ends_with(".safetensors") && f.find("-of-") != std::string::npos);
    if (ours && written.count(f) == 0) fs::remove(e.path(), ec);
  }
  return Status::ok();
}

}  // namespace

Status export_family_weights(const std::string& from, WeightsFormat format, const std::string& out, DType dtype,
                             const WeightsOpenOptions& options, uint64_t max_shard_bytes) {
  if (format == WeightsFormat::kLlmc)
    return Status::invalid_argument("{} holds a Llama-family model; llm.c's files hold GPT-2s", from);
  STRATA_ASSIGN_OR_RETURN(SafetensorsShards file, SafetensorsShards::open(from));
  STRATA_ASSIGN_OR_RETURN(const LlamaConfig config,
                          llama_config_from_metadata(file.files().front().metadata(), from));
  // The model's shape only (offloaded: nothing allocated for its units), to read and check the file by.
  std::unique_ptr<kernels::Device> device = kernels::make_cpu_device(kernels::cpu_fast_kernels());
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Llama> model,
                          Llama::create(config, *device, kernels::MatmulPrecision::kF32, /*offloaded=*/true));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<WeightsFile> src, open_named_weights(from, *model, options));
  std::vector<SafetensorsTensor> tensors = tensors_of(*model, *src, dtype);
  if (format == WeightsFormat::kStrata) return write_safetensors(out, tensors, model->metadata());
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) return Status::io_error("{}: cannot create the folder: {}", out, ec.message());
  STRATA_RETURN_IF_ERROR(write_hf_shards(std::move(tensors), out, max_shard_bytes));
  const char* torch_dtype = dtype == DType::kBF16 ? "bfloat16" : "float32";
  return write_text_atomic((fs::path(out) / "config.json").string(),
                           hf_llama_config_json(config, torch_dtype).dump(2) + "\n");
}

}  // namespace strata::engine
