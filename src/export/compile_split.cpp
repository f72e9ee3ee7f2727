// kiln::compile's split calls (compile_split.h).
#include "compile_split.h"

#include <cstring>
#include <memory>

#include "kiln/core/pool_frees.h"

namespace kiln::compile_detail {

namespace {

// Held kernels run with no private pool: its free blocks include those of tensors that died
// after the kernels that write and read them were held, and those kernels are about to run.
class NoPool {
 public:
  NoPool() : saved_(memory::exchange_private_pool(nullptr)) {}
  ~NoPool() { memory::exchange_private_pool(saved_); }
  NoPool(const NoPool&) = delete;
  NoPool& operator=(const NoPool&) = delete;

 private:
  memory::PrivatePool* saved_;
};

}  // namespace

Deferrer::Deferrer(memory::PrivatePool& pool, bool fuse) : Recorder(true), pool_(pool), fuse_(fuse) {
  memory::log_pool_frees(pool_, true);
  (void)take_frees();
}

Deferrer::~Deferrer() { memory::log_pool_frees(pool_, false); }

std::vector<std::pair<void*, size_t>> Deferrer::take_frees() { return memory::take_pool_frees(pool_); }

void Deferrer::kernel(const char* name, capture::Replay replay) {
  held_.push_back({name, false, std::move(replay), nullptr, nullptr, {}, take_frees(), nullptr, std::nullopt, {}});
}

void Deferrer::loop(const capture::Loop& l, capture::LoopRun run) {
  if (!held_.empty()) held_.back().loop = std::make_shared<const LoopRecord>(LoopRecord{l, std::move(run)});
}

void Deferrer::reduction(capture::Reduction r) {
  if (!held_.empty()) held_.back().reduce = std::make_shared<const capture::Reduction>(std::move(r));
}

void Deferrer::graph_break(const std::string& what) {
  if (!held_.empty()) run("the graph break (" + what + ")");
}

const void* Deferrer::keep(const void* p, int n) {
  Bytes16& b = kept_.emplace_back();
  std::memcpy(b.bytes, p, static_cast<size_t>(n < 16 ? n : 16));
  return b.bytes;
}

// Called before every kernel that cannot wait and every host action: nothing is built
// unless something is held.
void Deferrer::sync(const char* before) {
  if (!held_.empty()) run(before);
}

void Deferrer::run(std::string before) {
  std::vector<Recorded> ops = std::move(held_);
  held_.clear();
  const std::vector<std::pair<void*, size_t>> freed_at_end = take_frees();
  CompileStats::SplitGraph& g = graphs_run.emplace_back();
  g.kernels = static_cast<int64_t>(ops.size());
  g.before = std::move(before);
  if (fuse_ && ops.size() > 1) {
    const FusionReport fr = fuse_elementwise(ops, freed_at_end);
    g.fused_loops = fr.groups;
    g.fused_kernels = fr.kernels;
  }
  {
    const capture::RunNow now;
    const NoPool no_pool;
    for (const Recorded& r : ops) r.fn();
  }
  hold_.release();
}

}  // namespace kiln::compile_detail
