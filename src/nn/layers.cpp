// nn layers: Linear, Conv2d, Embedding, Dropout, pooling, Flatten, GELU and containers.
#include "kiln/nn/layers.h"

#include <cmath>

#include "kiln/autograd/custom_function.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/init.h"
#include "kiln/ops/conv.h"
#include "kiln/ops/dropout.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/ops/linalg.h"
#include "nn_util.h"

namespace kiln::nn {

namespace {
using util::dtype_or_default;
using util::int_or_tuple;
using util::py_bool;

std::vector<int64_t> pair2(const std::vector<int64_t>& v, const char* what) {
  KILN_CHECK(v.size() == 1 || v.size() == 2, ValueError, what, " expects 1 or 2 values, got ", v.size());
  return v.size() == 1 ? std::vector<int64_t>{v[0], v[0]} : v;
}

// torch's reset_parameters for Linear and Conv: kaiming_uniform_(a=sqrt(5)), bias U(-1/sqrt(fan_in), ..).
void reset_weight_bias(Tensor& weight, Tensor& bias) {
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    int64_t fan_in = init::calculate_fan_in_and_fan_out(weight).first;
    double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    init::uniform_(bias, -bound, bound);
  }
}
}  // namespace

// ---- Linear ----
Linear::Linear(LinearOptions o)
    : Module("Linear"),
      options(o),
      weight(register_parameter("weight", empty({o.out_features, o.in_features}, dtype_or_default(o.dtype)))),
      bias(register_parameter("bias", o.bias ? empty({o.out_features}, dtype_or_default(o.dtype)) : Tensor())) {
  KILN_CHECK(o.in_features >= 0 && o.out_features >= 0, ValueError,
             "Linear: in_features and out_features must be >= 0, got ", o.in_features, " and ", o.out_features);
  reset_parameters();
}
void Linear::reset_parameters() { reset_weight_bias(weight, bias); }
Tensor Linear::forward(const Tensor& x) {
  KILN_CHECK(x.dim() >= 1 && x.size(-1) == options.in_features, ShapeError, "Linear: expected input with last dim ",
             options.in_features, ", got shape ", x.shape_string());
  // kiln::linear adds the bias inside the oneDNN product and forms grad_weight as gᵀ · x (no separate add pass);
  // without gradients it reads the weight packed in oneDNN's layout (a training step skips even the check).
  if (grad_mode_enabled() && weight.requires_grad()) return kiln::linear(x, weight, bias);
  return kiln::linear(x, weight, bias, weight_pack);
}
Tensor Linear::forward_gelu(const Tensor& x, const std::string& approximate) {
  return linear_gelu(x, weight, bias, approximate, &weight_pack);
}
Tensor Linear::forward_add(const Tensor& x, const Tensor& residual) {
  return linear_add(x, weight, bias, residual, &weight_pack);
}
std::string Linear::extra_repr() const {
  return "in_features=" + std::to_string(options.in_features) +
         ", out_features=" + std::to_string(options.out_features) + ", bias=" + py_bool(options.bias);
}

// ---- Conv2d ----
static std::vector<int64_t> conv_weight_shape(const Conv2dOptions& o) {
  KILN_CHECK(o.groups > 0 && o.in_channels % o.groups == 0 && o.out_channels % o.groups == 0, ValueError,
             "Conv2d: in_channels (", o.in_channels, ") and out_channels (", o.out_channels,
             ") must be divisible by groups (", o.groups, ")");
  auto k = pair2(o.kernel_size, "Conv2d kernel_size");
  return {o.out_channels, o.in_channels / o.groups, k[0], k[1]};
}
Conv2d::Conv2d(Conv2dOptions o)
    : Module("Conv2d"),
      options(std::move(o)),
      weight(register_parameter("weight", empty(conv_weight_shape(options), dtype_or_default(options.dtype)))),
      bias(register_parameter(
          "bias", options.bias ? empty({options.out_channels}, dtype_or_default(options.dtype)) : Tensor())) {
  reset_parameters();
}
void Conv2d::reset_parameters() { reset_weight_bias(weight, bias); }
Tensor Conv2d::forward(const Tensor& x) {
  return conv2d(x, weight, bias, options.stride, options.padding, options.dilation, options.groups);
}
std::string Conv2d::extra_repr() const {
  std::string s = std::to_string(options.in_channels) + ", " + std::to_string(options.out_channels) +
                  ", kernel_size=" + int_or_tuple(pair2(options.kernel_size, "kernel_size")) +
                  ", stride=" + int_or_tuple(pair2(options.stride, "stride"));
  if (pair2(options.padding, "padding") != std::vector<int64_t>{0, 0})
    s += ", padding=" + int_or_tuple(pair2(options.padding, "padding"));
  if (pair2(options.dilation, "dilation") != std::vector<int64_t>{1, 1})
    s += ", dilation=" + int_or_tuple(pair2(options.dilation, "dilation"));
  if (options.groups != 1) s += ", groups=" + std::to_string(options.groups);
  if (!options.bias) s += ", bias=False";
  return s;
}

// ---- Embedding ----
Embedding::Embedding(EmbeddingOptions o)
    : Module("Embedding"),
      options(o),
      weight(register_parameter("weight", empty({o.num_embeddings, o.embedding_dim}, dtype_or_default(o.dtype)))) {
  init::normal_(weight, 0.0, 1.0);
  if (o.padding_idx) {
    int64_t p = *o.padding_idx < 0 ? *o.padding_idx + o.num_embeddings : *o.padding_idx;
    KILN_CHECK(p >= 0 && p < o.num_embeddings, ValueError, "Embedding: padding_idx must be in [-", o.num_embeddings,
               ", ", o.num_embeddings, "), got ", *o.padding_idx);
    padding_idx_ = p;
    Tensor row = weight.select(0, p);
    init::zeros_(row);
  }
}
Tensor Embedding::forward(const Tensor& indices) {
  KILN_CHECK(indices.dtype() == kInt64 || indices.dtype() == kInt32, DTypeError,
             "Embedding: expected int64 or int32 indices, got ", dtype_name(indices.dtype()));
  std::vector<int64_t> shape(indices.sizes().begin(), indices.sizes().end());
  shape.push_back(options.embedding_dim);
  Tensor out = weight.index_select(0, indices.reshape({-1})).view(shape);
  if (!padding_idx_) return out;
  // Same values; the padding positions take theirs from a detached copy, so no gradient reaches that row.
  return where(indices.eq(*padding_idx_).unsqueeze(-1), out.detach(), out);
}
std::string Embedding::extra_repr() const {
  return std::to_string(options.num_embeddings) + ", " + std::to_string(options.embedding_dim) +
         (padding_idx_ ? ", padding_idx=" + std::to_string(*padding_idx_) : std::string());
}

// ---- Dropout ----
Dropout::Dropout(double p) : Module("Dropout"), p(p) {
  KILN_CHECK(p >= 0.0 && p <= 1.0, ValueError, "Dropout: p must be in [0, 1], got ", p);
}
Tensor functional::dropout(const Tensor& x, double p, bool training) {
  KILN_CHECK(p >= 0.0 && p <= 1.0, ValueError, "dropout: expected a probability p in [0, 1], got ", p);
  if (!training || p == 0.0) return x;
  if (p == 1.0) return x * zeros_like(x);
  return ops::dropout_train(x, p);
}

Tensor Dropout::forward(const Tensor& x) { return functional::dropout(x, p, is_training()); }
std::string Dropout::extra_repr() const {
  std::string s = std::to_string(p);
  s.erase(s.find_last_not_of('0') + 1);
  if (s.back() == '.') s += '0';
  return "p=" + s + ", inplace=False";
}

// ---- pooling ----
MaxPool2d::MaxPool2d(Pool2dOptions o) : Module("MaxPool2d"), options(std::move(o)) {}
Tensor MaxPool2d::forward(const Tensor& x) {
  return max_pool2d(x, options.kernel_size, options.stride, options.padding, options.dilation, options.ceil_mode);
}
std::string MaxPool2d::extra_repr() const {
  return "kernel_size=" + int_or_tuple(options.kernel_size) +
         ", stride=" + int_or_tuple(options.stride.empty() ? options.kernel_size : options.stride) +
         ", padding=" + int_or_tuple(options.padding) + ", dilation=" + int_or_tuple(options.dilation) +
         ", ceil_mode=" + py_bool(options.ceil_mode);
}
AvgPool2d::AvgPool2d(Pool2dOptions o) : Module("AvgPool2d"), options(std::move(o)) {}
Tensor AvgPool2d::forward(const Tensor& x) {
  return avg_pool2d(x, options.kernel_size, options.stride, options.padding, options.ceil_mode,
                    options.count_include_pad);
}
std::string AvgPool2d::extra_repr() const {
  return "kernel_size=" + int_or_tuple(options.kernel_size) +
         ", stride=" + int_or_tuple(options.stride.empty() ? options.kernel_size : options.stride) +
         ", padding=" + int_or_tuple(options.padding);
}
namespace {
OptionalSize2d optional_pair(const std::vector<int64_t>& v) {
  const std::vector<int64_t> p = pair2(v, "AdaptiveAvgPool2d output_size");
  return {p[0], p[1]};
}
std::string int_or_none(std::optional<int64_t> v) { return v ? std::to_string(*v) : "None"; }
}  // namespace
AdaptiveAvgPool2d::AdaptiveAvgPool2d(std::vector<int64_t> output_size)
    : Module("AdaptiveAvgPool2d"), output_size(optional_pair(output_size)), one_value_(output_size.size() == 1) {}
AdaptiveAvgPool2d::AdaptiveAvgPool2d(std::initializer_list<int64_t> output_size)
    : AdaptiveAvgPool2d(std::vector<int64_t>(output_size)) {}
AdaptiveAvgPool2d::AdaptiveAvgPool2d(OptionalSize2d output_size)
    : Module("AdaptiveAvgPool2d"), output_size(output_size) {}
Tensor AdaptiveAvgPool2d::forward(const Tensor& x) { return adaptive_avg_pool2d(x, output_size); }
std::string AdaptiveAvgPool2d::extra_repr() const {
  if (one_value_) return "output_size=" + int_or_none(output_size[0]);
  return "output_size=(" + int_or_none(output_size[0]) + ", " + int_or_none(output_size[1]) + ")";
}

// ---- Flatten, GELU ----
Flatten::Flatten(int64_t start_dim, int64_t end_dim) : Module("Flatten"), start_dim(start_dim), end_dim(end_dim) {}
Tensor Flatten::forward(const Tensor& x) { return x.flatten(start_dim, end_dim); }
std::string Flatten::extra_repr() const {
  return "start_dim=" + std::to_string(start_dim) + ", end_dim=" + std::to_string(end_dim);
}
GELU::GELU(std::string approximate) : Module("GELU"), approximate(std::move(approximate)) {
  KILN_CHECK(this->approximate == "none" || this->approximate == "tanh", ValueError,
             "GELU: approximate must be \"none\" or \"tanh\", got \"", this->approximate, "\"");
}

// ---- containers ----
Functional::Functional(Fn fn, std::string name) : Module("Functional"), fn_(std::move(fn)), name_(std::move(name)) {
  KILN_CHECK(static_cast<bool>(fn_), ValueError, "Functional: expected a function, got an empty std::function");
}

namespace detail {
ModulePtr ModuleSeq::operator[](size_t i) const {
  const auto& c = child_entries();
  KILN_CHECK(i < c.size(), IndexError, type_name(), " index ", i, " out of range for size ", c.size());
  return c[i].second;
}
void ModuleSeq::append(ModulePtr m) { register_module(std::to_string(size()), std::move(m)); }
void ModuleSeq::wrong_type(size_t i, const Module& m, const std::type_info& want) const {
  throw ValueError(::kiln::detail::concat(type_name(), " element ", i, " is a ", m.type_name(), " (",
                                          autograd::demangle(typeid(m).name()), "), not a ",
                                          autograd::demangle(want.name())));
}
}  // namespace detail

Sequential::Sequential(std::initializer_list<ModulePtr> modules) : ModuleSeq("Sequential") {
  for (auto& m : modules) push_back(m);
}
Sequential& Sequential::push_back(ModulePtr m) {
  append(std::move(m));
  return *this;
}
Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (auto& m : children()) y = (*m)(y);
  return y;
}
ModuleList::ModuleList(std::initializer_list<ModulePtr> modules) : ModuleSeq("ModuleList") {
  for (auto& m : modules) push_back(m);
}
ModuleList& ModuleList::push_back(ModulePtr m) {
  append(std::move(m));
  return *this;
}

ModuleDict::ModuleDict(std::initializer_list<std::pair<std::string, ModulePtr>> modules) : Module("ModuleDict") {
  for (auto& [n, m] : modules) insert(n, m);
}
ModuleDict& ModuleDict::insert(const std::string& name, ModulePtr m) {
  register_module(name, std::move(m));
  return *this;
}
bool ModuleDict::contains(const std::string& name) const {
  for (auto& [n, m] : named_children())
    if (n == name) return true;
  return false;
}
ModulePtr ModuleDict::operator[](const std::string& name) const {
  std::string names;
  for (auto& [n, m] : named_children()) {
    if (n == name) return m;
    names += (names.empty() ? "" : ", ") + n;
  }
  KILN_CHECK(false, ValueError, "ModuleDict has no module \"", name, "\"; it holds: ", names);
  return nullptr;
}

}  // namespace kiln::nn
