#include "engine/model/unit_split.h"

#include <algorithm>
#include <cstring>

#include "common/check.h"

namespace strata::engine {

RowSlice row_slice(int64_t rows, int rank, int size) {
  const int64_t per = (rows + size - 1) / size;
  const int64_t start = std::min<int64_t>(rows, per * rank);
  return {start, std::min<int64_t>(rows, start + per) - start};
}

UnitSplit::UnitSplit(FlatLayout whole, std::vector<TensorSplit> splits, int size)
    : whole_(std::move(whole)), splits_(std::move(splits)), size_(size) {
  STRATA_ASSERT(splits_.size() == whole_.specs().size() && size_ >= 1);
  for (int r = 0; r < size_; ++r) {
    FlatLayout local;
    for (size_t t = 0; t < splits_.size(); ++t) {
      const TensorSpec& s = whole_.specs()[t];
      const TensorSplit& sp = splits_[t];
      std::vector<int64_t> shape = s.shape;
      if (sp.kind == TensorSplit::kRows) {
        STRATA_ASSERT(shape[0] % sp.segments == 0);
        const int64_t block = shape[0] / sp.segments;
        STRATA_ASSERT_MSG(sp.segments == 1 || block % size_ == 0, "a segmented tensor must split evenly");
        shape[0] = sp.segments * row_slice(block, r, size_).count;
      } else if (sp.kind == TensorSplit::kColumns) {
        STRATA_ASSERT(shape.size() == 2 && shape[1] % size_ == 0);
        shape[1] /= size_;
      }
      local.add(s.name, std::move(shape));
    }
    local_.push_back(std::move(local));
  }
}

size_t UnitSplit::max_local_numel() const {
  size_t n = 0;
  for (const FlatLayout& l : local_) n = std::max(n, l.numel());
  return n;
}

template <typename Fn>
void UnitSplit::for_each_run(size_t t, int rank, Fn&& fn) const {
  const TensorSpec& w = whole_.specs()[t];
  const TensorSpec& l = local_[static_cast<size_t>(rank)].specs()[t];
  const TensorSplit& sp = splits_[t];
  const size_t row_len = w.shape.size() >= 2 ? static_cast<size_t>(w.numel() / w.shape[0]) : 1;
  switch (sp.kind) {
    case TensorSplit::kReplicated:
      fn(l.offset, w.offset, w.numel());
      break;
    case TensorSplit::kRows: {  // each segment's slice of rows is one contiguous run
      const int64_t block = w.shape[0] / sp.segments;
      const RowSlice rs = row_slice(block, rank, size_);
      for (int seg = 0; seg < sp.segments; ++seg) {
        fn(l.offset + static_cast<size_t>(seg * rs.count) * row_len,
           w.offset + static_cast<size_t>(seg * block + rs.start) * row_len, static_cast<size_t>(rs.count) * row_len);
      }
      break;
    }
    case TensorSplit::kColumns: {  // a run per row
      const size_t cols = static_cast<size_t>(w.shape[1]), local_cols = cols / static_cast<size_t>(size_);
      for (size_t row = 0; row < static_cast<size_t>(w.shape[0]); ++row)
        fn(l.offset + row * local_cols, w.offset + row * cols + static_cast<size_t>(rank) * local_cols, local_cols);
      break;
    }
  }
}

void UnitSplit::slice(const float* whole, int rank, float* local) const {
  for (size_t t = 0; t < splits_.size(); ++t)
    for_each_run(t, rank,
                 [&](size_t lo, size_t wo, size_t n) { std::memcpy(local + lo, whole + wo, n * sizeof(float)); });
}

void UnitSplit::assemble(const float* local, int rank, float* whole) const {
  for (size_t t = 0; t < splits_.size(); ++t)
    for_each_run(t, rank,
                 [&](size_t lo, size_t wo, size_t n) { std::memcpy(whole + wo, local + lo, n * sizeof(float)); });
}

Ranges UnitSplit::replicated_ranges(int rank) const {
  Ranges out;
  for (size_t t = 0; t < splits_.size(); ++t) {
    if (splits_[t].kind != TensorSplit::kReplicated) continue;
    const TensorSpec& l = local_[static_cast<size_t>(rank)].specs()[t];
    if (!out.empty() && out.back().first + out.back().second == l.offset)
      out.back().second += l.numel();
    else
      out.emplace_back(l.offset, l.numel());
  }
  return out;
}

Status sum_in_rank_order(comm::Communicator& group, std::vector<double>* per, const char* what) {
  const size_t U = per->size(), R = static_cast<size_t>(group.size());
  std::vector<double> all(U * R);
  STRATA_RETURN_IF_ERROR(group.all_gather(per->data(), all.data(), 2 * U, DType::kF32).with_context(what));
  for (size_t u = 0; u < U; ++u) {
    double s = 0.0;
    for (size_t r = 0; r < R; ++r) s += all[r * U + u];
    (*per)[u] = s;
  }
  return Status::ok();
}

Status NormShares::sum(std::vector<double>* per) const {
  if (!active()) return Status::ok();
  return sum_in_rank_order(*group, per, "gradient norm over the tensor-parallel group");
}

}  // namespace strata::engine
