// Bring-your-own classification data as arrays: a features array and a labels
// array, from two .npy files (np.save(x), np.save(y)) or from two tensors of
// one safetensors file (safetensors.torch.save_file({"features": x, "labels": y})).
//
// Sample i is {features[i] as float32, labels[i] as an int64 class index}.
// Features are [N, ...] of any real or bool dtype; they are converted once to
// float32 (values as stored, not rescaled: uint8 pixels stay in [0, 255]) and
// must be finite. Labels are [N] (or [N, 1]) integer class indices >= 0, or
// floating-point values that are such integers. Every problem — counts that
// differ, a negative or fractional label, a NaN feature — is a FormatError
// naming the file and the sample, raised at construction; the readers below it
// (read_npy, load_safetensors) treat their files as hostile. The arrays are
// held in memory charged to MemoryCategory::Data; get() returns views.
#pragma once

#include <string>

#include "kiln/data/dataset.h"

namespace kiln::data {

class ArrayDataset : public Dataset<Example> {
 public:
  /// `features_source` and `labels_source` name the arrays in error messages
  /// ("x.npy", "train.safetensors: labels").
  ArrayDataset(const Tensor& features, const Tensor& labels, const std::string& features_source = "features",
               const std::string& labels_source = "labels");

  /// Features and labels from two .npy files.
  static ArrayDataset from_npy(const std::string& features_path, const std::string& labels_path);
  /// Features and labels as the tensors `features_key` and `labels_key` of one
  /// safetensors file; a missing key is a FormatError listing the keys present.
  static ArrayDataset from_safetensors(const std::string& path, const std::string& features_key = "features",
                                       const std::string& labels_key = "labels");

  int64_t size() const override { return features_.size(0); }
  Example get(int64_t index) const override;

  /// One more than the largest label (0 for an empty dataset).
  int64_t num_classes() const { return num_classes_; }
  /// float32 [N, ...] and int64 [N].
  const Tensor& features() const { return features_; }
  const Tensor& labels() const { return labels_; }

 private:
  Tensor features_, labels_;
  int64_t num_classes_ = 0;
};

}  // namespace kiln::data
