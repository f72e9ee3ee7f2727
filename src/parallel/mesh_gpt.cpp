// parallel::MeshGPT: the GPT over a dp x tp x pp mesh.
//
// Note [Mesh GPT state]
// Every rank knows the whole GPT's state dict entries (names and shapes, read
// from the models::GPT it was built from) and which stage holds each. Merging
// is done in two moves: within a stage, parallel::full_state_dict all-gathers
// the tp shards (every tp rank gets the whole tensors); across stages, the
// stage holding an entry broadcasts it over the pp group (one tp coordinate's
// line of stages), so every rank ends with the same state dict. The optimizer
// state goes the same way, parameter by parameter; its tensors' shapes travel
// with them (an optimizer may keep state that is not per element).
#include "kiln/parallel/mesh_gpt.h"

#include <cmath>
#include <cstring>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/dist/dist.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"

namespace kiln::parallel {
namespace {

int dim_index(const dist::DeviceMesh& mesh, const std::string& name) {
  for (int i = 0; i < mesh.ndim(); ++i)
    if (mesh.dims()[static_cast<size_t>(i)].name == name) return i;
  return -1;
}

std::string mesh_dims_text(const dist::DeviceMesh& mesh) {
  std::string s;
  for (const auto& d : mesh.dims()) s += (s.empty() ? "" : ", ") + d.name + "=" + std::to_string(d.size);
  return "{" + s + "}";
}

/// Every pipeline of the mesh: for each coordinate of the other dimensions (row-major), its ranks along pp.
std::vector<std::vector<int>> pipelines_of(const dist::DeviceMesh& mesh, int pp) {
  std::vector<std::vector<int>> out;
  std::vector<int> c(static_cast<size_t>(mesh.ndim()), 0);
  while (true) {
    std::vector<int> line;
    for (int k = 0; k < mesh.dims()[static_cast<size_t>(pp)].size; ++k) {
      c[static_cast<size_t>(pp)] = k;
      line.push_back(mesh.rank_at(c));
    }
    c[static_cast<size_t>(pp)] = 0;
    out.push_back(std::move(line));
    int d = mesh.ndim() - 1;
    for (; d >= 0; --d) {
      if (d == pp) continue;
      if (++c[static_cast<size_t>(d)] < mesh.dims()[static_cast<size_t>(d)].size) break;
      c[static_cast<size_t>(d)] = 0;
    }
    if (d < 0) return out;
  }
}

/// Root's string on every rank of `g`.
std::string broadcast_text(dist::ProcessGroup& g, const std::string& s, int root) {
  Tensor n = tensor<int64_t>({static_cast<int64_t>(s.size())});
  g.broadcast(n, root)->wait();
  const int64_t len = n.item<int64_t>();
  if (len == 0) return {};
  Tensor chars = zeros({len}, TensorOptions(kInt64));
  if (g.rank() == root)
    for (size_t i = 0; i < s.size(); ++i) chars.data_ptr<int64_t>()[i] = static_cast<unsigned char>(s[i]);
  g.broadcast(chars, root)->wait();
  std::string out(static_cast<size_t>(len), '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(chars.data_ptr<int64_t>()[i]);
  return out;
}

/// Root's tensor (any dtype and shape) on every rank of `g`.
Tensor broadcast_tensor(dist::ProcessGroup& g, const Tensor& t, int root) {
  constexpr int64_t kMaxDims = 8;
  Tensor hdr = zeros({2 + kMaxDims}, TensorOptions(kInt64));
  if (g.rank() == root) {
    KILN_ASSERT(t.dim() <= kMaxDims, "state tensor of more than ", kMaxDims, " dims");
    auto* h = hdr.data_ptr<int64_t>();
    h[0] = static_cast<int64_t>(t.dtype()), h[1] = t.dim();
    for (int64_t d = 0; d < t.dim(); ++d) h[2 + d] = t.size(d);
  }
  g.broadcast(hdr, root)->wait();
  const auto* h = hdr.data_ptr<int64_t>();
  Tensor out = g.rank() == root
                   ? t.contiguous().clone()
                   : kiln::empty(std::vector<int64_t>(h + 2, h + 2 + h[1]), TensorOptions(static_cast<DType>(h[0])));
  g.broadcast(out, root)->wait();
  return out;
}

std::vector<int64_t> dims_of(const Tensor& t) { return {t.sizes().begin(), t.sizes().end()}; }

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

}  // namespace

MeshGPT::MeshGPT(const models::GPT& full, const dist::DeviceMesh& mesh, MeshGPTOptions options) : options_(options) {
  for (const char* d : {"dp", "tp", "pp"})
    KILN_CHECK(dim_index(mesh, d) >= 0, ValueError, "parallel::MeshGPT: expected a mesh with dimensions named dp, tp ",
               "and pp (size 1 where unused), got ", mesh_dims_text(mesh), ", which has no '", d, "'");
  KILN_CHECK(!full.options.activation_checkpointing.enabled(), ValueError,
             "parallel::MeshGPT: activation checkpointing is not supported with tensor parallelism (its recomputed "
             "forward would repeat the tp collectives); build the GPT without it");
  dp_ = mesh.group("dp"), tp_ = mesh.group("tp"), pp_ = mesh.group("pp");
  world_ = dist::world();
  const int p = pp_->size();
  KILN_CHECK(full.options.n_layer >= p, ValueError, "parallel::MeshGPT: ", p, " pipeline stages need at least ", p,
             " layers, the GPT has n_layer = ", full.options.n_layer);
  for (const auto& [name, t] : full.state_dict()) {
    full_entries_.emplace_back(name, std::vector<int64_t>(t.sizes().begin(), t.sizes().end()));
    full_numel_ += name == "lm_head.weight" ? 0 : t.numel();
  }
  for (const auto& entry : full.named_parameters()) full_params_.push_back(entry.first);

  // Building draws weights that load_from_full then replaces: the run's random stream must not move.
  const GeneratorState saved = default_generator().get_state();
  auto groups = make_pipeline_groups(pipelines_of(mesh, dim_index(mesh, "pp")));
  KILN_ASSERT(groups.num_stages == p && groups.stage == pp_->rank(), "pipeline groups disagree with the mesh");
  {
    TensorParallelGPT whole(full.options, tp_, TensorParallelOptions{.sequence_parallel = options_.sequence_parallel});
    whole.load_from_full(full.state_dict());
    layers_ = balanced_layer_ranges(full.options.n_layer, p);
    stage_ =
        std::make_shared<TensorParallelGPTStage>(whole, groups.stage, p, layers_[static_cast<size_t>(groups.stage)]);
  }
  default_generator().set_state(saved);
  specs_ = shard_specs(*stage_);
  for (const auto& [name, shape] : full_entries_)
    if (owner_stage(name) == pp_->rank()) {
      const std::string local = local_name(name);
      bool held = false;
      for (const auto& entry : stage_->named_parameters()) held = held || entry.first == local;
      KILN_ASSERT(held, "stage ", pp_->rank(), " should hold '", name, "' as '", local, "'");
    }
  pipe_ = std::make_unique<Pipeline>(
      stage_, std::move(groups),
      PipelineOptions{.micro_batches = options_.micro_batches, .schedule = options_.schedule}, stage_->loss_fn(),
      stage_->tied_parameters());
}

int MeshGPT::owner_stage(const std::string& name) const {
  const int p = pp_->size();
  if (name == "lm_head.weight" || starts_with(name, "transformer.ln_f.")) return p - 1;
  if (starts_with(name, "transformer.h.")) {
    const int64_t layer = std::stoll(name.substr(std::strlen("transformer.h.")));
    for (int s = 0; s < p; ++s)
      if (layer >= layers_[static_cast<size_t>(s)].first && layer < layers_[static_cast<size_t>(s)].second) return s;
  }
  return 0;  // wte, wpe
}

std::string MeshGPT::local_name(const std::string& name) const {
  // One stage holds the tied weight once, under the embedding's name.
  if (name == "lm_head.weight" && pp_->size() == 1) return "transformer.wte.weight";
  return name;
}

PipelineStepResult MeshGPT::forward_backward(const Tensor& idx, const Tensor& targets) {
  return pipe_->step(idx, targets);
}

double MeshGPT::evaluate(const Tensor& idx, const Tensor& targets) { return pipe_->evaluate(idx, targets); }

void MeshGPT::allreduce_gradients() {
  if (dp_->size() == 1) return;
  NoGradGuard no_grad;
  std::vector<Tensor> params;
  std::vector<Tensor> flat;
  for (auto& entry : stage_->named_parameters()) {
    Tensor& g = entry.second.mutable_grad();
    if (!g.defined()) g = zeros_like(entry.second);  // a replica without a gradient contributes zero
    params.push_back(entry.second);
    flat.push_back(g.reshape({-1}));
  }
  Tensor buffer = cat(flat, 0);
  {
    dist::CollectiveLabel l("mesh GPT: mean of the dp replicas' gradients (" + std::to_string(buffer.numel()) +
                            " elements)");
    dp_->allreduce(buffer, dist::ReduceOp::Sum)->wait();
  }
  buffer.mul_(1.0 / static_cast<double>(dp_->size()));
  int64_t at = 0;
  for (Tensor& p : params) {
    Tensor& g = p.mutable_grad();
    g.copy_(buffer.narrow(0, at, g.numel()).view(g.sizes()));
    at += g.numel();
  }
}

double MeshGPT::clip_grad_norm_(double max_norm) {
  NoGradGuard no_grad;
  double sq = 0;
  std::vector<Tensor> grads;
  for (auto& [name, p] : stage_->named_parameters()) {
    const Tensor& g = p.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    if (stage_->is_tied_copy(name)) continue;  // the first stage counts the tied weight
    auto it = specs_.find(name);
    const bool replicated = it == specs_.end() || it->second.kind == ShardSpec::Kind::Replicated;
    if (replicated && tp_->rank() != 0) continue;  // equal on every tp rank: counted once
    // Squares summed in double straight from the float32 gradient (no float64 copy per step).
    const Tensor c = g.dtype() == kFloat64 ? g.contiguous() : g.to(kFloat32).contiguous();
    if (c.dtype() == kFloat64) {
      const double* d = c.data_ptr<double>();
      for (int64_t i = 0; i < c.numel(); ++i) sq += d[i] * d[i];
    } else {
      const float* d = c.data_ptr<float>();
      for (int64_t i = 0; i < c.numel(); ++i) sq += static_cast<double>(d[i]) * static_cast<double>(d[i]);
    }
  }
  // Every rank's partial sum as its double's bit pattern (collectives carry
  // no float64), added in world-rank order: the same total on every rank.
  Tensor mine = empty({1}, TensorOptions(kInt64));
  std::memcpy(mine.data_ptr<int64_t>(), &sq, sizeof sq);
  std::vector<Tensor> all;
  for (int r = 0; r < world_->size(); ++r) all.push_back(empty({1}, TensorOptions(kInt64)));
  {
    dist::CollectiveLabel l("mesh GPT: global gradient norm");
    world_->allgather(all, mine)->wait();
  }
  double total = 0;
  for (const Tensor& t : all) {
    double v = 0;
    std::memcpy(&v, t.data_ptr<int64_t>(), sizeof v);
    total += v;
  }
  // Each dp replica contributed the same (averaged) gradients.
  const double norm = std::sqrt(total / static_cast<double>(dp_->size()));
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1)
    for (Tensor& g : grads) g.mul_(coef);
  return norm;
}

nn::NamedTensors MeshGPT::full_state_dict() {
  NoGradGuard no_grad;
  std::map<std::string, Tensor> mine;
  for (auto& [name, t] : parallel::full_state_dict(*stage_, tp_)) mine[name] = t;
  nn::NamedTensors out;
  dist::CollectiveLabel l("mesh GPT full_state_dict: each stage's merged tensors over pp");
  for (const auto& [name, shape] : full_entries_) {
    const int owner = owner_stage(name);
    Tensor t = owner == pp_->rank() ? mine.at(local_name(name)) : kiln::empty(shape);
    if (pp_->size() > 1) pp_->broadcast(t, owner)->wait();
    out.emplace_back(name, t);
  }
  return out;
}

void MeshGPT::load_full_state_dict(const nn::NamedTensors& state_dict) {
  parallel::load_from_full(*stage_, state_dict, tp_);
}

std::map<std::string, optim::ParamState> MeshGPT::full_optim_state(
    const std::map<std::string, optim::ParamState>& local) {
  NoGradGuard no_grad;
  std::map<std::string, optim::ParamState> out;
  std::map<std::string, std::vector<int64_t>> local_shapes;
  for (const auto& [name, t] : stage_->named_parameters()) local_shapes[name] = dims_of(t);
  const int me = pp_->rank();
  dist::CollectiveLabel l("mesh GPT full optimizer state: tp merges and pp broadcasts");
  for (const std::string& name : full_params_) {
    const int owner = owner_stage(name);
    const std::string lname = local_name(name);
    // The owner stage merges over tp (every tp rank of it has the same keys: one optimizer type).
    std::map<std::string, Tensor> merged;
    int64_t has = 0, step = 0;
    std::string keys;
    if (owner == me) {
      auto it = local.find(lname);
      if (it != local.end()) {
        has = 1, step = it->second.step;
        const auto spec_it = specs_.find(lname);
        const ShardSpec spec = spec_it == specs_.end() ? ShardSpec{} : spec_it->second;
        for (const auto& [key, value] : it->second.tensors) {
          keys += key + "\n";
          // Per-element state (moments, momentum) has the parameter's shard's shape and merges as it does.
          const bool per_element = value.dim() > 0 && dims_of(value) == local_shapes.at(lname);
          merged[key] = per_element ? merge_shards(value, spec, tp_) : value.detach().clone();
        }
      }
    }
    Tensor head = tensor<int64_t>({has, step});
    if (pp_->size() > 1) {
      pp_->broadcast(head, owner)->wait();
      keys = broadcast_text(*pp_, keys, owner);
    }
    if (head.data_ptr<int64_t>()[0] == 0) continue;
    optim::ParamState st;
    st.step = head.data_ptr<int64_t>()[1];
    std::istringstream ks(keys);
    for (std::string key; std::getline(ks, key);) {
      Tensor t = owner == me ? merged.at(key) : Tensor();
      st.tensors[key] = pp_->size() > 1 ? broadcast_tensor(*pp_, t, owner) : t;
    }
    out[name] = std::move(st);
  }
  return out;
}

std::map<std::string, optim::ParamState> MeshGPT::local_optim_state(
    const std::map<std::string, optim::ParamState>& full) {
  std::map<std::string, optim::ParamState> out;
  std::map<std::string, std::vector<int64_t>> shapes(full_entries_.begin(), full_entries_.end());
  for (const auto& entry : stage_->named_parameters()) {
    const std::string& lname = entry.first;
    const std::string fname = lname == "lm_head.weight" ? "transformer.wte.weight" : lname;
    auto it = full.find(fname);
    if (it == full.end()) continue;
    auto spec_it = specs_.find(lname);
    const ShardSpec spec = spec_it == specs_.end() ? ShardSpec{} : spec_it->second;
    optim::ParamState st;
    st.step = it->second.step;
    for (const auto& [key, value] : it->second.tensors) {
      const bool per_element = value.dim() > 0 && dims_of(value) == shapes.at(fname);
      st.tensors[key] = per_element ? local_part(value, spec, tp_).clone() : value.clone();
    }
    out[lname] = std::move(st);
  }
  return out;
}

int64_t MeshGPT::local_numel() const { return stage_->num_parameters(); }

std::string MeshGPT::describe() const {
  const auto& r = layers_[static_cast<size_t>(pp_->rank())];
  std::ostringstream os;
  os << "stage " << pp_->rank() << " of " << pp_->size() << " (layers " << r.first << "-" << r.second - 1
     << "), tp rank " << tp_->rank() << " of " << tp_->size() << ", dp replica " << dp_->rank() << " of " << dp_->size()
     << ": " << local_numel() << " of the GPT's " << full_numel_ << " parameters";
  return os.str();
}

}  // namespace kiln::parallel
