// kiln::compile's fusion pass (compile_fusion.h): consecutive elementwise
// kernels over one iteration space become one loop over tiles of it, an
// intermediate that dies inside the run lives only in a tile-sized scratch,
// and a reduction of the run's result to one value reduces each tile as it is made.
//
// Why tiles and not a generated loop body: each kernel keeps its own
// vectorised row code, so a fused loop computes every element with exactly
// the instructions the unfused kernel used (bitwise equal results) while the
// tile an op has just written is still in L1/L2 when the next op reads it.
#include "compile_fusion.h"

#include <algorithm>
#include <array>
#include <numeric>
#include <optional>
#include <sstream>
#include <string_view>

#include "kiln/core/allocator.h"
#include "kiln/core/parallel.h"
#include "kiln/core/threads.h"

namespace kiln::compile_detail {

namespace {

using capture::Loop;

// Elements per tile: a multiple of 256, because the kernels vectorise rows in
// steps of at most 64 elements and convert in blocks of 256 from a row's
// start, so a tile's rows begin where the unfused row had a vector (and
// thread split) boundary anyway, and the tail of the space is the same tail.
// Sized so that a tile of every operand fits in a quarter of L2 (256 KiB),
// within bounds that keep the per-tile call overhead small.
constexpr int64_t kTileBytes = int64_t{256} << 10;
constexpr int64_t kMinTileElems = 1024, kMaxTileElems = int64_t{1} << 16;
// A tile larger than this (a space whose outermost slice alone is large)
// keeps its intermediates in memory: scratch must stay cache-sized.
constexpr int64_t kMaxScratchElems = kMaxTileElems;

struct Extent {
  uintptr_t lo = 0, hi = 0;  // [lo, hi)
};

Extent extent(const Loop& l, int op) {
  int64_t lo = 0, hi = 0;
  for (int d = 0; d < l.ndim; ++d) {
    const int64_t span = (l.sizes[d] - 1) * l.strides[op][d];
    (span < 0 ? lo : hi) += span;
  }
  const auto base = reinterpret_cast<uintptr_t>(l.data[op]);
  return {base + static_cast<uintptr_t>(lo),
          base + static_cast<uintptr_t>(hi) + static_cast<uintptr_t>(l.elem_size[op])};
}

bool overlaps(const Extent& a, const Extent& b) { return a.lo < b.hi && b.lo < a.hi; }

bool same_space(const Loop& a, const Loop& b) {
  if (a.ndim != b.ndim) return false;
  for (int d = 0; d < a.ndim; ++d)
    if (a.sizes[d] != b.sizes[d]) return false;
  return true;
}

/// `l` as a loop over `space`'s sizes: itself when it has them, and a 1-D loop
/// of as many elements viewed in their order (position (i0, i1, ...) is its
/// element i0 + s0 i1 + ...). A fused loop runs such a loop on 1-D ranges of
/// whole tiles; the view is what its operands are compared in.
Loop view_in(const Loop& l, const Loop& space) {
  if (l.ndim == space.ndim) return l;
  Loop v = l;
  v.ndim = space.ndim;
  std::copy(space.sizes, space.sizes + space.ndim, v.sizes);
  for (int op = 0; op < l.nops; ++op) {
    int64_t st = l.strides[op][0];
    for (int d = 0; d < space.ndim; ++d) {
      v.strides[op][d] = st;
      st *= space.sizes[d];
    }
  }
  return v;
}

/// The space a run and `b` share, when they can share one: equal sizes, or a
/// 1-D loop of as many elements beside a multi-dimensional one (a broadcast
/// add, whose loop is 2-D, and the ReLU on its result, 1-D).
bool joint_space(const Loop& space, const Loop& b, Loop& out) {
  if (same_space(space, b)) {
    out = space;
    return true;
  }
  if (b.numel() != space.numel()) return false;
  if (b.ndim == 1) {
    out = space;
    return true;
  }
  if (space.ndim == 1) {
    out = b;
    return true;
  }
  return false;
}

/// Operand `oa` of `a` and `ob` of `b` (same space) address the same element at every position.
bool same_mapping(const Loop& a, int oa, const Loop& b, int ob) {
  if (a.data[oa] != b.data[ob] || a.elem_size[oa] != b.elem_size[ob]) return false;
  for (int d = 0; d < a.ndim; ++d)
    if (a.sizes[d] > 1 && a.strides[oa][d] != b.strides[ob][d]) return false;
  return true;
}

bool fusable(const Loop& l) {
  if (l.ndim < 1 || l.nops < 1 || l.numel() <= 0) return false;
  for (int op = 0; op < l.nops; ++op)
    if (l.elem_size[op] <= 0) return false;
  // Every position writes its own element: tiles may then run in any order.
  for (int d = 0; d < l.ndim; ++d)
    if (l.sizes[d] > 1 && l.strides[0][d] == 0) return false;
  return true;
}

/// `b` may join `group` (all viewed in `space`): whatever one writes, the
/// other touches either at the same element of the same position or not at all.
bool compatible(const std::vector<const Loop*>& group, const Loop& b, const Loop& space) {
  const Loop vb = view_in(b, space);
  for (const Loop* g : group) {
    const Loop a = view_in(*g, space);
    for (int oa = 0; oa < a.nops; ++oa) {
      const Extent ea = extent(a, oa);
      for (int ob = 0; ob < vb.nops; ++ob) {
        if (oa != 0 && ob != 0) continue;  // two reads never conflict
        if (overlaps(ea, extent(vb, ob)) && !same_mapping(a, oa, vb, ob)) return false;
      }
    }
  }
  return true;
}

bool covered(const Extent& e, const std::vector<std::pair<void*, size_t>>& blocks) {
  for (const auto& [p, n] : blocks) {
    const auto lo = reinterpret_cast<uintptr_t>(p);
    if (e.lo >= lo && e.hi <= lo + n) return true;
  }
  return false;
}

/// This thread's scratch for fused loops, at least `bytes`, from kiln's allocator: memory
/// statistics count it as workspace, as the kernels' own scratch.
char* tile_scratch(size_t bytes) {
  struct Block {
    void* p = nullptr;
    size_t n = 0;
    ~Block() { memory::deallocate(p, n, MemoryCategory::Workspace); }
  };
  thread_local Block b;
  if (b.n < bytes) {
    memory::deallocate(b.p, b.n, MemoryCategory::Workspace);
    b.p = nullptr;
    b.n = 0;
    b.p = memory::allocate(bytes, MemoryCategory::Workspace);
    b.n = bytes;
  }
  return static_cast<char*>(b.p);
}

/// The fused loop: tiles of the outermost dim (the only one for a 1-D space).
class FusedLoop {
 public:
  std::vector<std::shared_ptr<const LoopRecord>> ops;
  std::vector<std::array<int, capture::kLoopOperands>> slot;  // per op and operand: scratch slot, or -1
  std::vector<uint8_t> flat;  // per op: a 1-D loop in a multi-dimensional space (run on linear ranges)
  int nslots = 0;
  int dim = 0;             // the tiled dim
  int64_t tiled_size = 1;  // its size
  int64_t inner = 1;       // elements per index of it
  int64_t step = 1;        // its indices per tile
  int64_t tiles = 0;
  int64_t tile_elems = 0;
  // A reduction that ends the run: it reduces the pieces of each tile of the array op
  // `red_src` writes (from its scratch slot `red_slot`, or from memory when -1) into
  // `accs`, one accumulator per piece, and combines them once every tile is done.
  std::shared_ptr<const capture::Reduction> red;
  int red_slot = -1;
  std::unique_ptr<unsigned char[]> accs;

  void run() const {
    const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(tile_elems, 1));
    parallel_for(tiles, grain, [this](int64_t b, int64_t e) { run_tiles(b, e); });
    if (red) red->finish(accs.get(), (red->numel + red->piece - 1) / red->piece);
  }

 private:
  void run_tiles(int64_t b, int64_t e) const {
    // Slots start on cache lines and lie a few lines more than a tile apart, so that an op's
    // loads from one slot and stores to the next do not alias at 4 KiB.
    const auto slot_bytes = static_cast<size_t>(tile_elems) * 8 + 320;
    char* const slots = nslots > 0 ? tile_scratch(slot_bytes * static_cast<size_t>(nslots)) : nullptr;
    Loop part;
    for (int64_t t = b; t < e; ++t) {
      const int64_t lo = t * step;
      for (size_t k = 0; k < ops.size(); ++k) {
        const Loop& base = ops[k]->loop;
        Loop& l = part;  // only the dims and operands in use are copied
        capture::copy_loop_shape(l, base);
        for (int op = 0; op < base.nops; ++op) l.elem_size[op] = base.elem_size[op];
        const int64_t len = std::min(step, tiled_size - lo);
        // A flat loop runs on the linear range of the tile's rows.
        const int ldim = flat[k] ? 0 : dim;
        const int64_t first = flat[k] ? lo * inner : lo;
        l.sizes[ldim] = flat[k] ? len * inner : len;
        for (int op = 0; op < l.nops; ++op) {
          const int s = slot[k][static_cast<size_t>(op)];
          if (s < 0) {
            l.data[op] += first * l.strides[op][ldim];
            continue;
          }
          l.data[op] = slots + static_cast<size_t>(s) * slot_bytes;
          int64_t st = l.elem_size[op];
          for (int d = 0; d < l.ndim; ++d) {
            l.strides[op][d] = st;
            st *= l.sizes[d];
          }
        }
        ops[k]->run(l);
      }
      if (red) reduce_tile(lo, slots, slot_bytes);
    }
  }

  // Tiles start at multiples of the reduction's piece (make_fused), so each tile holds whole pieces.
  void reduce_tile(int64_t lo, const char* slots, size_t slot_bytes) const {
    const int64_t first = lo * inner, end = std::min(tiled_size, lo + step) * inner;
    const char* base =
        red_slot >= 0 ? slots + static_cast<size_t>(red_slot) * slot_bytes : red->in + first * red->elem_size;
    for (int64_t at = first; at < end; at += red->piece)
      red->reduce_piece(base + (at - first) * red->elem_size, std::min(red->piece, end - at),
                        accs.get() + (at / red->piece) * red->acc_size);
  }
};

std::string space_str(const Loop& l) {
  std::ostringstream os;
  os << '[';
  for (int d = l.ndim - 1; d >= 0; --d) os << l.sizes[d] << (d ? ", " : "");
  os << ']';
  return os.str();
}

/// A fused loop's origin: the first kernel's line, the ops of all of them.
EventOrigin fused_origin(const std::vector<Recorded>& ops, size_t g0, size_t g_last) {
  EventOrigin o = ops[g0].origin;
  o.op.clear();
  std::vector<std::string_view> seen;
  for (size_t k = g0; k <= g_last; ++k) {
    const std::string& op = ops[k].origin.op;
    if (op.empty() || std::find(seen.begin(), seen.end(), op) != seen.end()) continue;
    seen.push_back(op);
    o.op += (o.op.empty() ? "" : ", ") + op;
  }
  return o;
}

/// Builds the fused loop for ops[g0, g1], whose iteration space is `space`, and says what it did.
/// With `red_src` set, ops[g1 + 1] is a reduction of what ops[*red_src] writes, and joins the loop.
Recorded make_fused(std::vector<Recorded>& ops, size_t g0, size_t g1, const Loop& space, std::optional<size_t> red_src,
                    const std::vector<std::pair<void*, size_t>>& freed_at_end, FusionReport& report) {
  const size_t g_last = red_src ? g1 + 1 : g1;
  auto f = std::make_shared<FusedLoop>();
  if (red_src) f->red = ops[g1 + 1].reduce;
  f->dim = space.ndim - 1;
  const int64_t outer = space.sizes[f->dim];
  const int64_t inner = space.numel() / outer;
  f->inner = inner;
  f->tiled_size = outer;
  std::vector<Loop> views;  // the run's loops in its space
  bool any_flat = false;
  for (size_t k = g0; k <= g1; ++k) {
    const Loop& l = ops[k].loop->loop;
    f->flat.push_back(l.ndim != space.ndim ? 1 : 0);
    any_flat = any_flat || l.ndim != space.ndim;
    views.push_back(view_in(l, space));
  }
  auto view = [&](size_t k) -> const Loop& { return views[k - g0]; };
  std::vector<const char*> seen;
  int64_t bytes_per_elem = 0;  // over the distinct arrays the run touches
  for (size_t k = g0; k <= g1; ++k) {
    const Loop& l = ops[k].loop->loop;
    for (int op = 0; op < l.nops; ++op) {
      if (std::find(seen.begin(), seen.end(), l.data[op]) != seen.end()) continue;
      seen.push_back(l.data[op]);
      bytes_per_elem += l.elem_size[op];
    }
  }
  int64_t tile =
      std::clamp(kTileBytes / std::max<int64_t>(bytes_per_elem, 1), kMinTileElems, kMaxTileElems) / 256 * 256;
  // A run that fits in L2 as a whole and that no kernel would split across threads is one
  // tile: more would only add calls.
  if (space.numel() * bytes_per_elem <= 4 * kTileBytes && space.numel() < kGrainSize) tile = space.numel();
  f->step = f->dim == 0 ? tile : std::max<int64_t>(1, tile / inner);
  if (any_flat && f->step < outer) {
    // A flat loop's ranges must start at multiples of 256 elements, as a 1-D tile's do.
    const int64_t q = 256 / std::gcd(inner, int64_t{256});
    f->step = std::max(q, f->step / q * q);
  }
  if (f->red && f->step < outer && (f->step * inner) % f->red->piece != 0)
    f->step = f->red->piece % inner == 0 ? f->red->piece / inner : outer;  // tiles of whole pieces
  f->step = std::min(f->step, outer);
  f->tiles = (outer + f->step - 1) / f->step;
  f->tile_elems = f->step * inner;
  const bool scratch_ok = f->tile_elems <= kMaxScratchElems;

  // Blocks freed after each op of the run and before the first op after it.
  std::vector<std::pair<void*, size_t>> freed_later;
  auto freed_from = [&](size_t k) {  // freed after op k, up to the end of the run
    freed_later.clear();
    for (size_t j = k + 1; j <= g_last; ++j)
      freed_later.insert(freed_later.end(), ops[j].freed_before.begin(), ops[j].freed_before.end());
    const auto& tail = g_last + 1 < ops.size() ? ops[g_last + 1].freed_before : freed_at_end;
    freed_later.insert(freed_later.end(), tail.begin(), tail.end());
    return freed_later;
  };

  struct Value {
    size_t writer;  // index into the run
    int slot;
    size_t last_use;
  };
  std::vector<Value> in_scratch;  // dead intermediates currently held in a slot
  std::vector<int> free_slots;
  int64_t unwritten = 0;
  std::ostringstream names;
  for (size_t k = g0; k <= g1; ++k) {
    const Loop& l = view(k);
    f->ops.push_back(ops[k].loop);
    std::array<int, capture::kLoopOperands> s{};
    s.fill(-1);
    for (int op = 1; op < l.nops; ++op)
      for (const Value& v : in_scratch)
        if (same_mapping(view(v.writer), 0, l, op)) s[static_cast<size_t>(op)] = v.slot;
    // The value op k writes replaces whatever its elements held.
    std::erase_if(in_scratch, [&](const Value& v) {
      if (!same_mapping(view(v.writer), 0, l, 0)) return false;
      free_slots.push_back(v.slot);
      return true;
    });
    // Dead after the run: overwritten by a later op of it, or its block freed before anything else ran.
    bool dead = false;
    size_t last_use = k;
    if (scratch_ok) {
      const Extent e = extent(l, 0);
      bool overwritten = false;
      for (size_t j = k + 1; j <= g1 && !overwritten; ++j) {
        const Loop& lj = view(j);
        for (int op = 1; op < lj.nops; ++op)
          if (same_mapping(l, 0, lj, op)) last_use = j;
        overwritten = same_mapping(l, 0, lj, 0);
      }
      dead = overwritten || covered(e, freed_from(k));
    }
    if (red_src && *red_src == k) last_use = g1 + 1;  // the reduction reads it after the tile's last op
    if (dead) {
      int slot = -1;
      for (size_t i = 0; i < free_slots.size(); ++i) {
        // Not a slot this op reads: an input and the output of other element sizes must not share one.
        if (std::find(s.begin() + 1, s.end(), free_slots[i]) != s.end()) continue;
        slot = free_slots[i];
        free_slots.erase(free_slots.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
      if (slot < 0) slot = f->nslots++;
      s[0] = slot;
      if (red_src && *red_src == k) f->red_slot = slot;
      in_scratch.push_back({k, slot, last_use});
      unwritten += l.numel() * l.elem_size[0];
    }
    f->slot.push_back(s);
    // Slots whose value no later op of the run reads are free again.
    std::erase_if(in_scratch, [&](const Value& v) {
      if (v.last_use > k || v.writer == k) return false;
      free_slots.push_back(v.slot);
      return true;
    });
    names << (k > g0 ? ", " : "") << ops[k].name;
  }
  if (f->red) {
    names << ", " << ops[g_last].name;
    const int64_t pieces = (f->red->numel + f->red->piece - 1) / f->red->piece;
    f->accs = std::make_unique<unsigned char[]>(static_cast<size_t>(pieces * f->red->acc_size));
  }
  Recorded r{"fused loop",
             false,
             [f] { f->run(); },
             nullptr,
             nullptr,
             "fused(" + names.str() + ")",
             {},
             nullptr,
             std::nullopt,
             fused_origin(ops, g0, g_last)};
  std::ostringstream line;
  line << r.fused_name << " over " << space_str(space) << ", " << f->tiles << (f->tiles == 1 ? " tile" : " tiles");
  if (f->red) line << ", reduced tile by tile";
  if (unwritten) line << ", " << unwritten << " bytes of intermediates not written";
  report.lines.push_back(line.str());
  report.unwritten_bytes += unwritten;
  ++report.groups;
  report.kernels += static_cast<int64_t>(g_last - g0 + 1);
  return r;
}

/// When ops[j + 1] reduces to one value the whole array that an op of the run ops[i, j]
/// writes last, in the order of the run's space: that op. Tiles must then hold whole
/// pieces of the reduction, which needs the elements per index of the tiled dim to divide
/// a piece or be a multiple of one (or the run to be one tile).
std::optional<size_t> reduced_output(const std::vector<Recorded>& ops, size_t i, size_t j, const Loop& space) {
  if (j + 1 >= ops.size() || !ops[j + 1].reduce) return std::nullopt;
  const capture::Reduction& r = *ops[j + 1].reduce;
  const int64_t inner = space.numel() / space.sizes[space.ndim - 1];
  if (r.numel != space.numel() || r.piece <= 0 || !(r.numel <= r.piece || r.piece % inner == 0 || inner % r.piece == 0))
    return std::nullopt;
  for (size_t k = j + 1; k-- > i;) {
    const Loop v = view_in(ops[k].loop->loop, space);
    if (v.data[0] != r.in) continue;
    if (v.elem_size[0] != r.elem_size) return std::nullopt;
    int64_t st = r.elem_size;
    for (int d = 0; d < v.ndim; ++d) {
      if (v.sizes[d] > 1 && v.strides[0][d] != st) return std::nullopt;
      st *= v.sizes[d];
    }
    return k;  // the last writer: no later op of the run writes these elements
  }
  return std::nullopt;
}

}  // namespace

FusionReport fuse_elementwise(std::vector<Recorded>& ops, const std::vector<std::pair<void*, size_t>>& freed_at_end) {
  FusionReport report;
  std::vector<Recorded> out;
  out.reserve(ops.size());
  size_t i = 0;
  while (i < ops.size()) {
    size_t j = i;
    Loop space;  // the run's iteration space
    if (ops[i].loop && fusable(ops[i].loop->loop)) {
      space = ops[i].loop->loop;
      std::vector<const Loop*> group{&ops[i].loop->loop};
      Loop joint;
      while (j + 1 < ops.size() && ops[j + 1].loop && fusable(ops[j + 1].loop->loop) &&
             joint_space(space, ops[j + 1].loop->loop, joint) && compatible(group, ops[j + 1].loop->loop, joint)) {
        group.push_back(&ops[++j].loop->loop);
        space = joint;
      }
    }
    const std::optional<size_t> src =
        ops[i].loop && fusable(ops[i].loop->loop) ? reduced_output(ops, i, j, space) : std::nullopt;
    if (j > i || src) {
      out.push_back(make_fused(ops, i, j, space, src, freed_at_end, report));
    } else {
      out.push_back(std::move(ops[i]));
    }
    i = src ? j + 2 : j + 1;
  }
  ops = std::move(out);
  return report;
}

}  // namespace kiln::compile_detail
