// kiln::compile's graph rewrites (compile_rewrite.h): ReLU then max pooling,
// run as max pooling then ReLU.
//
// Note [ReLU-pooling rewrite]
// A max pool of a ReLU is the ReLU of the max pool: the ReLU is monotone, so
// it keeps which element of a window is largest, and the first maximum of a
// window of ReLU outputs is the first maximum of its inputs wherever that
// maximum is positive (or NaN). The rewrite pools the ReLU's input with a
// pool that applies the ReLU to each maximum as it writes it, so the
// full-size ReLU output is never written. The same pool marks, in the
// workspace byte that tells the backward where each maximum was, the windows
// whose maximum the ReLU's backward would mask (<= its threshold): the pool's
// backward then routes nothing there and writes what threshold_backward would
// have, so neither the pool's full-size gradient nor threshold_backward's
// full-size pass over it remains.
//
// Where a window's maximum is not positive, the two may route its gradient
// to different elements of the window, but both mask it to zero: the
// gradient is the same. The values are the same but for the sign of a zero:
// a window [-1, -0.0] pools to +0 (the ReLU of -1, first) as recorded and to
// the ReLU of -0.0, which keeps the sign, rewritten. The backward holds only
// for a threshold >= 0 (the ReLU's is 0), which the rewrite checks.
//
// What makes it safe is the record, not the model's code: the ReLU op and the
// pool's backward op watch their outputs (capture::watch), so the capture
// knows every op that took the address of those bytes. The rewrite applies
// only when the ReLU's output is read by the pool and the ReLU's backward and
// by nothing else, its gradient by nothing before the ReLU's backward writes
// its result over it, and the output dies inside the step. The ReLU's output
// block, no longer written, holds the workspace; the pooled output is written
// where the ReLU ran, so its block must not have held a live tensor then.
#include "compile_rewrite.h"

#include <cstring>
#include <map>
#include <sstream>

#include "kiln/core/capture.h"

namespace kiln::compile_detail {

namespace {

using capture::Loop;

int64_t dense_bytes(const Loop& l, int op) {  // the bytes a dense operand spans, or -1
  int64_t n = l.elem_size[op];
  for (int d = 0; d < l.ndim; ++d) {
    if (l.sizes[d] == 1) continue;
    if (l.strides[op][d] < 0) return -1;
  }
  int64_t span = 0;
  for (int d = 0; d < l.ndim; ++d) span += (l.sizes[d] - 1) * l.strides[op][d];
  n += span;
  return n == l.numel() * l.elem_size[op] ? n : -1;
}

bool same_layout(const Loop& l, int a, int b) {
  if (l.elem_size[a] != l.elem_size[b]) return false;
  for (int d = 0; d < l.ndim; ++d)
    if (l.sizes[d] != 1 && l.strides[a][d] != l.strides[b][d]) return false;
  return true;
}

bool freed_after(const std::vector<Recorded>& ops, size_t k, const std::vector<std::pair<void*, size_t>>& at_end,
                 const void* block) {
  for (size_t j = k + 1; j < ops.size(); ++j)
    for (const auto& f : ops[j].freed_before)
      if (f.first == block) return true;
  for (const auto& f : at_end)
    if (f.first == block) return true;
  return false;
}

bool is_operands(const Recorded& r, const char* what) {
  return !r.host && r.operands && std::strcmp(r.operands->ops.what, what) == 0;
}

bool is_loop(const Recorded& r, const char* name, int nops) {
  return !r.host && r.loop && std::strcmp(r.name, name) == 0 && r.loop->loop.nops == nops;
}

Recorded operands_event(const char* name, const Recorded& like, const capture::Operands& o) {
  auto rec = std::make_shared<const OperandsRecord>(OperandsRecord{o, like.operands->run});
  Recorded r{name, false, [rec] { rec->run(rec->ops); }, nullptr, nullptr, {}, {}, rec, std::nullopt, like.origin};
  return r;
}

// Removes the dropped events, each one's frees carried to the next event kept
// (or to the end); returns each old event's new index.
std::vector<size_t> drop_events(std::vector<Recorded>& ops, const std::vector<char>& dropped,
                                std::vector<std::pair<void*, size_t>>& freed_at_end) {
  std::vector<size_t> map(ops.size(), RewriteReport::kDropped);
  std::vector<Recorded> out;
  out.reserve(ops.size());
  std::vector<std::pair<void*, size_t>> carried;  // frees of a dropped event, due before the next one
  for (size_t i = 0; i < ops.size(); ++i) {
    if (dropped[i]) {
      carried.insert(carried.end(), ops[i].freed_before.begin(), ops[i].freed_before.end());
      continue;
    }
    Recorded r = std::move(ops[i]);
    r.freed_before.insert(r.freed_before.begin(), carried.begin(), carried.end());
    carried.clear();
    map[i] = out.size();
    out.push_back(std::move(r));
  }
  freed_at_end.insert(freed_at_end.begin(), carried.begin(), carried.end());
  ops = std::move(out);
  return map;
}

struct Match {
  size_t relu, pool, pool_bwd, relu_bwd;
  char* scratch;  // the ReLU output's block
  int64_t relu_bytes, pooled_bytes;
};

// The pattern of the Note for one watched ReLU output, or nothing and `why` not (for the log).
std::optional<Match> match(const std::vector<Recorded>& ops, const WatchRecord& relu_out,
                           const std::multimap<const void*, const WatchRecord*>& grads,
                           const std::vector<std::pair<void*, size_t>>& at_end, std::string& why) {
  auto no = [&why](std::string reason) -> std::optional<Match> {
    why = std::move(reason);
    return std::nullopt;
  };
  if (relu_out.at == 0 || relu_out.accesses.empty()) return no("nothing reads it");
  Match m{};
  m.relu = relu_out.at - 1;
  const Recorded& relu = ops[m.relu];
  if (!is_loop(relu, "unary", 2) || relu.loop->loop.data[0] != relu_out.data) return no("not the ReLU kernel's output");
  const Loop& rl = relu.loop->loop;
  m.relu_bytes = dense_bytes(rl, 0);
  if (m.relu_bytes < 0 || dense_bytes(rl, 1) != m.relu_bytes || !same_layout(rl, 0, 1))
    return no("input and output are not dense in one layout");
  const auto rlo = reinterpret_cast<uintptr_t>(rl.data[0]), clo = reinterpret_cast<uintptr_t>(rl.data[1]);
  if (rlo < clo + static_cast<uintptr_t>(m.relu_bytes) && clo < rlo + static_cast<uintptr_t>(m.relu_bytes))
    return no("in place");
  // Read by the pool right after it, then by one op in the backward (threshold_backward), and by nothing else.
  m.pool = m.relu + 1;
  m.relu_bwd = relu_out.accesses.back();
  for (size_t a : relu_out.accesses)
    if (a != m.pool && a != m.relu_bwd) return no("read by another op (before event " + std::to_string(a) + ")");
  if (m.pool >= ops.size() || m.relu_bwd <= m.pool || m.relu_bwd >= ops.size()) return no("not read in a backward");
  const Recorded& pool = ops[m.pool];
  if (!is_operands(pool, "max_pool_nhwc_forward") || pool.operands->ops.ptr[0] != relu_out.data ||
      pool.operands->ops.bytes[0] != m.relu_bytes)
    return no("not pooled next by a channels-last max pool with a workspace");
  m.pooled_bytes = pool.operands->ops.bytes[1];
  const Recorded& tb = ops[m.relu_bwd];
  if (!is_loop(tb, "threshold_backward", 3) || !tb.scalar || !(*tb.scalar >= 0.0))
    return no("its last reader is not threshold_backward with a threshold >= 0");
  const Loop& tl = tb.loop->loop;
  if (tl.data[2] != relu_out.data) return no("threshold_backward does not mask by it");
  if (tl.data[0] != tl.data[1]) return no("threshold_backward does not write over the gradient");
  if (dense_bytes(tl, 0) != m.relu_bytes || !same_layout(tl, 0, 2) || !same_layout(tl, 0, 1) ||
      tl.elem_size[0] != rl.elem_size[0])
    return no("threshold_backward's operands are not dense in the ReLU's layout");
  // The pool's backward wrote that gradient, with the pool's workspace; nothing read it before the ReLU's backward.
  const WatchRecord* g = nullptr;  // the latest watch of that block before the ReLU's backward
  for (auto [it, end] = grads.equal_range(tl.data[1]); it != end; ++it)
    if (it->second->at > m.pool + 1 && it->second->at <= m.relu_bwd && (!g || it->second->at > g->at)) g = it->second;
  if (!g) return no("its gradient is not the pool's backward's output");
  m.pool_bwd = g->at - 1;
  for (size_t a : g->accesses)
    // From the ReLU's backward on, the block holds that backward's result, in both records.
    if (a < m.relu_bwd) return no("its gradient is read by another op (before event " + std::to_string(a) + ")");
  const Recorded& pb = ops[m.pool_bwd];
  if (!is_operands(pb, "max_pool_nhwc_backward") || pb.operands->ops.ptr[2] != tl.data[1] ||
      pb.operands->ops.ptr[1] != pool.operands->ops.ptr[2] || pb.operands->ops.bytes[2] != m.relu_bytes ||
      pb.operands->ops.bytes[0] != m.pooled_bytes)
    return no("its gradient is not written by the channels-last pool's backward");
  // The ReLU output's block is scratch until it is freed, which must happen inside the step.
  if (!freed_after(ops, m.relu_bwd, at_end, relu_out.data)) return no("it outlives the step");
  m.scratch = static_cast<char*>(const_cast<void*>(relu_out.data));
  if (pool.operands->ops.bytes[2] > m.relu_bytes) return no("the pool's workspace does not fit in its block");
  // The pool now runs where the ReLU ran: its output's block must not have held a tensor freed in between.
  const auto plo = reinterpret_cast<uintptr_t>(pool.operands->ops.ptr[1]);
  const uintptr_t phi = plo + static_cast<uintptr_t>(m.pooled_bytes);
  for (const auto& [block, bytes] : pool.freed_before) {
    const auto lo = reinterpret_cast<uintptr_t>(block);
    if (lo < phi && plo < lo + bytes) return no("the pooled output's block was in use when the ReLU ran");
  }
  return m;
}

}  // namespace

RewriteReport rewrite_relu_pooling(std::vector<Recorded>& ops, const std::vector<WatchRecord>& watches,
                                   std::vector<std::pair<void*, size_t>>& freed_at_end) {
  RewriteReport report;
  std::multimap<const void*, const WatchRecord*> grads;
  for (const WatchRecord& w : watches)
    if (w.role == "max_pool2d grad_input") grads.emplace(w.data, &w);
  std::vector<Match> found;
  std::vector<char> taken(ops.size(), 0);
  for (const WatchRecord& w : watches) {
    if (w.role != "relu output") continue;
    std::string why;
    const std::optional<Match> m = match(ops, w, grads, freed_at_end, why);
    if (!m) {  // said only of a ReLU that a max pool follows: the others are not candidates
      if (w.at < ops.size() && is_operands(ops[w.at], "max_pool_nhwc_forward"))
        report.lines.push_back("not rewritten: the relu before event " + std::to_string(w.at) + ": " + why);
      continue;
    }
    if (taken[m->relu] || taken[m->pool] || taken[m->pool_bwd] || taken[m->relu_bwd]) continue;
    taken[m->relu] = taken[m->pool] = taken[m->pool_bwd] = taken[m->relu_bwd] = 1;
    found.push_back(*m);
  }
  if (found.empty()) return report;

  // Each pair's ReLU becomes the pool with the ReLU, its pool's backward the same backward reading
  // the moved workspace; the pool and the ReLU's backward are dropped.
  std::vector<char> dropped(ops.size(), 0);
  for (const Match& m : found) {
    const Loop& relu = ops[m.relu].loop->loop;
    const int es = relu.elem_size[0];

    // The workspace moves to the ReLU output's block, the step's alone from before the ReLU
    // ran to its backward: the recorded one, allocated after the ReLU, may lie in a block that
    // still held a live tensor when the ReLU ran.
    const OperandsRecord& pool = *ops[m.pool].operands;
    capture::Operands fwd = pool.ops;
    fwd.ptr[0] = relu.data[1];  // the ReLU's input
    fwd.ptr[2] = m.scratch;
    fwd.has_scalar = true;
    fwd.scalar = *ops[m.relu_bwd].scalar;
    const OperandsRecord& pool_bwd = *ops[m.pool_bwd].operands;
    capture::Operands bwd = pool_bwd.ops;
    bwd.ptr[1] = m.scratch;

    std::ostringstream os;
    os << "rewritten: relu -> max_pool2d run as max_pool2d(relu) on " << m.relu_bytes / es << " elements pooled to "
       << m.pooled_bytes / es << " (events " << m.relu << ", " << m.pool << ", " << m.pool_bwd << ", " << m.relu_bwd
       << ")";
    report.lines.push_back(os.str());
    report.relu_pools += 1;
    report.unwritten_bytes += 2 * m.relu_bytes;

    Recorded pool_ev = operands_event("max_pool_nhwc_forward(relu)", ops[m.pool], fwd);
    pool_ev.freed_before = std::move(ops[m.relu].freed_before);
    ops[m.relu] = std::move(pool_ev);
    Recorded bwd_ev = operands_event("max_pool_nhwc_backward(relu)", ops[m.pool_bwd], bwd);
    bwd_ev.freed_before = std::move(ops[m.pool_bwd].freed_before);
    ops[m.pool_bwd] = std::move(bwd_ev);
    dropped[m.pool] = dropped[m.relu_bwd] = 1;
  }

  report.map = drop_events(ops, dropped, freed_at_end);
  return report;
}

std::vector<WatchRecord> remap_watches(const std::vector<WatchRecord>& watches, const std::vector<size_t>& map,
                                       size_t old_events) {
  if (map.empty()) return watches;
  // A position p (before event p) becomes the count of kept events before it.
  std::vector<size_t> at(old_events + 1, 0);
  for (size_t i = 0; i < old_events; ++i) at[i + 1] = at[i] + (map[i] != RewriteReport::kDropped ? 1 : 0);
  std::vector<WatchRecord> out;
  out.reserve(watches.size());
  for (const WatchRecord& w : watches) {
    WatchRecord r{w.id, w.data, w.role, at[std::min(w.at, old_events)], {}};
    for (size_t a : w.accesses)
      if (a >= old_events || map[a] != RewriteReport::kDropped) r.accesses.push_back(at[std::min(a, old_events)]);
    out.push_back(std::move(r));
  }
  return out;
}

namespace {

// A rewrite that runs a kernel and the one recorded right after it as one
// (the first's Operands::join_next decides whether they join and how), where
// the buffer the first writes is read by the second alone, as its watch
// shows, and dies inside the step.
struct Join {
  const char* first;  // the two kernels' Operands::what
  const char* second;
  int written;              // the first's operand that the second reads
  const char* role;         // the watch on that buffer
  const char* name;         // the joined event's
  bool first_origin;        // the joined event reports the first kernel's op and line (else the second's)
  const char* first_label;  // for the log
  const char* second_label;
  const char* buffer;  // "output", "gradient"
  const char* how;
  const char* refused;
};

RewriteReport join_adjacent(std::vector<Recorded>& ops, const std::vector<WatchRecord>& watches,
                            std::vector<std::pair<void*, size_t>>& freed_at_end, const Join& j,
                            int64_t RewriteReport::*count) {
  RewriteReport report;
  std::vector<char> dropped(ops.size(), 0);
  for (size_t a = 0; a + 1 < ops.size(); ++a) {
    const size_t b = a + 1;
    if (dropped[a] || !is_operands(ops[a], j.first) || !is_operands(ops[b], j.second)) continue;
    const Recorded &x = ops[a], &y = ops[b];
    auto no = [&](const std::string& why) {
      report.lines.push_back(std::string("not rewritten: the ") + j.first_label + " at event " + std::to_string(a) +
                             " into the " + j.second_label + " at event " + std::to_string(b) + ": " + why);
    };
    const capture::OperandsJoin join = x.operands->ops.join_next;
    auto joined = join ? join(x.operands->ops, y.operands->ops) : std::nullopt;
    if (!joined) {
      no(j.refused);
      continue;
    }
    void* buf = x.operands->ops.ptr[j.written];
    const WatchRecord* w = nullptr;
    for (const WatchRecord& r : watches)
      if (r.role == j.role && r.data == buf && r.at == a + 1) w = &r;
    bool others = false;
    if (w)
      for (size_t acc : w->accesses) others = others || acc != b;
    if (!w || others || !freed_after(ops, b, freed_at_end, buf)) {
      no(std::string("its ") + j.buffer +
         (!w       ? " was not watched"
          : others ? " is read by another op"
                   : " outlives the step"));
      continue;
    }
    const int64_t bytes = x.operands->ops.bytes[j.written];
    std::ostringstream os;
    os << "rewritten: " << j.how << " (" << bytes << " bytes of full-size " << j.buffer << " not written; events " << a
       << ", " << b << ")";
    report.lines.push_back(os.str());
    report.*count += 1;
    report.unwritten_bytes += bytes;
    auto rec = std::make_shared<const OperandsRecord>(OperandsRecord{joined->first, std::move(joined->second)});
    Recorded r{j.name, false,        [rec] { rec->run(rec->ops); },       nullptr, nullptr, {}, {},
               rec,    std::nullopt, j.first_origin ? x.origin : y.origin};
    r.freed_before = x.freed_before;
    r.freed_before.insert(r.freed_before.end(), y.freed_before.begin(), y.freed_before.end());
    ops[b] = std::move(r);
    ops[a].freed_before.clear();
    dropped[a] = 1;
  }
  if (report.*count > 0) report.map = drop_events(ops, dropped, freed_at_end);
  return report;
}

}  // namespace

// Note [Convolution inside the pool]
// The same first convolution's output (one input channel, kiln's direct
// forward) is read by the max pool after it and by nothing else once the
// ReLU-pooling rewrite has run the ReLU inside the pool: the convolution
// writes a full-size output for the pool to read back. The kernels layer's
// pooled forward computes the convolution rows each band of windows reads
// into a small scratch and pools them with the pool's own kernel, so the
// pooled values and workspace bytes are those of the two kernels in turn. The
// convolution's op watches its output; the rewrite applies only when the pool
// is the event right after the convolution, reads that output, nothing else
// does, and it is freed inside the step.
RewriteReport rewrite_conv_pools(std::vector<Recorded>& ops, const std::vector<WatchRecord>& watches,
                                 std::vector<std::pair<void*, size_t>>& freed_at_end) {
  return join_adjacent(
      ops, watches, freed_at_end,
      {"conv2d_forward_direct", "max_pool_nhwc_forward", 3, "conv2d output", "conv2d_forward_pooled", true, "conv2d",
       "max_pool2d", "output", "conv2d -> max_pool2d run as one, pooling each band of rows as it is computed",
       "the convolution or the pool is not one the pooled forward takes"},
      &RewriteReport::conv_pools);
}

// Note [Pool backward into the weight gradient]
// A convolution whose input needs no gradient (a network's first layer: its
// input is the data) has only a weight gradient in backward, and when a max
// pool read its output (through the ReLU-pooling rewrite's pool or not), the
// gradient it reads is the pool's backward's full-size output: the pool's
// output gradient at each window's maximum, zero elsewhere. Where that weight
// gradient takes the direct sum (Note [Few-channel weight gradient] in
// src/kernels/cpu/conv_direct.cpp), the kernels layer has a form that
// builds each pixel's gradient vector from the pool's output gradient and
// workspace as the pool's backward would and adds it in the same order, so
// the full-size gradient is neither written nor read back, with the same
// bits. The record shows when that is safe: the pool's backward watches its
// output, and the rewrite applies only when the weight gradient is the event
// right after the pool's backward (so the pool's inputs are as it left them),
// reads that output, nothing else reads it, and it is freed inside the step.
RewriteReport rewrite_pool_weight_grads(std::vector<Recorded>& ops, const std::vector<WatchRecord>& watches,
                                        std::vector<std::pair<void*, size_t>>& freed_at_end) {
  return join_adjacent(ops, watches, freed_at_end,
                       {"max_pool_nhwc_backward", "conv2d_backward_weight", 2, "max_pool2d grad_input",
                        "conv2d_backward_weight_pooled", false, "max_pool2d backward", "weight gradient", "gradient",
                        "max_pool2d backward -> conv2d weight gradient run as one, reading the pooled gradient",
                        "the convolution or the pool is not one the pooled weight gradient takes"},
                       &RewriteReport::pool_weight_grads);
}

}  // namespace kiln::compile_detail
