// index.json of a sharded checkpoint (sharded_checkpoint_format.h): written by
// rank 0 of a save, parsed by every reader. The parser treats the text as
// hostile: it bounds nesting and refuses duplicate keys while parsing, checks
// every field's type and range, that each tensor's slices cover it exactly
// once, and last the checksum over the whole index (metadata included: a
// flipped digit in a step still parses).
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "kiln/core/error.h"
#include "sharded_checkpoint_format.h"

namespace kiln::dist::shard_format {

using json = nlohmann::json;
using detail::concat;

uint64_t fnv1a64(const void* p, size_t n, uint64_t h) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ULL;
  return h;
}

std::string hex16(uint64_t v) {
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string shard_file_name(int64_t r, int64_t n) { return concat("shard-", r, "-of-", n, ".safetensors"); }

std::string slice_key(const std::string& name, int64_t begin) { return concat(name, "@", begin); }

std::optional<DType> dtype_from_name(std::string_view name) {
  for (int i = 0; i < kNumDTypes; ++i) {
    if (dtype_name(static_cast<DType>(i)) == name) return static_cast<DType>(i);
  }
  return std::nullopt;
}

std::optional<int64_t> checked_numel(const std::vector<int64_t>& shape, int64_t itemsize) {
  const int64_t limit = std::numeric_limits<int64_t>::max() / itemsize;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && n > limit / d) return std::nullopt;
    n *= d;
  }
  return n;
}

namespace {

std::string range_str(int64_t b, int64_t e) { return concat("[", b, ", ", e, ")"); }

}  // namespace

std::string coverage_problem(const std::string& name, int64_t numel, std::vector<Range> ranges) {
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.length < b.length;
  });
  int64_t next = 0;  // every element before it is covered once
  const Range* prev = nullptr;
  for (const Range& r : ranges) {
    const int64_t end = r.begin + r.length;  // callers checked 0 <= begin <= numel - length
    if (r.begin > next) {
      return concat("tensor '", name, "' (", numel, " elements): elements ", range_str(next, r.begin),
                    " are held by no one (expected every element exactly once; the next slice, elements ",
                    range_str(r.begin, end), ", is ", r.owner, "'s)");
    }
    if (r.begin < next) {
      return concat("tensor '", name, "' (", numel, " elements): elements ", range_str(r.begin, std::min(next, end)),
                    " are held twice, by ", prev->owner, " (elements ",
                    range_str(prev->begin, prev->begin + prev->length), ") and by ", r.owner, " (elements ",
                    range_str(r.begin, end), ") (expected every element exactly once)");
    }
    next = end;
    prev = &r;
  }
  if (next < numel) {
    return concat("tensor '", name, "' (", numel, " elements): elements ", range_str(next, numel),
                  " are held by no one (expected every element exactly once)");
  }
  return {};
}

namespace {

// The object without its checksum, compactly: what the checksum covers.
uint64_t index_hash(json j) {
  j.erase("checksum");
  const std::string text = j.dump();
  return fnv1a64(text.data(), text.size());
}

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw FormatError(concat(source, ": not a valid sharded checkpoint index: ", what));
}

// Parses, refusing duplicate keys (nlohmann would keep the last, hiding a
// tensor) and nesting deeper than root -> tensors -> tensor -> slices -> slice.
json parse_json(std::string_view text, const std::string& source) {
  std::vector<std::set<std::string>> keys;  // per open container (arrays keep an empty set)
  auto cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= 5) fail(source, "the JSON nests deeper than an index does (expected at most 5 levels)");
        keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second)
          fail(source, concat("key '", parsed.get<std::string>(), "' appears twice in one object"));
        break;
      case json::parse_event_t::value: break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    fail(source, concat("expected JSON, got a parse error: ", e.what()));
  }
}

const json& field(const json& obj, const char* key, const std::string& where, const std::string& source) {
  auto it = obj.find(key);
  if (it == obj.end()) fail(source, concat(where, ": expected a field '", key, "'"));
  return *it;
}

int64_t int_field(const json& obj, const char* key, const std::string& where, const std::string& source) {
  const json& v = field(obj, key, where, source);
  // nlohmann keeps non-negative integers unsigned: above INT64_MAX they must not wrap.
  if (v.is_number_unsigned() && v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return static_cast<int64_t>(v.get<uint64_t>());
  if (v.is_number_integer() && !v.is_number_unsigned()) return v.get<int64_t>();
  fail(source, concat(where, ": expected '", key, "' to be an integer that fits int64, got ", v.dump()));
}

const std::string& str_field(const json& obj, const char* key, const std::string& where, const std::string& source) {
  const json& v = field(obj, key, where, source);
  if (!v.is_string()) fail(source, concat(where, ": expected '", key, "' to be a string, got ", v.dump()));
  return v.get_ref<const std::string&>();
}

std::optional<uint64_t> parse_hex16(const std::string& s) {
  if (s.size() != 16 ||
      !std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); }))
    return std::nullopt;
  return std::stoull(s, nullptr, 16);
}

// r for "shard-<r>-of-<world>.safetensors" exactly, else -1.
int64_t shard_rank(const std::string& file, int64_t world) {
  const std::string prefix = "shard-";
  const size_t of = file.find("-of-");
  if (file.rfind(prefix, 0) != 0 || of == std::string::npos || of <= prefix.size() || of - prefix.size() > 7) return -1;
  int64_t r = 0;
  for (size_t i = prefix.size(); i < of; ++i) {
    if (file[i] < '0' || file[i] > '9') return -1;
    r = r * 10 + (file[i] - '0');
  }
  return r < world && file == shard_file_name(r, world) ? r : -1;
}

IndexTensor parse_tensor(const std::string& name, const json& t, int64_t world, const std::string& source,
                         std::set<std::pair<int64_t, std::string>>& used) {
  const std::string where = concat("tensor '", name, "'");
  if (!t.is_object()) fail(source, concat(where, ": expected an object, got ", t.type_name()));
  IndexTensor out;
  const std::string& dt = str_field(t, "dtype", where, source);
  const auto dtype = dtype_from_name(dt);
  if (!dtype)
    fail(source, concat(where, ": expected a kiln dtype name (float32, bfloat16, int64, ...), got '", dt, "'"));
  out.dtype = *dtype;
  const json& shape = field(t, "shape", where, source);
  if (!shape.is_array() || shape.size() > kMaxDims)
    fail(source, concat(where, ": expected 'shape' to be an array of at most ", kMaxDims, " sizes"));
  for (const json& d : shape) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(source, concat(where, ": expected non-negative integer sizes in 'shape', got ", d.dump()));
    out.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  const auto numel = checked_numel(out.shape, element_size(out.dtype));
  if (!numel)
    fail(source, concat(where, ": shape ", shape.dump(), " of ", dt, " holds more bytes than int64 can count"));
  out.numel = *numel;
  const json& slices = field(t, "slices", where, source);
  if (!slices.is_array()) fail(source, concat(where, ": expected 'slices' to be an array"));
  std::vector<Range> ranges;
  for (size_t i = 0; i < slices.size(); ++i) {
    const json& s = slices[i];
    const std::string sw = concat(where, " slice ", i);
    if (!s.is_object()) fail(source, concat(sw, ": expected an object, got ", s.type_name()));
    IndexSlice sl;
    const std::string& file = str_field(s, "file", sw, source);
    const int64_t r = shard_rank(file, world);
    // A name from the fixed pattern only: a hostile index must not point outside the directory.
    if (r < 0)
      fail(source, concat(sw, ": expected 'file' to be shard-<r>-of-", world, ".safetensors, got '", file, "'"));
    sl.file = r;
    sl.key = str_field(s, "key", sw, source);
    sl.begin = int_field(s, "begin", sw, source);
    sl.length = int_field(s, "length", sw, source);
    if (sl.begin < 0 || sl.length <= 0 || sl.begin > out.numel - sl.length) {
      fail(source, concat(sw, ": expected 0 <= begin, 0 < length and begin + length <= ", out.numel,
                          " (the tensor's elements), got begin ", sl.begin, ", length ", sl.length));
    }
    const auto sum = parse_hex16(str_field(s, "fnv1a64", sw, source));
    if (!sum) fail(source, concat(sw, ": expected 'fnv1a64' to be 16 hex digits"));
    sl.checksum = *sum;
    if (!used.emplace(r, sl.key).second)
      fail(source, concat(sw, ": key '", sl.key, "' of ", file, " is used by another slice too"));
    ranges.push_back(Range{sl.begin, sl.length, concat(file, " key '", sl.key, "'")});
    out.slices.push_back(std::move(sl));
  }
  const std::string problem = coverage_problem(name, out.numel, std::move(ranges));
  if (!problem.empty()) fail(source, problem);
  std::sort(out.slices.begin(), out.slices.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  return out;
}

}  // namespace

std::string write_index(const Index& index) {
  json j = json::object();
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["world_size"] = index.world_size;
  j["metadata"] = index.metadata;
  json tensors = json::object();
  for (const auto& [name, t] : index.tensors) {
    json slices = json::array();
    for (const IndexSlice& s : t.slices) {
      slices.push_back({{"file", shard_file_name(s.file, index.world_size)},
                        {"key", s.key},
                        {"begin", s.begin},
                        {"length", s.length},
                        {"fnv1a64", hex16(s.checksum)}});
    }
    tensors[name] = {{"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape}, {"slices", std::move(slices)}};
  }
  j["tensors"] = std::move(tensors);
  j["checksum"] = hex16(index_hash(j));
  return j.dump(1) + "\n";
}

Index parse_index(std::string_view text, const std::string& source) {
  const json j = parse_json(text, source);
  if (!j.is_object()) fail(source, concat("expected a JSON object, got ", j.type_name()));
  const std::string top = "top level";
  const std::string& format = str_field(j, "format", top, source);
  if (format != kFormat) fail(source, concat("expected 'format' to be '", kFormat, "', got '", format, "'"));
  const int64_t version = int_field(j, "version", top, source);
  if (version != kVersion)
    fail(source, concat("expected format version ", kVersion, ", got ", version, " (written by another kiln?)"));
  Index index;
  index.world_size = int_field(j, "world_size", top, source);
  if (index.world_size < 1 || index.world_size > kMaxWorldSize)
    fail(source, concat("expected 'world_size' in [1, ", kMaxWorldSize, "], got ", index.world_size));
  const json& md = field(j, "metadata", top, source);
  if (!md.is_object()) fail(source, "expected 'metadata' to be an object of strings");
  for (const auto& [k, v] : md.items()) {
    if (!v.is_string()) fail(source, concat("metadata '", k, "': expected a string, got ", v.dump()));
    index.metadata[k] = v.get<std::string>();
  }
  const json& tensors = field(j, "tensors", top, source);
  if (!tensors.is_object()) fail(source, "expected 'tensors' to be an object");
  std::set<std::pair<int64_t, std::string>> used;
  for (const auto& [name, t] : tensors.items())
    index.tensors.emplace(name, parse_tensor(name, t, index.world_size, source, used));
  const auto sum = parse_hex16(str_field(j, "checksum", top, source));
  if (!sum) fail(source, "expected 'checksum' to be 16 hex digits");
  const uint64_t got = index_hash(j);
  if (got != *sum) {
    fail(source, concat("checksum mismatch: the index says ", hex16(*sum), ", its contents hash to ", hex16(got),
                        " (the file is corrupted or was edited)"));
  }
  return index;
}

}  // namespace kiln::dist::shard_format
