// Images from PNG and JPEG files (Debian's libpng and libjpeg-turbo), and
// ImageFolder: a folder of images per class, as torchvision.datasets.ImageFolder.
//
// Decoding gives uint8 [C, H, W] with C = 1 (grayscale) or 3 (RGB). The
// channels are converted as PIL's Image.convert does, which is what a
// torchvision pipeline sees: an alpha channel is dropped (not composited),
// grayscale becomes RGB by repetition, and RGB becomes grayscale by ITU-R
// 601-2 luma, L = (19595 R + 38470 G + 7471 B + 2^15) >> 16. PNG colours are
// what libpng's simplified reader gives as 8-bit sRGB: 16-bit samples are
// reduced to 8 bits, and a file whose gAMA chunk differs from sRGB's may come
// out gamma corrected where PIL ignores gAMA (such files are rare). CMYK JPEGs
// are refused.
//
// Every file is hostile input: the format is taken from the file's first bytes
// (not its name), the image's size is checked against `max_pixels` before any
// pixel memory is allocated (like PIL's decompression-bomb limit), and a
// truncated or corrupt file — libjpeg's "premature end of data" warning
// included, which it would otherwise fill with gray — is a FormatError naming
// the file and the decoder's complaint. Pixel memory is charged to
// MemoryCategory::Data.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/data/dataset.h"

namespace kiln::data {

/// PIL's default decompression-bomb limit (Image.MAX_IMAGE_PIXELS).
inline constexpr int64_t kMaxImagePixels = 89478485;

struct ImageInfo {
  int64_t channels = 0;  // as stored, alpha not counted: 1 (grayscale) or 3 (color)
  int64_t height = 0, width = 0;
};

/// The header of a PNG or JPEG image in memory, without decoding its pixels.
ImageInfo probe_image(std::span<const uint8_t> bytes, std::string_view source = "<memory>");

/// A PNG or JPEG image as uint8 [C, H, W]; C = `channels` (1 or 3), or as stored when 0.
Tensor decode_image(std::span<const uint8_t> bytes, std::string_view source = "<memory>", int64_t channels = 0,
                    int64_t max_pixels = kMaxImagePixels);

/// decode_image of a file's bytes; IOError if it cannot be read.
Tensor read_image(const std::string& path, int64_t channels = 0, int64_t max_pixels = kMaxImagePixels);

/// uint8 [C, H, W] resized to [C, height, width] by bilinear interpolation at
/// pixel centres (torch.nn.functional.interpolate, mode="bilinear",
/// align_corners=False, no antialiasing), rounded to the nearest integer.
Tensor resize_bilinear(const Tensor& image, int64_t height, int64_t width);

struct ImageFolderOptions {
  std::string root = {};
  /// 1 or 3; 0: 1 when every image is grayscale, else 3.
  int64_t channels = 0;
  /// {H, W} (or {S} for S x S): every image is resized to it; empty: every
  /// image must have the first one's size.
  std::vector<int64_t> size = {};
  /// The class folders, in class-index order (a validation folder numbered as
  /// its training folder; a class without a folder has no images); empty:
  /// every subfolder of root, sorted by name.
  std::vector<std::string> classes = {};
  int64_t max_pixels = kMaxImagePixels;
};

/// root/<class>/**/<image>.{png,jpg,jpeg} (extension case-insensitive; other
/// files skipped), class indices in sorted folder order and samples in sorted
/// path order, as torchvision's ImageFolder. Every image is decoded once at
/// construction into one uint8 [N, C, H, W] tensor (a problem in any file is
/// raised then, naming it); sample i is {float32 [C, H, W] in [0, 1] (as
/// ToTensor gives), int64 class index}.
class ImageFolder : public Dataset<Example> {
 public:
  explicit ImageFolder(ImageFolderOptions options);
  int64_t size() const override { return images_.size(0); }
  Example get(int64_t index) const override;

  const std::vector<std::string>& classes() const { return classes_; }
  const std::vector<std::string>& paths() const { return paths_; }
  /// uint8 [N, C, H, W] and int64 [N].
  const Tensor& images() const { return images_; }
  const Tensor& labels() const { return labels_; }

 private:
  std::vector<std::string> classes_, paths_;
  Tensor images_, labels_;
};

}  // namespace kiln::data
