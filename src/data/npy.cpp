// .npy files (include/kiln/data/npy.h).
//
// One parser serves files and memory through a Bytes source that reads at an
// offset, so a file's elements go straight into the tensor (no second copy)
// and the fuzz target exercises the same code as read_npy.
#include "kiln/data/npy.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "file_io.h"
#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/ops/factory.h"

namespace kiln::data {

namespace {

using kiln::detail::concat;

constexpr uint8_t kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
// numpy itself refuses headers over 10000 bytes by default; far larger ones
// (wide structured dtypes) are possible, but not for the plain arrays read here.
constexpr uint64_t kMaxHeader = uint64_t{1} << 20;
constexpr size_t kMaxDims = 32;

/// Bytes at an offset, from a file or from memory.
class Bytes {
 public:
  virtual ~Bytes() = default;
  virtual uint64_t size() const = 0;
  /// Reads up to n bytes at offset; fewer only at the end.
  virtual size_t read(uint64_t offset, char* dst, size_t n) const = 0;
  virtual const std::string& name() const = 0;
};

class FileBytes : public Bytes {
 public:
  explicit FileBytes(const std::string& path) : path_(path), file_(detail::open_regular(path, "read_npy")) {}
  uint64_t size() const override { return file_.size; }
  size_t read(uint64_t offset, char* dst, size_t n) const override {
    return detail::pread_some(file_.fd.get(), dst, n, offset, path_);
  }
  const std::string& name() const override { return path_; }

 private:
  std::string path_;
  detail::OpenFile file_;
};

class MemoryBytes : public Bytes {
 public:
  MemoryBytes(std::span<const uint8_t> bytes, std::string_view source) : bytes_(bytes), name_(source) {}
  uint64_t size() const override { return bytes_.size(); }
  size_t read(uint64_t offset, char* dst, size_t n) const override {
    if (offset >= bytes_.size()) return 0;
    const size_t got = std::min<uint64_t>(n, bytes_.size() - offset);
    std::memcpy(dst, bytes_.data() + offset, got);
    return got;
  }
  const std::string& name() const override { return name_; }

 private:
  std::span<const uint8_t> bytes_;
  std::string name_;
};

struct Header {
  std::string descr;
  char order = '<', kind = 'f';
  int64_t itemsize = 4;
  bool fortran = false;
  std::vector<int64_t> shape;
  bool has_descr = false, has_fortran = false, has_shape = false;
};

/// Scans the header's dict literal; every read is bounds-checked, and the
/// only values accepted are the strings, booleans and integer tuples np.save writes.
class Scanner {
 public:
  Scanner(std::string_view text, const std::string& source) : s_(text), source_(source) {}

  Header parse() {
    Header h;
    ws();
    expect('{', "a dict starting with '{'");
    for (;;) {
      ws();
      if (eat('}')) break;
      const size_t key_at = i_;
      const std::string key = quoted("a quoted key");
      ws();
      expect(':', "':' after the key");
      ws();
      if (key == "descr") {
        dup(h.has_descr, key, key_at);
        if (peek() == '[')
          fail(
              "descr is a list: structured arrays (record dtypes) are not supported; save each field as its own array");
        h.descr = quoted("descr as a quoted dtype string such as '<f4'");
      } else if (key == "fortran_order") {
        dup(h.has_fortran, key, key_at);
        h.fortran = boolean();
      } else if (key == "shape") {
        dup(h.has_shape, key, key_at);
        h.shape = tuple();
      } else {
        i_ = key_at;
        fail(concat("unexpected key '", key, "' (a .npy header has exactly descr, fortran_order and shape)"));
      }
      ws();
      if (eat(',')) continue;
      expect('}', "',' or '}' after a value");
      break;
    }
    ws();
    if (i_ != s_.size()) fail("unexpected text after the dict");
    if (!h.has_descr || !h.has_fortran || !h.has_shape)
      throw FormatError(concat("'", source_, "': the .npy header lacks ",
                               !h.has_descr     ? "'descr'"
                               : !h.has_fortran ? "'fortran_order'"
                                                : "'shape'",
                               " (it must have descr, fortran_order and shape)"));
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    const size_t from = std::min(i_, s_.size());
    std::string near(s_.substr(from, 24));
    for (char& c : near)
      if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
    throw FormatError(concat("'", source_, "': bad .npy header at byte ", from, ": ", what,
                             near.empty() ? std::string(" (at its end)") : concat(" (near \"", near, "\")")));
  }
  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  bool eat(char c) {
    if (peek() != c || i_ >= s_.size()) return false;
    ++i_;
    return true;
  }
  void expect(char c, const char* what) {
    if (!eat(c)) fail(concat("expected ", what));
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  void dup(bool& seen, const std::string& key, size_t at) {
    if (seen) {
      i_ = at;
      fail(concat("key '", key, "' given twice"));
    }
    seen = true;
  }
  std::string quoted(const char* what) {
    const char q = peek();
    if (q != '\'' && q != '"') fail(concat("expected ", what));
    ++i_;
    const size_t end = s_.find(q, i_);
    if (end == std::string_view::npos) fail("unterminated string");
    std::string out(s_.substr(i_, end - i_));
    if (out.find('\\') != std::string::npos) fail("escapes in strings are not supported");
    i_ = end + 1;
    return out;
  }
  bool boolean() {
    if (s_.substr(i_, 4) == "True") {
      i_ += 4;
      return true;
    }
    if (s_.substr(i_, 5) == "False") {
      i_ += 5;
      return false;
    }
    fail("expected True or False for fortran_order");
  }
  std::vector<int64_t> tuple() {
    expect('(', "shape as a tuple such as (3, 4)");
    std::vector<int64_t> dims;
    for (;;) {
      ws();
      if (eat(')')) break;
      if (peek() < '0' || peek() > '9') fail("expected a non-negative integer in shape");
      uint64_t v = 0;
      while (peek() >= '0' && peek() <= '9') {
        if (__builtin_mul_overflow(v, 10u, &v) || __builtin_add_overflow(v, static_cast<uint64_t>(peek() - '0'), &v) ||
            v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          fail("a dimension too large for int64");
        ++i_;
      }
      eat('L');  // Python 2's long literals, in files its numpy wrote
      if (dims.size() == kMaxDims) fail(concat("more than ", kMaxDims, " dimensions"));
      dims.push_back(static_cast<int64_t>(v));
      ws();
      if (eat(',')) continue;
      expect(')', "',' or ')' in shape");
      break;
    }
    return dims;
  }

  std::string_view s_;
  const std::string& source_;
  size_t i_ = 0;
};

/// The tensor dtype an element type arrives as, or FormatError naming it.
DType target_dtype(Header& h, const std::string& source) {
  const std::string& d = h.descr;
  std::string shown = d;
  for (char& c : shown)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
  auto unsupported = [&](const char* why) {
    return FormatError(concat("'", source, "': unsupported .npy dtype '", shown, "': ", why));
  };
  if (d.size() < 2 || (d[0] != '<' && d[0] != '>' && d[0] != '|' && d[0] != '='))
    throw unsupported("expected a byte order (<, >, | or =), a kind and a size, e.g. '<f4'");
  h.order = d[0] == '=' ? '<' : d[0];  // '=' is native: little endian on every machine kiln runs on
  h.kind = d[1];
  switch (h.kind) {
    case 'O': throw unsupported("object arrays hold pickled Python objects, which kiln does not load");
    case 'c': throw unsupported("complex numbers are not supported");
    case 'U':
    case 'S':
    case 'a': throw unsupported("string arrays are not supported; store numbers");
    case 'M':
    case 'm': throw unsupported("datetime arrays are not supported");
    case 'V': throw unsupported("void (raw record) arrays are not supported");
    default: break;
  }
  if (d.size() < 3) throw unsupported("expected a size in bytes after the kind, e.g. '<f4'");
  int64_t size = 0;
  for (size_t i = 2; i < d.size(); ++i) {
    if (d[i] < '0' || d[i] > '9' || size > 1000) throw unsupported("expected a size in bytes after the kind");
    size = size * 10 + (d[i] - '0');
  }
  h.itemsize = size;
  const bool ok_size = (h.kind == 'f' && (size == 2 || size == 4 || size == 8)) ||
                       ((h.kind == 'i' || h.kind == 'u') && (size == 1 || size == 2 || size == 4 || size == 8)) ||
                       (h.kind == 'b' && size == 1);
  if (!ok_size) throw unsupported("expected f2/f4/f8, i1..i8, u1..u8 or b1");
  if (h.order == '|' && size != 1) throw unsupported("'|' (no byte order) is only valid for one-byte elements");
  if (h.kind == 'f') return size == 2 ? kFloat16 : size == 4 ? kFloat32 : kFloat64;
  if (h.kind == 'b') return kBool;
  if (h.kind == 'u' && size == 1) return kUInt8;
  if (h.kind == 'i' && size == 4) return kInt32;
  return kInt64;
}

/// The raw bytes of element i as an unsigned integer (in the file's byte order).
uint64_t load_raw(const uint8_t* p, int64_t size, bool big) {
  uint64_t v = 0;
  for (int64_t b = 0; b < size; ++b) v |= static_cast<uint64_t>(p[big ? size - 1 - b : b]) << (8 * b);
  return v;
}

/// Converts `count` raw elements into `out` (whose dtype target_dtype chose).
void convert(const Header& h, const uint8_t* raw, int64_t count, Tensor& out, const std::string& source) {
  const bool big = h.order == '>';
  const int64_t size = h.itemsize;
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t out_size = static_cast<int64_t>(out.element_size());
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t v = load_raw(raw + i * size, size, big);
    if (h.kind == 'f' || (h.kind == 'i' && out_size == size)) {
      // Same width: the value's bits, now in the machine's (little-endian) order.
      std::memcpy(dst + i * out_size, &v, static_cast<size_t>(out_size));
      continue;
    }
    int64_t w = 0;
    if (h.kind == 'i') {
      const int shift = static_cast<int>(64 - 8 * size);
      w = static_cast<int64_t>(v << shift) >> shift;  // sign-extend
    } else {
      KILN_CHECK(v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), FormatError, "'", source,
                 "': element ", i, " is ", v, ", beyond int64, which kiln reads uint64 arrays as");
      w = static_cast<int64_t>(v);
    }
    std::memcpy(dst + i * out_size, &w, sizeof w);
  }
}

Tensor parse(const Bytes& in) {
  const std::string& src = in.name();
  uint8_t pre[12] = {};
  const size_t got = in.read(0, reinterpret_cast<char*>(pre), 10);
  KILN_CHECK(got >= 8 && std::memcmp(pre, kMagic, 6) == 0, FormatError, "'", src,
             "': not a .npy file (expected it to start with \"\\x93NUMPY\"",
             got < 6 ? concat("; it has ", got, " bytes") : "", ")");
  const int major = pre[6], minor = pre[7];
  KILN_CHECK((major == 1 || major == 2 || major == 3) && minor == 0, FormatError, "'", src,
             "': unsupported .npy format version ", major, ".", minor, " (expected 1.0, 2.0 or 3.0)");
  const uint64_t len_bytes = major == 1 ? 2 : 4;
  const uint64_t preamble = 8 + len_bytes;
  if (major > 1) in.read(10, reinterpret_cast<char*>(pre) + 10, 2);
  KILN_CHECK(in.size() >= preamble, FormatError, "'", src, "': truncated: the file ends inside the header length (",
             in.size(), " bytes)");
  const uint64_t header_len = major == 1 ? load_raw(pre + 8, 2, false) : load_raw(pre + 8, 4, false);
  KILN_CHECK(header_len <= kMaxHeader, FormatError, "'", src, "': the header length field says ", header_len,
             " bytes, more than the ", kMaxHeader, " a .npy header of a plain array can need");
  KILN_CHECK(header_len <= in.size() - preamble, FormatError, "'", src, "': truncated: the header length field says ",
             header_len, " bytes, the file has ", in.size() - preamble, " after the preamble");
  std::string text(static_cast<size_t>(header_len), '\0');
  KILN_CHECK(in.read(preamble, text.data(), text.size()) == text.size(), FormatError, "'", src,
             "': truncated while reading the header");
  Header h = Scanner(text, src).parse();
  const DType dtype = target_dtype(h, src);

  // Element count with overflow checks; `dense` (the non-zero dims' product)
  // bounds the strides even when a zero dim empties the array.
  uint64_t dense = 1;
  bool overflow = false, has_zero = false;
  for (int64_t d : h.shape) {
    if (d == 0)
      has_zero = true;
    else
      overflow = overflow || __builtin_mul_overflow(dense, static_cast<uint64_t>(d), &dense);
  }
  uint64_t dense_bytes = 0;
  overflow =
      overflow || __builtin_mul_overflow(dense, static_cast<uint64_t>(std::max<int64_t>(h.itemsize, 8)), &dense_bytes);
  KILN_CHECK(!overflow && dense_bytes <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), FormatError, "'",
             src, "': the header's shape ", shape_str(h.shape), " has more elements than any file can hold");
  const uint64_t count = has_zero ? 0 : dense;
  const uint64_t want = count * static_cast<uint64_t>(h.itemsize);
  const uint64_t have = in.size() - preamble - header_len;
  KILN_CHECK(want <= have, FormatError, "'", src, "': truncated: shape ", shape_str(h.shape), " of '", h.descr,
             "' needs ", want, " bytes of data, the file has ", have);
  KILN_CHECK(want == have, FormatError, "'", src, "': ", have - want, " trailing bytes after the ", want,
             " bytes of data that shape ", shape_str(h.shape), " of '", h.descr, "' needs");

  // A Fortran-order array is the C-order array of the reversed shape, transposed.
  std::vector<int64_t> stored = h.shape;
  if (h.fortran) std::reverse(stored.begin(), stored.end());
  const TensorOptions data_opts = TensorOptions().dtype(dtype).category(MemoryCategory::Data);
  Tensor out = empty(stored, data_opts);
  const uint64_t offset = preamble + header_len;
  // Read straight into the tensor where the bytes already are its elements:
  // bool, uint8, and little-endian types of kiln's width (uint64 needs a range check).
  const bool direct =
      h.kind == 'b' || (h.kind == 'u' && h.itemsize == 1) ||
      (h.itemsize > 1 && h.order == '<' && h.kind != 'u' && static_cast<int64_t>(out.element_size()) == h.itemsize);
  if (direct) {
    KILN_CHECK(in.read(offset, static_cast<char*>(out.data_ptr()), want) == want, FormatError, "'", src,
               "': truncated while reading the data (the file shrank)");
  } else {
    Tensor raw = empty({static_cast<int64_t>(want)}, TensorOptions().dtype(kUInt8).category(MemoryCategory::Data));
    KILN_CHECK(in.read(offset, static_cast<char*>(raw.data_ptr()), want) == want, FormatError, "'", src,
               "': truncated while reading the data (the file shrank)");
    convert(h, raw.data_ptr<uint8_t>(), static_cast<int64_t>(count), out, src);
  }
  if (dtype == kBool) {
    // A bool other than 0 or 1 is undefined behaviour the moment it is read as bool.
    const auto* b = static_cast<const uint8_t*>(out.data_ptr());
    for (uint64_t i = 0; i < count; ++i)
      KILN_CHECK(b[i] <= 1, FormatError, "'", src, "': bool element ", i, " is ", int(b[i]), " (expected 0 or 1)");
  }
  if (!h.fortran || h.shape.size() < 2) return out;
  std::vector<int64_t> perm(h.shape.size());
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int64_t>(perm.size() - 1 - i);
  MemoryCategoryGuard data_memory(MemoryCategory::Data);
  return out.permute(perm).contiguous();
}

}  // namespace

Tensor read_npy(const std::string& path) { return parse(FileBytes(path)); }

Tensor parse_npy(std::span<const uint8_t> bytes, std::string_view source) { return parse(MemoryBytes(bytes, source)); }

}  // namespace kiln::data
