// export::capture (include/kiln/export/capture.h): module-level capture. Each
// module type kiln knows has an emitter that writes the ONNX nodes its
// inference forward computes (the forwards of src/nn and src/nn/models_*.cpp,
// read side by side with these). Why module-level rather than op-level
// tracing: docs/export.md.
#include "kiln/export/capture.h"

#include <cmath>
#include <limits>
#include <typeinfo>

#include "builder.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/models/cnn.h"
#include "kiln/models/gpt.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/models/vit.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/norm.h"
#include "kiln/nn/transformer.h"
#include "kiln/ops/factory.h"
#include "kiln/quant/fuse.h"
#include "kiln/quant/ptq.h"
#include "qdq.h"

namespace kiln::exporter {
namespace {

using detail::GraphBuilder;
using detail::ModuleScope;

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

template <typename M>
bool is(const nn::Module& m) {
  return typeid(m) == typeid(M);
}

Dim broadcast_dim(const Dim& a, const Dim& b) {
  if (a == b) return a;
  if (a.is_fixed() && a.size == 1) return b;
  if (b.is_fixed() && b.size == 1) return a;
  throw ShapeError("export: cannot broadcast dims " + a.str() + " and " + b.str());
}

Shape broadcast(const Shape& a, const Shape& b) {
  Shape out(std::max(a.size(), b.size()));
  for (size_t i = 0; i < out.size(); ++i) {
    const size_t ia = i + a.size(), ib = i + b.size();
    const Dim one = Dim::fixed(1);
    const Dim& da = ia >= out.size() ? a[ia - out.size()] : one;
    const Dim& db = ib >= out.size() ? b[ib - out.size()] : one;
    out[i] = broadcast_dim(da, db);
  }
  return out;
}

// One value per spatial dim from a torch-style option ({k} or {kH, kW}).
std::vector<int64_t> pair(const std::vector<int64_t>& v, const std::vector<int64_t>& fallback = {}) {
  if (v.empty()) return fallback;
  return v.size() == 1 ? std::vector<int64_t>{v[0], v[0]} : v;
}

class Emitter {
 public:
  explicit Emitter(GraphBuilder& b) : b_(b) {}

  /// The nodes of module `m` (at `path`) applied to value `x`; returns its
  /// output value, recorded as the module's (Graph::module_outputs).
  std::string module(nn::Module& m, const std::string& path, const std::string& x) {
    std::string y = dispatch(m, path, x);
    if (y != x) b_.graph.module_outputs.push_back({path, m.type_name(), y});
    return y;
  }

 private:
  std::string dispatch(nn::Module& m, const std::string& path, const std::string& x) {
    const ModuleScope scope(b_, path, m.type_name());
    if (is<nn::Linear>(m) || is<quant::QuantizedLinear>(m)) return linear(static_cast<nn::Linear&>(m), path, x);
    if (is<nn::Conv2d>(m) || is<quant::QuantizedConv2d>(m)) return conv(static_cast<nn::Conv2d&>(m), path, x);
    if (is<nn::BatchNorm2d>(m) || is<nn::BatchNorm1d>(m)) return batch_norm(static_cast<nn::BatchNorm&>(m), path, x);
    if (is<nn::LayerNorm>(m)) return layer_norm(static_cast<nn::LayerNorm&>(m), path, x);
    if (is<nn::Embedding>(m)) return embedding(static_cast<nn::Embedding&>(m), path, x);
    if (is<nn::Dropout>(m) || is<nn::Identity>(m)) return x;  // eval: the identity
    if (is<quant::FoldedBatchNorm2d>(m)) return x;            // folded into the conv before it
    if (is<nn::ReLU>(m)) return unary("Relu", x);
    if (is<nn::Tanh>(m)) return unary("Tanh", x);
    if (is<nn::Sigmoid>(m)) return unary("Sigmoid", x);
    if (is<nn::SiLU>(m)) return b_.node("Mul", {x, unary("Sigmoid", x)}, b_.shape(x));
    if (is<nn::GELU>(m)) return gelu(x, static_cast<nn::GELU&>(m).approximate);
    if (is<nn::Softmax>(m))
      return b_.node("Softmax", {x}, b_.shape(x), kFloat32, {{"axis", static_cast<nn::Softmax&>(m).dim}});
    if (is<nn::MaxPool2d>(m)) return pool("MaxPool", static_cast<nn::MaxPool2d&>(m).options, x);
    if (is<nn::AvgPool2d>(m)) return pool("AveragePool", static_cast<nn::AvgPool2d&>(m).options, x);
    if (is<nn::AdaptiveAvgPool2d>(m)) return adaptive_avg_pool(static_cast<nn::AdaptiveAvgPool2d&>(m), path, x);
    if (is<nn::Flatten>(m)) {
      auto& f = static_cast<nn::Flatten&>(m);
      return flatten(x, f.start_dim, f.end_dim, path);
    }
    if (is<nn::Sequential>(m)) {
      std::string y = x;
      for (const auto& [name, child] : m.named_children()) y = module(*child, join(path, name), y);
      return y;
    }
    if (is<nn::CausalSelfAttention>(m)) return attention(static_cast<nn::CausalSelfAttention&>(m), path, x);
    if (is<nn::TransformerMLP>(m)) {
      auto& mlp = static_cast<nn::TransformerMLP&>(m);
      std::string h = module(*mlp.c_fc, join(path, "c_fc"), x);
      h = module(*mlp.gelu, join(path, "gelu"), h);
      return module(*mlp.c_proj, join(path, "c_proj"), h);
    }
    if (is<nn::TransformerBlock>(m)) {
      auto& blk = static_cast<nn::TransformerBlock&>(m);
      std::string a = module(*blk.attn, join(path, "attn"), module(*blk.ln_1, join(path, "ln_1"), x));
      std::string h = add(x, a);
      std::string f = module(*blk.mlp, join(path, "mlp"), module(*blk.ln_2, join(path, "ln_2"), h));
      return add(h, f);
    }
    if (is<models::MLP>(m)) {
      auto& mlp = static_cast<models::MLP&>(m);
      const std::string flat = b_.shape(x).size() == 2 ? x : flatten(x, 1, -1, path);
      return module(*mlp.layers, join(path, "layers"), flat);
    }
    if (is<models::CNN>(m)) return cnn(static_cast<models::CNN&>(m), path, x);
    if (is<models::BasicBlock>(m)) return basic_block(static_cast<models::BasicBlock&>(m), path, x);
    if (is<models::ResNet>(m)) return resnet(static_cast<models::ResNet&>(m), path, x);
    if (is<models::ViT>(m)) return vit(static_cast<models::ViT&>(m), path, x);
    if (is<models::GPT>(m)) return gpt(static_cast<models::GPT&>(m), path, x);
    throw ValueError("export: cannot export module '" + (path.empty() ? std::string("<root>") : path) + "' of type " +
                     m.type_name() +
                     ": the exporter writes the forwards of nn's layers and the model zoo's models "
                     "(docs/export.md lists them); a module with a forward of its own (or nn::Functional, whose "
                     "function it cannot see) needs an emitter in src/export/capture.cpp");
  }

  std::string unary(const std::string& op, const std::string& x) { return b_.node(op, {x}, b_.shape(x)); }
  std::string binary(const std::string& op, const std::string& a, const std::string& c) {
    return b_.node(op, {a, c}, broadcast(b_.shape(a), b_.shape(c)));
  }
  std::string add(const std::string& a, const std::string& c) { return binary("Add", a, c); }
  std::string mul(const std::string& a, const std::string& c) { return binary("Mul", a, c); }

  // Linear's weight [out, in] transposed to [in, out], for MatMul on inputs of
  // rank > 2 (Gemm takes only matrices): a Transpose node over the weight's own
  // initializer, so a tied weight (GPT's lm_head and wte) stays one tensor in
  // the file and every initializer keeps its state_dict name. Runtimes fold
  // the constant Transpose when they load the model.
  std::string transposed_weight(const std::string& name, const Tensor& w) {
    auto it = transposed_.find(w.impl());
    if (it != transposed_.end()) return it->second;
    const std::string v = transpose(b_.weight(name, w), {1, 0});
    transposed_[w.impl()] = v;
    return v;
  }

  std::string linear(nn::Linear& l, const std::string& path, const std::string& x) {
    const Shape& s = b_.shape(x);
    KILN_CHECK(!s.empty() && s.back() == Dim::fixed(l.options.in_features), ShapeError, "export: Linear '", path,
               "' expects inputs [..., ", l.options.in_features, "], got ", shape_string(s));
    Shape out = s;
    out.back() = Dim::fixed(l.options.out_features);
    const bool bias = l.bias.defined();
    // An int8 layer: QDQ nodes around the float op (qdq.h).
    const auto q = detail::quantized_layer(l);
    const std::string xin = q ? detail::qdq_input(b_, x, *q) : x;
    if (s.size() == 2) {
      std::vector<std::string> in{xin,
                                  q ? detail::qdq_weight(b_, path, *q) : b_.weight(join(path, "weight"), l.weight)};
      if (bias) in.push_back(b_.weight(join(path, "bias"), l.bias));
      return b_.node("Gemm", in, out, kFloat32, {{"transB", int64_t{1}}});
    }
    const std::string wt =
        q ? transpose(detail::qdq_weight(b_, path, *q), {1, 0}) : transposed_weight(join(path, "weight"), l.weight);
    std::string y = b_.node("MatMul", {xin, wt}, out);
    return bias ? add(y, b_.weight(join(path, "bias"), l.bias)) : y;
  }

  static std::vector<int64_t> spatial_out(const Shape& s, const std::string& what, const std::vector<int64_t>& k,
                                          const std::vector<int64_t>& stride, const std::vector<int64_t>& pad,
                                          const std::vector<int64_t>& dil, bool ceil_mode) {
    KILN_CHECK(s.size() == 4 && s[2].is_fixed() && s[3].is_fixed(), ShapeError, "export: ", what,
               " expects inputs [N, C, H, W] with fixed H and W, got ", shape_string(s));
    std::vector<int64_t> out(2);
    for (size_t i = 0; i < 2; ++i) {
      const int64_t span = s[2 + i].size + 2 * pad[i] - dil[i] * (k[i] - 1) - 1;
      int64_t o = (ceil_mode ? (span + stride[i] - 1) / stride[i] : span / stride[i]) + 1;
      // As torch: with ceil_mode, a window that starts inside the right padding is dropped.
      if (ceil_mode && (o - 1) * stride[i] >= s[2 + i].size + pad[i]) --o;
      KILN_CHECK(o > 0, ShapeError, "export: ", what, " gives an empty output for input ", shape_string(s));
      out[i] = o;
    }
    return out;
  }

  std::string conv(nn::Conv2d& c, const std::string& path, const std::string& x) {
    const auto& o = c.options;
    const auto k = pair(o.kernel_size), st = pair(o.stride), pd = pair(o.padding), dl = pair(o.dilation);
    const Shape& s = b_.shape(x);
    const auto hw = spatial_out(s, "Conv2d '" + path + "'", k, st, pd, dl, false);
    KILN_CHECK(s[1] == Dim::fixed(o.in_channels), ShapeError, "export: Conv2d '", path, "' expects ", o.in_channels,
               " input channels, got ", shape_string(s));
    const auto q = detail::quantized_layer(c);
    std::vector<std::string> in{q ? detail::qdq_input(b_, x, *q) : x,
                                q ? detail::qdq_weight(b_, path, *q) : b_.weight(join(path, "weight"), c.weight)};
    if (c.bias.defined()) in.push_back(b_.weight(join(path, "bias"), c.bias));
    return b_.node("Conv", in, {s[0], Dim::fixed(o.out_channels), Dim::fixed(hw[0]), Dim::fixed(hw[1])}, kFloat32,
                   {{"kernel_shape", k},
                    {"strides", st},
                    {"pads", std::vector<int64_t>{pd[0], pd[1], pd[0], pd[1]}},
                    {"dilations", dl},
                    {"group", o.groups}});
  }

  std::string pool(const std::string& op, const nn::Pool2dOptions& o, const std::string& x) {
    const auto k = pair(o.kernel_size), st = pair(o.stride, k), pd = pair(o.padding);
    const auto dl = op == "MaxPool" ? pair(o.dilation) : std::vector<int64_t>{1, 1};
    const Shape& s = b_.shape(x);
    const auto hw = spatial_out(s, op, k, st, pd, dl, o.ceil_mode);
    std::map<std::string, Attribute> attrs{{"kernel_shape", k},
                                           {"strides", st},
                                           {"pads", std::vector<int64_t>{pd[0], pd[1], pd[0], pd[1]}},
                                           {"ceil_mode", int64_t{o.ceil_mode}}};
    if (op == "MaxPool") {
      if (dl != std::vector<int64_t>{1, 1}) attrs["dilations"] = dl;
    } else {
      attrs["count_include_pad"] = int64_t{o.count_include_pad};
    }
    return b_.node(op, {x}, {s[0], s[1], Dim::fixed(hw[0]), Dim::fixed(hw[1])}, kFloat32, attrs);
  }

  std::string adaptive_avg_pool(nn::AdaptiveAvgPool2d& p, const std::string& path, const std::string& x) {
    const Shape& s = b_.shape(x);
    KILN_CHECK(s.size() == 4 && s[2].is_fixed() && s[3].is_fixed(), ShapeError, "export: AdaptiveAvgPool2d '", path,
               "' expects [N, C, H, W] with fixed H and W, got ", shape_string(s));
    std::vector<int64_t> k(2);
    for (size_t i = 0; i < 2; ++i) {
      const int64_t in = s[2 + i].size, out = p.output_size[i].value_or(in);
      // Equal bins only: then the adaptive pool is an ordinary average pool.
      KILN_CHECK(in % out == 0, ValueError, "export: AdaptiveAvgPool2d '", path, "' with output ", out,
                 " over an input of ", in, " has unequal bins, which ONNX's AveragePool cannot express");
      k[i] = in / out;
    }
    if (k[0] == s[2].size && k[1] == s[3].size)
      return b_.node("GlobalAveragePool", {x}, {s[0], s[1], Dim::fixed(1), Dim::fixed(1)});
    return pool("AveragePool", nn::Pool2dOptions{.kernel_size = k, .stride = k}, x);
  }

  std::string flatten(const std::string& x, int64_t start, int64_t end, const std::string& path) {
    const Shape s = b_.shape(x);
    const auto r = static_cast<int64_t>(s.size());
    if (start < 0) start += r;
    if (end < 0) end += r;
    KILN_CHECK(0 <= start && start <= end && end < r, ValueError, "export: flatten of '", path, "' over dims ", start,
               "..", end, " of a rank-", r, " input");
    int64_t merged = 1;
    for (int64_t i = start; i <= end; ++i) {
      KILN_CHECK(s[i].is_fixed(), ShapeError, "export: flatten in '", path, "' merges the symbolic dim ", s[i].str(),
                 " of ", shape_string(s), "; only fixed dims can be merged");
      merged *= s[i].size;
    }
    Shape out(s.begin(), s.begin() + start);
    out.push_back(Dim::fixed(merged));
    out.insert(out.end(), s.begin() + end + 1, s.end());
    if (end == r - 1 && start == 1) return b_.node("Flatten", {x}, out, kFloat32, {{"axis", int64_t{1}}});
    return reshape(x, out);
  }

  // Reshape to `out`: symbolic dims (which keep their place) are copied (0).
  std::string reshape(const std::string& x, const Shape& out, DType dtype = kFloat32) {
    std::vector<int64_t> spec;
    const Shape& s = b_.shape(x);
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i].is_fixed()) {
        spec.push_back(out[i].size);
      } else {
        KILN_ASSERT(i < s.size() && s[i] == out[i], "export: reshape moves symbolic dim ", out[i].str());
        spec.push_back(0);
      }
    }
    return b_.node("Reshape", {x, b_.ints(spec)}, out, dtype);
  }

  std::string transpose(const std::string& x, const std::vector<int64_t>& perm) {
    const Shape& s = b_.shape(x);
    Shape out;
    for (int64_t p : perm) out.push_back(s[static_cast<size_t>(p)]);
    return b_.node("Transpose", {x}, out, b_.value(x).dtype, {{"perm", perm}});
  }

  // x.shape[from:to] as a 1-D int64 value (for dims known only at run time).
  std::string shape_slice(const std::string& x, int64_t from, int64_t to) {
    const std::string shp = b_.node("Shape", {x}, {Dim::fixed(static_cast<int64_t>(b_.shape(x).size()))}, kInt64);
    return b_.node("Slice", {shp, b_.ints({from}), b_.ints({to}), b_.ints({0})}, {Dim::fixed(to - from)}, kInt64);
  }

  std::string batch_norm(nn::BatchNorm& bn, const std::string& path, const std::string& x) {
    KILN_CHECK(bn.running_mean.defined(), ValueError, "export: ", bn.type_name(), " '", path,
               "' keeps no running statistics (track_running_stats = false), so its inference output depends on the "
               "batch; it cannot be exported");
    const Shape& s = b_.shape(x);
    KILN_CHECK(s.size() >= 2 && s[1] == Dim::fixed(bn.options.num_features), ShapeError, "export: ", bn.type_name(),
               " '", path, "' expects inputs [N, ", bn.options.num_features, ", ...], got ", shape_string(s));
    const int64_t c = bn.options.num_features;
    const std::string scale = bn.weight.defined() ? b_.weight(join(path, "weight"), bn.weight)
                                                  : b_.constant("ones", ones({c}, TensorOptions(kFloat32)));
    const std::string shift = bn.bias.defined() ? b_.weight(join(path, "bias"), bn.bias)
                                                : b_.constant("zeros", zeros({c}, TensorOptions(kFloat32)));
    return b_.node("BatchNormalization",
                   {x, scale, shift, b_.weight(join(path, "running_mean"), bn.running_mean),
                    b_.weight(join(path, "running_var"), bn.running_var)},
                   s, kFloat32, {{"epsilon", static_cast<float>(bn.options.eps)}});
  }

  std::string layer_norm(nn::LayerNorm& ln, const std::string& path, const std::string& x) {
    const auto& shape = ln.options.normalized_shape;
    const Shape& s = b_.shape(x);
    const auto k = static_cast<int64_t>(shape.size());
    KILN_CHECK(k >= 1 && k <= static_cast<int64_t>(s.size()), ShapeError, "export: LayerNorm '", path,
               "' normalises over ", k, " dims of an input ", shape_string(s));
    for (int64_t i = 0; i < k; ++i)
      KILN_CHECK(s[s.size() - static_cast<size_t>(k - i)] == Dim::fixed(shape[static_cast<size_t>(i)]), ShapeError,
                 "export: LayerNorm '", path, "' expects trailing dims matching its normalized_shape, got ",
                 shape_string(s));
    const Tensor w = ln.weight.defined() ? ln.weight : ones(shape, TensorOptions(kFloat32));
    const Tensor bias = ln.bias.defined() ? ln.bias : zeros(shape, TensorOptions(kFloat32));
    const std::string wv = ln.weight.defined() ? b_.weight(join(path, "weight"), w) : b_.constant("ones", w);
    const std::string bv = ln.bias.defined() ? b_.weight(join(path, "bias"), bias) : b_.constant("zeros", bias);
    const auto eps = static_cast<float>(ln.options.eps);
    if (b_.opset >= 17)
      return b_.node("LayerNormalization", {x, wv, bv}, s, kFloat32, {{"axis", -k}, {"epsilon", eps}});
    // Before opset 17: the reductions themselves (biased variance, as LayerNorm's).
    std::vector<int64_t> axes;
    for (int64_t i = -k; i < 0; ++i) axes.push_back(i);
    Shape reduced = s;
    for (int64_t i = 0; i < k; ++i) reduced[s.size() - 1 - static_cast<size_t>(i)] = Dim::fixed(1);
    const std::map<std::string, Attribute> attrs{{"axes", axes}, {"keepdims", int64_t{1}}};
    const std::string mean = b_.node("ReduceMean", {x}, reduced, kFloat32, attrs);
    const std::string d = binary("Sub", x, mean);
    const std::string var = b_.node("ReduceMean", {mul(d, d)}, reduced, kFloat32, attrs);
    const std::string den = unary("Sqrt", add(var, b_.scalar(eps)));
    return add(mul(binary("Div", d, den), wv), bv);
  }

  std::string embedding(nn::Embedding& e, const std::string& path, const std::string& idx) {
    const Value& v = b_.value(idx);
    KILN_CHECK(v.dtype == kInt64, DTypeError, "export: Embedding '", path, "' expects int64 indices, got ",
               dtype_name(v.dtype));
    Shape out = v.shape;
    out.push_back(Dim::fixed(e.options.embedding_dim));
    return b_.node("Gather", {b_.weight(join(path, "weight"), e.weight), idx}, out, kFloat32, {{"axis", int64_t{0}}});
  }

  // GELU written out (ONNX has a Gelu operator only from opset 20).
  std::string gelu(const std::string& x, const std::string& approximate) {
    std::string inner;
    if (approximate == "tanh") {
      const std::string x3 = mul(mul(x, x), x);
      const std::string u = add(x, mul(x3, b_.scalar(0.044715f)));
      inner = unary("Tanh", mul(u, b_.scalar(static_cast<float>(std::sqrt(2.0 / M_PI)))));
    } else {
      KILN_CHECK(approximate == "none", ValueError, "export: GELU with approximate='", approximate, "'");
      inner = unary("Erf", mul(x, b_.scalar(static_cast<float>(1.0 / std::sqrt(2.0)))));
    }
    return mul(mul(x, add(inner, b_.scalar(1.0f))), b_.scalar(0.5f));
  }

  std::string attention(nn::CausalSelfAttention& a, const std::string& path, const std::string& x) {
    const Shape s = b_.shape(x);
    KILN_CHECK(s.size() == 3 && s[2] == Dim::fixed(a.d_model), ShapeError, "export: attention '", path,
               "' expects [B, T, ", a.d_model, "], got ", shape_string(s));
    const int64_t d = a.d_model, nh = a.n_head, hs = d / nh;
    const std::string qkv = module(*a.c_attn, join(path, "c_attn"), x);
    const ModuleScope scope(b_, path, a.type_name());
    const Shape part{s[0], s[1], Dim::fixed(d)};
    const auto qkv3 =
        b_.node_n("Split", {qkv, b_.ints({d, d, d})}, {part, part, part}, kFloat32, {{"axis", int64_t{2}}});
    const Shape heads{s[0], s[1], Dim::fixed(nh), Dim::fixed(hs)};
    const std::string q = transpose(reshape(qkv3[0], heads), {0, 2, 1, 3});   // [B, nh, T, hs]
    const std::string kt = transpose(reshape(qkv3[1], heads), {0, 2, 3, 1});  // [B, nh, hs, T]
    const std::string v = transpose(reshape(qkv3[2], heads), {0, 2, 1, 3});
    std::string scores = b_.node("MatMul", {q, kt}, {s[0], Dim::fixed(nh), s[1], s[1]});
    scores = mul(scores, b_.scalar(static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)))));
    if (a.causal) scores = add(scores, causal_mask(s[1], scores, path));
    const std::string att = b_.node("Softmax", {scores}, b_.shape(scores), kFloat32, {{"axis", int64_t{-1}}});
    const std::string y = b_.node("MatMul", {att, v}, b_.shape(q));
    const std::string merged = reshape(transpose(y, {0, 2, 1, 3}), part);
    return module(*a.c_proj, join(path, "c_proj"), merged);
  }

  // 0 where key j <= query i, -inf above: added to the scores. A fixed length
  // gets its own [T, T] constant; a symbolic one slices the [L, L] constant of
  // the longest sequence the model takes (GPT's block_size).
  std::string causal_mask(const Dim& t, const std::string& scores, const std::string& path) {
    int64_t len = t.is_fixed() ? t.size : max_seq_;
    KILN_CHECK(len > 0, ValueError, "export: causal attention '", path, "' over the symbolic length ", t.str(),
               " needs the longest sequence it will see (a GPT's block_size); export it inside its model");
    auto it = masks_.find(len);
    if (it == masks_.end()) {
      std::vector<float> m(static_cast<size_t>(len * len), 0.0f);
      for (int64_t i = 0; i < len; ++i)
        for (int64_t j = i + 1; j < len; ++j)
          m[static_cast<size_t>(i * len + j)] = -std::numeric_limits<float>::infinity();
      it = masks_.emplace(len, b_.constant("causal_mask", tensor(m, {len, len}))).first;
    }
    if (t.is_fixed()) return it->second;
    return b_.node("Slice", {it->second, b_.ints({0, 0}), shape_slice(scores, 2, 4), b_.ints({0, 1})}, {t, t});
  }

  std::string cnn(models::CNN& m, const std::string& path, const std::string& x) {
    const nn::Pool2dOptions two{.kernel_size = {2}};
    std::string y = pool("MaxPool", two, unary("Relu", module(*m.conv1, join(path, "conv1"), x)));
    y = pool("MaxPool", two, unary("Relu", module(*m.conv2, join(path, "conv2"), y)));
    y = unary("Relu", module(*m.fc1, join(path, "fc1"), flatten(y, 1, -1, path)));
    return module(*m.fc2, join(path, "fc2"), y);
  }

  std::string basic_block(models::BasicBlock& m, const std::string& path, const std::string& x) {
    std::string y = unary("Relu", module(*m.bn1, join(path, "bn1"), module(*m.conv1, join(path, "conv1"), x)));
    y = module(*m.bn2, join(path, "bn2"), module(*m.conv2, join(path, "conv2"), y));
    const std::string shortcut = m.downsample ? module(*m.downsample, join(path, "downsample"), x) : x;
    return unary("Relu", add(y, shortcut));
  }

  std::string resnet(models::ResNet& m, const std::string& path, const std::string& x) {
    std::string y = unary("Relu", module(*m.bn1, join(path, "bn1"), module(*m.conv1, join(path, "conv1"), x)));
    for (size_t i = 0; i < m.stages.size(); ++i)
      y = module(*m.stages[i], join(path, "layer" + std::to_string(i + 1)), y);
    const Shape& s = b_.shape(y);
    y = b_.node("GlobalAveragePool", {y}, {s[0], s[1], Dim::fixed(1), Dim::fixed(1)});  // y.mean({2, 3})
    return module(*m.fc, join(path, "fc"), flatten(y, 1, -1, path));
  }

  std::string vit(models::ViT& m, const std::string& path, const std::string& x) {
    const int64_t dim = m.options.dim, p = m.num_patches();
    std::string t = module(*m.patch_embed, join(path, "patch_embed"), x);  // [N, dim, gh, gw]
    const Dim n = b_.shape(t)[0];
    t = transpose(reshape(t, {n, Dim::fixed(dim), Dim::fixed(p)}), {0, 2, 1});  // [N, P, dim]
    const std::string expand_to = n.is_fixed() ? b_.ints({n.size, 1, dim})
                                               : b_.node("Concat", {shape_slice(x, 0, 1), b_.ints({1, dim})},
                                                         {Dim::fixed(3)}, kInt64, {{"axis", int64_t{0}}});
    const std::string cls = b_.node("Expand", {b_.weight(join(path, "cls_token"), m.cls_token), expand_to},
                                    {n, Dim::fixed(1), Dim::fixed(dim)});
    t = b_.node("Concat", {cls, t}, {n, Dim::fixed(p + 1), Dim::fixed(dim)}, kFloat32, {{"axis", int64_t{1}}});
    t = add(t, b_.weight(join(path, "pos_embed"), m.pos_embed));
    for (size_t i = 0; i < m.blocks->size(); ++i)
      t = module(*(*m.blocks)[i], join(path, "blocks." + std::to_string(i)), t);
    t = module(*m.norm, join(path, "norm"), t);
    const std::string zero = b_.constant("const", full({}, int64_t{0}, TensorOptions(kInt64)));
    t = b_.node("Gather", {t, zero}, {n, Dim::fixed(dim)}, kFloat32, {{"axis", int64_t{1}}});  // select(1, 0)
    return module(*m.head, join(path, "head"), t);
  }

  std::string gpt(models::GPT& m, const std::string& path, const std::string& idx) {
    const Shape s = b_.shape(idx);
    KILN_CHECK(s.size() == 2, ShapeError, "export: GPT expects idx [B, T], got ", shape_string(s));
    KILN_CHECK(!s[1].is_fixed() || s[1].size <= m.options.block_size, ShapeError, "export: GPT takes at most ",
               m.options.block_size, " positions, the example has ", s[1].size);
    max_seq_ = m.options.block_size;
    const std::string tok = module(*m.wte, join(path, "transformer.wte"), idx);  // [B, T, C]
    std::string pos;
    {
      const ModuleScope scope(b_, join(path, "transformer.wpe"), m.wpe->type_name());
      // wpe(arange(T)) is wpe's first T rows.
      const std::string w = b_.weight(join(path, "transformer.wpe.weight"), m.wpe->weight);
      const std::string end = s[1].is_fixed() ? b_.ints({s[1].size}) : shape_slice(idx, 1, 2);
      pos = b_.node("Slice", {w, b_.ints({0}), end, b_.ints({0})}, {s[1], Dim::fixed(m.options.n_embd)});
    }
    std::string x = add(tok, pos);
    for (size_t i = 0; i < m.h->size(); ++i)
      x = module(*(*m.h)[i], join(path, "transformer.h." + std::to_string(i)), x);
    x = module(*m.ln_f, join(path, "transformer.ln_f"), x);
    return module(*m.lm_head, join(path, "lm_head"), x);
  }

  GraphBuilder& b_;
  int64_t max_seq_ = 0;
  std::map<int64_t, std::string> masks_;
  std::map<const void*, std::string> transposed_;
};

// Restores the train/eval mode of every module on the way out (capture runs eval).
class ModeRestore {
 public:
  explicit ModeRestore(nn::Module& root) {
    for (nn::Module* m : root.modules()) modes_.emplace_back(m, m->is_training());
  }
  ~ModeRestore() {
    // train() recurses: in pre-order, each module's flag is set after its parent's.
    for (auto& [m, on] : modes_) m->train(on);
  }
  ModeRestore(const ModeRestore&) = delete;
  ModeRestore& operator=(const ModeRestore&) = delete;

 private:
  std::vector<std::pair<nn::Module*, bool>> modes_;
};

}  // namespace

Graph capture(nn::Module& module, const std::vector<Tensor>& example_inputs, const CaptureOptions& options) {
  KILN_CHECK(options.opset >= 13 && options.opset <= 17, ValueError,
             "export: opset expects 13 to 17 (17: LayerNormalization; 13: for consumers without it), got ",
             options.opset);
  KILN_CHECK(example_inputs.size() == 1, ValueError, "export: expected one example input (the models take one), got ",
             example_inputs.size());
  const Tensor& example = example_inputs[0];
  KILN_CHECK(example.defined() && (example.dtype() == kFloat32 || example.dtype() == kInt64), DTypeError,
             "export: expected a float32 (or, for token ids, int64) example input, got ",
             example.defined() ? std::string(dtype_name(example.dtype())) : std::string("an undefined tensor"));
  for (const auto& [name, m] : module.named_modules())
    // A QuantizedLinear and a FoldedBatchNorm2d carry a hook of their own that changes nothing (it makes
    // fusing parents call their forward); the capture writes that forward.
    KILN_CHECK(!m->has_forward_hooks() || typeid(*m) == typeid(quant::QuantizedLinear) ||
                   typeid(*m) == typeid(quant::FoldedBatchNorm2d),
               ValueError, "export: module '", name.empty() ? "<root>" : name, "' of type ", m->type_name(),
               " has forward hooks, whose effect on its output an exported graph cannot contain; "
               "remove them before exporting");
  for (const auto& [input, axes] : options.dynamic_axes) {
    KILN_CHECK(input == "input", ValueError, "export: dynamic_axes names the input '", input,
               "'; the graph's input is called \"input\"");
    for (const auto& [axis, sym] : axes)
      KILN_CHECK(axis >= 0 && axis < example.dim() && !sym.empty(), ValueError, "export: dynamic axis ", axis, " (\"",
                 sym, "\") of an input of rank ", example.dim());
  }

  const ModeRestore restore(module);
  module.eval();
  detail::GraphBuilder b(options.opset);
  b.graph.name = module.type_name();
  Shape in_shape;
  std::map<std::string, int64_t> bound;  // symbol -> the example's size
  const auto dyn =
      options.dynamic_axes.count("input") ? options.dynamic_axes.at("input") : std::map<int64_t, std::string>{};
  for (int64_t i = 0; i < example.dim(); ++i) {
    auto it = dyn.find(i);
    if (it == dyn.end()) {
      in_shape.push_back(Dim::fixed(example.size(i)));
    } else {
      in_shape.push_back(Dim::sym(it->second));
      bound[it->second] = example.size(i);
    }
  }
  const Value input{"input", example.dtype(), in_shape};
  b.graph.inputs.push_back(input);
  b.graph.values["input"] = input;

  Emitter e(b);
  std::string out;
  {
    const NoGradGuard no_grad;
    out = e.module(module, "", "input");
  }
  // The output is called "output": rename the value its last node computes.
  if (out == "input") out = b.node("Identity", {out}, in_shape, example.dtype());
  Value ov = b.value(out);
  for (Node& n : b.graph.nodes)
    for (std::string& o : n.outputs)
      if (o == out) o = "output";
  b.graph.values.erase(out);
  for (ModuleOutput& mo : b.graph.module_outputs)
    if (mo.value == out) mo.value = "output";
  ov.name = "output";
  b.graph.values["output"] = ov;
  b.graph.outputs.push_back(ov);
  b.graph.validate();

  // The capture against the model: its output shape on the example.
  Tensor ref;
  {
    const NoGradGuard no_grad;
    ref = module(example);
  }
  bool same = ref.dim() == static_cast<int64_t>(ov.shape.size());
  for (size_t i = 0; same && i < ov.shape.size(); ++i) {
    const Dim& d = ov.shape[i];
    same = ref.size(static_cast<int64_t>(i)) == (d.is_fixed() ? d.size : bound.at(d.symbol));
  }
  KILN_CHECK(same, InternalError, "export: the captured graph of ", module.type_name(), " gives an output ",
             shape_string(ov.shape), " where the module gives ", ref.shape_string(), " on the example input");
  return std::move(b.graph);
}

}  // namespace kiln::exporter
