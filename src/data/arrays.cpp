// Features and labels as arrays (include/kiln/data/arrays.h).
#include "kiln/data/arrays.h"

#include <cmath>
#include <limits>

#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/data/npy.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/factory.h"

namespace kiln::data {

namespace {

using kiln::detail::concat;

// A label this large is not a class index (regression targets, ids): one
// output per class would make a model of millions of logits.
constexpr int64_t kMaxClasses = int64_t{1} << 20;

/// Labels as int64 [N], checked to be class indices.
Tensor class_indices(const Tensor& labels, const std::string& source) {
  KILN_CHECK(labels.dim() == 1 || (labels.dim() == 2 && labels.size(1) == 1), FormatError, "'", source,
             "': expected labels of shape [N] (or [N, 1]), got ", labels.shape_string(),
             " (one integer class index per sample)");
  const Tensor flat = labels.reshape({labels.size(0)});
  const int64_t n = flat.size(0);
  MemoryCategoryGuard data_memory(MemoryCategory::Data);
  if (is_floating_point(flat.dtype())) {
    const Tensor d = flat.to(kFloat64).contiguous();
    const double* p = d.data_ptr<double>();
    for (int64_t i = 0; i < n; ++i)
      KILN_CHECK(std::isfinite(p[i]) && p[i] >= 0 && p[i] == std::floor(p[i]) && p[i] < kMaxClasses, FormatError, "'",
                 source, "': label ", i, " is ", p[i], "; expected class indices: integers in [0, ", kMaxClasses,
                 ") (kiln trains classifiers from these arrays, not regression)");
  }
  KILN_CHECK(is_floating_point(flat.dtype()) || is_integral(flat.dtype(), /*include_bool=*/true), FormatError, "'",
             source, "': expected integer labels, got ", dtype_name(flat.dtype()));
  Tensor out = flat.to(kInt64, /*copy=*/true).contiguous();
  const int64_t* p = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    KILN_CHECK(p[i] >= 0 && p[i] < kMaxClasses, FormatError, "'", source, "': label ", i, " is ", p[i],
               "; expected class indices in [0, ", kMaxClasses, ")");
  return out;
}

/// Features as float32, contiguous, every value finite.
Tensor float_features(const Tensor& features, const std::string& source) {
  KILN_CHECK(features.dim() >= 2, FormatError, "'", source,
             "': expected features of shape [N, ...] (2 or more dims), got ", features.shape_string(),
             " (a single feature per sample is [N, 1])");
  KILN_CHECK(is_floating_point(features.dtype()) || is_integral(features.dtype(), /*include_bool=*/true), FormatError,
             "'", source, "': expected numeric features, got ", dtype_name(features.dtype()));
  MemoryCategoryGuard data_memory(MemoryCategory::Data);
  Tensor out = features.to(kFloat32).contiguous();
  const float* p = out.data_ptr<float>();
  const int64_t n = out.numel(), per = n / std::max<int64_t>(1, out.size(0));
  for (int64_t i = 0; i < n; ++i)
    KILN_CHECK(std::isfinite(p[i]), FormatError, "'", source, "': sample ", i / per, " has a non-finite feature (",
               p[i], " at flat position ", i % per, "); clean or impute the data first");
  return out;
}

}  // namespace

ArrayDataset::ArrayDataset(const Tensor& features, const Tensor& labels, const std::string& features_source,
                           const std::string& labels_source) {
  KILN_CHECK(features.defined() && labels.defined(), ValueError, "ArrayDataset: expected two defined tensors");
  features_ = float_features(features, features_source);
  labels_ = class_indices(labels, labels_source);
  KILN_CHECK(features_.size(0) == labels_.size(0), FormatError, "mismatched counts: '", features_source, "' has ",
             features_.size(0), " samples but '", labels_source, "' has ", labels_.size(0), " labels");
  const int64_t* p = labels_.data_ptr<int64_t>();
  for (int64_t i = 0; i < labels_.size(0); ++i) num_classes_ = std::max(num_classes_, p[i] + 1);
}

ArrayDataset ArrayDataset::from_npy(const std::string& features_path, const std::string& labels_path) {
  const Tensor features = read_npy(features_path);  // first, so a problem in both names the features file
  return ArrayDataset(features, read_npy(labels_path), features_path, labels_path);
}

ArrayDataset ArrayDataset::from_safetensors(const std::string& path, const std::string& features_key,
                                            const std::string& labels_key) {
  const io::SafetensorsFile file = io::load_safetensors(path);
  for (const std::string* key : {&features_key, &labels_key}) {
    if (file.contains(*key)) continue;
    std::string names;
    for (size_t i = 0; i < file.tensors.size() && i < 20; ++i) names += (i ? ", " : "") + file.tensors[i].first;
    throw FormatError(concat("'", path, "': no tensor named '", *key, "' (it holds ", file.tensors.size(), " tensors",
                             names.empty() ? "" : ": ", names, "); name them with features_key/labels_key"));
  }
  return ArrayDataset(file.at(features_key), file.at(labels_key), path + ": " + features_key, path + ": " + labels_key);
}

Example ArrayDataset::get(int64_t index) const {
  KILN_CHECK(index >= 0 && index < size(), IndexError, "ArrayDataset: index ", index, " out of range [0, ", size(),
             ")");
  return {features_.select(0, index), labels_.select(0, index)};
}

}  // namespace kiln::data
