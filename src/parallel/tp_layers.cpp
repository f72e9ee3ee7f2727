// Tensor-parallel layers (column- and row-parallel Linear, vocabulary-parallel
// Embedding), the shard layout of their parameters, and loading a
// single-process state dict into shards / merging the shards back.
#include <cmath>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/nn/init.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/parallel/tensor_parallel.h"

namespace kiln::parallel {
namespace {

using dist::ProcessGroupPtr;

std::string dims_text(const std::vector<int64_t>& d) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < d.size(); ++i) os << (i ? ", " : "") << d[i];
  os << "]";
  return os.str();
}

// n / parts when it divides, else 0: sizes for the member initialisers, whose
// divisibility is checked (on every rank alike) after the layout check.
int64_t part_or_zero(int64_t n, int64_t parts) { return parts > 0 && n % parts == 0 ? n / parts : 0; }

void check_divides(int64_t n, int64_t parts, const std::string& layer, const char* what, const ProcessGroupPtr& group) {
  KILN_CHECK(n > 0 && n % parts == 0, ShapeError, "tensor parallel '", layer, "': expected ", what, " (", n,
             ") to divide evenly into ", parts, " parts over ", group->describe(), ", got a remainder of ",
             parts > 0 ? n % parts : n);
}

ProcessGroupPtr checked_group(ProcessGroupPtr g, const std::string& layer) {
  KILN_CHECK(g != nullptr && g->is_member(), DistributedError, "tensor parallel '", layer,
             "': expected a process group this rank belongs to, got ", g ? g->describe() : std::string("none"));
  return g;
}

// A draw of the full [out, in] weight as nn::Linear's default initialisation
// (kaiming_uniform(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))), the same on every
// rank seeded alike, of which each rank keeps its shard.
Tensor linear_default(std::vector<int64_t> shape, int64_t fan_in) {
  Tensor t = kiln::empty(shape);
  const double b = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  nn::init::uniform_(t, -b, b);
  return t;
}

void copy_shard(Tensor& local, const Tensor& full, const ShardSpec& spec, const ProcessGroupPtr& g) {
  NoGradGuard no_grad;
  local.copy_(shard_of(full, spec, g->rank(), g->size()));
}

struct Entry {
  std::string name;
  Tensor local;
  ShardSpec spec;
};

// The state_dict() entries of `root` with the live tensor behind each name and its layout.
std::vector<Entry> entries_of(nn::Module& root) {
  std::map<std::string, std::pair<Tensor, ShardSpec>> by_name;
  for (auto& [prefix, m] : root.named_modules()) {
    auto* sharded = dynamic_cast<ShardedModule*>(m);
    const std::string p = prefix.empty() ? "" : prefix + ".";
    for (auto& [n, t] : m->named_parameters(false))
      by_name[p + n] = {t, sharded ? sharded->shard_spec(n) : ShardSpec{}};
    for (auto& [n, t] : m->named_buffers(false)) by_name[p + n] = {t, ShardSpec{}};
  }
  std::vector<Entry> out;
  for (auto& [n, t] : root.state_dict()) {
    auto it = by_name.find(n);
    KILN_ASSERT(it != by_name.end(), "state_dict entry '", n, "' has no parameter or buffer behind it");
    out.push_back({n, it->second.first, it->second.second});
  }
  return out;
}

}  // namespace

// ---- layouts ----

std::map<std::string, ShardSpec> shard_specs(nn::Module& module) {
  std::map<std::string, ShardSpec> out;
  for (auto& [prefix, m] : module.named_modules()) {
    auto* sharded = dynamic_cast<ShardedModule*>(m);
    for (auto& [n, t] : m->named_parameters(false))
      out[(prefix.empty() ? "" : prefix + ".") + n] = sharded ? sharded->shard_spec(n) : ShardSpec{};
  }
  return out;
}

std::vector<int64_t> full_shape(const std::vector<int64_t>& local, const ShardSpec& spec, int parts) {
  std::vector<int64_t> s = local;
  if (spec.kind == ShardSpec::Kind::Rows) s.at(0) *= parts;
  if (spec.kind == ShardSpec::Kind::Columns) s.at(1) *= parts;
  return s;
}

Tensor shard_of(const Tensor& full, const ShardSpec& spec, int rank, int parts) {
  if (spec.kind == ShardSpec::Kind::Replicated || parts == 1) return full;
  if (spec.kind == ShardSpec::Kind::Columns) {
    KILN_CHECK(full.dim() >= 2 && full.size(1) % parts == 0, ShapeError,
               "tensor parallel: expected a tensor whose dim 1 divides into ", parts, " column shards, got ",
               full.shape_string());
    const int64_t c = full.size(1) / parts;
    return full.narrow(1, c * rank, c).contiguous();
  }
  const int64_t n = full.size(0), blocks = spec.blocks;
  KILN_CHECK(full.dim() >= 1 && n % (blocks * parts) == 0, ShapeError,
             "tensor parallel: expected a tensor whose dim 0 (", n, ") divides into ", blocks, " block(s) of ", parts,
             " row shards, got ", full.shape_string());
  std::vector<int64_t> local(full.sizes().begin(), full.sizes().end());
  local[0] = n / parts;
  const int64_t per = n / blocks / parts;
  return full.reshape({blocks, n / blocks, -1}).narrow(1, per * rank, per).reshape(local).contiguous();
}

Tensor merge_shards(const Tensor& local, const ShardSpec& spec, const ProcessGroupPtr& group) {
  const int parts = group->size();
  if (spec.kind == ShardSpec::Kind::Replicated || parts == 1) return local.detach().clone();
  Tensor in = local.detach().contiguous();
  std::vector<Tensor> all;
  for (int r = 0; r < parts; ++r) all.push_back(kiln::empty(in.sizes(), TensorOptions(in.dtype())));
  group->allgather(all, in)->wait();
  if (spec.kind == ShardSpec::Kind::Columns) return cat(all, 1).contiguous();
  const std::vector<int64_t> whole = full_shape({in.sizes().begin(), in.sizes().end()}, spec, parts);
  std::vector<Tensor> blocked;
  for (const Tensor& t : all) blocked.push_back(t.reshape({spec.blocks, in.size(0) / spec.blocks, -1}));
  return cat(blocked, 1).reshape(whole).contiguous();
}

void load_from_full(nn::Module& module, const nn::NamedTensors& full, const ProcessGroupPtr& group) {
  std::map<std::string, Tensor> by_name(full.begin(), full.end());
  const int parts = group->size();
  std::vector<Entry> entries = entries_of(module);
  std::string problem;
  for (const Entry& e : entries) {
    const std::vector<int64_t> want = full_shape({e.local.sizes().begin(), e.local.sizes().end()}, e.spec, parts);
    auto it = by_name.find(e.name);
    if (it == by_name.end()) {
      problem = "the state dict has no '" + e.name + "' (expected " + dims_text(want) + ")";
      break;
    }
    const std::vector<int64_t> got(it->second.sizes().begin(), it->second.sizes().end());
    if (got != want) {
      problem = "'" + e.name + "' is " + dims_text(got) + " in the state dict but this rank's shard " +
                dims_text({e.local.sizes().begin(), e.local.sizes().end()}) + " is 1/" + std::to_string(parts) +
                " of " + dims_text(want);
      break;
    }
  }
  // Agree before copying anything: a rank that cannot load must not leave the
  // others waiting in the next collective.
  if (parts > 1) {
    Tensor flag = kiln::full({1}, problem.empty() ? 0.0 : 1.0, TensorOptions(kInt64));
    std::vector<Tensor> flags;
    for (int r = 0; r < parts; ++r) flags.push_back(kiln::empty({1}, TensorOptions(kInt64)));
    {
      dist::CollectiveLabel label("tensor parallel load_from_full: agreeing that every rank's shards fit");
      group->allgather(flags, flag)->wait();
    }
    std::vector<int> failed;
    for (int r = 0; r < parts; ++r)
      if (flags[static_cast<size_t>(r)].data_ptr<int64_t>()[0] != 0) failed.push_back(r);
    if (!failed.empty()) {
      std::vector<int64_t> f(failed.begin(), failed.end());
      KILN_CHECK(false, ShapeError, "tensor parallel load_from_full over ", group->describe(), ": rank(s) ",
                 dims_text(f), " could not take their shards",
                 problem.empty() ? std::string(" (see their error)")
                                 : ": on rank " + std::to_string(group->rank()) + ", " + problem);
    }
  } else {
    KILN_CHECK(problem.empty(), ShapeError, "tensor parallel load_from_full: ", problem);
  }
  for (Entry& e : entries) copy_shard(e.local, by_name.at(e.name), e.spec, group);
}

nn::NamedTensors full_state_dict(nn::Module& module, const ProcessGroupPtr& group) {
  nn::NamedTensors out;
  dist::CollectiveLabel label("tensor parallel full_state_dict: all-gather of the shards");
  for (const Entry& e : entries_of(module)) out.emplace_back(e.name, merge_shards(e.local, e.spec, group));
  return out;
}

namespace detail {

void check_same_layout(const ProcessGroupPtr& group, const std::string& layer, const std::string& kind,
                       const std::vector<int64_t>& dims) {
  if (group->size() == 1) return;
  constexpr int64_t kSlots = 8;  // a hash of the name, the dim count, up to 6 dims
  KILN_ASSERT(dims.size() + 2 <= kSlots, "too many dims for the layout check");
  uint64_t h = 1469598103934665603ull;
  for (char c : layer + "/" + kind) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  Tensor mine = kiln::full({kSlots}, -1.0, TensorOptions(kInt64));
  int64_t* m = mine.data_ptr<int64_t>();
  m[0] = static_cast<int64_t>(h >> 11);
  m[1] = static_cast<int64_t>(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) m[2 + i] = dims[i];
  std::vector<Tensor> all;
  for (int r = 0; r < group->size(); ++r) all.push_back(kiln::empty({kSlots}, TensorOptions(kInt64)));
  {
    dist::CollectiveLabel label("tensor parallel '" + layer + "': layout check");
    group->allgather(all, mine)->wait();
  }
  auto layout = [&](int r) {
    const int64_t* p = all[static_cast<size_t>(r)].data_ptr<int64_t>();
    return std::vector<int64_t>(p, p + 2 + std::max<int64_t>(0, std::min<int64_t>(p[1], kSlots - 2)));
  };
  const std::vector<int64_t> first = layout(0);
  for (int r = 1; r < group->size(); ++r) {
    const std::vector<int64_t> other = layout(r);
    if (other == first) continue;
    const std::vector<int64_t> d0(first.begin() + 2, first.end()), dr(other.begin() + 2, other.end());
    KILN_CHECK(other[0] != first[0], ShapeError, "tensor parallel layer '", layer, "' (", kind, ") over ",
               group->describe(), ": rank 0 builds it with full dims ", dims_text(d0), " but rank ", r, " with ",
               dims_text(dr), "; every rank of the group must build the same full layer and keep 1/", group->size(),
               " of it (this is rank ", group->rank(), ")");
    KILN_CHECK(false, ShapeError, "tensor parallel layer '", layer, "' (", kind, ") over ", group->describe(),
               ": rank ", r,
               " is building another layer at this point than rank 0 (the ranks build different "
               "models, or their layers in another order; this is rank ",
               group->rank(), ")");
  }
}

}  // namespace detail

// ---- ColumnParallelLinear ----

ColumnParallelLinear::ColumnParallelLinear(ColumnParallelLinearOptions o, ProcessGroupPtr g)
    : nn::Module("ColumnParallelLinear"),
      options(std::move(o)),
      group(checked_group(std::move(g), options.name)),
      weight(register_parameter("weight", kiln::empty({part_or_zero(options.out_features, group->size()),
                                                       std::max<int64_t>(options.in_features, 0)}))),
      bias(register_parameter(
          "bias", options.bias ? kiln::empty({part_or_zero(options.out_features, group->size())}) : Tensor())) {
  detail::check_same_layout(group, options.name, "ColumnParallelLinear",
                            {options.in_features, options.out_features, options.blocks, options.bias ? 1 : 0,
                             options.sequence_parallel ? 1 : 0});
  KILN_CHECK(options.in_features > 0 && options.blocks > 0, ValueError, "ColumnParallelLinear '", options.name,
             "': expected in_features > 0 and blocks > 0, got ", options.in_features, " and ", options.blocks);
  check_divides(options.out_features, options.blocks * group->size(), options.name, "out_features", group);
  KILN_CHECK(!(options.gather_output && options.blocks > 1), ValueError, "ColumnParallelLinear '", options.name,
             "': gather_output with blocks = ", options.blocks,
             " would concatenate the ranks' blocks rank by rank, not as the single-process layer; split the "
             "output into its blocks first");
  // nn::Linear's default initialisation, drawn whole and sharded (same numbers on every rank).
  Tensor w = linear_default({options.out_features, options.in_features}, options.in_features);
  copy_shard(weight, w, shard_spec("weight"), group);
  if (options.bias) {
    Tensor b = linear_default({options.out_features}, options.in_features);
    copy_shard(bias, b, shard_spec("bias"), group);
  }
}

ShardSpec ColumnParallelLinear::shard_spec(const std::string&) const {
  return ShardSpec{.kind = ShardSpec::Kind::Rows, .blocks = options.blocks};
}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  KILN_CHECK(x.dim() >= 1 && x.size(-1) == options.in_features, ShapeError, "ColumnParallelLinear '", options.name,
             "': expected input with last dim ", options.in_features, ", got shape ", x.shape_string());
  Tensor in = options.sequence_parallel ? gather_from_sequence_parallel_region(x, group, options.name)
                                        : copy_to_tp_region(x, group, options.name);
  Tensor y = linear(in, weight, bias);
  return options.gather_output ? gather_from_tp_region(y, group, options.name) : y;
}

std::string ColumnParallelLinear::extra_repr() const {
  std::ostringstream os;
  os << "in_features=" << options.in_features << ", out_features=" << options.out_features
     << " (this rank: " << weight.size(0) << "), bias=" << (options.bias ? "True" : "False")
     << ", gather_output=" << (options.gather_output ? "True" : "False") << ", tp=" << group->size();
  return os.str();
}

void ColumnParallelLinear::load_from_full(const Tensor& w, const Tensor& b) {
  nn::NamedTensors full{{"weight", w}};
  if (options.bias) full.emplace_back("bias", b);
  parallel::load_from_full(*this, full, group);
}

// ---- RowParallelLinear ----

RowParallelLinear::RowParallelLinear(RowParallelLinearOptions o, ProcessGroupPtr g)
    : nn::Module("RowParallelLinear"),
      options(std::move(o)),
      group(checked_group(std::move(g), options.name)),
      weight(register_parameter("weight", kiln::empty({std::max<int64_t>(options.out_features, 0),
                                                       part_or_zero(options.in_features, group->size())}))),
      bias(register_parameter("bias",
                              options.bias ? kiln::empty({std::max<int64_t>(options.out_features, 0)}) : Tensor())) {
  detail::check_same_layout(
      group, options.name, "RowParallelLinear",
      {options.in_features, options.out_features, options.bias ? 1 : 0, options.sequence_parallel ? 1 : 0});
  KILN_CHECK(options.out_features > 0, ValueError, "RowParallelLinear '", options.name,
             "': expected out_features > 0, got ", options.out_features);
  check_divides(options.in_features, group->size(), options.name, "in_features", group);
  Tensor w = linear_default({options.out_features, options.in_features}, options.in_features);
  copy_shard(weight, w, shard_spec("weight"), group);
  if (options.bias) {
    NoGradGuard no_grad;
    bias.copy_(linear_default({options.out_features}, options.in_features));
  }
}

ShardSpec RowParallelLinear::shard_spec(const std::string& name) const {
  return name == "weight" ? ShardSpec{.kind = ShardSpec::Kind::Columns} : ShardSpec{};
}

Tensor RowParallelLinear::forward(const Tensor& x) {
  Tensor in = options.input_is_parallel ? x : scatter_to_tp_region(x, group, options.name);
  KILN_CHECK(in.dim() >= 1 && in.size(-1) == weight.size(1), ShapeError, "RowParallelLinear '", options.name,
             "': expected ", options.input_is_parallel ? "this rank's input slice" : "the input", " with last dim ",
             options.input_is_parallel ? weight.size(1) : options.in_features, ", got shape ", x.shape_string());
  // The bias joins after the sum: added on every rank before it, it would count tp times.
  if (options.sequence_parallel) {
    Tensor y = reduce_scatter_to_sequence_parallel_region(linear(in, weight), group, options.name);
    // Each rank adds the bias to its own tokens only: f sums their gradients.
    return options.bias ? y + copy_to_tp_region(bias, group, options.name + ".bias") : y;
  }
  Tensor y = reduce_from_tp_region(linear(in, weight), group, options.name);
  return options.bias ? y + bias : y;
}

std::string RowParallelLinear::extra_repr() const {
  std::ostringstream os;
  os << "in_features=" << options.in_features << " (this rank: " << weight.size(1)
     << "), out_features=" << options.out_features << ", bias=" << (options.bias ? "True" : "False")
     << ", input_is_parallel=" << (options.input_is_parallel ? "True" : "False") << ", tp=" << group->size();
  return os.str();
}

void RowParallelLinear::load_from_full(const Tensor& w, const Tensor& b) {
  nn::NamedTensors full{{"weight", w}};
  if (options.bias) full.emplace_back("bias", b);
  parallel::load_from_full(*this, full, group);
}

// ---- VocabParallelEmbedding ----

VocabParallelEmbedding::VocabParallelEmbedding(VocabParallelEmbeddingOptions o, ProcessGroupPtr g)
    : nn::Module("VocabParallelEmbedding"),
      options(std::move(o)),
      group(checked_group(std::move(g), options.name)),
      vocab_start(part_or_zero(options.num_embeddings, group->size()) * group->rank()),
      vocab_end(vocab_start + part_or_zero(options.num_embeddings, group->size())),
      weight(register_parameter("weight", kiln::empty({part_or_zero(options.num_embeddings, group->size()),
                                                       std::max<int64_t>(options.embedding_dim, 0)}))) {
  detail::check_same_layout(group, options.name, "VocabParallelEmbedding",
                            {options.num_embeddings, options.embedding_dim, options.sequence_parallel ? 1 : 0});
  KILN_CHECK(options.embedding_dim > 0, ValueError, "VocabParallelEmbedding '", options.name,
             "': expected embedding_dim > 0, got ", options.embedding_dim);
  check_divides(options.num_embeddings, group->size(), options.name, "num_embeddings", group);
  // nn::Embedding's N(0, 1), drawn whole and sharded.
  Tensor w = kiln::empty({options.num_embeddings, options.embedding_dim});
  nn::init::normal_(w, 0.0, 1.0);
  copy_shard(weight, w, shard_spec("weight"), group);
}

ShardSpec VocabParallelEmbedding::shard_spec(const std::string&) const {
  return ShardSpec{.kind = ShardSpec::Kind::Rows};
}

Tensor VocabParallelEmbedding::forward(const Tensor& idx) {
  KILN_CHECK(idx.dtype() == kInt64, DTypeError, "VocabParallelEmbedding '", options.name,
             "': expected int64 token ids, got ", dtype_name(idx.dtype()));
  Tensor ids = idx.contiguous();
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    KILN_CHECK(p[i] >= 0 && p[i] < options.num_embeddings, IndexError, "VocabParallelEmbedding '", options.name,
               "': expected ids in [0, ", options.num_embeddings, "), got ", p[i], " at flat position ", i);
  // Ids outside this rank's rows look up row 0 and are zeroed; the all-reduce
  // then adds the one rank's row that holds each id.
  Tensor outside = ids.lt(vocab_start).logical_or(ids.ge(vocab_end));
  Tensor rows = embedding(weight, ids.sub(vocab_start).masked_fill(outside, 0));
  Tensor keep = outside.logical_not().to(rows.dtype()).unsqueeze(-1);
  return options.sequence_parallel ? reduce_scatter_to_sequence_parallel_region(rows * keep, group, options.name)
                                   : reduce_from_tp_region(rows * keep, group, options.name);
}

std::string VocabParallelEmbedding::extra_repr() const {
  std::ostringstream os;
  os << options.num_embeddings << ", " << options.embedding_dim << " (this rank: rows [" << vocab_start << ", "
     << vocab_end << ")), tp=" << group->size();
  return os.str();
}

void VocabParallelEmbedding::load_from_full(const Tensor& w) {
  parallel::load_from_full(*this, nn::NamedTensors{{"weight", w}}, group);
}

}  // namespace kiln::parallel
