// safetensors reader and writer (include/kiln/io/safetensors.h).
//
// Reading validates the whole header against the file's size before any
// tensor is allocated, so a hostile file cannot make us allocate more than it
// holds: every tensor's bytes lie inside the buffer, the buffer is covered
// exactly once (no holes, no overlap, as the format requires), hence the sum
// of the allocations is the buffer's size. The file is read with pread into
// the tensors' own memory: no mapping that a concurrent truncation could turn
// into SIGBUS, and no second copy of a large checkpoint.
#include "kiln/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>

#include "kiln/ops/factory.h"

namespace kiln::io {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian values and kiln copies them as they are");

namespace {

using json = nlohmann::ordered_json;
using detail::concat;

// The reference implementation's limit; a real header is a few KB per thousand tensors.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr int kMaxDims = 64;
constexpr std::string_view kMetadataKey = "__metadata__";

std::string sys_error(int e) { return std::error_code(e, std::generic_category()).message(); }

[[noreturn]] void fail(std::string_view source, const std::string& what) {
  throw FormatError(concat("safetensors '", source, "': ", what));
}

[[noreturn]] void fail_tensor(std::string_view source, std::string_view name, const std::string& what) {
  throw FormatError(concat("safetensors '", source, "': tensor '", name, "': ", what));
}

std::optional<DType> dtype_from_safetensors(std::string_view s) {
  for (int i = 0; i < kNumDTypes; ++i) {
    const auto dt = static_cast<DType>(i);
    if (dtype_safetensors_name(dt) == s) return dt;
  }
  return std::nullopt;
}

// A JSON value for an error message, cut short: a hostile header can hold megabytes.
std::string brief(const json& v) {
  std::string s = v.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

uint64_t read_le64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Reads a JSON value that must be a non-negative integer that fits int64.
std::optional<uint64_t> as_count(const json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return u;
    return std::nullopt;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

// Parses the JSON, refusing what a safetensors header never holds before it
// is built: duplicate keys (nlohmann would keep the last), nesting deeper than
// header -> entry -> shape, arrays longer than kMaxDims, tensor entries with
// many fields. A DOM costs ~16x its text per tiny value, so without these
// limits a 100 MB header of "[0,0,0,..." would cost gigabytes.
json parse_json(const char* text, size_t n, std::string_view source) {
  struct Frame {
    bool array;
    bool metadata;  // the __metadata__ object: any number of string fields
    size_t count = 0;
    std::set<std::string> keys;
  };
  std::vector<Frame> stack;
  std::string top_key;
  auto count_in_array = [&] {
    if (!stack.empty() && stack.back().array && ++stack.back().count > static_cast<size_t>(kMaxDims)) {
      fail(source, concat("an array in the header of '", top_key, "' holds more than ", kMaxDims, " entries"));
    }
  };
  auto cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        // depth is that of the container's parent: header 0, tensor entry 1, shape 2.
        if (depth >= 3) fail(source, "the JSON header nests deeper than a safetensors header can");
        count_in_array();
        stack.push_back(Frame{ev == json::parse_event_t::array_start, depth == 1 && top_key == kMetadataKey, 0, {}});
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key: {
        const auto& k = parsed.get_ref<const std::string&>();
        Frame& f = stack.back();
        if (!f.keys.insert(k).second) {
          if (depth == 1) fail(source, concat("tensor name '", k, "' appears twice in the header"));
          fail(source, concat("key '", k, "' appears twice in one object of the header"));
        }
        if (depth == 1) top_key = k;
        if (depth >= 2 && !f.metadata && ++f.count > 16) {
          fail(source, concat("the entry of '", top_key, "' has more than 16 fields"));
        }
        break;
      }
      case json::parse_event_t::value: count_in_array(); break;
    }
    return true;
  };
  try {
    return json::parse(text, text + n, cb);
  } catch (const json::exception& e) {
    fail(source, concat("the header is not valid JSON (", e.what(), ")"));
  }
}

TensorInfo parse_entry(const std::string& name, const json& v, uint64_t buffer_size, std::string_view source) {
  if (!v.is_object())
    fail_tensor(source, name, concat("expected an object with dtype, shape and data_offsets, got ", v.type_name()));
  TensorInfo info;
  info.name = name;
  auto field = [&](const char* key) -> const json& {
    auto it = v.find(key);
    if (it == v.end()) fail_tensor(source, name, concat("missing field '", key, "'"));
    return *it;
  };
  const json& dt = field("dtype");
  if (!dt.is_string()) fail_tensor(source, name, concat("dtype must be a string, got ", dt.type_name()));
  const auto parsed_dt = dtype_from_safetensors(dt.get_ref<const std::string&>());
  if (!parsed_dt) {
    fail_tensor(source, name,
                concat("unsupported dtype '", dt.get_ref<const std::string&>(),
                       "'; kiln reads F32, F64, BF16, F16, I64, I32, U8 and BOOL"));
  }
  info.dtype = *parsed_dt;

  const json& shape = field("shape");
  if (!shape.is_array()) fail_tensor(source, name, concat("shape must be an array, got ", shape.type_name()));
  if (shape.size() > static_cast<size_t>(kMaxDims)) {
    fail_tensor(source, name, concat("shape has ", shape.size(), " dims; at most ", kMaxDims, " are supported"));
  }
  // `dense` is the product of the non-zero dims: it bounds every partial product
  // of sizes and strides, so it must fit int64 even for an empty tensor.
  uint64_t dense = 1;
  bool overflow = false, has_zero = false;
  for (const json& s : shape) {
    const auto n = as_count(s);
    if (!n) fail_tensor(source, name, concat("shape entries must be non-negative integers, got ", brief(s)));
    info.shape.push_back(static_cast<int64_t>(*n));
    if (*n == 0)
      has_zero = true;
    else
      overflow = overflow || __builtin_mul_overflow(dense, *n, &dense);
  }
  uint64_t nbytes = 0;
  overflow = overflow || dense > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
             __builtin_mul_overflow(dense, static_cast<uint64_t>(element_size(info.dtype)), &nbytes);
  if (overflow)
    fail_tensor(source, name, concat("shape ", shape_str(info.shape), " has more elements than memory can hold"));
  if (has_zero) nbytes = 0;

  const json& off = field("data_offsets");
  if (!off.is_array() || off.size() != 2) {
    fail_tensor(source, name, concat("data_offsets must be an array [begin, end], got ", brief(off)));
  }
  const auto b = as_count(off[0]), e = as_count(off[1]);
  if (!b || !e) fail_tensor(source, name, concat("data_offsets must be non-negative integers, got ", brief(off)));
  const std::string span = concat("[", *b, ", ", *e, "]");
  if (*e < *b) fail_tensor(source, name, concat("data_offsets ", span, " end before they begin"));
  if (*e > buffer_size) {
    fail_tensor(source, name,
                concat("data_offsets ", span, " run past the end of the data buffer (", buffer_size, " bytes)"));
  }
  if (*e - *b != nbytes) {
    fail_tensor(source, name,
                concat("data_offsets ", span, " hold ", *e - *b, " bytes, but dtype ",
                       dtype_safetensors_name(info.dtype), " with shape ", shape_str(info.shape), " needs ", nbytes));
  }
  info.data_begin = *b;
  info.data_end = *e;
  return info;
}

// Validates the header text against a buffer of `buffer_size` bytes.
SafetensorsHeader parse_header(const char* text, size_t n, uint64_t data_start, uint64_t buffer_size,
                               std::string_view source) {
  const json root = parse_json(text, n, source);
  if (!root.is_object()) fail(source, concat("the header must be a JSON object, got ", root.type_name()));
  SafetensorsHeader h;
  h.data_start = data_start;
  h.data_size = buffer_size;
  for (const auto& [key, value] : root.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object())
        fail(source, concat("__metadata__ must be an object of strings, got ", value.type_name()));
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) fail(source, concat("__metadata__ value of '", mk, "' must be a string, got ", brief(mv)));
        h.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    h.tensors.push_back(parse_entry(key, value, buffer_size, source));
  }
  // The buffer must be covered exactly once: sort by offsets and walk it.
  std::stable_sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.data_begin != b.data_begin ? a.data_begin < b.data_begin : a.data_end < b.data_end;
  });
  uint64_t cursor = 0;
  const TensorInfo* prev = nullptr;
  for (const auto& t : h.tensors) {
    if (t.data_begin < cursor) {
      fail_tensor(source, t.name,
                  concat("data_offsets [", t.data_begin, ", ", t.data_end, "] overlap tensor '", prev->name, "' at [",
                         prev->data_begin, ", ", prev->data_end, "]"));
    }
    if (t.data_begin > cursor) {
      fail_tensor(source, t.name,
                  concat("data_offsets [", t.data_begin, ", ", t.data_end, "] leave bytes [", cursor, ", ",
                         t.data_begin, ") of the buffer unused; the format allows no holes"));
    }
    if (t.data_end > t.data_begin) {
      cursor = t.data_end;
      prev = &t;
    }
  }
  if (cursor != buffer_size) {
    fail(source, concat("the tensors cover ", cursor, " bytes of the data buffer but it holds ", buffer_size,
                        " (trailing bytes belong to no tensor)"));
  }
  return h;
}

// The 8-byte length prefix against the total size; returns the header length.
uint64_t check_framing(const uint8_t* first8, uint64_t total, std::string_view source) {
  if (total < 8)
    fail(source, concat("the file holds ", total, " bytes; a safetensors file starts with an 8-byte header length"));
  const uint64_t n = read_le64(first8);
  // The verdict first: text or another format read as a length is an absurd number.
  if (n > kMaxHeaderBytes) {
    fail(source, concat("not a safetensors file (or a corrupt one): its first 8 bytes, read as the header length, "
                        "give ",
                        n, ", which exceeds the 100 MB limit"));
  }
  if (n > total - 8) {
    fail(source, concat("not a complete safetensors file (truncated, or another format): header length ", n,
                        " runs past the end of the file (", total, " bytes)"));
  }
  return n;
}

Tensor allocate_for(const TensorInfo& info) {
  return empty(info.shape, TensorOptions(info.dtype).category(MemoryCategory::Data));
}

// A bool byte other than 0 or 1 is undefined behaviour to read as bool in C++.
void check_bool_bytes(const Tensor& t, const TensorInfo& info, std::string_view source) {
  if (info.dtype != kBool) return;
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (p[i] > 1) {
      fail_tensor(source, info.name,
                  concat("BOOL element ", i, " holds byte ", static_cast<int>(p[i]), "; expected 0 or 1"));
    }
  }
}

// ---- files ----

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// Reads exactly n bytes at `offset`; FormatError if the file ends first.
void pread_all(int fd, void* dst, uint64_t n, uint64_t offset, std::string_view source) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, uint64_t{1} << 30));
    const ssize_t r = ::pread(fd, p, chunk, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw IOError(concat("safetensors '", source, "': read failed at offset ", offset, ": ", sys_error(errno)));
    }
    if (r == 0) fail(source, concat("the file ended at offset ", offset, " while reading (was it truncated?)"));
    p += r;
    n -= static_cast<uint64_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

struct OpenFile {
  Fd fd;
  uint64_t size;
};

OpenFile open_for_read(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw IOError(concat("safetensors '", path, "': cannot open for reading: ", sys_error(errno)));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    throw IOError(concat("safetensors '", path, "': cannot stat: ", sys_error(errno)));
  }
  if (!S_ISREG(st.st_mode)) throw IOError(concat("safetensors '", path, "': not a regular file"));
  return {Fd(fd.release()), static_cast<uint64_t>(st.st_size)};
}

SafetensorsHeader read_header(int fd, uint64_t size, const std::string& path) {
  uint8_t first8[8] = {};
  if (size >= 8) pread_all(fd, first8, 8, 0, path);
  const uint64_t n = check_framing(first8, size, path);
  std::string text(static_cast<size_t>(n), '\0');
  pread_all(fd, text.data(), n, 8, path);
  return parse_header(text.data(), text.size(), 8 + n, size - 8 - n, path);
}

void write_all(int fd, const void* src, size_t n, const std::string& tmp) {
  const auto* p = static_cast<const char*>(src);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw IOError(concat("save_safetensors: writing '", tmp, "' failed: ", sys_error(errno)));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// ---- writing ----

struct Prepared {
  std::string header;        // 8-byte length + JSON padded to a multiple of 8
  std::vector<Tensor> data;  // contiguous, in file order
  uint64_t data_bytes = 0;
};

Prepared prepare(const NamedTensors& tensors, const Metadata& metadata) {
  Prepared p;
  json root = json::object();
  if (!metadata.empty()) {
    json m = json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    root[std::string(kMetadataKey)] = std::move(m);
  }
  std::set<std::string_view> seen;
  for (const auto& [name, t] : tensors) {
    KILN_CHECK(name != kMetadataKey, ValueError,
               "save_safetensors: '__metadata__' is reserved and cannot name a tensor");
    KILN_CHECK(seen.insert(name).second, ValueError, "save_safetensors: tensor name '", name, "' is given twice");
    KILN_CHECK(t.defined(), ValueError, "save_safetensors: tensor '", name, "' is undefined");
    Tensor c = t.contiguous();
    const uint64_t nb = static_cast<uint64_t>(c.nbytes());
    json e = json::object();
    e["dtype"] = std::string(dtype_safetensors_name(c.dtype()));
    e["shape"] = json::array();
    for (int64_t s : c.sizes()) e["shape"].push_back(s);
    e["data_offsets"] = json::array({p.data_bytes, p.data_bytes + nb});
    root[name] = std::move(e);
    p.data_bytes += nb;
    p.data.push_back(std::move(c));
  }
  std::string text;
  try {
    text = root.dump();
  } catch (const json::exception& e) {
    throw ValueError(concat("save_safetensors: a tensor name or metadata string is not valid UTF-8 (", e.what(), ")"));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t n = text.size();
  p.header.resize(8);
  std::memcpy(p.header.data(), &n, 8);
  p.header += text;
  return p;
}

void fsync_directory(const std::string& path) {
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return;  // the rename is done; some systems cannot open directories
  if (::fsync(fd.get()) != 0 && errno != EINVAL && errno != EROFS) {
    throw IOError(
        concat("save_safetensors: '", path, "' was written, but syncing its directory failed: ", sys_error(errno)));
  }
}

}  // namespace

bool SafetensorsFile::contains(std::string_view name) const {
  return std::any_of(tensors.begin(), tensors.end(), [&](const auto& p) { return p.first == name; });
}

const Tensor& SafetensorsFile::at(std::string_view name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return t;
  }
  std::string names;
  for (size_t i = 0; i < tensors.size() && i < 20; ++i) names += (i ? ", " : "") + tensors[i].first;
  if (tensors.size() > 20) names += ", ...";
  throw ValueError(
      concat("safetensors: no tensor named '", name, "'; the file holds ", tensors.size(), " tensors: ", names));
}

std::vector<uint8_t> serialize_safetensors(const NamedTensors& tensors, const Metadata& metadata) {
  const Prepared p = prepare(tensors, metadata);
  std::vector<uint8_t> out(p.header.size() + p.data_bytes);
  std::memcpy(out.data(), p.header.data(), p.header.size());
  size_t pos = p.header.size();
  for (const Tensor& t : p.data) {
    if (t.nbytes()) std::memcpy(out.data() + pos, t.data_ptr(), static_cast<size_t>(t.nbytes()));
    pos += static_cast<size_t>(t.nbytes());
  }
  return out;
}

SafetensorsFile parse_safetensors(std::span<const uint8_t> bytes, std::string_view source) {
  const uint64_t total = bytes.size();
  const uint64_t n = check_framing(bytes.data(), total, source);
  const SafetensorsHeader h =
      parse_header(reinterpret_cast<const char*>(bytes.data()) + 8, n, 8 + n, total - 8 - n, source);
  SafetensorsFile f;
  f.metadata = h.metadata;
  for (const auto& info : h.tensors) {
    Tensor t = allocate_for(info);
    const uint64_t nb = info.data_end - info.data_begin;
    if (nb) std::memcpy(t.data_ptr(), bytes.data() + h.data_start + info.data_begin, nb);
    check_bool_bytes(t, info, source);
    f.tensors.emplace_back(info.name, std::move(t));
  }
  return f;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  OpenFile f = open_for_read(path);
  return read_header(f.fd.get(), f.size, path);
}

SafetensorsFile load_safetensors(const std::string& path) {
  OpenFile of = open_for_read(path);
  const SafetensorsHeader h = read_header(of.fd.get(), of.size, path);
  SafetensorsFile f;
  f.metadata = h.metadata;
  for (const auto& info : h.tensors) {
    Tensor t = allocate_for(info);
    pread_all(of.fd.get(), t.data_ptr(), info.data_end - info.data_begin, h.data_start + info.data_begin, path);
    check_bool_bytes(t, info, path);
    f.tensors.emplace_back(info.name, std::move(t));
  }
  return f;
}

void save_safetensors(const std::string& path, const NamedTensors& tensors, const Metadata& metadata) {
  const Prepared p = prepare(tensors, metadata);  // all validation before the disk is touched
  const std::string tmp = concat(path, ".tmp.", ::getpid());
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    throw IOError(
        concat("save_safetensors: cannot create '", tmp, "' (to be renamed to '", path, "'): ", sys_error(errno)));
  }
  try {
    write_all(fd.get(), p.header.data(), p.header.size(), tmp);
    for (const Tensor& t : p.data) write_all(fd.get(), t.data_ptr(), static_cast<size_t>(t.nbytes()), tmp);
    if (::fsync(fd.get()) != 0)
      throw IOError(concat("save_safetensors: fsync of '", tmp, "' failed: ", sys_error(errno)));
    if (::close(fd.release()) != 0) {
      throw IOError(concat("save_safetensors: closing '", tmp, "' failed: ", sys_error(errno)));
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      throw IOError(concat("save_safetensors: cannot rename '", tmp, "' to '", path, "': ", sys_error(errno)));
    }
  } catch (...) {
    if (fd.get() >= 0) ::close(fd.release());
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_directory(path);
}

}  // namespace kiln::io
