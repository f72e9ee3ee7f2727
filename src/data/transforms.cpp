#include "kiln/data/transforms.h"

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"

namespace kiln::data::transforms {

namespace {

Tensor as_chw_float(const Tensor& x, const char* who) {
  KILN_CHECK(x.defined() && x.dim() == 3, ShapeError, who, ": expected an image tensor [C, H, W], got ",
             x.defined() ? x.shape_string() : std::string("an undefined tensor"));
  KILN_CHECK(x.is_floating_point(), DTypeError, who, ": expected a floating-point image, got dtype ",
             dtype_name(x.dtype()));
  return x.to(kFloat32).contiguous();
}

/// A uniform double in [0, 1) from this sample's generator.
double uniform01() {
  Tensor r = rand({1}, TensorOptions().dtype(kFloat64), &sample_generator());
  return r.item<double>();
}

}  // namespace

Transform normalize(std::vector<double> mean, std::vector<double> std) {
  KILN_CHECK(!mean.empty() && mean.size() == std.size(), ValueError,
             "normalize: expected mean and std of the same non-zero length, got ", mean.size(), " and ", std.size());
  for (double s : std) KILN_CHECK(s != 0, ValueError, "normalize: expected non-zero std values, got 0");
  return [mean = std::move(mean), std = std::move(std)](const Tensor& in) {
    Tensor x = as_chw_float(in, "normalize");
    const int64_t c = x.size(0), hw = x.size(1) * x.size(2);
    KILN_CHECK(mean.size() == 1 || static_cast<int64_t>(mean.size()) == c, ShapeError, "normalize: expected 1 or ", c,
               " mean/std values for ", c, " channels, got ", mean.size());
    Tensor out = empty({c, x.size(1), x.size(2)}, TensorOptions().dtype(kFloat32));
    const float* s = x.data_ptr<float>();
    float* d = out.data_ptr<float>();
    for (int64_t ch = 0; ch < c; ++ch) {
      size_t k = mean.size() == 1 ? 0 : static_cast<size_t>(ch);
      const float m = static_cast<float>(mean[k]), inv = static_cast<float>(1.0 / std[k]);
      for (int64_t i = 0; i < hw; ++i) d[ch * hw + i] = (s[ch * hw + i] - m) * inv;
    }
    return out;
  };
}

Transform random_crop(int64_t size, int64_t padding) {
  KILN_CHECK(size >= 1 && padding >= 0, ValueError, "random_crop: expected size >= 1 and padding >= 0, got ", size,
             " and ", padding);
  return [size, padding](const Tensor& in) {
    Tensor x = as_chw_float(in, "random_crop");
    const int64_t c = x.size(0), h = x.size(1), w = x.size(2);
    const int64_t ph = h + 2 * padding, pw = w + 2 * padding;
    KILN_CHECK(size <= ph && size <= pw, ShapeError, "random_crop: crop ", size, " larger than the padded image ", ph,
               " x ", pw);
    const int64_t top = static_cast<int64_t>(uniform01() * static_cast<double>(ph - size + 1));
    const int64_t left = static_cast<int64_t>(uniform01() * static_cast<double>(pw - size + 1));
    Tensor out = zeros({c, size, size}, TensorOptions().dtype(kFloat32));
    const float* s = x.data_ptr<float>();
    float* d = out.data_ptr<float>();
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t y = 0; y < size; ++y) {
        const int64_t sy = top + y - padding;
        if (sy < 0 || sy >= h) continue;
        for (int64_t xx = 0; xx < size; ++xx) {
          const int64_t sx = left + xx - padding;
          if (sx >= 0 && sx < w) d[(ch * size + y) * size + xx] = s[(ch * h + sy) * w + sx];
        }
      }
    return out;
  };
}

Transform random_horizontal_flip(double p) {
  KILN_CHECK(p >= 0 && p <= 1, ValueError, "random_horizontal_flip: expected p in [0, 1], got ", p);
  return [p](const Tensor& in) {
    Tensor x = as_chw_float(in, "random_horizontal_flip");
    if (!(uniform01() < p)) return x.is_same(in) ? x.clone() : x;
    const int64_t rows = x.size(0) * x.size(1), w = x.size(2);
    Tensor out = empty({x.size(0), x.size(1), w}, TensorOptions().dtype(kFloat32));
    const float* s = x.data_ptr<float>();
    float* d = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < w; ++i) d[r * w + i] = s[r * w + (w - 1 - i)];
    return out;
  };
}

Transform compose(std::vector<Transform> transforms) {
  for (auto& t : transforms) KILN_CHECK(t != nullptr, ValueError, "compose: expected transforms, got a null one");
  return [ts = std::move(transforms)](const Tensor& in) {
    Tensor x = in;
    for (auto& t : ts) x = t(x);
    return x;
  };
}

}  // namespace kiln::data::transforms
