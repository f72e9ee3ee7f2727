// exporter::fuse_for_kiln (include/kiln/export/optimize.h): Conv and
// Gemm/MatMul chains into kiln.FusedConv / kiln.FusedGemm nodes for kiln's
// inference runtime. One chain at a time: find it on a fresh index, rewrite
// it, compact the graph, look again (graphs here have hundreds of nodes, so
// the quadratic walk costs microseconds and keeps every match on a
// consistent index).
#include <algorithm>
#include <cmath>
#include <set>

#include "graph_edit.h"
#include "kiln/core/error.h"
#include "kiln/export/optimize.h"

namespace kiln::exporter {
namespace {

using detail::GraphIndex;

bool near(std::optional<float> v, double want) { return v && std::abs(*v - want) <= 1e-6 * std::abs(want); }

// The operand of binary node n that is not `v` ("" when n does not read v once).
std::string other_operand(const Node& n, const std::string& v) {
  if (n.inputs.size() != 2) return {};
  if (n.inputs[0] == v && n.inputs[1] != v) return n.inputs[1];
  if (n.inputs[1] == v && n.inputs[0] != v) return n.inputs[0];
  return {};
}

struct Step {
  size_t node;
  std::string out;
};

// The node reading `v` alone, when it has op type `op`.
std::optional<size_t> next(const Graph& g, const GraphIndex& ix, const std::string& v, const char* op) {
  const auto r = ix.sole_reader(v);
  if (!r || g.nodes[*r].op_type != op || g.nodes[*r].outputs.size() != 1) return std::nullopt;
  return r;
}

// A binary node reading v and a scalar constant ≈ c; its output.
std::optional<std::string> scalar_step(const Graph& g, const GraphIndex& ix, const std::string& v, const char* op,
                                       double c, std::set<size_t>& nodes) {
  const auto n = next(g, ix, v, op);
  if (!n || !near(detail::scalar_value(ix, other_operand(g.nodes[*n], v)), c)) return std::nullopt;
  nodes.insert(*n);
  return g.nodes[*n].outputs[0];
}

struct Activation {
  std::string name;  // "relu", "gelu", "gelu_tanh"
  std::set<size_t> nodes;
  std::string out;
};

// GELU as capture writes it (capture.cpp's gelu), starting at x:
//   erf:  0.5 * (x * (erf(x * 1/sqrt2) + 1))
//   tanh: 0.5 * (x * (tanh((x + x*x*x * 0.044715) * sqrt(2/pi)) + 1))
// Every node reading x must be part of the pattern.
std::optional<Activation> match_gelu(const Graph& g, const GraphIndex& ix, const std::string& x) {
  if (ix.graph_outputs.count(x) || !ix.readers.count(x)) return std::nullopt;
  std::set<size_t> x_readers(ix.readers.at(x).begin(), ix.readers.at(x).end());
  Activation a;
  auto finish = [&](const std::string& u) -> std::optional<Activation> {
    // u = (tanh or erf) + 1 -> x * u -> * 0.5
    const auto m = next(g, ix, u, "Mul");
    if (!m || other_operand(g.nodes[*m], u) != x) return std::nullopt;
    a.nodes.insert(*m);
    const auto out = scalar_step(g, ix, g.nodes[*m].outputs[0], "Mul", 0.5, a.nodes);
    if (!out) return std::nullopt;
    std::set<size_t> readers_in = x_readers;
    for (size_t n : a.nodes) readers_in.erase(n);
    if (!readers_in.empty()) return std::nullopt;
    a.out = *out;
    return a;
  };
  for (size_t r : x_readers) {
    const Node& n = g.nodes[r];
    if (n.op_type != "Mul" || n.outputs.size() != 1) continue;
    if (near(detail::scalar_value(ix, other_operand(n, x)), 1.0 / std::sqrt(2.0))) {
      a = {"gelu", {r}, {}};
      const auto e = next(g, ix, n.outputs[0], "Erf");
      if (!e) return std::nullopt;
      a.nodes.insert(*e);
      const auto u = scalar_step(g, ix, g.nodes[*e].outputs[0], "Add", 1.0, a.nodes);
      if (!u) return std::nullopt;
      return finish(*u);
    }
    if (n.inputs.size() == 2 && n.inputs[0] == x && n.inputs[1] == x) {
      a = {"gelu_tanh", {r}, {}};
      const auto cube = next(g, ix, n.outputs[0], "Mul");
      if (!cube || other_operand(g.nodes[*cube], n.outputs[0]) != x) return std::nullopt;
      a.nodes.insert(*cube);
      const auto scaled = scalar_step(g, ix, g.nodes[*cube].outputs[0], "Mul", 0.044715, a.nodes);
      if (!scaled) return std::nullopt;
      const auto add = next(g, ix, *scaled, "Add");
      if (!add || other_operand(g.nodes[*add], *scaled) != x) return std::nullopt;
      a.nodes.insert(*add);
      const auto inner = scalar_step(g, ix, g.nodes[*add].outputs[0], "Mul", std::sqrt(2.0 / M_PI), a.nodes);
      if (!inner) return std::nullopt;
      const auto t = next(g, ix, *inner, "Tanh");
      if (!t) return std::nullopt;
      a.nodes.insert(*t);
      const auto u = scalar_step(g, ix, g.nodes[*t].outputs[0], "Add", 1.0, a.nodes);
      if (!u) return std::nullopt;
      return finish(*u);
    }
  }
  return std::nullopt;
}

std::optional<Activation> match_activation(const Graph& g, const GraphIndex& ix, const std::string& v, bool gelu) {
  if (const auto r = next(g, ix, v, "Relu")) return Activation{"relu", {*r}, g.nodes[*r].outputs[0]};
  if (gelu) return match_gelu(g, ix, v);
  return std::nullopt;
}

// An Add of v and a non-constant value of v's shape (the residual); its output.
std::optional<std::pair<size_t, std::string>> match_residual(const Graph& g, const GraphIndex& ix,
                                                             const std::string& v) {
  const auto a = next(g, ix, v, "Add");
  if (!a) return std::nullopt;
  const std::string r = other_operand(g.nodes[*a], v);
  if (r.empty() || ix.init(r) || g.values.at(r).shape != g.values.at(v).shape ||
      g.values.at(r).dtype != g.values.at(v).dtype)
    return std::nullopt;
  return std::make_pair(*a, r);
}

bool gemm_is_linear(const Node& n) {
  for (const auto& [k, v] : n.attributes) {
    if (k == "transB" && std::get<int64_t>(v) == 1) continue;
    if ((k == "transA" || k == "transB") && std::get<int64_t>(v) == 0) continue;
    if ((k == "alpha" || k == "beta") && std::get<float>(v) == 1.0f) continue;
    return false;
  }
  auto it = n.attributes.find("transB");
  return it != n.attributes.end() && std::get<int64_t>(it->second) == 1;
}

// Rewrites one chain starting at node i; false when node i starts none.
bool fuse_at(Graph& g, size_t i, FuseReport& r) {
  const GraphIndex ix(g);
  const Node& head = g.nodes[i];
  if (head.outputs.size() != 1) return false;
  std::set<size_t> absorbed;
  std::string x, w, b, cur = head.outputs[0];
  const bool conv = head.op_type == "Conv";
  if (conv) {
    if (head.inputs.size() < 2 || !ix.init(head.inputs[1])) return false;
    if (head.inputs.size() > 2 && !head.inputs[2].empty() && !ix.init(head.inputs[2])) return false;
    x = head.inputs[0];
    w = head.inputs[1];
    b = head.inputs.size() > 2 ? head.inputs[2] : "";
  } else if (head.op_type == "Gemm") {
    if (!gemm_is_linear(head) || !ix.init(head.inputs[1])) return false;
    if (head.inputs.size() > 2 && !head.inputs[2].empty()) {
      const Tensor* bt = ix.init(head.inputs[2]);
      if (!bt || bt->dim() != 1) return false;  // Gemm's C may broadcast other shapes
      b = head.inputs[2];
    }
    x = head.inputs[0];
    w = head.inputs[1];
  } else if (head.op_type == "MatMul") {
    // MatMul(x, Transpose(W)) as capture writes Linear on rank > 2.
    const auto t = ix.producer_of(head.inputs[1]);
    if (!t || g.nodes[*t].op_type != "Transpose" || !ix.init(g.nodes[*t].inputs[0])) return false;
    const Tensor* wt = ix.init(g.nodes[*t].inputs[0]);
    const auto& perm = std::get<std::vector<int64_t>>(g.nodes[*t].attributes.at("perm"));
    if (wt->dim() != 2 || perm != std::vector<int64_t>{1, 0}) return false;
    if (g.values.at(head.inputs[0]).shape.size() < 2) return false;
    x = head.inputs[0];
    w = g.nodes[*t].inputs[0];
    // Add(y, bias): a 1-D initializer of the output's width.
    if (const auto a = next(g, ix, cur, "Add")) {
      const std::string bias = other_operand(g.nodes[*a], cur);
      const Tensor* bt = ix.init(bias);
      if (bt && bt->dim() == 1 && bt->size(0) == wt->size(0)) {
        b = bias;
        absorbed.insert(*a);
        cur = g.nodes[*a].outputs[0];
      }
    }
  } else {
    return false;
  }
  std::string residual;
  if (const auto res = match_residual(g, ix, cur)) {
    absorbed.insert(res->first);
    residual = res->second;
    cur = g.nodes[res->first].outputs[0];
  }
  std::string act = "none";
  if (const auto a = match_activation(g, ix, cur, !conv)) {
    absorbed.insert(a->nodes.begin(), a->nodes.end());
    act = a->name;
    cur = a->out;
  }
  size_t last = i;
  for (size_t n : absorbed) last = std::max(last, n);
  Node fused;
  fused.name = head.name + (absorbed.empty() ? "" : "+fused");
  fused.op_type = conv ? "kiln.FusedConv" : "kiln.FusedGemm";
  fused.inputs = {x, w, b};
  if (!residual.empty()) fused.inputs.push_back(residual);
  fused.outputs = {cur};
  if (conv) fused.attributes = head.attributes;
  fused.attributes["activation"] = act;
  fused.attributes["residual"] = int64_t{residual.empty() ? 0 : 1};
  fused.module = head.module;
  fused.module_type = head.module_type;
  std::set<size_t> removed = absorbed;
  removed.insert(i);
  removed.erase(last);
  g.nodes[last] = std::move(fused);
  detail::compact(g, removed);
  ++(conv ? r.fused_conv : r.fused_gemm);
  r.absorbed += static_cast<int64_t>(absorbed.size());
  return true;
}

// The attention capture writes (capture.cpp's attention), from the qkv value:
//   Split(qkv, [d, d, d], axis 2) -> Reshape [0, 0, nh, hs] each -> Transpose
//   q (0 2 1 3), k (0 2 3 1), v (0 2 1 3); MatMul(q, kt) -> Mul(1/sqrt(hs))
//   [-> Add(causal mask, or a Slice of it)] -> Softmax(-1) -> MatMul(., v)
//   -> Transpose (0 2 1 3) -> Reshape [0, 0, d]
// becomes one kiln.Attention(qkv) with attributes n_head and causal. Returns
// false when the Split at node i does not start that pattern.
bool is_causal_mask(const Tensor* m) {
  if (!m || m->dim() != 2 || m->size(0) != m->size(1) || m->dtype() != kFloat32) return false;
  const Tensor c = m->contiguous();
  const float* p = c.data_ptr<float>();
  const int64_t n = m->size(0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j)
      if ((j > i) != (std::isinf(p[i * n + j]) && p[i * n + j] < 0) || (j <= i && p[i * n + j] != 0.0f)) return false;
  return true;
}

bool fuse_attention_at(Graph& g, size_t i, FuseReport& r) {
  const GraphIndex ix(g);
  const Node& split = g.nodes[i];
  if (split.op_type != "Split" || split.outputs.size() != 3 || split.inputs.size() != 2) return false;
  const std::string qkv = split.inputs[0];
  const Shape& qs = g.values.at(qkv).shape;
  if (qs.size() != 3 || !qs[2].is_fixed() || qs[2].size % 3 != 0) return false;
  if (!ix.init(split.inputs[1])) return false;
  auto axis = split.attributes.find("axis");
  if (axis == split.attributes.end() || std::get<int64_t>(axis->second) != 2) return false;
  const int64_t d = qs[2].size / 3;
  std::set<size_t> nodes{i};
  // Each part: Reshape to [B, T, nh, hs] then Transpose.
  auto head = [&](const std::string& part, const std::vector<int64_t>& perm,
                  int64_t& nh) -> std::optional<std::string> {
    const auto rs = next(g, ix, part, "Reshape");
    if (!rs) return std::nullopt;
    const Shape& hs = g.values.at(g.nodes[*rs].outputs[0]).shape;
    if (hs.size() != 4 || !hs[2].is_fixed() || !hs[3].is_fixed() || hs[2].size * hs[3].size != d) return std::nullopt;
    nh = hs[2].size;
    const auto tr = next(g, ix, g.nodes[*rs].outputs[0], "Transpose");
    if (!tr || std::get<std::vector<int64_t>>(g.nodes[*tr].attributes.at("perm")) != perm) return std::nullopt;
    nodes.insert({*rs, *tr});
    return g.nodes[*tr].outputs[0];
  };
  int64_t nh_q = 0, nh_k = 0, nh_v = 0;
  const auto q = head(split.outputs[0], {0, 2, 1, 3}, nh_q), kt = head(split.outputs[1], {0, 2, 3, 1}, nh_k),
             v = head(split.outputs[2], {0, 2, 1, 3}, nh_v);
  if (!q || !kt || !v || nh_q != nh_k || nh_q != nh_v) return false;
  const int64_t nh = nh_q, hs = d / nh;
  const auto mm = next(g, ix, *q, "MatMul");
  if (!mm || g.nodes[*mm].inputs != std::vector<std::string>{*q, *kt} || ix.sole_reader(*kt) != *mm) return false;
  nodes.insert(*mm);
  auto cur = scalar_step(g, ix, g.nodes[*mm].outputs[0], "Mul", 1.0 / std::sqrt(static_cast<double>(hs)), nodes);
  if (!cur) return false;
  bool causal = false;
  // The scaled scores' readers: the mask's Add, and for a symbolic length the
  // Shape whose Slice sizes the mask; or the Softmax alone.
  std::optional<size_t> add, shape;
  for (size_t n : ix.readers.count(*cur) ? ix.readers.at(*cur) : std::vector<size_t>{}) {
    if (g.nodes[n].op_type == "Add" && !add) {
      add = n;
    } else if (g.nodes[n].op_type == "Shape" && !shape) {
      shape = n;
    } else if (g.nodes[n].op_type != "Softmax") {
      return false;
    }
  }
  if (add) {
    const std::string m = other_operand(g.nodes[*add], *cur);
    const Tensor* mask = ix.init(m);
    if (!mask) {
      // A symbolic length: Slice(longest mask, [0, 0], Slice(Shape(scores), 2, 4)).
      const auto sl = ix.producer_of(m);
      if (!sl || g.nodes[*sl].op_type != "Slice" || g.nodes[*sl].inputs.size() < 3 || ix.sole_reader(m) != *add)
        return false;
      const Tensor* starts = ix.init(g.nodes[*sl].inputs[1]);
      if (!starts || starts->dtype() != kInt64 || starts->numel() != 2 ||
          starts->contiguous().data_ptr<int64_t>()[0] != 0 || starts->contiguous().data_ptr<int64_t>()[1] != 0)
        return false;
      const auto ends = ix.producer_of(g.nodes[*sl].inputs[2]);
      if (!ends || g.nodes[*ends].op_type != "Slice" || !shape ||
          g.nodes[*ends].inputs[0] != g.nodes[*shape].outputs[0] ||
          ix.sole_reader(g.nodes[*shape].outputs[0]) != *ends || ix.sole_reader(g.nodes[*ends].outputs[0]) != *sl)
        return false;
      mask = ix.init(g.nodes[*sl].inputs[0]);
      nodes.insert({*sl, *ends, *shape});
      shape.reset();
    }
    if (!is_causal_mask(mask) || ix.graph_outputs.count(*cur)) return false;
    causal = true;
    nodes.insert(*add);
    cur = g.nodes[*add].outputs[0];
  }
  if (shape) return false;
  const auto sm = next(g, ix, *cur, "Softmax");
  if (!sm || std::get<int64_t>(g.nodes[*sm].attributes.at("axis")) != -1) return false;
  nodes.insert(*sm);
  const auto av = next(g, ix, g.nodes[*sm].outputs[0], "MatMul");
  if (!av || g.nodes[*av].inputs[1] != *v || ix.sole_reader(*v) != *av) return false;
  nodes.insert(*av);
  const auto tr = next(g, ix, g.nodes[*av].outputs[0], "Transpose");
  if (!tr || std::get<std::vector<int64_t>>(g.nodes[*tr].attributes.at("perm")) != std::vector<int64_t>{0, 2, 1, 3})
    return false;
  nodes.insert(*tr);
  const auto rs = next(g, ix, g.nodes[*tr].outputs[0], "Reshape");
  if (!rs || g.values.at(g.nodes[*rs].outputs[0]).shape.size() != 3) return false;
  nodes.insert(*rs);
  size_t last = *std::max_element(nodes.begin(), nodes.end());
  Node fused;
  fused.name = split.name + "+attention";
  fused.op_type = "kiln.Attention";
  fused.inputs = {qkv};
  fused.outputs = {g.nodes[*rs].outputs[0]};
  fused.attributes = {{"n_head", nh}, {"causal", int64_t{causal ? 1 : 0}}};
  fused.module = split.module;
  fused.module_type = split.module_type;
  nodes.erase(last);
  g.nodes[last] = std::move(fused);
  detail::compact(g, nodes);
  ++r.attention;
  r.absorbed += static_cast<int64_t>(nodes.size());
  return true;
}

}  // namespace

FuseReport fuse_for_kiln(Graph& g) {
  FuseReport r;
  for (size_t i = 0; i < g.nodes.size();) {
    // After a rewrite the fused node sits at its chain's last place, so the
    // nodes before i are unchanged and the scan goes on from i.
    if (!fuse_at(g, i, r) && !fuse_attention_at(g, i, r)) ++i;
  }
  r.absorbed += remove_dead(g);  // the weights' Transposes of fused MatMuls
  return r;
}

}  // namespace kiln::exporter
