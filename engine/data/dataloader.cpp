#include "engine/data/dataloader.h"

#include <glob.h>

#include <algorithm>
#include <filesystem>

#include "common/check.h"

namespace strata::engine {

namespace fs = std::filesystem;

Result<std::vector<std::string>> expand_shard_pattern(const std::string& pattern) {
  std::vector<std::string> out;
  std::error_code ec;
  if (fs::is_directory(pattern, ec)) {
    for (const auto& e : fs::directory_iterator(pattern, ec))
      if (e.is_regular_file() && e.path().extension() == ".bin") out.push_back(e.path().string());
  } else if (pattern.find_first_of("*?[") != std::string::npos) {
    glob_t g{};
    if (glob(pattern.c_str(), 0, nullptr, &g) == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
    }
    globfree(&g);
  } else {
    if (!fs::exists(pattern, ec)) return Status::not_found("token shard {} does not exist", pattern);
    out.push_back(pattern);
  }
  if (out.empty()) return Status::not_found("no token shards match {}", pattern);
  std::sort(out.begin(), out.end());
  return out;
}

Result<DataLoader> DataLoader::open(const std::string& pattern, int B, int T, int vocab_size,
                                    const std::string& what) {
  if (pattern.empty()) return Status::invalid_argument("{} is not set: give a token shard file, folder or glob", what);
  DataLoader dl;
  auto paths = expand_shard_pattern(pattern);
  if (!paths.is_ok()) return paths.status().with_context(what);
  dl.paths_ = std::move(paths).value();
  dl.B_ = B;
  dl.T_ = T;
  dl.vocab_size_ = vocab_size;
  dl.what_ = what;
  const size_t window = static_cast<size_t>(B) * T + 1;
  for (const std::string& p : dl.paths_) {
    auto shard = TokenShard::open(p, vocab_size);
    if (!shard.is_ok()) return shard.status().with_context(what);
    dl.sizes_.push_back(shard->size());
    dl.total_tokens_ += shard->size();
    if (shard->size() >= window) dl.batches_per_epoch_ += (shard->size() - 1) / (window - 1);
  }
  if (dl.batches_per_epoch_ == 0) {
    return Status::invalid_argument(
        "{}: no shard in {} holds a full batch of {} x {} + 1 = {} tokens (largest has {}); use a smaller "
        "training.batch_size or training.seq_len",
        what, pattern, B, T, window, *std::max_element(dl.sizes_.begin(), dl.sizes_.end()));
  }
  STRATA_RETURN_IF_ERROR(dl.seek(Position{}));
  return dl;
}

Status DataLoader::load(size_t shard) {
  if (current_index_ == shard) return Status::ok();
  current_.reset();
  auto s = TokenShard::open(paths_[shard], vocab_size_);
  if (!s.is_ok()) return s.status().with_context(what_);
  current_.emplace(std::move(s).value());
  current_index_ = shard;
  return Status::ok();
}

Status DataLoader::seek(const Position& pos) {
  if (pos.shard >= paths_.size()) {
    return Status::invalid_argument("{}: resume position names shard {} but only {} shards match", what_, pos.shard,
                                    paths_.size());
  }
  if (pos.offset > sizes_[pos.shard]) {
    return Status::invalid_argument("{}: resume position is token {} of {}, which has {}", what_, pos.offset,
                                    paths_[pos.shard], sizes_[pos.shard]);
  }
  pos_ = pos;
  return Status::ok();
}

Status DataLoader::next_batch(int32_t* inputs, int32_t* targets) {
  const size_t n = static_cast<size_t>(B_) * T_;
  // Advance to a shard with room for the next window (at most one full lap: open() proved one exists).
  for (size_t tries = 0; pos_.offset + n + 1 > sizes_[pos_.shard]; ++tries) {
    pos_.offset = 0;
    if (++pos_.shard == paths_.size()) {
      pos_.shard = 0;
      ++pos_.epoch;
    }
    STRATA_ASSERT(tries <= paths_.size());
  }
  STRATA_RETURN_IF_ERROR(load(pos_.shard));
  current_->copy(pos_.offset, n, inputs);
  current_->copy(pos_.offset + 1, n, targets);
  pos_.offset += n;
  return Status::ok();
}

}  // namespace strata::engine
