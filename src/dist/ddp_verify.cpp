// DDP's wrap-time check that every rank holds the same model: the same
// parameters and buffers, in the same order, with the same shapes and dtypes.
// Without it, ranks that built different models (a config that differs per
// rank, a branch on the rank) fail later inside the first broadcast with only
// MPI_ERR_TRUNCATE, or worse, average gradients of unrelated tensors when the
// element counts happen to agree. torch runs the same check at construction.
#include "ddp_verify.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"

namespace kiln::dist::detail {
namespace {

// One record of int64 per tensor, so that one allgather moves them all.
constexpr int64_t kMaxDims = 8;
constexpr int64_t kNameWords = 8;  // the first 64 bytes of the name, for the message
constexpr int64_t kRecord = 4 + kMaxDims + kNameWords;
constexpr int64_t kAbsent = -1;  // a rank that has fewer tensors than another

struct Entry {
  std::string name;
  bool buffer;
  Tensor t;
};

void encode(const Entry& e, int64_t* r) {
  r[0] = e.buffer ? 1 : 0;
  r[1] = static_cast<int64_t>(e.t.dtype());
  r[2] = e.t.dim();
  r[3] = e.t.numel();
  for (int64_t d = 0; d < kMaxDims; ++d) r[4 + d] = d < e.t.dim() ? e.t.size(d) : 0;
  // More than kMaxDims dimensions: the element count still tells them apart.
  char name[kNameWords * 8] = {};
  std::memcpy(name, e.name.data(), std::min(e.name.size(), sizeof name));
  std::memcpy(r + 4 + kMaxDims, name, sizeof name);
}

std::string describe(const int64_t* r) {
  if (r[0] == kAbsent) return "absent";
  std::ostringstream os;
  os << (r[0] ? "buffer '" : "parameter '");
  char name[kNameWords * 8 + 1] = {};
  std::memcpy(name, r + 4 + kMaxDims, kNameWords * 8);
  os << name << "' " << dtype_name(static_cast<DType>(r[1])) << " [";
  for (int64_t d = 0; d < std::min(r[2], kMaxDims); ++d) os << (d ? ", " : "") << r[4 + d];
  if (r[2] > kMaxDims) os << ", ... (" << r[3] << " elements)";
  os << "]";
  return os.str();
}

}  // namespace

void verify_same_model(ProcessGroup& group, const std::vector<std::pair<std::string, Tensor>>& params,
                       const std::vector<std::pair<std::string, Tensor>>& buffers) {
  const int world = group.size();
  if (world == 1) return;
  std::vector<Entry> entries;
  for (const auto& [n, t] : params) entries.push_back({n, false, t});
  for (const auto& [n, t] : buffers) entries.push_back({n, true, t});

  Tensor count = full({1}, static_cast<double>(entries.size()), kInt64);
  std::vector<Tensor> counts;
  for (int r = 0; r < world; ++r) counts.push_back(empty({1}, kInt64));
  group.allgather(counts, count)->wait();
  int64_t most = 0;
  for (const Tensor& c : counts) most = std::max(most, c.data_ptr<int64_t>()[0]);

  Tensor mine = full({std::max<int64_t>(most, 1), kRecord}, static_cast<double>(kAbsent), kInt64);
  for (size_t i = 0; i < entries.size(); ++i) encode(entries[i], mine.data_ptr<int64_t>() + i * kRecord);
  std::vector<Tensor> all;
  for (int r = 0; r < world; ++r) all.push_back(empty(mine.sizes(), kInt64));
  group.allgather(all, mine)->wait();

  // Every rank reaches the same verdict from the same gathered records, so
  // they all throw together and none goes on to a broadcast that would hang.
  for (int64_t i = 0; i < most; ++i) {
    const int64_t* ref = all[0].data_ptr<int64_t>() + i * kRecord;
    std::vector<int> differ;
    for (int r = 1; r < world; ++r) {
      const int64_t* rec = all[static_cast<size_t>(r)].data_ptr<int64_t>() + i * kRecord;
      if (!std::equal(rec, rec + 4 + kMaxDims, ref)) differ.push_back(r);
    }
    if (differ.empty()) continue;
    std::ostringstream os;
    os << "DistributedDataParallel: the ranks do not wrap the same model. Tensor #" << i
       << " (parameters that require a gradient, then buffers, in registration order) is, on rank 0, " << describe(ref);
    for (int r : differ) {
      os << "; on rank " << r << ", " << describe(all[static_cast<size_t>(r)].data_ptr<int64_t>() + i * kRecord);
    }
    os << ". Counts of such tensors per rank:";
    for (int r = 0; r < world; ++r)
      os << " rank " << r << ": " << counts[static_cast<size_t>(r)].data_ptr<int64_t>()[0];
    os << ". Every rank must build the same architecture with the same settings before wrapping it "
          "(look for a config or a branch that depends on the rank)";
    throw DistributedError(os.str());
  }
}

void verify_same_hook(ProcessGroup& group, CommHook hook, const PowerSGDOptions& powersgd) {
  const int world = group.size();
  if (world < 2) return;
  // [hook, PowerSGD's rank, its start]: the last two are 0 for the other hooks (PowerSGD's rank is >= 1).
  const bool psgd = hook == CommHook::PowerSGD;
  Tensor mine = empty({3}, kInt64);
  int64_t* m = mine.data_ptr<int64_t>();
  m[0] = static_cast<int64_t>(hook);
  m[1] = psgd ? powersgd.matrix_approximation_rank : 0;
  m[2] = psgd ? powersgd.start_powerSGD_iter : 0;
  std::vector<Tensor> all(static_cast<size_t>(world));
  for (auto& a : all) a = empty({3}, kInt64);
  {
    CollectiveLabel label("DDP communication hook check");
    group.allgather(all, mine)->wait();
  }
  auto same = [&](int r) { return all[static_cast<size_t>(r)].equal(all[0]); };
  bool agree = true;
  for (int r = 1; r < world; ++r) agree = agree && same(r);
  if (agree) return;
  std::ostringstream os;
  os << "DistributedDataParallel: the ranks' communication hooks differ:";
  for (int r = 0; r < world; ++r) {
    const int64_t* a = all[static_cast<size_t>(r)].data_ptr<int64_t>();
    os << (r ? "," : "") << " rank " << r << " " << comm_hook_name(static_cast<CommHook>(a[0]));
    if (a[1] > 0) os << " (matrix_approximation_rank " << a[1] << ", start_powerSGD_iter " << a[2] << ")";
  }
  os << "; every rank must register the same hook (DDPOptions::comm_hook or register_comm_hook) before its first "
        "backward, or the ranks exchange their buckets differently";
  throw DistributedError(os.str());
}

}  // namespace kiln::dist::detail
