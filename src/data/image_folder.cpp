// ImageFolder (include/kiln/data/image.h).
//
// Two passes over the files: the first reads only each image's header, so
// that the channel count, a size mismatch or an oversized image is known (and
// reported, naming the file) before the dataset's one tensor is allocated; the
// second decodes each image into its slot of that tensor.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>

#include "file_io.h"
#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/data/image.h"
#include "kiln/ops/factory.h"

namespace kiln::data {

namespace {

namespace fs = std::filesystem;
using kiln::detail::concat;

bool is_image_name(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext == ".png" || ext == ".jpg" || ext == ".jpeg";
}

/// Image files under `dir`, recursively, in sorted path order. Symlinked
/// directories are not followed (a link cycle cannot make the walk endless).
std::vector<std::string> images_under(const fs::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    if (it->is_regular_file(type_ec) && is_image_name(it->path())) out.push_back(it->path().string());
  }
  KILN_CHECK(!ec, IOError, "ImageFolder: cannot list '", dir.string(), "': ", ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

std::string read_file(const std::string& path) { return detail::read_whole_file(path, "ImageFolder"); }

std::span<const uint8_t> as_bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace

ImageFolder::ImageFolder(ImageFolderOptions o) {
  KILN_CHECK(o.channels == 0 || o.channels == 1 || o.channels == 3, ValueError,
             "ImageFolder: expected channels 0 (as the images), 1 or 3, got ", o.channels);
  KILN_CHECK(o.max_pixels > 0, ValueError, "ImageFolder: expected max_pixels > 0, got ", o.max_pixels);
  KILN_CHECK(o.size.empty() || ((o.size.size() == 1 || o.size.size() == 2) &&
                                std::all_of(o.size.begin(), o.size.end(), [](int64_t s) { return s > 0; })),
             ValueError, "ImageFolder: expected size {H, W} or {S} with positive values, or empty, got ",
             shape_str(o.size));
  const fs::path root(o.root);
  std::error_code ec;
  KILN_CHECK(fs::is_directory(root, ec), IOError, "ImageFolder: '", o.root,
             "' is not a directory (expected root/<class>/<image>.png|jpg)");

  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(root, ec))
    if (std::error_code dir_ec; entry.is_directory(dir_ec)) found.push_back(entry.path().filename().string());
  KILN_CHECK(!ec, IOError, "ImageFolder: cannot list '", o.root, "': ", ec.message());
  std::sort(found.begin(), found.end());
  const bool given = !o.classes.empty();
  if (given) {
    const std::set<std::string> known(o.classes.begin(), o.classes.end());
    for (const auto& f : found)
      KILN_CHECK(known.count(f), FormatError, "ImageFolder: '", (root / f).string(), "' is not one of the ",
                 o.classes.size(), " classes of the training data");
  }
  classes_ = given ? o.classes : found;
  KILN_CHECK(!classes_.empty(), FormatError, "ImageFolder: '", o.root,
             "' has no class subfolders (expected root/<class>/<image>.png|jpg)");

  std::vector<int64_t> label_of;
  for (size_t c = 0; c < classes_.size(); ++c) {
    if (given && !fs::is_directory(root / classes_[c], ec)) continue;
    const auto files = images_under(root / classes_[c]);
    KILN_CHECK(given || !files.empty(), FormatError, "ImageFolder: class folder '", (root / classes_[c]).string(),
               "' holds no .png, .jpg or .jpeg files");
    for (const auto& f : files) {
      paths_.push_back(f);
      label_of.push_back(static_cast<int64_t>(c));
    }
  }
  const auto n = static_cast<int64_t>(paths_.size());
  KILN_CHECK(n > 0, FormatError, "ImageFolder: no images under '", o.root, "'");

  // Pass 1: headers only.
  std::vector<ImageInfo> info(static_cast<size_t>(n));
  bool any_color = false;
  for (int64_t i = 0; i < n; ++i) {
    const std::string& p = paths_[static_cast<size_t>(i)];
    info[static_cast<size_t>(i)] = probe_image(as_bytes(read_file(p)), p);
    const ImageInfo& im = info[static_cast<size_t>(i)];
    KILN_CHECK(im.height <= o.max_pixels / im.width, FormatError, "'", p, "': the image is ", im.width, "x", im.height,
               " pixels, more than the limit of ", o.max_pixels);
    any_color = any_color || im.channels == 3;
    if (o.size.empty())
      KILN_CHECK(
          im.height == info[0].height && im.width == info[0].width, FormatError, "'", p, "' is ", im.width, "x",
          im.height, " but '", paths_[0], "' is ", info[0].width, "x", info[0].height,
          ": images of one dataset need one size (resize them: ImageFolderOptions::size, or data.resize in a config)");
  }
  const int64_t c = o.channels ? o.channels : (any_color ? 3 : 1);
  const int64_t h = o.size.empty() ? info[0].height : o.size[0];
  const int64_t w = o.size.empty() ? info[0].width : o.size.back();

  // Pass 2: decode into place.
  images_ = empty({n, c, h, w}, TensorOptions().dtype(kUInt8).category(MemoryCategory::Data));
  labels_ = empty({n}, TensorOptions().dtype(kInt64).category(MemoryCategory::Data));
  std::memcpy(labels_.data_ptr(), label_of.data(), label_of.size() * sizeof(int64_t));
  uint8_t* dst = images_.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const std::string& p = paths_[static_cast<size_t>(i)];
    Tensor im = decode_image(as_bytes(read_file(p)), p, c, o.max_pixels);
    KILN_CHECK(im.size(1) == info[static_cast<size_t>(i)].height && im.size(2) == info[static_cast<size_t>(i)].width,
               FormatError, "'", p, "' changed while the dataset was being read");
    if (im.size(1) != h || im.size(2) != w) im = resize_bilinear(im, h, w);
    std::memcpy(dst + i * c * h * w, im.data_ptr(), static_cast<size_t>(c * h * w));
  }
}

Example ImageFolder::get(int64_t index) const {
  KILN_CHECK(index >= 0 && index < size(), IndexError, "ImageFolder: index ", index, " out of range [0, ", size(), ")");
  const int64_t per = images_.numel() / images_.size(0);
  Tensor x = empty({images_.size(1), images_.size(2), images_.size(3)},
                   TensorOptions().dtype(kFloat32).category(MemoryCategory::Data));
  const uint8_t* src = images_.data_ptr<uint8_t>() + index * per;
  float* d = x.data_ptr<float>();
  for (int64_t i = 0; i < per; ++i) d[i] = static_cast<float>(src[i]) / 255.0f;
  return {x, labels_.select(0, index)};
}

}  // namespace kiln::data
