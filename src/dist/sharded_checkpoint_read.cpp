// ShardedCheckpoint, the reader (include/kiln/dist/sharded_checkpoint.h).
// Opening validates index.json (parse_index) and every shard file's header
// against it, so that read() can only fail on data that changed since; read()
// fetches each overlapping slice whole, verifies its checksum, and copies the
// part asked for.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/factory.h"
#include "sharded_checkpoint_format.h"

namespace kiln::dist {

namespace fs = std::filesystem;
using detail::concat;
using namespace shard_format;

namespace {

// Closes on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::string read_index_text(const fs::path& path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) {
    const int err = errno;
    throw IOError(concat("sharded checkpoint: cannot open '", path.string(), "': ", std::strerror(err),
                         err == ENOENT ? " (expected the index of a complete sharded checkpoint; a save that did not "
                                         "finish leaves only '<dir>.partial', which is never read)"
                                       : ""));
  }
  struct stat st {};
  KILN_CHECK(::fstat(f.fd, &st) == 0 && S_ISREG(st.st_mode), IOError, "sharded checkpoint: '", path.string(),
             "' is not a regular file");
  KILN_CHECK(static_cast<uint64_t>(st.st_size) <= kMaxIndexBytes, FormatError, path.string(),
             ": expected an index of at most ", kMaxIndexBytes, " bytes, got ", st.st_size);
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t r = ::read(f.fd, text.data() + got, text.size() - got);
    if (r < 0 && errno == EINTR) continue;
    KILN_CHECK(r >= 0, IOError, "sharded checkpoint: reading '", path.string(), "' failed: ", std::strerror(errno));
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  text.resize(got);
  return text;
}

}  // namespace

struct ShardedCheckpoint::Impl {
  fs::path dir;
  Index index;
  std::vector<fs::path> files;                  // per rank
  std::map<const IndexSlice*, uint64_t> where;  // file offset of each slice's bytes

  // Reads `bytes` at `offset` of file `r` into `out`.
  void pread_all(int64_t r, void* out, uint64_t bytes, uint64_t offset) const {
    const std::string path = files[static_cast<size_t>(r)].string();
    Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
    KILN_CHECK(f.fd >= 0, IOError, "sharded checkpoint: cannot open '", path, "': ", std::strerror(errno));
    auto* p = static_cast<char*>(out);
    while (bytes > 0) {
      const ssize_t got = ::pread(f.fd, p, bytes, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      KILN_CHECK(got >= 0, IOError, "sharded checkpoint: reading '", path, "' failed: ", std::strerror(errno));
      KILN_CHECK(got > 0, FormatError, path, ": truncated: expected ", bytes, " more bytes at offset ", offset,
                 ", got the end of the file (it shrank after the checkpoint was opened)");
      p += got, bytes -= static_cast<uint64_t>(got), offset += static_cast<uint64_t>(got);
    }
  }

  const IndexTensor& tensor(const std::string& name) const {
    auto it = index.tensors.find(name);
    if (it != index.tensors.end()) return it->second;
    std::string some;
    int k = 0;
    for (const auto& [n, t] : index.tensors) {
      if (k++ == 10) {
        some += ", ...";
        break;
      }
      some += concat(k > 1 ? ", " : "", "'", n, "'");
    }
    throw ValueError(concat("sharded checkpoint '", dir.string(), "': no tensor named '", name, "'; it holds ",
                            index.tensors.size(), " tensors: ", some));
  }
};

ShardedCheckpoint::ShardedCheckpoint(const fs::path& dir) : impl_(std::make_unique<Impl>()) {
  impl_->dir = dir;
  const fs::path index_path = dir / kIndexName;
  impl_->index = parse_index(read_index_text(index_path), index_path.string());
  const Index& index = impl_->index;
  for (int64_t r = 0; r < index.world_size; ++r) impl_->files.push_back(dir / shard_file_name(r, index.world_size));
  // The slices of each file, to check against its header.
  std::vector<std::vector<const IndexSlice*>> by_file(static_cast<size_t>(index.world_size));
  std::map<const IndexSlice*, DType> slice_dtype;
  for (const auto& [name, t] : index.tensors) {
    for (const IndexSlice& s : t.slices) {
      by_file[static_cast<size_t>(s.file)].push_back(&s);
      slice_dtype[&s] = t.dtype;
    }
  }
  for (int64_t r = 0; r < index.world_size; ++r) {
    const std::string path = impl_->files[static_cast<size_t>(r)].string();
    // Every rank wrote a file, holding slices or not: a missing one is a damaged checkpoint.
    io::SafetensorsHeader h;
    try {
      h = io::read_safetensors_header(path);
    } catch (const IOError& e) {
      throw IOError(concat("sharded checkpoint '", dir.string(), "': rank ", r, "'s shard file (the index says ",
                           index.world_size, " ranks saved it): ", e.what()));
    } catch (const FormatError& e) {
      throw FormatError(concat("sharded checkpoint '", dir.string(), "': rank ", r, "'s shard file: ", e.what()));
    }
    auto md = [&](const std::string& key) {
      auto it = h.metadata.find(key);
      return it == h.metadata.end() ? std::string("(absent)") : it->second;
    };
    KILN_CHECK(md("kiln.sharded_checkpoint.rank") == std::to_string(r) &&
                   md("kiln.sharded_checkpoint.world_size") == std::to_string(index.world_size),
               FormatError, path, ": expected the shard of rank ", r, " of ", index.world_size, ", got rank ",
               md("kiln.sharded_checkpoint.rank"), " of ", md("kiln.sharded_checkpoint.world_size"));
    std::map<std::string, const io::TensorInfo*> infos;
    for (const io::TensorInfo& info : h.tensors) infos[info.name] = &info;
    for (const IndexSlice* s : by_file[static_cast<size_t>(r)]) {
      auto it = infos.find(s->key);
      KILN_CHECK(it != infos.end(), FormatError, path, ": expected a tensor '", s->key,
                 "' (named by the index), the file has none");
      const io::TensorInfo& info = *it->second;
      const DType want = slice_dtype[s];
      KILN_CHECK(info.dtype == want && info.shape == std::vector<int64_t>{s->length}, FormatError, path, ": tensor '",
                 s->key, "': expected ", dtype_name(want), " [", s->length, "] as the index says, got ",
                 dtype_name(info.dtype), " ", shape_str(info.shape));
      impl_->where[s] = h.data_start + info.data_begin;
    }
  }
}

ShardedCheckpoint::~ShardedCheckpoint() = default;
ShardedCheckpoint::ShardedCheckpoint(ShardedCheckpoint&&) noexcept = default;
ShardedCheckpoint& ShardedCheckpoint::operator=(ShardedCheckpoint&&) noexcept = default;

const fs::path& ShardedCheckpoint::dir() const { return impl_->dir; }
int ShardedCheckpoint::world_size() const { return static_cast<int>(impl_->index.world_size); }
const ShardedMetadata& ShardedCheckpoint::metadata() const { return impl_->index.metadata; }

std::vector<std::string> ShardedCheckpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, t] : impl_->index.tensors) out.push_back(name);
  return out;
}

bool ShardedCheckpoint::contains(const std::string& name) const { return impl_->index.tensors.count(name) > 0; }
std::vector<int64_t> ShardedCheckpoint::shape(const std::string& name) const { return impl_->tensor(name).shape; }
DType ShardedCheckpoint::dtype(const std::string& name) const { return impl_->tensor(name).dtype; }
int64_t ShardedCheckpoint::numel(const std::string& name) const { return impl_->tensor(name).numel; }

Tensor ShardedCheckpoint::read(const std::string& name, int64_t begin, int64_t length) const {
  const IndexTensor& t = impl_->tensor(name);
  KILN_CHECK(begin >= 0 && length >= 0 && begin <= t.numel - length, IndexError, "sharded checkpoint '",
             impl_->dir.string(), "': tensor '", name, "' has ", t.numel, " elements; expected a range within [0, ",
             t.numel, "), got begin ", begin, ", length ", length);
  MemoryCategoryGuard category(MemoryCategory::Data);
  Tensor out = empty({length}, TensorOptions().dtype(t.dtype));
  const int64_t item = element_size(t.dtype), end = begin + length;
  auto* dst = static_cast<char*>(out.data_ptr());
  // The first slice that ends after `begin`: slices are sorted and contiguous.
  auto it = std::upper_bound(t.slices.begin(), t.slices.end(), begin,
                             [](int64_t b, const IndexSlice& s) { return b < s.begin + s.length; });
  std::vector<char> buffer;
  for (; it != t.slices.end() && it->begin < end; ++it) {
    const IndexSlice& s = *it;
    const int64_t lo = std::max(begin, s.begin), hi = std::min(end, s.begin + s.length);
    const uint64_t nbytes = static_cast<uint64_t>(s.length * item);
    const bool whole = lo == s.begin && hi == s.begin + s.length;
    char* into = dst + (lo - begin) * item;
    if (!whole) {
      buffer.resize(nbytes);
      into = buffer.data();
    }
    impl_->pread_all(s.file, into, nbytes, impl_->where.at(&s));
    const uint64_t sum = fnv1a64(into, nbytes);
    KILN_CHECK(sum == s.checksum, FormatError, impl_->files[static_cast<size_t>(s.file)].string(), ": tensor '", s.key,
               "' (elements [", s.begin, ", ", s.begin + s.length, ") of '", name,
               "'): checksum mismatch: the index says ", hex16(s.checksum), ", the data hashes to ", hex16(sum),
               " (the file is corrupted)");
    if (!whole) std::memcpy(dst + (lo - begin) * item, buffer.data() + (lo - s.begin) * item, (hi - lo) * item);
  }
  if (t.dtype == kBool) {  // a bool that is neither 0 nor 1 is undefined behaviour to read
    const auto* b = static_cast<const unsigned char*>(out.data_ptr());
    for (int64_t i = 0; i < length; ++i) {
      KILN_CHECK(b[i] <= 1, FormatError, "sharded checkpoint '", impl_->dir.string(), "': tensor '", name, "' element ",
                 begin + i, ": expected a bool byte 0 or 1, got ", int(b[i]));
    }
  }
  return out;
}

Tensor ShardedCheckpoint::read_full(const std::string& name) const {
  const IndexTensor& t = impl_->tensor(name);
  return read(name, 0, t.numel).reshape(t.shape);
}

bool is_sharded_checkpoint(const fs::path& dir) {
  try {
    parse_index(read_index_text(dir / kIndexName), (dir / kIndexName).string());
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace kiln::dist
