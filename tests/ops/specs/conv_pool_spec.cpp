// Registry entries for the conv_pool family: conv2d, max_pool2d,
// max_pool2d_with_indices, avg_pool2d, adaptive_avg_pool2d
// (tests/ops/specs/op_spec.h). Each sample names the torch expression the
// oracle evaluates over x0, x1, ... (F is torch.nn.functional).
#include "kiln/ops/conv.h"
#include "kiln/ops/factory.h"
#include "ops/specs/op_spec.h"

namespace kiln::ops {

namespace {

const std::vector<DType> kDenseDTypes = {kFloat32, kFloat64, kBFloat16};

// Convolutions sum C * kH * kW products in an order that differs from
// torch's; pooling is exact for max and one division for averages.
Tolerance conv_tolerance(DType dt) {
  if (dt == kFloat32) return {1e-4, 1e-5};
  return default_tolerance(dt);
}

using Run = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

// Every sample differentiates all its inputs (floating dtypes only here), so
// each input stays at <= ~200 elements: the float64 numerical check costs two
// forwards per element.
OpSample sample(std::string label, std::vector<Tensor> inputs, Run run, std::string torch) {
  std::vector<int> grads;
  for (size_t i = 0; i < inputs.size(); ++i) grads.push_back(static_cast<int>(i));
  return {std::move(label), std::move(inputs), std::move(run), std::move(torch), std::move(grads)};
}

template <typename F>
Run unary(F f) {
  return [f](const std::vector<Tensor>& x) { return std::vector<Tensor>{f(x[0])}; };
}

OpErrorCase error_case(std::string label, std::function<void()> run, std::string type, std::string contains) {
  return {std::move(label), std::move(run), std::move(type), std::move(contains)};
}

std::vector<OpSample> conv_samples(DType dt) {
  auto s = [dt](IntArrayRef shape, uint64_t seed) { return sample_tensor(shape, dt, seed); };
  auto conv = [](auto f) {
    return [f](const std::vector<Tensor>& x) { return std::vector<Tensor>{f(x)}; };
  };
  auto plain = conv([](const std::vector<Tensor>& x) { return conv2d(x[0], x[1], x[2]); });
  return {
      sample("bias", {s({2, 3, 5, 6}, 1), s({4, 3, 3, 3}, 2), s({4}, 3)}, plain, "F.conv2d(x0, x1, x2)"),
      sample("stride 2 padding 1", {s({2, 3, 6, 5}, 4), s({4, 3, 3, 3}, 5), s({4}, 6)},
             conv([](const std::vector<Tensor>& x) { return conv2d(x[0], x[1], x[2], 2, 1); }),
             "F.conv2d(x0, x1, x2, stride=2, padding=1)"),
      sample("dilation, rectangular padding, no bias", {s({1, 3, 8, 8}, 7), s({4, 3, 3, 2}, 8)},
             conv([](const std::vector<Tensor>& x) { return conv2d(x[0], x[1], {}, 1, {2, 1}, 2); }),
             "F.conv2d(x0, x1, None, padding=(2, 1), dilation=2)"),
      sample("groups 2", {s({1, 4, 6, 6}, 9), s({6, 2, 3, 3}, 10), s({6}, 11)},
             conv([](const std::vector<Tensor>& x) { return conv2d(x[0], x[1], x[2], 1, 1, 1, 2); }),
             "F.conv2d(x0, x1, x2, padding=1, groups=2)"),
      sample("depthwise", {s({1, 4, 6, 6}, 12), s({4, 1, 3, 3}, 13)},
             conv([](const std::vector<Tensor>& x) { return conv2d(x[0], x[1], {}, 1, 1, 1, 4); }),
             "F.conv2d(x0, x1, None, padding=1, groups=4)"),
      sample("unbatched", {s({3, 6, 6}, 14), s({2, 3, 3, 3}, 15), s({2}, 16)}, plain, "F.conv2d(x0, x1, x2)"),
      sample("noncontig", {sample_noncontig({2, 3, 5, 6}, dt, 17), sample_noncontig({4, 3, 3, 2}, dt, 18), s({4}, 19)},
             plain, "F.conv2d(x0, x1, x2)"),
      sample("padding same", {s({1, 3, 6, 5}, 20), s({2, 3, 2, 3}, 21)},
             conv([](const std::vector<Tensor>& x) { return conv2d(x[0], x[1], {}, 1, PaddingMode::Same); }),
             "F.conv2d(x0, x1, None, padding='same')"),
      sample("stride (1, 2) 1x1", {s({2, 5, 4, 4}, 22), s({3, 5, 1, 1}, 23), s({3}, 24)},
             conv([](const std::vector<Tensor>& x) { return conv2d(x[0], x[1], x[2], {1, 2}); }),
             "F.conv2d(x0, x1, x2, stride=(1, 2))"),
      sample("empty batch", {s({0, 3, 5, 5}, 25), s({2, 3, 3, 3}, 26), s({2}, 27)}, plain, "F.conv2d(x0, x1, x2)"),
  };
}

std::vector<OpSample> max_pool_samples(DType dt) {
  auto s = [dt](IntArrayRef shape, uint64_t seed) { return sample_tensor(shape, dt, seed); };
  return {
      sample("kernel 2", {s({2, 2, 6, 6}, 31)}, unary([](const Tensor& x) { return max_pool2d(x, 2); }),
             "F.max_pool2d(x0, 2)"),
      sample("kernel 3 stride 2 padding 1", {s({1, 2, 9, 8}, 32)},
             unary([](const Tensor& x) { return max_pool2d(x, 3, 2, 1); }), "F.max_pool2d(x0, 3, stride=2, padding=1)"),
      sample("dilation 2", {s({1, 2, 9, 9}, 33)}, unary([](const Tensor& x) { return max_pool2d(x, 2, 1, 1, 2); }),
             "F.max_pool2d(x0, 2, stride=1, padding=1, dilation=2)"),
      sample("ceil_mode", {s({1, 2, 7, 6}, 34)},
             unary([](const Tensor& x) { return max_pool2d(x, 3, 2, 0, 1, true); }),
             "F.max_pool2d(x0, 3, stride=2, ceil_mode=True)"),
      sample("rectangular", {s({1, 2, 7, 8}, 35)},
             unary([](const Tensor& x) { return max_pool2d(x, {2, 3}, {1, 2}); }),
             "F.max_pool2d(x0, (2, 3), stride=(1, 2))"),
      sample("noncontig", {sample_noncontig({1, 3, 6, 8}, dt, 36)},
             unary([](const Tensor& x) { return max_pool2d(x, 2); }), "F.max_pool2d(x0, 2)"),
      sample("unbatched", {s({3, 6, 6}, 37)}, unary([](const Tensor& x) { return max_pool2d(x, 3, 3); }),
             "F.max_pool2d(x0, 3, stride=3)"),
      sample("empty batch", {s({0, 3, 4, 4}, 38)}, unary([](const Tensor& x) { return max_pool2d(x, 2); }),
             "F.max_pool2d(x0, 2)"),
  };
}

std::vector<OpSample> avg_pool_samples(DType dt) {
  auto s = [dt](IntArrayRef shape, uint64_t seed) { return sample_tensor(shape, dt, seed); };
  return {
      sample("kernel 2", {s({2, 2, 6, 6}, 41)}, unary([](const Tensor& x) { return avg_pool2d(x, 2); }),
             "F.avg_pool2d(x0, 2)"),
      sample("padding, count_include_pad", {s({1, 2, 7, 6}, 42)},
             unary([](const Tensor& x) { return avg_pool2d(x, 3, 2, 1); }), "F.avg_pool2d(x0, 3, stride=2, padding=1)"),
      sample("padding, exclude pad", {s({1, 2, 7, 6}, 43)},
             unary([](const Tensor& x) { return avg_pool2d(x, 3, 2, 1, false, false); }),
             "F.avg_pool2d(x0, 3, stride=2, padding=1, count_include_pad=False)"),
      sample("ceil_mode, count_include_pad", {s({1, 2, 7, 6}, 44)},
             unary([](const Tensor& x) { return avg_pool2d(x, 2, 2, 1, true); }),
             "F.avg_pool2d(x0, 2, stride=2, padding=1, ceil_mode=True)"),
      sample("ceil_mode, exclude pad", {s({1, 2, 7, 6}, 45)},
             unary([](const Tensor& x) { return avg_pool2d(x, 2, 2, 1, true, false); }),
             "F.avg_pool2d(x0, 2, stride=2, padding=1, ceil_mode=True, count_include_pad=False)"),
      sample("ceil_mode past the input", {s({1, 2, 7, 6}, 46)},
             unary([](const Tensor& x) { return avg_pool2d(x, 3, 2, 0, true); }),
             "F.avg_pool2d(x0, 3, stride=2, ceil_mode=True)"),
      sample("divisor_override", {s({1, 2, 6, 6}, 47)},
             unary([](const Tensor& x) { return avg_pool2d(x, 2, {}, 0, false, true, 3); }),
             "F.avg_pool2d(x0, 2, divisor_override=3)"),
      sample("noncontig", {sample_noncontig({1, 3, 6, 8}, dt, 48)},
             unary([](const Tensor& x) { return avg_pool2d(x, 2); }), "F.avg_pool2d(x0, 2)"),
      sample("unbatched", {s({3, 6, 6}, 49)}, unary([](const Tensor& x) { return avg_pool2d(x, {3, 2}); }),
             "F.avg_pool2d(x0, (3, 2))"),
  };
}

std::vector<OpSample> adaptive_samples(DType dt) {
  auto s = [dt](IntArrayRef shape, uint64_t seed) { return sample_tensor(shape, dt, seed); };
  return {
      sample("uniform bins", {s({2, 3, 6, 4}, 51)},
             unary([](const Tensor& x) { return adaptive_avg_pool2d(x, {3, 2}); }),
             "F.adaptive_avg_pool2d(x0, (3, 2))"),
      sample("non-uniform bins", {s({1, 2, 7, 6}, 52)},
             unary([](const Tensor& x) { return adaptive_avg_pool2d(x, {3, 4}); }),
             "F.adaptive_avg_pool2d(x0, (3, 4))"),
      sample("global", {s({2, 3, 5, 5}, 53)}, unary([](const Tensor& x) { return adaptive_avg_pool2d(x, 1); }),
             "F.adaptive_avg_pool2d(x0, 1)"),
      sample("larger than input", {s({1, 2, 3, 3}, 54)},
             unary([](const Tensor& x) { return adaptive_avg_pool2d(x, {5, 4}); }),
             "F.adaptive_avg_pool2d(x0, (5, 4))"),
      sample("noncontig", {sample_noncontig({1, 3, 6, 8}, dt, 55)},
             unary([](const Tensor& x) { return adaptive_avg_pool2d(x, {4, 3}); }),
             "F.adaptive_avg_pool2d(x0, (4, 3))"),
      sample("unbatched", {s({3, 7, 7}, 56)}, unary([](const Tensor& x) { return adaptive_avg_pool2d(x, 2); }),
             "F.adaptive_avg_pool2d(x0, 2)"),
  };
}

std::vector<OpErrorCase> pool_errors(const char* op, Tensor (*pool)(const Tensor&, IntArrayRef)) {
  return {
      error_case("2-D input", [pool] { pool(zeros({4, 4}), 2); }, "ShapeError", "4-D [N, C, H, W]"),
      error_case("input smaller than the kernel", [pool] { pool(zeros({1, 1, 2, 2}), 3); }, "ShapeError",
                 "computed output size 0 x 0"),
      error_case("integer input", [pool] { pool(zeros({1, 1, 4, 4}, kInt64), 2); }, "DTypeError", op),
  };
}

}  // namespace

void register_conv_pool_ops(std::vector<OpSpec>& r) {
  const size_t first = r.size();
  r.push_back(OpSpec{"conv2d", kDenseDTypes, conv_samples, conv_tolerance, [] {
                       return std::vector<OpErrorCase>{
                           error_case("channels", [] { conv2d(zeros({1, 4, 5, 5}), zeros({8, 3, 3, 3})); }, "ShapeError",
                                      "[out_channels, in_channels / groups, kH, kW]) expects input with 3 channels"),
                           error_case("groups", [] { conv2d(zeros({1, 4, 5, 5}), zeros({9, 2, 3, 3}), {}, 1, 0, 1, 2); },
                                      "ShapeError", "must divide out_channels"),
                           error_case("kernel larger than input",
                                      [] { conv2d(zeros({1, 4, 2, 2}), zeros({8, 4, 3, 3})); }, "ShapeError",
                                      "computed output size"),
                           error_case("bias", [] { conv2d(zeros({1, 4, 5, 5}), zeros({8, 4, 3, 3}), zeros({7})); },
                                      "ShapeError", "expected bias of shape [8]"),
                           error_case("mixed dtypes",
                                      [] { conv2d(zeros({1, 4, 5, 5}), zeros({8, 4, 3, 3}, kFloat64)); }, "DTypeError",
                                      "float32 and float64"),
                           error_case("same with stride",
                                      [] { conv2d(zeros({1, 4, 5, 5}), zeros({8, 4, 3, 3}), {}, 2, PaddingMode::Same); },
                                      "ValueError", "strided"),
                       };
                     }});

  r.push_back(OpSpec{"max_pool2d", kDenseDTypes, max_pool_samples, conv_tolerance, [] {
                       auto errs = pool_errors("max_pool2d", [](const Tensor& x, IntArrayRef k) {
                         return max_pool2d(x, k);
                       });
                       errs.push_back(error_case("padding over half the kernel",
                                                 [] { max_pool2d(zeros({1, 1, 4, 4}), 3, {}, 2); }, "ValueError",
                                                 "at most half the kernel size"));
                       return errs;
                     }});

  r.push_back(OpSpec{
      "max_pool2d_with_indices", kDenseDTypes,
      [](DType dt) {
        return std::vector<OpSample>{sample(
            "ceil_mode with padding", {sample_tensor({1, 3, 7, 6}, dt, 61)},
            [](const std::vector<Tensor>& x) {
              auto [v, i] = max_pool2d_with_indices(x[0], 3, 2, 1, 1, true);
              return std::vector<Tensor>{v, i};
            },
            "F.max_pool2d(x0, 3, stride=2, padding=1, ceil_mode=True, return_indices=True)")};
      },
      conv_tolerance,
      [] {
        return pool_errors("max_pool2d_with_indices", [](const Tensor& x, IntArrayRef k) {
          return std::get<0>(max_pool2d_with_indices(x, k));
        });
      }});

  r.push_back(OpSpec{"avg_pool2d", kDenseDTypes, avg_pool_samples, conv_tolerance, [] {
                       std::vector<OpErrorCase> errs{
                           error_case("2-D input", [] { avg_pool2d(zeros({4, 4}), 2); }, "ShapeError", "4-D [N, C, H, W]"),
                           error_case("input smaller than the kernel", [] { avg_pool2d(zeros({1, 1, 2, 2}), 3); },
                                      "ShapeError", "computed output size 0 x 0"),
                           error_case("divisor_override 0",
                                      [] { avg_pool2d(zeros({1, 1, 4, 4}), 2, {}, 0, false, true, 0); }, "ValueError",
                                      "divisor_override must be nonzero"),
                       };
                       return errs;
                     }});

  r.push_back(OpSpec{"adaptive_avg_pool2d", kDenseDTypes, adaptive_samples, conv_tolerance, [] {
                       return std::vector<OpErrorCase>{
                           error_case("2-D input", [] { adaptive_avg_pool2d(zeros({4, 4}), 2); }, "ShapeError",
                                      "4-D [N, C, H, W]"),
                           error_case("empty plane", [] { adaptive_avg_pool2d(zeros({1, 1, 0, 4}), 2); }, "ShapeError",
                                      "non-empty"),
                           error_case("integer input", [] { adaptive_avg_pool2d(zeros({1, 1, 4, 4}, kInt64), 2); },
                                      "DTypeError", "adaptive_avg_pool2d"),
                       };
                     }});
  // Every entry has a backward (float dtypes only here): the registry driver checks it.
  for (size_t i = first; i < r.size(); ++i) r[i].differentiable = true;
}

}  // namespace kiln::ops
