#include "engine/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "storage/safetensors.h"
#include "storage/token_shard.h"

namespace strata::engine {

namespace fs = std::filesystem;

namespace {

Status write_text_atomic(const std::string& path, const std::string& text) {
  std::span<const std::byte> part(reinterpret_cast<const std::byte*>(text.data()), text.size());
  return write_file_atomic(path, std::span<const std::span<const std::byte>>(&part, 1));
}

std::map<std::string, std::string> model_metadata(const GPT2Config& c) {
  return {{"format", "strata-gpt2"},
          {"n_layer", std::to_string(c.n_layer)},
          {"n_head", std::to_string(c.n_head)},
          {"n_embd", std::to_string(c.n_embd)},
          {"vocab_size", std::to_string(c.vocab_size)},
          {"block_size", std::to_string(c.block_size)}};
}

// Every tensor of every unit, reading from `base(unit_index)`, named `prefix + spec.name`.
template <typename BaseFn>
std::vector<SafetensorsTensor> tensors_of(const GPT2& model, const std::string& prefix, BaseFn base) {
  std::vector<SafetensorsTensor> out;
  for (size_t i = 0; i < model.units().size(); ++i) {
    const Unit& u = model.units()[i];
    for (const TensorSpec& s : u.layout.specs())
      out.push_back(SafetensorsTensor{prefix + s.name, DType::kF32, s.shape, base(i) + s.offset});
  }
  return out;
}

template <typename BaseFn>
Status read_tensors(const SafetensorsFile& f, const GPT2& model, const std::string& prefix, BaseFn base) {
  for (size_t i = 0; i < model.units().size(); ++i) {
    const Unit& u = model.units()[i];
    for (const TensorSpec& s : u.layout.specs()) {
      STRATA_ASSIGN_OR_RETURN(auto bytes, f.expect(prefix + s.name, DType::kF32, s.shape));
      std::memcpy(base(i) + s.offset, bytes.data(), bytes.size());
    }
  }
  return Status::ok();
}

// Host copies of one state of every unit, in the units' layouts.
using HostUnits = std::vector<std::vector<float>>;

HostUnits host_units(const GPT2& model) {
  HostUnits out;
  for (const Unit& u : model.units()) out.emplace_back(u.numel());
  return out;
}

auto base_of(HostUnits& h) {
  return [&h](size_t i) { return h[i].data(); };
}

Status check_model_metadata(const SafetensorsFile& f, const GPT2Config& c) {
  const auto& md = f.metadata();
  for (const auto& [key, want] : model_metadata(c)) {
    if (key == "format") continue;
    auto it = md.find(key);
    if (it == md.end()) continue;  // foreign files may lack metadata; shapes are still checked per tensor
    if (it->second != want) {
      return Status::invalid_argument("{} was saved from a model with model.{} = {}, but this run has {}", f.path(),
                                      key, it->second, want);
    }
  }
  return Status::ok();
}

}  // namespace

Status check_writable_dir(const std::string& dir, const std::string& what) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::io_error("{} {} cannot be created: {}", what, dir, ec.message());
  const std::string probe = (fs::path(dir) / fmt::format(".write_probe.{}", getpid())).string();
  {
    std::ofstream out(probe);
    if (!out || !(out << "probe") || !out.flush()) {
      return Status::io_error("{} {} is not writable: {}", what, dir, std::strerror(errno));
    }
  }
  fs::remove(probe, ec);
  return Status::ok();
}

Status save_model(const GPT2& model, const std::string& path) {
  HostUnits params = host_units(model);
  for (size_t i = 0; i < params.size(); ++i) STRATA_RETURN_IF_ERROR(model.read_params(i, params[i].data()));
  auto tensors = tensors_of(model, "", base_of(params));
  return write_safetensors(path, tensors, model_metadata(model.config()));
}

Status load_model(GPT2& model, const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open(path));
  STRATA_RETURN_IF_ERROR(check_model_metadata(f, model.config()));
  HostUnits params = host_units(model);
  STRATA_RETURN_IF_ERROR(read_tensors(f, model, "", base_of(params)));
  for (size_t i = 0; i < params.size(); ++i) STRATA_RETURN_IF_ERROR(model.write_params(i, params[i].data()));
  return Status::ok();
}

Result<std::string> save_checkpoint(const std::string& checkpoint_dir, const GPT2& model, Optimizer& opt,
                                    const TrainState& state, int keep) {
  const std::string name = fmt::format("step_{:06d}", state.step);
  const fs::path final_dir = fs::path(checkpoint_dir) / name;
  const fs::path tmp_dir = fs::path(checkpoint_dir) / (name + ".tmp");
  std::error_code ec;
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  if (ec) return Status::io_error("cannot create checkpoint folder {}: {}", tmp_dir.string(), ec.message());

  STRATA_RETURN_IF_ERROR(save_model(model, (tmp_dir / "model.safetensors").string()));
  HostUnits m = host_units(model), v = host_units(model);
  for (size_t i = 0; i < m.size(); ++i) STRATA_RETURN_IF_ERROR(opt.read_moments(i, m[i].data(), v[i].data()));
  std::vector<SafetensorsTensor> moments = tensors_of(model, "m.", base_of(m));
  for (auto& t : tensors_of(model, "v.", base_of(v))) moments.push_back(std::move(t));
  STRATA_RETURN_IF_ERROR(write_safetensors((tmp_dir / "optimizer.safetensors").string(), moments,
                                           {{"adam_steps", std::to_string(opt.steps_taken())}}));
  nlohmann::json js = {
      {"format", "strata-checkpoint"},
      {"version", 1},
      {"step", state.step},
      {"adam_steps", opt.steps_taken()},
      {"train_position",
       {{"shard", state.train_pos.shard}, {"offset", state.train_pos.offset}, {"epoch", state.train_pos.epoch}}},
      {"config", state.config},
  };
  STRATA_RETURN_IF_ERROR(write_text_atomic((tmp_dir / "state.json").string(), js.dump(2) + "\n"));

  fs::remove_all(final_dir, ec);  // a checkpoint of the same step from an earlier, resumed run
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) return Status::io_error("cannot rename {} to {}: {}", tmp_dir.string(), final_dir.string(), ec.message());
  STRATA_RETURN_IF_ERROR(write_text_atomic((fs::path(checkpoint_dir) / "latest").string(), name + "\n"));

  if (keep > 0) {
    std::vector<std::string> steps;
    for (const auto& e : fs::directory_iterator(checkpoint_dir, ec)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && n.starts_with("step_") && !n.ends_with(".tmp")) steps.push_back(n);
    }
    std::sort(steps.begin(), steps.end());
    for (size_t i = 0; i + keep < steps.size(); ++i) fs::remove_all(fs::path(checkpoint_dir) / steps[i], ec);
  }
  return final_dir.string();
}

Result<TrainState> load_checkpoint(const std::string& path, GPT2& model, Optimizer& opt) {
  fs::path dir(path);
  std::error_code ec;
  if (fs::exists(dir / "latest", ec)) {
    std::ifstream in(dir / "latest");
    std::string name;
    in >> name;
    if (name.empty()) return Status::corruption("{} is empty", (dir / "latest").string());
    dir /= name;
  }
  if (!fs::exists(dir / "state.json", ec)) {
    return Status::not_found("{} is not a checkpoint (no state.json, and no 'latest' file naming one)", path);
  }
  std::ifstream in(dir / "state.json");
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json js;
  try {
    js = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    return Status::corruption("{}: not valid JSON: {}", (dir / "state.json").string(), e.what());
  }
  TrainState st;
  try {
    st.step = js.at("step").get<int>();
    opt.set_steps_taken(js.at("adam_steps").get<int>());
    const auto& p = js.at("train_position");
    st.train_pos.shard = p.at("shard").get<size_t>();
    st.train_pos.offset = p.at("offset").get<size_t>();
    st.train_pos.epoch = p.at("epoch").get<uint64_t>();
    st.config = js.value("config", nlohmann::json::object());
  } catch (const nlohmann::json::exception& e) {
    return Status::corruption("{}: missing or malformed field: {}", (dir / "state.json").string(), e.what());
  }
  STRATA_RETURN_IF_ERROR(load_model(model, (dir / "model.safetensors").string()));
  STRATA_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open((dir / "optimizer.safetensors").string()));
  HostUnits m = host_units(model), v = host_units(model);
  STRATA_RETURN_IF_ERROR(read_tensors(f, model, "m.", base_of(m)));
  STRATA_RETURN_IF_ERROR(read_tensors(f, model, "v.", base_of(v)));
  // After the parameters: an offloaded optimizer takes its master weights from them.
  for (size_t i = 0; i < m.size(); ++i) STRATA_RETURN_IF_ERROR(opt.write_moments(i, m[i].data(), v[i].data()));
  return st;
}

}  // namespace strata::engine
