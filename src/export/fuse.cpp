// exporter::fuse_for_kiln (include/kiln/export/optimize.h): Conv and
// Gemm/MatMul chains into kiln.FusedConv / kiln.FusedGemm nodes for kiln's
// inference runtime. One chain at a time: find it on a fresh index, rewrite
// it, compact the graph, look again (graphs here have hundreds of nodes, so
// the quadratic walk costs microseconds and keeps every match on a
// consistent index).
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

}  // namespace

FuseReport fuse_for_kiln(Graph& g) {
  FuseReport r;
  for (size_t i = 0; i < g.nodes.size();) {
    // After a rewrite the fused node sits at its chain's last place, so the
    // nodes before i are unchanged and the scan goes on from i.
    if (!fuse_at(g, i, r)) ++i;
  }
  r.absorbed += remove_dead(g);  // the weights' Transposes of fused MatMuls
  return r;
}

}  // namespace kiln::exporter
