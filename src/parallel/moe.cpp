// parallel::MoE: routing, capacity, the load-balancing loss and the
// expert-parallel dispatch/combine all-to-alls (docs/moe.md).
#include "kiln/parallel/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "kiln/autograd/custom_function.h"
#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/ops/reduce.h"

namespace kiln::parallel {
namespace {

using autograd::AutogradContext;
using dist::ProcessGroupPtr;

std::string label_for(const std::string& who, const char* what) {
  return "MoE '" + (who.empty() ? std::string("(unnamed)") : who) + "': " + what;
}

// Rows of x [M, d]: in_splits[j] rows go to rank j, out_splits[j] rows come from rank j.
Tensor exchange_rows(const Tensor& x, const std::vector<int64_t>& out_splits, const std::vector<int64_t>& in_splits,
                     const ProcessGroupPtr& g, const std::string& label) {
  const int64_t rows = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
  Tensor in = x.contiguous();
  Tensor out = kiln::empty({rows, x.size(1)}, TensorOptions(x.dtype()));
  dist::CollectiveLabel l(label);
  g->alltoall(out, in, out_splits, in_splits)->wait();
  return out;
}

// The dispatch (or combine) all-to-all; backward sends the gradients back the way the rows came.
struct AllToAllRows : autograd::Function<AllToAllRows> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x, std::vector<int64_t> out_splits,
                        std::vector<int64_t> in_splits, ProcessGroupPtr g, std::string fwd_label,
                        std::string bwd_label) {
    ctx.saved_data["out_splits"] = out_splits;
    ctx.saved_data["in_splits"] = in_splits;
    ctx.saved_data["g"] = g;
    ctx.saved_data["bwd_label"] = bwd_label;
    return exchange_rows(x, out_splits, in_splits, g, fwd_label);
  }
  static TensorList backward(AutogradContext& ctx, TensorList grads) {
    auto& d = ctx.saved_data;
    // Reversed: what came from rank j goes back to rank j.
    return {exchange_rows(grads[0], d.get<std::vector<int64_t>>("in_splits"), d.get<std::vector<int64_t>>("out_splits"),
                          d.get<ProcessGroupPtr>("g"), d.get<std::string>("bwd_label"))};
  }
};

Tensor index_tensor(const std::vector<int64_t>& v) {
  return kiln::tensor<int64_t>(v, {static_cast<int64_t>(v.size())});
}

}  // namespace

MoE::MoE(MoEOptions o, dist::ProcessGroupPtr g)
    : nn::Module("MoE"),
      options([&] {
        if (o.d_ff == 0) o.d_ff = 4 * o.d_model;
        return o;
      }()),
      group(std::move(g)),
      ep(group ? group->size() : 1),
      ep_rank(group ? group->rank() : 0),
      local_experts(options.num_experts / ep),
      first_expert(local_experts * ep_rank) {
  KILN_CHECK(options.d_model > 0 && options.d_ff > 0, ValueError, "MoE '", options.name,
             "': expected d_model > 0 and d_ff > 0 (0 resolves to 4 * d_model), got ", options.d_model, " and ",
             options.d_ff);
  KILN_CHECK(options.num_experts > 0 && options.top_k >= 1 && options.top_k <= options.num_experts, ValueError, "MoE '",
             options.name, "': expected 1 <= top_k <= num_experts, got top_k ", options.top_k, " and num_experts ",
             options.num_experts);
  KILN_CHECK(!group || group->is_member(), ValueError, "MoE '", options.name,
             "': this process is not a member of the expert-parallel group ", group ? group->describe() : "");
  KILN_CHECK(options.num_experts % ep == 0, ValueError, "MoE '", options.name, "': expected num_experts (",
             options.num_experts, ") to divide evenly across the expert-parallel group of ", ep, " ranks");
  router = register_module("router",
                           std::make_shared<nn::Linear>(nn::LinearOptions{
                               .in_features = options.d_model, .out_features = options.num_experts, .bias = false}));
  experts = register_module("experts", std::make_shared<nn::ModuleDict>());
  const nn::TransformerBlockOptions mlp{
      .d_model = options.d_model, .n_head = 1, .d_ff = options.d_ff, .dropout = options.dropout};
  for (int64_t e = first_expert; e < first_expert + local_experts; ++e)
    experts->insert(std::to_string(e), std::make_shared<nn::TransformerMLP>(mlp));
}

Tensor MoE::forward(const Tensor& input) {
  const int64_t d = options.d_model, E = options.num_experts, k = options.top_k;
  KILN_CHECK(input.dim() >= 1 && input.size(-1) == d, ShapeError, "MoE '", options.name, "': expected input [.., ", d,
             "], got ", input.shape_string());
  const Tensor x = input.reshape({-1, d});
  const int64_t N = x.size(0);
  const Tensor logits = (*router)(x);  // [N, E]

  // Top-k on the host: the choice is not differentiated (only the gates are).
  // It decides the shapes that follow, so kiln::compile cannot replay it (with
  // no expert-parallel group there is no collective to stop the capture).
  capture::graph_break_if_recording("MoE routing (top-k) reads the router's logits on the host");
  std::vector<int64_t> choice(static_cast<size_t>(N * k));
  {
    const Tensor lg = logits.detach().to(kFloat32).contiguous();
    const float* p = lg.data_ptr<float>();
    std::vector<int64_t> ids(static_cast<size_t>(E));
    for (int64_t n = 0; n < N; ++n) {
      std::iota(ids.begin(), ids.end(), 0);
      const float* row = p + n * E;
      std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                        [row](int64_t a, int64_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
      std::copy(ids.begin(), ids.begin() + k, choice.begin() + n * k);
    }
  }

  // Capacity: first choices of every token before any second choice.
  MoEStats s;
  s.routed.assign(static_cast<size_t>(E), 0);
  s.kept.assign(static_cast<size_t>(E), 0);
  const int64_t cap = options.capacity_factor > 0
                          ? static_cast<int64_t>(std::ceil(options.capacity_factor * static_cast<double>(N * k) /
                                                           static_cast<double>(E)))
                          : 0;
  s.capacity = cap;
  std::vector<char> keep(static_cast<size_t>(N * k), 0);
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t e = choice[n * k + j];
      ++s.routed[e];
      if (cap == 0 || s.kept[e] < cap) {
        ++s.kept[e];
        keep[n * k + j] = 1;
      } else {
        ++s.dropped;
      }
    }
  }
  for (int64_t n = 0; n < N; ++n) {
    bool any = false;
    for (int64_t j = 0; j < k; ++j) any = any || keep[n * k + j];
    if (!any) ++s.dropped_tokens;
  }

  // Switch's load-balancing loss over k choices: E * sum_e f_e P_e.
  {
    std::vector<float> f(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      f[e] = static_cast<float>(static_cast<double>(s.routed[e]) / static_cast<double>(std::max<int64_t>(N * k, 1)));
    const Tensor P = softmax(logits, -1).mean({0});
    aux_ = (P * kiln::tensor<float>(f, {E}).to(P.dtype())).sum() * static_cast<double>(E);
  }

  // Mixtral's gates: softmax over the k chosen logits.
  const Tensor gates = softmax(gather(logits, 1, kiln::tensor<int64_t>(choice, {N, k})), -1);

  // The kept assignments grouped by expert (token order within an expert).
  std::vector<std::vector<int64_t>> by_expert(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < k; ++j)
      if (keep[n * k + j]) by_expert[choice[n * k + j]].push_back(n * k + j);
  std::vector<int64_t> flat, token;
  for (const auto& v : by_expert)
    for (int64_t a : v) {
      flat.push_back(a);
      token.push_back(a / k);
    }
  const int64_t M = static_cast<int64_t>(flat.size());
  const Tensor tok = index_tensor(token);
  const Tensor rows = index_select(x, 0, tok);                                        // [M, d]
  const Tensor row_gates = index_select(gates.reshape({-1}), 0, index_tensor(flat));  // [M]

  // Dispatch: counts first (each rank learns how many rows each source sends to each of its experts).
  std::vector<int64_t> in_splits(static_cast<size_t>(ep), 0), out_splits(static_cast<size_t>(ep), 0);
  for (int64_t e = 0; e < E; ++e) in_splits[e / local_experts] += s.kept[e];
  // recv[src][l]: rows from rank src for local expert l.
  std::vector<int64_t> recv(static_cast<size_t>(ep * local_experts));
  if (ep > 1) {
    Tensor counts = kiln::tensor<int64_t>(s.kept, {E});
    Tensor got = kiln::empty({E}, TensorOptions(kInt64));
    {
      dist::CollectiveLabel l(label_for(options.name, "forward all-to-all of the token counts"));
      group->alltoall(got, counts)->wait();
    }
    const int64_t* g = got.data_ptr<int64_t>();
    std::copy(g, g + E, recv.begin());
  } else {
    std::copy(s.kept.begin(), s.kept.end(), recv.begin());
  }
  for (int src = 0; src < ep; ++src)
    for (int64_t l = 0; l < local_experts; ++l) out_splits[src] += recv[src * local_experts + l];
  // Bytes leaving this rank: the dispatch sends its rows for other ranks'
  // experts, the combine returns the rows other ranks sent here.
  for (int j = 0; j < ep; ++j)
    if (j != ep_rank) s.alltoall_bytes += (in_splits[j] + out_splits[j]) * d * element_size(x.dtype());
  if (ep > 1) s.alltoall_bytes += (E - local_experts) * static_cast<int64_t>(sizeof(int64_t));

  Tensor received = rows;
  if (ep > 1)
    received =
        AllToAllRows::apply(rows, out_splits, in_splits, group, label_for(options.name, "forward dispatch all-to-all"),
                            label_for(options.name, "backward of the dispatch all-to-all"));

  // Received rows come in (source rank, local expert) blocks; group them by expert.
  std::vector<int64_t> perm;
  std::vector<int64_t> per_expert(static_cast<size_t>(local_experts), 0);
  {
    std::vector<int64_t> start(static_cast<size_t>(ep * local_experts));
    int64_t off = 0;
    for (int64_t b = 0; b < ep * local_experts; ++b) {
      start[b] = off;
      off += recv[b];
    }
    for (int64_t l = 0; l < local_experts; ++l)
      for (int src = 0; src < ep; ++src) {
        const int64_t b = src * local_experts + l;
        for (int64_t i = 0; i < recv[b]; ++i) perm.push_back(start[b] + i);
        per_expert[l] += recv[b];
      }
  }
  const bool identity = ep == 1;  // one process: rows are already grouped by expert
  const Tensor grouped = identity ? received : index_select(received, 0, index_tensor(perm));
  std::vector<Tensor> outs;
  int64_t pos = 0;
  for (int64_t l = 0; l < local_experts; ++l) {
    if (per_expert[l] == 0) continue;
    auto& expert = *(*experts)[std::to_string(first_expert + l)];
    outs.push_back(expert(grouped.narrow(0, pos, per_expert[l])));
    pos += per_expert[l];
  }
  // With nothing received the (empty) result still hangs off the dispatch, so
  // that every rank's backward runs both all-to-alls.
  Tensor y = outs.empty() ? grouped : (outs.size() == 1 ? outs[0] : cat(outs, 0));
  if (!identity) {
    std::vector<int64_t> inverse(perm.size());
    for (size_t i = 0; i < perm.size(); ++i) inverse[perm[i]] = static_cast<int64_t>(i);
    y = index_select(y, 0, index_tensor(inverse));
    y = AllToAllRows::apply(y, in_splits, out_splits, group, label_for(options.name, "forward combine all-to-all"),
                            label_for(options.name, "backward of the combine all-to-all"));
  }
  stats_ = std::move(s);

  // Combine: each kept assignment adds gate * expert output to its token; dropped ones add nothing.
  const Tensor contrib = y * row_gates.unsqueeze(1).to(y.dtype());
  const Tensor index = tok.unsqueeze(1).expand({M, d}).contiguous();
  Tensor out = kiln::zeros({N, d}, TensorOptions(contrib.dtype())).scatter_add(0, index, contrib);
  return out.reshape(input.sizes());
}

void MoE::load_from_full(const nn::NamedTensors& full) {
  NoGradGuard no_grad;
  for (auto& [name, t] : named_parameters()) {
    const std::string& key = name;  // clang 14 cannot capture a structured binding
    auto it = std::find_if(full.begin(), full.end(), [&](const auto& p) { return p.first == key; });
    KILN_CHECK(it != full.end(), ValueError, "MoE '", options.name, "' load_from_full: expected '", name,
               "' in the full state dict, got none");
    KILN_CHECK(it->second.sizes() == t.sizes(), ShapeError, "MoE '", options.name, "' load_from_full: expected '", name,
               "' of shape ", t.shape_string(), ", got ", it->second.shape_string());
    Tensor dst = t;
    dst.copy_(it->second);
  }
}

}  // namespace kiln::parallel
