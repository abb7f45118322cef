// The weights of a family whose files name the tensors as its units do (foreign_weights.h open_named_weights):
// Strata's model.safetensors and a Hugging Face checkpoint, one file or sharded, read one tensor range at a time.
#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/dtype.h"
#include "engine/checkpoint/foreign_weights.h"
#include "storage/safetensors_shards.h"

namespace strata::engine {
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

}  // namespace strata::engine
