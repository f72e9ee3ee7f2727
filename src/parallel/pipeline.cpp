// parallel::Pipeline: one stage's forwards and backwards over M micro-batches
// in the order of its schedule (pipeline_schedule.cpp), with activations sent
// forward and their gradients backward, and the step's figures.
//
// Note [Pipeline messages]
// Each transfer is two messages on the (link, direction) group: a header of
// int64s (micro-batch, slot, dtype, rank, dims) with tag 2m, then the tensor
// with tag 2m+1. The header lets the receiver allocate the tensor (so stages
// need not declare their activation shapes, and uneven micro-batches work) and
// carries the slot at which the sender's op ended, from which the receiver
// counts when its own op could start: the slot-counted bubble is measured
// from the schedule the stages really ran, not computed from a formula.
// Every send and recv carries a dist::CollectiveLabel naming the stage, the
// micro-batch and the direction, which the watchdog and `kiln launch`'s report
// print when a neighbour never comes.
#include "kiln/parallel/pipeline.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstring>
#include <sstream>
#include <utility>

#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/dist/dist.h"
#include "kiln/ops/factory.h"

namespace kiln::parallel {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

constexpr int64_t kMaxDims = 8;
constexpr int64_t kHeader = 4 + kMaxDims;  // micro-batch, slot, dtype, ndim, dims

std::string list_ranks(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// The group rank of world rank `w` in `g`.
int group_rank_of(const dist::ProcessGroup& g, int w) {
  const auto r = g.ranks();
  const auto it = std::find(r.begin(), r.end(), w);
  KILN_ASSERT(it != r.end(), "world rank ", w, " is not in ", g.describe());
  return static_cast<int>(it - r.begin());
}

std::string label(int stage, int64_t m, const char* what, const char* dir, int peer) {
  return "pipeline stage " + std::to_string(stage) + ", micro-batch " + std::to_string(m) + ", " + what + " (" + dir +
         " stage " + std::to_string(peer) + ")";
}

}  // namespace

PipelineGroups make_pipeline_groups(const std::vector<std::vector<int>>& pipelines) {
  auto world = dist::world();  // throws before dist::init()
  const int n = world->size(), me = world->rank();
  // Argument errors are the same on every process (same list), so each throws
  // before the first new_group.
  KILN_CHECK(!pipelines.empty(), ValueError,
             "parallel::make_pipeline_groups: expected at least one pipeline, got none");
  std::vector<int> seen(static_cast<size_t>(n), -1);
  for (size_t i = 0; i < pipelines.size(); ++i) {
    KILN_CHECK(!pipelines[i].empty(), ValueError, "parallel::make_pipeline_groups: pipeline ", i,
               " has no stages; expected a list of world ranks in stage order");
    for (int r : pipelines[i]) {
      KILN_CHECK(r >= 0 && r < n, ValueError, "parallel::make_pipeline_groups: pipeline ", i, " ",
                 list_ranks(pipelines[i]), " names rank ", r, ", but the world has ranks 0 .. ", n - 1);
      KILN_CHECK(seen[static_cast<size_t>(r)] < 0, ValueError, "parallel::make_pipeline_groups: rank ", r,
                 " is listed twice (pipeline ", seen[static_cast<size_t>(r)], " and pipeline ", i,
                 "); each rank runs one stage of one pipeline");
      seen[static_cast<size_t>(r)] = static_cast<int>(i);
    }
  }
  PipelineGroups mine;
  mine.num_stages = 0;
  for (const auto& pipe : pipelines) {
    const int p = static_cast<int>(pipe.size());
    const auto pos = std::find(pipe.begin(), pipe.end(), me);
    const bool member = pos != pipe.end();
    const int s = member ? static_cast<int>(pos - pipe.begin()) : -1;
    auto all = dist::new_group(pipe);
    if (member) {
      mine.stage = s;
      mine.num_stages = p;
      mine.ranks = pipe;
      mine.all = all;
    }
    // Link groups in link order, forward then backward: the same sequence of
    // new_group calls on every process.
    for (int l = 0; l + 1 < p; ++l) {
      auto fwd = dist::new_group({pipe[static_cast<size_t>(l)], pipe[static_cast<size_t>(l + 1)]});
      auto bwd = dist::new_group({pipe[static_cast<size_t>(l)], pipe[static_cast<size_t>(l + 1)]});
      if (s == l) mine.fwd_out = fwd, mine.bwd_in = bwd;
      if (s == l + 1) mine.fwd_in = fwd, mine.bwd_out = bwd;
    }
    if (p > 1) {
      auto ends = dist::new_group({pipe.front(), pipe.back()});
      if (s == 0 || s == p - 1) mine.ends = ends;
    }
  }
  return mine;
}

Pipeline::Pipeline(nn::ModulePtr stage, PipelineGroups groups, PipelineOptions options, LossFn loss_fn,
                   std::vector<Tensor> tied)
    : stage_(std::move(stage)),
      groups_(std::move(groups)),
      options_(options),
      loss_fn_(std::move(loss_fn)),
      tied_(std::move(tied)) {
  KILN_CHECK(stage_ != nullptr, ValueError, "parallel::Pipeline: expected a stage module, got a null pointer");
  KILN_CHECK(groups_.num_stages >= 1 && groups_.all, ValueError,
             "parallel::Pipeline: this process is in no pipeline (make_pipeline_groups gave it num_stages = ",
             groups_.num_stages, "); build a Pipeline only on the ranks of one");
  KILN_CHECK(options_.micro_batches >= 1, ValueError, "parallel::Pipeline: expected micro_batches >= 1, got ",
             options_.micro_batches);
  const int p = groups_.num_stages, s = groups_.stage;
  KILN_CHECK(s != p - 1 || loss_fn_, ValueError, "parallel::Pipeline: the last stage (", s,
             ") needs a loss function; got none");
  KILN_CHECK(tied_.empty() || p == 1 || s == 0 || s == p - 1, ValueError, "parallel::Pipeline: stage ", s, " of ", p,
             " was given ", tied_.size(), " tied parameters; only the first and the last stage hold tied copies");
  if (p == 1) tied_.clear();  // one stage holds the weight once: nothing to sum
  for (const auto& t : tied_) {
    KILN_CHECK(t.defined() && t.dtype() == kFloat32 && t.is_contiguous(), ValueError,
               "parallel::Pipeline: expected tied parameters that are defined, contiguous float32, got ",
               t.defined() ? dtype_name(t.dtype()) : "an undefined tensor");
  }
  if (groups_.ends && (s == 0 || s == p - 1)) {
    // Both ends must hold the same number of tied copies, or their gradient
    // sums would not pair up: compare the counts (both ends throw alike).
    dist::CollectiveLabel l("pipeline tied weights: the ends compare their counts");
    Tensor mine = full({1}, static_cast<double>(tied_.size()), TensorOptions(kInt64));
    std::vector<Tensor> both = {empty({1}, TensorOptions(kInt64)), empty({1}, TensorOptions(kInt64))};
    groups_.ends->allgather(both, mine)->wait();
    const int64_t a = both[0].item<int64_t>(), b = both[1].item<int64_t>();
    KILN_CHECK(a == b, ValueError, "parallel::Pipeline: the first and the last stage must pass the same number of ",
               "tied parameters, got ", groups_.ends->ranks()[0] == groups_.ranks.front() ? a : b, " on stage 0 and ",
               groups_.ends->ranks()[0] == groups_.ranks.front() ? b : a, " on stage ", p - 1);
  }
  if (!tied_.empty()) {
    // The copies must start equal (the same seed makes them so; a checkpoint
    // loaded on one end only would not): take the first stage's values.
    dist::CollectiveLabel l("pipeline tied weights: first stage's values to the last stage");
    NoGradGuard no_grad;
    const int root = group_rank_of(*groups_.ends, groups_.ranks.front());
    for (auto& t : tied_) groups_.ends->broadcast(t, root)->wait();
  }
}

PipelineStepResult Pipeline::step(const Tensor& input, const Tensor& target) {
  const auto t_step = Clock::now();
  const int p = groups_.num_stages, s = groups_.stage;
  const int64_t M = options_.micro_batches;
  const bool first = s == 0, last = s == p - 1;
  auto split = [&](const Tensor& t, const char* what) {
    KILN_CHECK(t.defined() && t.dim() >= 1 && t.size(0) % M == 0, ShapeError, "parallel::Pipeline::step: stage ", s,
               " expected ", what, " whose batch (dim 0) divides into ", M, " micro-batches, got ",
               t.defined() ? t.shape_string() : std::string("an undefined tensor"));
    std::vector<Tensor> parts;
    const int64_t b = t.size(0) / M;
    for (int64_t m = 0; m < M; ++m) parts.push_back(t.narrow(0, m * b, b));
    return parts;
  };
  std::vector<Tensor> in_mb, tgt_mb;
  if (first) in_mb = split(input, "an input");
  if (last) tgt_mb = split(target, "a target");

  StageStats st;
  st.stage = s;
  auto activation_bytes = [] { return memory::stats()[MemoryCategory::Activation].live_bytes; };
  const int64_t activations_before = activation_bytes();
  double loss_sum = 0;
  int64_t slot = 0, in_flight = 0;
  std::vector<Tensor> xs(static_cast<size_t>(M)), ys(static_cast<size_t>(M));
  std::vector<dist::WorkPtr> sends;
  std::vector<Tensor> tied_before;  // what the tied copies' .grad held before this step
  for (auto& t : tied_) {
    tied_before.push_back(t.grad());
    t.mutable_grad() = {};
  }

  // Note [Pipeline messages].
  auto send = [&](const dist::ProcessGroupPtr& g, int peer_stage, int64_t m, const Tensor& t, const char* what) {
    KILN_CHECK(t.dim() <= kMaxDims, ShapeError, "parallel::Pipeline: stage ", s, " can send tensors of up to ",
               kMaxDims, " dimensions, got ", t.shape_string());
    Tensor hdr = zeros({kHeader}, TensorOptions(kInt64));
    auto* h = hdr.data_ptr<int64_t>();
    h[0] = m, h[1] = slot, h[2] = static_cast<int64_t>(t.dtype()), h[3] = t.dim();
    for (int64_t d = 0; d < t.dim(); ++d) h[4 + d] = t.size(d);
    const int peer = group_rank_of(*g, groups_.ranks[static_cast<size_t>(peer_stage)]);
    dist::CollectiveLabel l(label(s, m, what, "send to", peer_stage));
    sends.push_back(g->send(hdr, peer, static_cast<int>(2 * m)));
    sends.push_back(g->send(t, peer, static_cast<int>(2 * m + 1)));
  };
  // Returns the tensor and the slot at which the sender's op ended.
  auto recv = [&](const dist::ProcessGroupPtr& g, int peer_stage, int64_t m, const char* what) {
    const auto t0 = Clock::now();
    const int peer = group_rank_of(*g, groups_.ranks[static_cast<size_t>(peer_stage)]);
    dist::CollectiveLabel l(label(s, m, what, "recv from", peer_stage));
    Tensor hdr = zeros({kHeader}, TensorOptions(kInt64));
    g->recv(hdr, peer, static_cast<int>(2 * m))->wait();
    const auto* h = hdr.data_ptr<int64_t>();
    KILN_CHECK(h[0] == m && h[3] >= 0 && h[3] <= kMaxDims, DistributedError, "parallel::Pipeline: stage ", s,
               " expected the header of micro-batch ", m, "'s ", what, " from stage ", peer_stage, ", got micro-batch ",
               h[0], " with ", h[3], " dimensions");
    std::vector<int64_t> shape(h + 4, h + 4 + h[3]);
    Tensor t = empty(shape, TensorOptions(static_cast<DType>(h[2])));
    g->recv(t, peer, static_cast<int>(2 * m + 1))->wait();
    st.wait_s += seconds_since(t0);
    return std::make_pair(t, h[1]);
  };

  for (const PipelineOp& op : schedule_ops(options_.schedule, s, p, M)) {
    const int64_t m = op.micro_batch;
    const auto mi = static_cast<size_t>(m);
    int64_t start = slot;
    if (op.forward) {
      Tensor x;
      if (first) {
        x = in_mb[mi];
      } else {
        auto [t, ready] = recv(groups_.fwd_in, s - 1, m, "activations forward");
        x = t;
        start = std::max(start, ready);
        if (is_floating_point(x.dtype())) x.requires_grad_(true);
      }
      const auto t0 = Clock::now();
      Tensor y = (*stage_)(x);
      if (last) {
        // Each micro-batch's mean loss counts 1/M, so that the summed
        // gradients are those of the whole batch's mean.
        y = loss_fn_(y, tgt_mb[mi]) * (1.0 / static_cast<double>(M));
        KILN_CHECK(y.numel() == 1, ShapeError, "parallel::Pipeline: the loss function must return one value, got ",
                   y.shape_string());
        loss_sum += y.item<double>();
      }
      KILN_CHECK(y.requires_grad(), ValueError, "parallel::Pipeline: stage ", s, "'s ", last ? "loss" : "output",
                 " of micro-batch ", m, " does not require grad, so no gradient could flow back through the pipeline");
      st.compute_s += seconds_since(t0);
      slot = start + 1;
      if (!last) send(groups_.fwd_out, s + 1, m, y.detach().contiguous(), "activations forward");
      xs[mi] = x;
      ys[mi] = y;
      st.peak_in_flight = std::max(st.peak_in_flight, ++in_flight);
    } else {
      Tensor gy;
      if (!last) {
        auto [t, ready] = recv(groups_.bwd_in, s + 1, m, "gradients backward");
        gy = t;
        start = std::max(start, ready);
      }
      const auto t0 = Clock::now();
      ys[mi].backward(gy);
      st.compute_s += seconds_since(t0);
      slot = start + 1;
      if (!first) {
        Tensor gx = xs[mi].grad();
        KILN_CHECK(gx.defined(), ValueError, "parallel::Pipeline: stage ", s, "'s input of micro-batch ", m,
                   " got no gradient; the stage's output must depend on its input");
        send(groups_.bwd_out, s - 1, m, gx.contiguous(), "gradients backward");
      }
      xs[mi] = {};  // this micro-batch's activations can go
      ys[mi] = {};
      --in_flight;
    }
    ++st.busy_slots;
    st.peak_held_activation_bytes = std::max(st.peak_held_activation_bytes, activation_bytes() - activations_before);
  }
  {
    const auto t0 = Clock::now();
    for (auto& w : sends) w->wait();
    st.wait_s += seconds_since(t0);
  }
  sum_tied_gradients(std::move(tied_before));
  st.last_slot = slot;
  st.total_s = seconds_since(t_step);
  return gather_stats(st, loss_sum);
}

double Pipeline::evaluate(const Tensor& input, const Tensor& target) {
  const int p = groups_.num_stages, s = groups_.stage;
  const bool first = s == 0, last = s == p - 1;
  NoGradGuard no_grad;
  // One message pair per link, as micro-batch 0 of a step (Note [Pipeline messages]).
  Tensor x = input;
  if (!first) {
    const int peer = group_rank_of(*groups_.fwd_in, groups_.ranks[static_cast<size_t>(s - 1)]);
    dist::CollectiveLabel l(label(s, 0, "evaluation activations forward", "recv from", s - 1));
    Tensor hdr = zeros({kHeader}, TensorOptions(kInt64));
    groups_.fwd_in->recv(hdr, peer, 0)->wait();
    const auto* h = hdr.data_ptr<int64_t>();
    KILN_CHECK(h[3] >= 0 && h[3] <= kMaxDims, DistributedError, "parallel::Pipeline::evaluate: stage ", s,
               " expected an activation header from stage ", s - 1, ", got one with ", h[3], " dimensions");
    x = empty(std::vector<int64_t>(h + 4, h + 4 + h[3]), TensorOptions(static_cast<DType>(h[2])));
    groups_.fwd_in->recv(x, peer, 1)->wait();
  }
  Tensor y = (*stage_)(x);
  double loss = 0;
  if (last) {
    loss = loss_fn_(y, target).item<double>();
  } else {
    y = y.contiguous();
    KILN_CHECK(y.dim() <= kMaxDims, ShapeError, "parallel::Pipeline: stage ", s, " can send tensors of up to ",
               kMaxDims, " dimensions, got ", y.shape_string());
    Tensor hdr = zeros({kHeader}, TensorOptions(kInt64));
    auto* h = hdr.data_ptr<int64_t>();
    h[2] = static_cast<int64_t>(y.dtype()), h[3] = y.dim();
    for (int64_t d = 0; d < y.dim(); ++d) h[4 + d] = y.size(d);
    const int peer = group_rank_of(*groups_.fwd_out, groups_.ranks[static_cast<size_t>(s + 1)]);
    dist::CollectiveLabel l(label(s, 0, "evaluation activations forward", "send to", s + 1));
    auto a = groups_.fwd_out->send(hdr, peer, 0);
    auto b = groups_.fwd_out->send(y, peer, 1);
    a->wait();
    b->wait();
  }
  if (p > 1) {
    // The double's bit pattern, exact (collectives carry no float64).
    dist::CollectiveLabel l("pipeline evaluation: the last stage's loss to every stage");
    Tensor bits = empty({1}, TensorOptions(kInt64));
    std::memcpy(bits.data_ptr<int64_t>(), &loss, sizeof loss);
    groups_.all->broadcast(bits, group_rank_of(*groups_.all, groups_.ranks.back()))->wait();
    std::memcpy(&loss, bits.data_ptr<int64_t>(), sizeof loss);
  }
  return loss;
}

// The tied copies' gradients: each end computed its own use's part; the
// weight's gradient in one process is the sum of both uses' (models::GPT
// holds one tensor), so each end adds the other's part. Only this step's
// part is exchanged: what .grad held before the step (accumulation over
// several steps) is set aside and added back, so it is not summed twice.
void Pipeline::sum_tied_gradients(std::vector<Tensor> before) {
  if (tied_.empty()) return;
  dist::CollectiveLabel l("pipeline tied weights: gradient sum of the first and the last stage");
  NoGradGuard no_grad;
  for (size_t i = 0; i < tied_.size(); ++i) {
    Tensor& g = tied_[i].mutable_grad();
    if (!g.defined()) g = zeros_like(tied_[i]);
    if (!g.is_contiguous()) g = g.contiguous();
    groups_.ends->allreduce(g, dist::ReduceOp::Sum)->wait();
    if (before[i].defined()) g.add_(before[i]);
  }
}

PipelineStepResult Pipeline::gather_stats(const StageStats& st, double loss_sum) {
  // Doubles travel as their bit patterns in an int64 allgather (exact).
  constexpr int64_t kFields = 9;
  const double mine[kFields] = {st.compute_s,
                                st.wait_s,
                                st.total_s,
                                static_cast<double>(st.peak_in_flight),
                                static_cast<double>(st.busy_slots),
                                static_cast<double>(st.last_slot),
                                loss_sum,
                                static_cast<double>(st.stage),
                                static_cast<double>(st.peak_held_activation_bytes)};
  Tensor in = empty({kFields}, TensorOptions(kInt64));
  std::memcpy(in.data_ptr<int64_t>(), mine, sizeof mine);
  const int p = groups_.num_stages;
  std::vector<Tensor> out;
  for (int r = 0; r < p; ++r) out.push_back(empty({kFields}, TensorOptions(kInt64)));
  {
    dist::CollectiveLabel l("pipeline step figures of every stage");
    groups_.all->allgather(out, in)->wait();
  }
  PipelineStepResult r;
  r.stages.resize(static_cast<size_t>(p));
  for (const auto& o : out) {
    double v[kFields];
    std::memcpy(v, o.data_ptr<int64_t>(), sizeof v);
    const auto stage = static_cast<int>(v[7]);
    StageStats& x = r.stages[static_cast<size_t>(stage)];
    x.stage = stage;
    x.compute_s = v[0], x.wait_s = v[1], x.total_s = v[2];
    x.peak_in_flight = static_cast<int64_t>(v[3]), x.busy_slots = static_cast<int64_t>(v[4]);
    x.last_slot = static_cast<int64_t>(v[5]);
    x.peak_held_activation_bytes = static_cast<int64_t>(v[8]);
    if (stage == p - 1) r.loss = v[6];
  }
  const int64_t M = options_.micro_batches;
  r.model_bubble = model_bubble(p, M);
  double compute = 0, longest = 0;
  for (const auto& x : r.stages) {
    r.slots = std::max(r.slots, x.last_slot);
    compute += x.compute_s;
    longest = std::max(longest, x.total_s);
  }
  r.slot_bubble = r.slots > 0 ? 1.0 - static_cast<double>(2 * M) / static_cast<double>(r.slots) : 0.0;
  r.wall_bubble = longest > 0 ? 1.0 - compute / (static_cast<double>(p) * longest) : 0.0;
  return r;
}

std::string PipelineStepResult::describe() const {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(3);
  os << "loss " << loss << "; bubble: model " << model_bubble << ", slots " << slot_bubble << " (" << slots
     << " slots), wall " << wall_bubble << "\n";
  os << "  stage | compute s | waiting s | step s | peak micro-batches in flight | peak activations held (KiB)\n";
  for (const auto& x : stages) {
    os << "  " << x.stage << " | " << x.compute_s << " | " << x.wait_s << " | " << x.total_s << " | "
       << x.peak_in_flight << " | " << static_cast<double>(x.peak_held_activation_bytes) / 1024.0 << "\n";
  }
  return os.str();
}

}  // namespace kiln::parallel
