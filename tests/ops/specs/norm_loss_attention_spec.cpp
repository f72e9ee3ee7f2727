// Registry entries (tests/ops/specs/op_spec.h) for normalisation, the fused
// loss and attention: batch_norm (training: ops::batch_norm_train and its
// fused batch_norm_relu_train / batch_norm_add_relu_train; eval: nn::BatchNorm2d
// with running statistics), layer_norm (nn::LayerNorm), cross_entropy
// (nn::functional::cross_entropy) and scaled_dot_product_attention
// (nn::functional::scaled_dot_product_attention).
//
// layer_norm, cross_entropy and attention are reached through their public nn
// entry points (a module or nn::functional), which stay whichever layer
// implements them. torch 1.13 (the oracle) has no F.scaled_dot_product_attention,
// so its samples spell out the reference formula softmax(q kᵀ / sqrt(E) + mask) v.
//
// The gradient samples differentiate every floating input except the running
// statistics, the class weights and the masks (which neither kiln nor torch
// differentiates here; one float-mask attention sample does differentiate its
// mask, which sends kiln down the composite path). Inputs stay small: the
// float64 gradcheck costs two forwards per element. Tolerances are the
// registry's defaults per dtype (float32 1e-5/1e-6 forward, 1e-4/1e-5 for
// gradients; float64 1e-10/1e-12): every entry passes them, so none is set.
#include <cmath>

#include "kiln/nn/attention.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/norm.h"
#include "kiln/ops/batch_norm.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/memory_format.h"
#include "ops/specs/op_spec.h"

namespace kiln::ops {

namespace {

const std::vector<DType> kFloatDTypes = {kFloat32, kFloat64};

using Run = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

OpSample sample(std::string label, std::vector<Tensor> inputs, Run run, std::string torch, std::vector<int> grads) {
  return {std::move(label), std::move(inputs), std::move(run), std::move(torch), std::move(grads)};
}

OpErrorCase error_case(std::string label, std::function<void()> run, std::string type, std::string contains) {
  return {std::move(label), std::move(run), std::move(type), std::move(contains)};
}

Tensor channels_last(const Tensor& t) { return contiguous(t, MemoryFormat::ChannelsLast); }

// ---- batch_norm ----

// Training-mode batch norm returns (output, batch mean, biased batch variance). The
// statistics carry no gradient (they feed the running statistics), so the gradient
// samples return the output alone: gradcheck rejects an output that does not require
// grad yet moves with the input. One forward-only sample per entry checks all three.
std::string bn_train_torch(const std::string& wrap_pre = "",
                           const std::string& wrap_post = "", const std::string& eps = "1e-5",
                           bool affine = true) {
  return wrap_pre + "F.batch_norm(x0, None, None, " + (affine ? "x1, x2" : "None, None") + ", training=True, eps=" +
         eps + ")" + wrap_post;
}
std::string bn_stats_torch(const std::string& output, const std::string& dims) {
  return "(" + output + ", x0.mean(dim=" + dims + "), x0.var(dim=" + dims + ", unbiased=False))";
}

template <typename F>
Run bn_output(F f) {
  return [f](const std::vector<Tensor>& x) { return std::vector<Tensor>{f(x).output}; };
}
template <typename F>
Run bn_all(F f) {
  return [f](const std::vector<Tensor>& x) {
    BatchNormResult r = f(x);
    return std::vector<Tensor>{r.output, r.mean, r.var};
  };
}

std::vector<OpSample> batch_norm_train_samples(DType dt) {
  auto s = [dt](IntArrayRef shape, uint64_t seed) { return sample_tensor(shape, dt, seed); };
  auto bn = [](const std::vector<Tensor>& x) { return batch_norm_train(x[0], x[1], x[2], 1e-5); };
  Run run = bn_output(bn);
  return {
      sample("[N, C]", {s({6, 3}, 1), s({3}, 2), s({3}, 3)}, run, bn_train_torch(), {0, 1, 2}),
      sample("[N, C, L]", {s({3, 4, 5}, 4), s({4}, 5), s({4}, 6)}, run, bn_train_torch(), {0, 1, 2}),
      sample("[N, C, H, W]", {s({2, 3, 4, 3}, 7), s({3}, 8), s({3}, 9)}, run, bn_train_torch(),
             {0, 1, 2}),
      sample("channels-last", {channels_last(s({2, 3, 4, 3}, 10)), s({3}, 11), s({3}, 12)}, run,
             bn_train_torch(), {0, 1, 2}),
      sample("noncontig", {sample_noncontig({2, 3, 4, 3}, dt, 13), s({3}, 14), s({3}, 15)}, run,
             bn_train_torch(), {0, 1, 2}),
      sample("no affine", {s({4, 3, 5}, 16)},
             bn_output([](const std::vector<Tensor>& x) { return batch_norm_train(x[0], Tensor(), Tensor(), 1e-5); }),
             bn_train_torch("", "", "1e-5", false), {0}),
      sample("eps 1e-2", {s({5, 2, 3}, 17), s({2}, 18), s({2}, 19)},
             bn_output([](const std::vector<Tensor>& x) { return batch_norm_train(x[0], x[1], x[2], 1e-2); }),
             bn_train_torch("", "", "1e-2"), {0, 1, 2}),
      sample("statistics (output, mean, var)", {s({2, 3, 4, 3}, 20), s({3}, 21), s({3}, 22)}, bn_all(bn),
             bn_stats_torch(bn_train_torch(), "(0, 2, 3)"), {}),
      sample("statistics, channels-last", {channels_last(s({2, 3, 4, 3}, 23)), s({3}, 24), s({3}, 25)}, bn_all(bn),
             bn_stats_torch(bn_train_torch(), "(0, 2, 3)"), {}),
  };
}

// relu(batch_norm) and relu(batch_norm + residual): fused into one node for channels-last
// inputs, the composite otherwise; both layouts are sampled. The normal draws hold no
// exact zeros, so no sample sits on the relu's kink and gradcheck runs.
std::vector<OpSample> batch_norm_relu_samples(DType dt) {
  auto s = [dt](IntArrayRef shape, uint64_t seed) { return sample_tensor(shape, dt, seed); };
  auto bn = [](const std::vector<Tensor>& x) { return batch_norm_relu_train(x[0], x[1], x[2], 1e-5); };
  Run run = bn_output(bn);
  const std::string torch = bn_train_torch("torch.relu(", ")");
  return {
      sample("channels-last (fused)", {channels_last(s({2, 3, 4, 3}, 31)), s({3}, 32), s({3}, 33)}, run, torch,
             {0, 1, 2}),
      sample("contiguous (composite)", {s({2, 3, 4, 3}, 34), s({3}, 35), s({3}, 36)}, run, torch, {0, 1, 2}),
      sample("[N, C]", {s({6, 4}, 37), s({4}, 38), s({4}, 39)}, run, bn_train_torch("torch.relu(", ")"),
             {0, 1, 2}),
      sample("statistics, channels-last (fused)", {channels_last(s({2, 3, 4, 3}, 40)), s({3}, 41), s({3}, 42)},
             bn_all(bn), bn_stats_torch(torch, "(0, 2, 3)"), {}),
  };
}

std::vector<OpSample> batch_norm_add_relu_samples(DType dt) {
  auto s = [dt](IntArrayRef shape, uint64_t seed) { return sample_tensor(shape, dt, seed); };
  auto bn = [](const std::vector<Tensor>& x) { return batch_norm_add_relu_train(x[0], x[1], x[2], x[3], 1e-5); };
  Run run = bn_output(bn);
  const std::string torch = bn_train_torch("torch.relu(", " + x3)");
  auto cl = [&s](uint64_t seed) { return channels_last(s({2, 3, 4, 3}, seed)); };
  return {
      sample("channels-last (fused)", {cl(51), s({3}, 52), s({3}, 53), cl(54)}, run, torch, {0, 1, 2, 3}),
      sample("contiguous (composite)", {s({2, 3, 4, 3}, 55), s({3}, 56), s({3}, 57), s({2, 3, 4, 3}, 58)}, run,
             torch, {0, 1, 2, 3}),
      sample("residual contiguous, x channels-last (composite)",
             {cl(59), s({3}, 60), s({3}, 61), s({2, 3, 4, 3}, 62)}, run, torch, {0, 1, 2, 3}),
      sample("statistics, channels-last (fused)", {cl(63), s({3}, 64), s({3}, 65), cl(66)}, bn_all(bn),
             bn_stats_torch(torch, "(0, 2, 3)"), {}),
  };
}

std::vector<OpErrorCase> batch_norm_train_errors() {
  return {
      error_case("int input",
                 [] { batch_norm_train(zeros({4, 3}, kInt64), Tensor(), Tensor(), 1e-5); }, "DTypeError",
                 "batch_norm: expected a float32 or float64 input"),
      error_case("weight of the wrong size",
                 [] { batch_norm_train(zeros({4, 3}), zeros({2}), zeros({3}), 1e-5); }, "DTypeError",
                 "with weight and bias of shape [C] and its dtype"),
      error_case("one value per channel",
                 [] { batch_norm_train(zeros({1, 3}), Tensor(), Tensor(), 1e-5); }, "ValueError",
                 "expected more than 1 value per channel when training"),
  };
}

// Eval mode: nn::BatchNorm2d / 1d normalise with the running statistics (x3, x4), which are
// buffers, not differentiated.
Run bn_eval(int64_t dims, bool affine, double eps) {
  return [dims, affine, eps](const std::vector<Tensor>& x) {
    const int64_t c = x[0].size(1);
    const nn::BatchNormOptions o{.num_features = c, .eps = eps, .affine = affine, .dtype = x[0].dtype()};
    std::shared_ptr<nn::BatchNorm> bn;
    if (dims == 4) bn = std::make_shared<nn::BatchNorm2d>(o);
    else bn = std::make_shared<nn::BatchNorm1d>(o);
    bn->train(false);
    const size_t r = affine ? 3 : 1;
    if (affine) {
      bn->weight = x[1];
      bn->bias = x[2];
    }
    bn->running_mean = x[r];
    bn->running_var = x[r + 1];
    return std::vector<Tensor>{bn->forward(x[0])};
  };
}

std::vector<OpSample> batch_norm_eval_samples(DType dt) {
  auto s = [dt](IntArrayRef shape, uint64_t seed) { return sample_tensor(shape, dt, seed); };
  auto var = [dt](IntArrayRef shape, uint64_t seed) { return sample_positive(shape, dt, seed); };
  return {
      sample("2d", {s({2, 3, 4, 3}, 51), s({3}, 52), s({3}, 53), s({3}, 54), var({3}, 55)}, bn_eval(4, true, 1e-5),
             "F.batch_norm(x0, x3, x4, x1, x2, training=False, eps=1e-5)", {0, 1, 2}),
      sample("2d channels-last", {channels_last(s({2, 3, 4, 3}, 56)), s({3}, 57), s({3}, 58), s({3}, 59), var({3}, 60)},
             bn_eval(4, true, 1e-5), "F.batch_norm(x0, x3, x4, x1, x2, training=False, eps=1e-5)", {0, 1, 2}),
      sample("1d [N, C, L]", {s({3, 4, 5}, 61), s({4}, 62), s({4}, 63), s({4}, 64), var({4}, 65)},
             bn_eval(3, true, 1e-5), "F.batch_norm(x0, x3, x4, x1, x2, training=False, eps=1e-5)", {0, 1, 2}),
      sample("1d [N, C] single row", {s({1, 4}, 66), s({4}, 67), s({4}, 68), s({4}, 69), var({4}, 70)},
             bn_eval(2, true, 1e-5), "F.batch_norm(x0, x3, x4, x1, x2, training=False, eps=1e-5)", {0, 1, 2}),
      sample("no affine, eps 1e-3", {s({4, 2, 3}, 71), s({2}, 72), var({2}, 73)}, bn_eval(3, false, 1e-3),
             "F.batch_norm(x0, x1, x2, None, None, training=False, eps=1e-3)", {0}),
  };
}

std::vector<OpErrorCase> batch_norm_eval_errors() {
  return {
      error_case("channel count",
                 [] {
                   nn::BatchNorm2d bn({.num_features = 3});
                   bn.train(false);
                   bn.forward(zeros({2, 4, 3, 3}));
                 },
                 "ShapeError", "BatchNorm2d: expected a 4-dim input with 3 channels in dim 1"),
      error_case("rank",
                 [] {
                   nn::BatchNorm1d bn({.num_features = 3});
                   bn.train(false);
                   bn.forward(zeros({2, 3, 3, 3}));
                 },
                 "ShapeError", "BatchNorm1d: expected a 2 or 3-dim input"),
  };
}

// ---- layer_norm ----

Run layer_norm(std::vector<int64_t> shape, bool affine, double eps) {
  return [shape, affine, eps](const std::vector<Tensor>& x) {
    nn::LayerNorm ln({.normalized_shape = shape, .eps = eps, .elementwise_affine = affine, .dtype = x[0].dtype()});
    if (affine) {
      ln.weight = x[1];
      ln.bias = x[2];
    }
    return std::vector<Tensor>{ln.forward(x[0])};
  };
}

std::vector<OpSample> layer_norm_samples(DType dt) {
  auto s = [dt](IntArrayRef shape, uint64_t seed) { return sample_tensor(shape, dt, seed); };
  return {
      sample("last dim", {s({4, 6}, 81), s({6}, 82), s({6}, 83)}, layer_norm({6}, true, 1e-5),
             "F.layer_norm(x0, (6,), x1, x2, eps=1e-5)", {0, 1, 2}),
      sample("last two dims", {s({2, 3, 4}, 84), s({3, 4}, 85), s({3, 4}, 86)}, layer_norm({3, 4}, true, 1e-5),
             "F.layer_norm(x0, (3, 4), x1, x2, eps=1e-5)", {0, 1, 2}),
      sample("noncontig", {sample_noncontig({5, 4}, dt, 87), s({4}, 88), s({4}, 89)}, layer_norm({4}, true, 1e-5),
             "F.layer_norm(x0, (4,), x1, x2, eps=1e-5)", {0, 1, 2}),
      sample("whole input, eps 1e-3", {s({3, 5}, 90), s({3, 5}, 91), s({3, 5}, 92)}, layer_norm({3, 5}, true, 1e-3),
             "F.layer_norm(x0, (3, 5), x1, x2, eps=1e-3)", {0, 1, 2}),
      sample("no affine (composite)", {s({3, 2, 5}, 93)}, layer_norm({5}, false, 1e-5),
             "F.layer_norm(x0, (5,), None, None, eps=1e-5)", {0}),
      sample("many rows", {s({70, 3}, 94), s({3}, 95), s({3}, 96)}, layer_norm({3}, true, 1e-5),
             "F.layer_norm(x0, (3,), x1, x2, eps=1e-5)", {0, 1, 2}),
  };
}

std::vector<OpErrorCase> layer_norm_errors() {
  return {
      error_case("normalized_shape mismatch",
                 [] {
                   nn::LayerNorm ln({.normalized_shape = {5}});
                   ln.forward(zeros({2, 4}));
                 },
                 "ShapeError", "LayerNorm: expected input ending in normalized_shape"),
  };
}

// ---- cross_entropy ----

// Class indices in [0, classes) from a fixed generator; `ignore` (if >= 0) replaces every third one.
Tensor targets(IntArrayRef shape, int64_t classes, uint64_t seed, int64_t ignore = -1, int64_t ignore_index = -100) {
  Generator g(seed);
  Tensor t = randint(0, classes, shape, kInt64, &g);
  if (ignore >= 0) {
    int64_t* p = t.data_ptr<int64_t>();
    for (int64_t i = ignore; i < t.numel(); i += 3) p[i] = ignore_index;
  }
  return t;
}

Run cross_entropy(nn::F::CrossEntropyOptions o, bool weighted = false) {
  return [o, weighted](const std::vector<Tensor>& x) {
    nn::F::CrossEntropyOptions opts = o;
    if (weighted) opts.weight = x[2];
    return std::vector<Tensor>{nn::F::cross_entropy(x[0], x[1], opts)};
  };
}

std::vector<OpSample> cross_entropy_samples(DType dt) {
  auto s = [dt](IntArrayRef shape, uint64_t seed) { return sample_tensor(shape, dt, seed); };
  using O = nn::F::CrossEntropyOptions;
  return {
      sample("[N, C] mean", {s({5, 4}, 101), targets({5}, 4, 102)}, cross_entropy(O{}), "F.cross_entropy(x0, x1)",
             {0}),
      sample("reduction sum", {s({5, 4}, 103), targets({5}, 4, 104)}, cross_entropy(O{.reduction = "sum"}),
             "F.cross_entropy(x0, x1, reduction='sum')", {0}),
      sample("reduction none", {s({5, 4}, 105), targets({5}, 4, 106)}, cross_entropy(O{.reduction = "none"}),
             "F.cross_entropy(x0, x1, reduction='none')", {0}),
      sample("[N, C, d1, d2]", {s({2, 3, 2, 3}, 107), targets({2, 2, 3}, 3, 108)}, cross_entropy(O{}),
             "F.cross_entropy(x0, x1)", {0}),
      sample("unbatched [C]", {s({6}, 109), targets({}, 6, 110)}, cross_entropy(O{}), "F.cross_entropy(x0, x1)",
             {0}),
      sample("noncontig", {sample_noncontig({6, 5}, dt, 111), targets({6}, 5, 112)}, cross_entropy(O{}),
             "F.cross_entropy(x0, x1)", {0}),
      sample("ignore_index -100", {s({6, 4}, 113), targets({6}, 4, 114, 1)}, cross_entropy(O{}),
             "F.cross_entropy(x0, x1)", {0}),
      sample("ignore_index 2, none", {s({6, 4}, 115), targets({6}, 4, 116, 0, 2)},
             cross_entropy(O{.ignore_index = 2, .reduction = "none"}),
             "F.cross_entropy(x0, x1, ignore_index=2, reduction='none')", {0}),
      sample("label_smoothing 0.1", {s({5, 4}, 117), targets({5}, 4, 118)}, cross_entropy(O{.label_smoothing = 0.1}),
             "F.cross_entropy(x0, x1, label_smoothing=0.1)", {0}),
      sample("label_smoothing 0.2, ignore_index, sum", {s({6, 3}, 119), targets({6}, 3, 120, 2)},
             cross_entropy(O{.reduction = "sum", .label_smoothing = 0.2}),
             "F.cross_entropy(x0, x1, reduction='sum', label_smoothing=0.2)", {0}),
      sample("class weight", {s({6, 4}, 121), targets({6}, 4, 122), sample_positive({4}, dt, 123)},
             cross_entropy(O{}, true), "F.cross_entropy(x0, x1, weight=x2)", {0}),
      sample("class weight, ignore_index, label_smoothing",
             {s({6, 4}, 124), targets({6}, 4, 125, 1), sample_positive({4}, dt, 126)},
             cross_entropy(O{.label_smoothing = 0.1}, true), "F.cross_entropy(x0, x1, weight=x2, label_smoothing=0.1)",
             {0}),
      sample("class probabilities", {s({4, 5}, 127), s({4, 5}, 128).softmax(1)}, cross_entropy(O{}),
             "F.cross_entropy(x0, x1)", {0, 1}),
      sample("class probabilities, label_smoothing, none", {s({4, 5}, 129), s({4, 5}, 130).softmax(1)},
             cross_entropy(O{.reduction = "none", .label_smoothing = 0.1}),
             "F.cross_entropy(x0, x1, reduction='none', label_smoothing=0.1)", {0, 1}),
  };
}

std::vector<OpErrorCase> cross_entropy_errors() {
  return {
      error_case("target out of range",
                 [] { nn::F::cross_entropy(zeros({2, 3}), tensor<int64_t>({0, 3}, {2})); }, "IndexError",
                 "cross_entropy: target 3 (at flat position 1) is out of bounds for 3 classes"),
      error_case("target shape",
                 [] { nn::F::cross_entropy(zeros({2, 3}), tensor<int64_t>({0, 1, 2}, {3})); }, "ShapeError",
                 "cross_entropy: expected target of shape"),
      error_case("int32 target",
                 [] { nn::F::cross_entropy(zeros({2, 3}), zeros({2}, kInt32)); }, "DTypeError",
                 "cross_entropy: expected target of dtype int64"),
      error_case("label_smoothing above 1",
                 [] { nn::F::cross_entropy(zeros({2, 3}), zeros({2}, kInt64), {.label_smoothing = 1.5}); },
                 "ValueError", "expected label_smoothing in [0, 1]"),
      error_case("class weight size",
                 [] { nn::F::cross_entropy(zeros({2, 3}), zeros({2}, kInt64), {.weight = ones({4})}); }, "ShapeError",
                 "cross_entropy: expected weight of shape [3]"),
  };
}

// ---- scaled_dot_product_attention ----

// torch's reference formula over x0 = q, x1 = k, x2 = v; `scores_op` edits the scaled scores.
std::string sdpa_torch(const std::string& scores_op = "") {
  return "torch.softmax((x0 @ x1.transpose(-2, -1) / math.sqrt(x0.shape[-1]))" + scores_op + ", dim=-1) @ x2";
}
const std::string kCausalOp =
    ".masked_fill(torch.ones(x0.shape[-2], x1.shape[-2], dtype=torch.bool).triu(1), -inf)";

Run sdpa(bool mask, bool causal, double dropout_p = 0.0, bool training = true) {
  return [=](const std::vector<Tensor>& x) {
    return std::vector<Tensor>{
        nn::F::scaled_dot_product_attention(x[0], x[1], x[2], mask ? x[3] : Tensor(), dropout_p, causal, training)};
  };
}

// A bool "may attend" mask [L, S] with key 0 always allowed, so no row is fully masked.
Tensor attend_mask(int64_t L, int64_t S, uint64_t seed) {
  Tensor m = sample_tensor({L, S}, kFloat32, seed) > 0.0;
  for (int64_t i = 0; i < L; ++i) m.data_ptr<bool>()[i * S] = true;
  return m;
}

std::vector<OpSample> sdpa_samples(DType dt) {
  auto s = [dt](IntArrayRef shape, uint64_t seed) { return sample_tensor(shape, dt, seed); };
  return {
      sample("[B, L, E]", {s({2, 4, 3}, 141), s({2, 5, 3}, 142), s({2, 5, 2}, 143)}, sdpa(false, false),
             sdpa_torch(), {0, 1, 2}),
      sample("[B, H, L, E]", {s({2, 2, 3, 4}, 144), s({2, 2, 3, 4}, 145), s({2, 2, 3, 4}, 146)}, sdpa(false, false),
             sdpa_torch(), {0, 1, 2}),
      sample("broadcast heads", {s({2, 2, 3, 4}, 147), s({1, 2, 5, 4}, 148), s({2, 1, 5, 3}, 149)},
             sdpa(false, false), sdpa_torch(), {0, 1, 2}),
      sample("2-D", {s({3, 4}, 150), s({5, 4}, 151), s({5, 2}, 152)}, sdpa(false, false), sdpa_torch(), {0, 1, 2}),
      sample("noncontig", {sample_noncontig({2, 4, 3}, dt, 153), sample_noncontig({2, 5, 3}, dt, 154),
                           sample_noncontig({2, 5, 2}, dt, 155)},
             sdpa(false, false), sdpa_torch(), {0, 1, 2}),
      sample("causal", {s({2, 4, 3}, 156), s({2, 4, 3}, 157), s({2, 4, 2}, 158)}, sdpa(false, true),
             sdpa_torch(kCausalOp), {0, 1, 2}),
      sample("causal L < S", {s({2, 3, 3}, 159), s({2, 5, 3}, 160), s({2, 5, 2}, 161)}, sdpa(false, true),
             sdpa_torch(kCausalOp), {0, 1, 2}),
      sample("bool mask", {s({2, 4, 3}, 162), s({2, 5, 3}, 163), s({2, 5, 2}, 164), attend_mask(4, 5, 165)},
             sdpa(true, false), sdpa_torch(".masked_fill(~x3, -inf)"), {0, 1, 2}),
      sample("float mask", {s({2, 4, 3}, 166), s({2, 5, 3}, 167), s({2, 5, 2}, 168), s({4, 5}, 169)},
             sdpa(true, false), sdpa_torch(" + x3"), {0, 1, 2}),
      sample("float mask with grad (composite)",
             {s({2, 4, 3}, 170), s({2, 5, 3}, 171), s({2, 5, 2}, 172), s({1, 5}, 173)}, sdpa(true, false),
             sdpa_torch(" + x3"), {0, 1, 2, 3}),
      sample("dropout_p 0.5 in eval", {s({2, 4, 3}, 174), s({2, 5, 3}, 175), s({2, 5, 2}, 176)},
             sdpa(false, false, 0.5, false), sdpa_torch(), {0, 1, 2}),
      // 80 query rows: the fused forward walks them in two blocks of 64 rows.
      sample("causal, two row blocks", {s({1, 80, 4}, 177), s({1, 80, 4}, 178), s({1, 80, 3}, 179)},
             sdpa(false, true), sdpa_torch(kCausalOp), {0, 1, 2}),
  };
}

std::vector<OpErrorCase> sdpa_errors() {
  auto z = [](IntArrayRef shape) { return zeros(shape); };
  return {
      error_case("q and k last dims differ",
                 [z] { nn::F::scaled_dot_product_attention(z({2, 3, 4}), z({2, 5, 3}), z({2, 5, 2})); }, "ShapeError",
                 "scaled_dot_product_attention: expected q and k to share the last dim E"),
      error_case("k and v lengths differ",
                 [z] { nn::F::scaled_dot_product_attention(z({2, 3, 4}), z({2, 5, 4}), z({2, 6, 2})); }, "ShapeError",
                 "expected k and v to share the sequence dim S"),
      error_case("mask and is_causal",
                 [z] {
                   nn::F::scaled_dot_product_attention(z({3, 4}), z({3, 4}), z({3, 4}), ones({3, 3}, kBool), 0.0,
                                                       true);
                 },
                 "ValueError", "expected either attn_mask or is_causal, got both"),
      error_case("int q",
                 [z] { nn::F::scaled_dot_product_attention(zeros({3, 4}, kInt64), z({3, 4}), z({3, 4})); },
                 "DTypeError", "expected floating-point q, k, v"),
      error_case("dropout_p above 1",
                 [z] { nn::F::scaled_dot_product_attention(z({3, 4}), z({3, 4}), z({3, 4}), Tensor(), 1.5); },
                 "ValueError", "expected dropout_p in [0, 1]"),
      error_case("mask shape",
                 [z] { nn::F::scaled_dot_product_attention(z({3, 4}), z({5, 4}), z({5, 4}), ones({3, 4}, kBool)); },
                 "ShapeError", "expected attn_mask broadcastable to"),
  };
}

OpSpec spec(std::string name, std::function<std::vector<OpSample>(DType)> samples,
            std::function<std::vector<OpErrorCase>()> errors) {
  OpSpec s;
  s.name = std::move(name);
  s.dtypes = kFloatDTypes;
  s.samples = std::move(samples);
  s.errors = std::move(errors);
  s.differentiable = true;
  return s;
}

}  // namespace

void register_norm_loss_attention_ops(std::vector<OpSpec>& r) {
  r.push_back(spec("batch_norm_train", batch_norm_train_samples, batch_norm_train_errors));
  r.push_back(spec("batch_norm_relu_train", batch_norm_relu_samples, {}));
  r.push_back(spec("batch_norm_add_relu_train", batch_norm_add_relu_samples, {}));
  r.push_back(spec("batch_norm_eval", batch_norm_eval_samples, batch_norm_eval_errors));
  r.push_back(spec("layer_norm", layer_norm_samples, layer_norm_errors));
  r.push_back(spec("cross_entropy", cross_entropy_samples, cross_entropy_errors));
  r.push_back(spec("scaled_dot_product_attention", sdpa_samples, sdpa_errors));
}

}  // namespace kiln::ops
