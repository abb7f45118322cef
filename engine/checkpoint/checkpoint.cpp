#include "engine/checkpoint/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "common/check.h"
#include "common/json_parse.h"
#include "common/log.h"
#include "engine/checkpoint/checkpoint_folder.h"
#include "engine/checkpoint/foreign_weights.h"
#include "storage/safetensors.h"
#include "storage/token_shard.h"

namespace strata::engine {

namespace fs = std::filesystem;

namespace {

// One state class of one unit at a time in host memory, read on demand: checkpoints of offloaded state never
// hold more than a unit's worth of it in RAM.
class UnitCache {
 public:
  using ReadFn = std::function<Status(size_t unit, float* m, float* v)>;  // v may be unused (null for params)
  UnitCache(const Model& model, ReadFn read, bool pair) : model_(model), read_(std::move(read)), pair_(pair) {}
  // The unit's first (or, with `second`, second) state from element `offset` to the unit's end, read if another
  // unit is cached.
  Result<std::span<const float>> get(size_t unit, bool second, size_t offset) {
    if (unit != cached_) {
      a_.resize(model_.whole_layout(unit).numel());
      if (pair_) b_.resize(a_.size());
      STRATA_RETURN_IF_ERROR(read_(unit, a_.data(), pair_ ? b_.data() : nullptr));
      cached_ = unit;
    }
    return std::span<const float>(second ? b_ : a_).subspan(offset);
  }

 private:
  const Model& model_;
  ReadFn read_;
  bool pair_;
  size_t cached_ = SIZE_MAX;
  std::vector<float> a_, b_;
};

// Adam's moments of unit u as whole tensors: under tensor parallelism this rank's slices, gathered over the
// group (collective); `m`, `v` hold the whole unit.
Status read_whole_moments(const Model& model, Optimizer& opt, size_t u, float* m, float* v) {
  if (!model.tensor_parallel()) return opt.read_moments(u, m, v);
  std::vector<float> lm(model.units()[u].numel()), lv(lm.size());
  STRATA_RETURN_IF_ERROR(opt.read_moments(u, lm.data(), lv.data()));
  STRATA_RETURN_IF_ERROR(model.gather_whole(u, lm.data(), m));
  return model.gather_whole(u, lv.data(), v);
}

// State k of a unit from element `from` to its end, a piece after another, gathered to the data-parallel
// group's rank 0 (PieceState::gather_piece: ZeRO-3 shards, or another pipeline stage's unit) and dropped. Every
// rank of the group walks the same pieces in the same order: here the ranks that do not write, and the writer
// past the last piece it read.
Status walk_pieces(const Model& model, Optimizer& opt, size_t unit, int k, size_t from, std::vector<float>& buffer) {
  for (size_t at = from, numel = model.whole_layout(unit).numel(); at < numel;) {
    STRATA_ASSIGN_OR_RETURN(
        const PieceState::StatePiece piece,
        opt.piece_state()->gather_piece(unit, k, at, PieceState::kMaxStatePiece, PieceState::buffer_in(buffer)));
    at += piece.length;
  }
  return Status::ok();
}

// The optimizer's state k of a unit (0: the weights, 1: Adam's m, 2: v) from element `offset` on, at least one
// element: from where the optimizer keeps it (offloaded state, a sub-group at a time, in host memory or read
// into one staging slot, within the host budget; under ZeRO-3, a piece at a time from the rank that holds it;
// another pipeline stage's, a piece at a time as that stage sends it) or else from one unit read whole — the
// model's weights, or its m and v — always so under tensor parallelism, whose reads gather the slices over the
// group.
class StateReader {
 public:
  StateReader(const Model& model, Optimizer& opt)
      : model_(model),
        opt_(opt),
        weights_(model, [&model](size_t u, float* p, float*) { return model.read_params(u, p); }, false),
        moments_(
            model, [&model, &opt](size_t u, float* m, float* v) { return read_whole_moments(model, opt, u, m, v); },
            true) {}
  Result<std::span<const float>> get(size_t unit, int k, size_t offset) {
    if (unit == unit_ && k == k_ && offset >= lo_ && offset - lo_ < piece_.size()) return piece_.subspan(offset - lo_);
    if (gathers_pieces(opt_, unit)) return gathered(unit, k, offset);
    if (!model_.tensor_parallel() && opt_.piece_state() != nullptr) {
      STRATA_ASSIGN_OR_RETURN(std::span<const float> piece, opt_.piece_state()->state_view(unit, k, offset));
      if (!piece.empty()) {
        unit_ = unit, k_ = k, lo_ = offset, piece_ = piece;
        return piece;
      }
    }
    unit_ = SIZE_MAX;  // the piece held was valid until this call on the optimizer
    return k == 0 ? weights_.get(unit, false, offset) : moments_.get(unit, k == 2, offset);
  }
  // Walks the rest of the gathered state being read, if any, as the other ranks do: call after a file's last
  // get().
  Status end() {
    if (walk_unit_ == SIZE_MAX) return Status::ok();
    const size_t unit = walk_unit_;
    unit_ = walk_unit_ = SIZE_MAX;
    return walk_pieces(model_, opt_, unit, walk_k_, walk_next_, buffer_);
  }

 private:
  // Gathered pieces come in order, each unit's state from its first element to its last (the other ranks walk
  // them so); a file's tensors tile a unit, so each is asked for where the last ended or within it.
  Result<std::span<const float>> gathered(size_t unit, int k, size_t offset) {
    if (unit != walk_unit_ || k != walk_k_) {
      STRATA_RETURN_IF_ERROR(end());
      walk_unit_ = unit, walk_k_ = k, walk_next_ = 0;
    }
    STRATA_ASSERT(offset >= walk_next_);  // pieces are never asked for twice
    for (;;) {
      STRATA_ASSIGN_OR_RETURN(
          const PieceState::StatePiece piece,
          opt_.piece_state()->gather_piece(unit, k, walk_next_, PieceState::kMaxStatePiece,
                                           PieceState::buffer_in(buffer_)));
      const size_t lo = walk_next_;
      walk_next_ += piece.length;
      if (offset < walk_next_) {
        unit_ = unit, k_ = k, lo_ = lo, piece_ = piece.data;
        return piece_.subspan(offset - lo);
      }
    }
  }

  const Model& model_;
  Optimizer& opt_;
  UnitCache weights_, moments_;
  size_t unit_ = SIZE_MAX, lo_ = 0;
  int k_ = 0;
  std::span<const float> piece_;  // [lo_, lo_ + size) of (unit_, k_)
  size_t walk_unit_ = SIZE_MAX, walk_next_ = 0;  // the gathered state being walked, and where its next piece starts
  int walk_k_ = 0;
  std::vector<float> buffer_;  // what other ranks send
};

// State `which` of unit i from element `offset` on: at least one element, valid until the next call.
using PieceFn = std::function<Result<std::span<const float>>(size_t unit, int which, size_t offset)>;

// Every tensor of every unit named `prefix + spec.name`, produced from `piece` as it is written, piece by
// piece. With two prefixes (Adam's m and v) a unit's m tensors are followed by its v tensors (`which` 0, 1).
// A value that is not finite fails the write, naming the tensor and element: a file of that state would
// train to NaN from any resume, and would replace good checkpoints as the newest.
std::vector<SafetensorsTensor> tensors_of(const Model& model, const std::vector<std::string>& prefixes, PieceFn piece) {
  std::vector<SafetensorsTensor> out;
  for (size_t i = 0; i < model.units().size(); ++i) {
    for (size_t k = 0; k < prefixes.size(); ++k) {
      for (const TensorSpec& s : model.whole_layout(i).specs()) {
        SafetensorsTensor t{prefixes[k] + s.name, DType::kF32, s.shape, nullptr, {}};
        t.view = [piece, i, k, name = t.name, offset = s.offset,
                  n = s.numel()](size_t byte) -> Result<std::span<const std::byte>> {
          STRATA_ASSERT(byte % sizeof(float) == 0);  // every piece handed over is whole floats
          const size_t at = byte / sizeof(float);
          STRATA_ASSIGN_OR_RETURN(std::span<const float> got, piece(i, static_cast<int>(k), offset + at));
          got = got.first(std::min(got.size(), n - at));
          if (const size_t bad = first_non_finite(got.data(), got.size()); bad != got.size()) {
            return Status::invalid_argument("tensor '{}' element {} is {}: the training state is not finite, so it "
                                            "is not saved",
                                            name, at + bad, got[bad]);
          }
          return std::as_bytes(got);
        };
        out.push_back(std::move(t));
      }
    }
  }
  return out;
}

Status write_whole_moments(const Model& model, Optimizer& opt, size_t u, const float* m, const float* v) {
  if (!model.tensor_parallel()) return opt.write_moments(u, m, v);
  std::vector<float> lm(model.units()[u].numel()), lv(lm.size());
  model.slice_whole(u, m, lm.data());
  model.slice_whole(u, v, lv.data());
  return opt.write_moments(u, lm.data(), lv.data());
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

Status save_model(const Model& model, const std::string& path) {
  UnitCache cache(model, [&](size_t u, float* p, float*) { return model.read_params(u, p); }, false);
  auto tensors = tensors_of(model, {""}, [&](size_t u, int, size_t offset) { return cache.get(u, false, offset); });
  return write_safetensors(path, tensors, model.metadata());
}

namespace {

// A weights file that holds exactly `model`'s tensors (every one checked before anything is written).
Result<std::unique_ptr<WeightsFile>> open_weights(const Model& model, const std::string& path_or_folder,
                                                  const WeightsOpenOptions& options = {}) {
  STRATA_ASSIGN_OR_RETURN(const std::string path, weights_path(path_or_folder));
  std::unique_ptr<WeightsFile> file;
  if (const auto* gpt2 = dynamic_cast<const GPT2*>(&model)) {  // GPT-2's files in the formats foreign_weights.h reads
    STRATA_ASSIGN_OR_RETURN(file, WeightsFile::open(path, options));
    STRATA_RETURN_IF_ERROR(file->check(gpt2->config()));
  } else {  // the other families' files name the tensors as their units do
    STRATA_ASSIGN_OR_RETURN(file, open_named_weights(path, model, options));
  }
  if (file->format() != WeightsFormat::kStrata)
    STRATA_LOG_INFO("reading {} ({} weights)", path, weights_format_name(file->format()));
  return file;
}

// Elements [offset, offset + dst.size()) of a unit of `layout` from `read` (elements [from, from + n) of one of
// its tensors into a pointer), tensor by tensor.
using TensorRangeFn = std::function<Status(const TensorSpec& s, size_t from, size_t n, float* dst)>;
Status read_unit_range(const FlatLayout& layout, size_t offset, std::span<float> dst, const TensorRangeFn& read) {
  const size_t end = offset + dst.size();
  for (const TensorSpec& s : layout.specs()) {
    const size_t lo = std::max(offset, s.offset), hi = std::min(end, s.offset + s.numel());
    if (lo < hi) STRATA_RETURN_IF_ERROR(read(s, lo - s.offset, hi - lo, dst.data() + (lo - offset)));
  }
  return Status::ok();
}

// Elements [offset, offset + dst.size()) of unit u's weights (its whole layout) from `file`.
Status read_weights(const Model& model, const WeightsFile& file, size_t u, size_t offset, std::span<float> dst) {
  return read_unit_range(model.whole_layout(u), offset, dst, [&](const TensorSpec& s, size_t from, size_t n,
                                                                 float* p) { return file.read_range(s, from, n, p); });
}

// State k (0: weights, 1: Adam's m, 2: v) of unit u, elements [offset, offset + dst.size()) of its whole layout.
using UnitFill = std::function<Status(size_t u, int k, size_t offset, std::span<float> dst)>;

// Every unit's weights and Adam moments from `fill`: through PieceState::load_state, a sub-group at a time, where the
// optimizer takes them (the offloaded one, ZeRO-3 shards included; not under tensor parallelism, whose units
// are slices of the whole tensors `fill` gives); the other units whole, their weights through write_params
// and then, with `moments`, their m and v through write_moments, else (moments zero) opt.adopt_params() once
// all are written — which takes the streamed units again too, with the same result; optimizers take all units
// or none, so it does not come to that but under tensor parallelism, where none is streamed. Units in order,
// each's weights before its moments.
Status load_units(Model& model, Optimizer& opt, const UnitFill& fill, bool moments) {
  bool adopt = false;
  std::vector<float> w, m, v;
  for (size_t u = 0; u < model.units().size(); ++u) {
    if (!model.tensor_parallel() && opt.piece_state() != nullptr) {
      STRATA_ASSIGN_OR_RETURN(const bool taken, opt.piece_state()->load_state(u, [&](int k, size_t offset,
                                                                                      std::span<float> dst) {
        return fill(u, k, offset, dst);
      }));
      if (taken) continue;
    }
    w.resize(model.whole_layout(u).numel());
    STRATA_RETURN_IF_ERROR(fill(u, 0, 0, w));
    STRATA_RETURN_IF_ERROR(model.write_params(u, w.data()));
    if (!moments) {
      adopt = true;
      continue;
    }
    m.resize(w.size());
    v.resize(w.size());
    STRATA_RETURN_IF_ERROR(fill(u, 1, 0, m));
    STRATA_RETURN_IF_ERROR(fill(u, 2, 0, v));
    STRATA_RETURN_IF_ERROR(write_whole_moments(model, opt, u, m.data(), v.data()));
  }
  return adopt ? opt.adopt_params() : Status::ok();
}

Status zeros(std::span<float> dst) {
  std::fill(dst.begin(), dst.end(), 0.0f);
  return Status::ok();
}

}  // namespace

Status load_model(Model& model, const std::string& path_or_folder, const WeightsOpenOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<WeightsFile> file, open_weights(model, path_or_folder, options));
  std::vector<float> unit;
  for (size_t i = 0; i < model.units().size(); ++i) {
    unit.resize(model.whole_layout(i).numel());
    STRATA_RETURN_IF_ERROR(read_weights(model, *file, i, 0, unit));
    STRATA_RETURN_IF_ERROR(model.write_params(i, unit.data()));
  }
  return Status::ok();
}

Status load_model(Model& model, Optimizer& opt, const std::string& path_or_folder, const WeightsOpenOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<WeightsFile> file, open_weights(model, path_or_folder, options));
  auto fill = [&](size_t u, int k, size_t offset, std::span<float> dst) {
    return k == 0 ? read_weights(model, *file, u, offset, dst) : zeros(dst);
  };
  return load_units(model, opt, fill, /*moments=*/false);
}

bool gathers_pieces(Optimizer& opt, size_t unit) {
  PieceState* pieces = opt.piece_state();
  return pieces != nullptr && pieces->gathers_pieces(unit);
}

Status init_model(Model& model, Optimizer& opt, uint64_t seed) {
  const std::unique_ptr<WeightsInit> init = model.initial_weights(seed);
  return load_model(model, opt,
                    [&](size_t u, size_t offset, std::span<float> dst) { return init->fill(u, offset, dst); });
}

Status load_model(Model& model, Optimizer& opt, const WeightsFill& fill) {
  auto units = [&](size_t u, int k, size_t offset, std::span<float> dst) {
    return k == 0 ? fill(u, offset, dst) : zeros(dst);
  };
  return load_units(model, opt, units, /*moments=*/false);
}

Result<std::string> save_checkpoint(const std::string& checkpoint_dir, const Model& model, Optimizer& opt,
                                    const TrainState& state, int keep) {
  const std::string name = fmt::format("step_{:06d}", state.step);
  const fs::path final_dir = fs::path(checkpoint_dir) / name;
  const fs::path tmp_dir = fs::path(checkpoint_dir) / (name + ".tmp");
  std::error_code ec;
  remove_unfinished_saves(checkpoint_dir);
  fs::create_directories(tmp_dir, ec);
  if (ec) return Status::io_error("cannot create checkpoint folder {}: {}", tmp_dir.string(), ec.message());
  // A save that fails (a full disk, a state that is not finite) leaves nothing of itself behind.
  struct RemoveOnFailure {
    const fs::path& dir;
    bool done = false;
    ~RemoveOnFailure() {
      std::error_code ignored;
      if (!done) fs::remove_all(dir, ignored);
    }
  } cleanup{tmp_dir};

  STRATA_RETURN_IF_ERROR(opt.finish());  // the parameters and moments of the last step, complete
  StateReader pieces(model, opt);
  STRATA_RETURN_IF_ERROR(write_safetensors(
      (tmp_dir / "model.safetensors").string(),
      tensors_of(model, {""}, [&](size_t u, int, size_t offset) { return pieces.get(u, 0, offset); }),
      model.metadata()));
  STRATA_RETURN_IF_ERROR(pieces.end());
  std::vector<SafetensorsTensor> moments = tensors_of(
      model, {"m.", "v."}, [&](size_t u, int which, size_t offset) { return pieces.get(u, 1 + which, offset); });
  STRATA_RETURN_IF_ERROR(write_safetensors((tmp_dir / "optimizer.safetensors").string(), moments,
                                           {{"adam_steps", std::to_string(opt.steps_taken())}}));
  STRATA_RETURN_IF_ERROR(pieces.end());
  STRATA_RETURN_IF_ERROR(
      write_text_atomic((tmp_dir / "state.json").string(), train_state_json(state, opt.steps_taken())));

  // In place; a checkpoint of the same step already there (a signal right after a periodic save, or an earlier
  // run's) ends up in tmp_dir, and goes only once `latest` names the new one.
  cleanup.done = true;  // from here tmp_dir may hold the earlier checkpoint of this step
  STRATA_RETURN_IF_ERROR(replace_dir(tmp_dir, final_dir));
  STRATA_RETURN_IF_ERROR(fsync_parent_dir(final_dir.string()));
  STRATA_RETURN_IF_ERROR(write_text_atomic((fs::path(checkpoint_dir) / "latest").string(), name + "\n"));
  fs::remove_all(tmp_dir, ec);
  if (keep > 0) prune_checkpoints(checkpoint_dir, name, keep);
  return final_dir.string();
}

Status take_part_in_checkpoint(const Model& model, Optimizer& opt, const std::function<bool(size_t unit)>& include) {
  STRATA_RETURN_IF_ERROR(opt.finish());
  std::vector<float> a, b;
  for (size_t u = 0; u < model.units().size(); ++u) {  // the model file's reads
    if (!include(u)) continue;
    if (gathers_pieces(opt, u)) {
      STRATA_RETURN_IF_ERROR(walk_pieces(model, opt, u, 0, 0, a));
      continue;
    }
    a.resize(model.whole_layout(u).numel());
    STRATA_RETURN_IF_ERROR(model.read_params(u, a.data()));
  }
  for (size_t u = 0; u < model.units().size(); ++u) {  // then the moments'
    if (!include(u)) continue;
    if (gathers_pieces(opt, u)) {
      STRATA_RETURN_IF_ERROR(walk_pieces(model, opt, u, 1, 0, a));
      STRATA_RETURN_IF_ERROR(walk_pieces(model, opt, u, 2, 0, a));
      continue;
    }
    a.resize(model.whole_layout(u).numel());
    b.resize(a.size());
    STRATA_RETURN_IF_ERROR(read_whole_moments(model, opt, u, a.data(), b.data()));
  }
  return Status::ok();
}

Result<TrainState> load_checkpoint(const std::string& path, Model& model, Optimizer& opt,
                                   const std::function<Status(const TrainState&)>& check) {
  fs::path dir(path);
  std::error_code ec;
  if (fs::exists(dir / "latest", ec)) {
    std::ifstream in(dir / "latest");
    std::string name;
    in >> name;
    if (name.empty()) return Status::corruption("{} is empty", (dir / "latest").string());
    dir /= name;
    dir = moved_aside_if_missing(dir);
    if (!fs::exists(dir / "state.json", ec))
      return Status::not_found("{} names '{}', which is not a checkpoint (no {})", (fs::path(path) / "latest").string(),
                               name, (dir / "state.json").string());
  } else {
    dir = moved_aside_if_missing(dir);
    if (!fs::exists(dir / "state.json", ec)) {  // a checkpoint_dir whose run stopped before writing `latest`?
      int64_t best = -1;
      fs::path found;
      for (const fs::path& p : step_folders(path)) {
        const int64_t step = checkpoint_step(p.filename().string());
        if (step > best && fs::exists(p / "state.json", ec)) {
          best = step;
          found = p;
        }
      }
      if (best >= 0) {
        STRATA_LOG_WARN("{} has no 'latest' (its run stopped before writing one); reading {}, its highest step", path,
                        found.string());
        dir = found;
      }
    }
  }
  if (!fs::exists(dir / "state.json", ec)) {
    return Status::not_found("{} is not a checkpoint (no state.json, and no 'latest' file naming one)", path);
  }
  const std::string state_path = (dir / "state.json").string();
  STRATA_ASSIGN_OR_RETURN(const std::string state_text, read_whole_file(state_path));
  STRATA_ASSIGN_OR_RETURN(const nlohmann::json js, parse_json(state_text, state_path, StatusCode::kCorruption));
  int64_t adam_steps = 0;
  STRATA_ASSIGN_OR_RETURN(TrainState st, parse_train_state(state_text, state_path, &adam_steps));
  // The step against the folder it was saved in (moved aside or not) and the optimizer file's count.
  std::string folder = dir.filename().string();
  if (folder.ends_with(".tmp.old")) folder.resize(folder.size() - 8);
  if (const int64_t named = checkpoint_step(folder); named >= 0 && named != st.step) {
    return Status::corruption("{}: step {}, but it is in the folder of step {}: the files are not one checkpoint",
                              state_path, st.step, named);
  }
  if (check) STRATA_RETURN_IF_ERROR(check(st));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<WeightsFile> weights,
                          open_weights(model, (dir / "model.safetensors").string()));
  STRATA_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open((dir / "optimizer.safetensors").string()));
  if (auto it = f.metadata().find("adam_steps"); it != f.metadata().end() && it->second != std::to_string(adam_steps)) {
    return Status::corruption("{}: adam_steps is {}, but {} says {}: the files are not one checkpoint", state_path,
                              adam_steps, f.path(), it->second);
  }
  static constexpr const char* kMoments[] = {"m.", "v."};
  for (size_t i = 0; i < model.units().size(); ++i) {  // every tensor before anything is written
    for (const TensorSpec& s : model.whole_layout(i).specs()) {
      for (const char* prefix : kMoments)
        STRATA_RETURN_IF_ERROR(f.expect(prefix + s.name, DType::kF32, s.shape).status());
    }
  }
  auto fill = [&](size_t u, int k, size_t offset, std::span<float> dst) {
    if (k == 0) return read_weights(model, *weights, u, offset, dst);
    return read_unit_range(model.whole_layout(u), offset, dst, [&](const TensorSpec& s, size_t from, size_t n,
                                                                   float* p) {
      return f.read_range(kMoments[k - 1] + s.name, DType::kF32, s.shape, from, n, p);
    });
  };
  STRATA_RETURN_IF_ERROR(load_units(model, opt, fill, /*moments=*/true));
  opt.set_steps_taken(static_cast<int>(adam_steps));
  return st;
}

}  // namespace strata::engine
