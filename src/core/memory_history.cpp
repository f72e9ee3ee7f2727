// Memory history: a table of live blocks with their call site, shape and dtype,
// an aggregate per (site, category), and the aggregate at the highest peak.
//
// Note [Call sites of allocations]
// Every public op takes its caller's std::source_location (for autograd's
// messages) and notes it on the thread (note_call_site) before it allocates.
// Ops call other ops and factories internally; those calls note kiln-internal
// files, which would hide the user's line, so sites in kiln's ops, autograd,
// kernels, core and public headers are ignored: the site that stays is the
// outermost one written in user code — or in a module, optimizer, model or
// loader, which is where a user reading the table can act. In backward the
// engine pins the site to the node's forward site (AllocSiteGuard), so a
// gradient reads "backward of MmBackward0 at model.cpp:42". When autograd
// records an op it *claims* the output's block with the node's site and name,
// which also names blocks made by nested internal calls.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include "kiln/core/capture_ops.h"
#include "kiln/core/format.h"
#include "kiln/core/memory_history.h"
#include "memory_history_internal.h"

namespace kiln::memory {

namespace detail {
constinit thread_local AllocSite t_alloc_site{};
}  // namespace detail

namespace {

bool internal_path(const char* file) {
  static constexpr const char* kInternal[] = {"src/ops/", "src/autograd/", "src/kernels/", "src/core/",
                                              "include/kiln/"};
  for (const char* p : kInternal)
    if (std::strstr(file, p)) return true;
  return false;
}

// file_name() pointers are string literals, so the answer is cached per pointer.
bool is_internal(const char* file) {
  struct Entry {
    const char* file = nullptr;
    bool internal = false;
  };
  thread_local Entry cache[64];
  Entry& e = cache[(reinterpret_cast<uintptr_t>(file) >> 3) & 63];
  if (e.file != file) e = {file, internal_path(file)};
  return e.internal;
}

constinit thread_local uint64_t t_site_notes = 0;  // capture::site_notes()

}  // namespace

void note_call_site(const char* file, uint32_t line) {
  AllocSite& s = detail::t_alloc_site;
  if (s.pinned || !file || is_internal(file)) return;
  ++t_site_notes;
  s.file = file;
  s.line = line;
  s.op = nullptr;
  s.backward = false;
}

namespace history {

namespace {
bool history_env() {
  const char* s = std::getenv("KILN_MEMORY_HISTORY");
  return s && *s && std::strcmp(s, "0") != 0;
}
}  // namespace

std::atomic<bool> g_recording{history_env()};
std::atomic<int64_t> g_tracked{0};

namespace {

constexpr int kMaxDims = 8;

struct SiteKey {
  const char* file;
  uint32_t line;
  const char* op;
  bool backward;
  bool operator==(const SiteKey&) const = default;
};
struct SiteKeyHash {
  size_t operator()(const SiteKey& k) const {
    size_t h = std::hash<const void*>()(k.file) ^ (std::hash<const void*>()(k.op) * 31);
    return h ^ (static_cast<size_t>(k.line) << 1) ^ (k.backward ? 0x9e3779b97f4a7c15ull : 0);
  }
};

struct Block {
  int64_t bytes = 0;
  uint32_t site = 0;
  MemoryCategory category = MemoryCategory::Activation;
  bool claimed = false;
  int8_t ndim = -1;  // -1: no shape known
  DType dtype = kFloat32;
  int64_t sizes[kMaxDims] = {};
};

struct Agg {
  int64_t bytes = 0;
  int64_t count = 0;
};

uint64_t agg_key(uint32_t site, MemoryCategory c) {
  return (static_cast<uint64_t>(site) << 3) | static_cast<uint64_t>(c);
}

struct PeakRow {
  uint32_t site;
  MemoryCategory category;
  Agg agg;
};

class History {
 public:
  void alloc(void* p, size_t size, MemoryCategory cat, int64_t total_live) {
    const AllocSite s = detail::t_alloc_site;
    std::lock_guard<std::mutex> lock(mu_);
    Block b;
    b.bytes = static_cast<int64_t>(size);
    b.category = cat;
    b.site = intern({s.file, s.line, s.op, s.backward});
    auto [it, inserted] = blocks_.insert_or_assign(p, b);
    (void)it;
    if (inserted) g_tracked.fetch_add(1, std::memory_order_relaxed);
    add(b, +1);
    if (total_live > peak_total_) {
      peak_total_ = total_live;
      peak_pending_ = true;
    }
  }

  void free(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(p);
    if (it == blocks_.end()) return;
    if (peak_pending_) capture_peak();  // the moment before the first free after a new peak is the peak
    add(it->second, -1);
    blocks_.erase(it);
    g_tracked.fetch_sub(1, std::memory_order_relaxed);
  }

  void recharge(void* p, MemoryCategory to) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(p);
    if (it == blocks_.end()) return;
    add(it->second, -1);
    it->second.category = to;
    add(it->second, +1);
  }

  void annotate(const void* p, IntArrayRef sizes, DType dtype) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(const_cast<void*>(p));
    if (it == blocks_.end()) return;
    Block& b = it->second;
    b.dtype = dtype;
    b.ndim = static_cast<int8_t>(std::min<size_t>(sizes.size(), kMaxDims));
    for (int i = 0; i < b.ndim; ++i) b.sizes[i] = sizes[static_cast<size_t>(i)];
  }

  void claim(const void* p, const char* file, uint32_t line, const char* op) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(const_cast<void*>(p));
    if (it == blocks_.end() || it->second.claimed) return;
    Block& b = it->second;
    add(b, -1);
    const SiteInfo& old = sites_[b.site];
    // In backward the pinned site (the node being run) is the better name for what it makes.
    // A node recorded by an op inside kiln names the op but keeps the user's line.
    if (!old.key.backward) {
      const bool keep_line = !file || is_internal(file);
      b.site = intern({keep_line ? old.key.file : file, keep_line ? old.key.line : line, op, false});
    }
    b.claimed = true;
    add(b, +1);
  }

  void reset_peak(int64_t total_live) {
    std::lock_guard<std::mutex> lock(mu_);
    peak_total_ = total_live;
    peak_pending_ = true;
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    g_tracked.fetch_sub(static_cast<int64_t>(blocks_.size()), std::memory_order_relaxed);
    blocks_.clear();
    aggs_.clear();
    peak_.clear();
    peak_total_ = 0;
    peak_pending_ = false;
  }

  Snapshot snapshot(size_t top, size_t top_tensors, bool at_peak) {
    Snapshot out;
    std::lock_guard<std::mutex> lock(mu_);
    out.history = true;
    std::vector<PeakRow> rows;
    if (at_peak) {
      if (peak_pending_) capture_peak();
      rows = peak_;
    } else {
      for (const auto& [k, a] : aggs_)
        if (a.count > 0) rows.push_back({static_cast<uint32_t>(k >> 3), static_cast<MemoryCategory>(k & 7), a});
    }
    // Merge rows whose site reads the same (one file can have several name pointers).
    std::map<std::tuple<std::string, std::string, int>, SiteUsage> merged;
    std::unordered_map<uint64_t, SiteUsage*> by_key;
    for (const PeakRow& r : rows) {
      const SiteInfo& s = sites_[r.site];
      SiteUsage& u = merged[{s.where, s.op, static_cast<int>(r.category)}];
      u.site = s.where;
      u.op = s.op;
      u.category = r.category;
      u.bytes += r.agg.bytes;
      u.tensors += r.agg.count;
      out.total_bytes += r.agg.bytes;
      by_key[agg_key(r.site, r.category)] = &u;
    }
    if (!at_peak) {
      std::vector<const Block*> largest;
      largest.reserve(blocks_.size());
      for (const auto& [p, b] : blocks_) {
        largest.push_back(&b);
        auto it = by_key.find(agg_key(b.site, b.category));
        if (it != by_key.end() && b.bytes > it->second->largest_bytes) {
          SiteUsage& u = *it->second;
          u.largest_bytes = b.bytes;
          u.largest_dtype = b.dtype;
          u.largest_shape = b.ndim >= 0 ? DimVector(IntArrayRef(b.sizes, static_cast<size_t>(b.ndim))) : DimVector();
        }
      }
      const size_t n = std::min(top_tensors, largest.size());
      std::partial_sort(largest.begin(), largest.begin() + static_cast<std::ptrdiff_t>(n), largest.end(),
                        [](const Block* a, const Block* b) { return a->bytes > b->bytes; });
      for (size_t i = 0; i < n; ++i) {
        const Block& b = *largest[i];
        const SiteInfo& s = sites_[b.site];
        TensorUsage t;
        t.site = s.where;
        t.op = s.op;
        t.category = b.category;
        t.bytes = b.bytes;
        if (b.ndim >= 0) {
          t.shape = DimVector(IntArrayRef(b.sizes, static_cast<size_t>(b.ndim)));
          t.dtype = b.dtype;
          t.has_shape = true;
        }
        out.tensors.push_back(std::move(t));
      }
    }
    for (auto& [k, u] : merged) out.sites.push_back(std::move(u));
    std::sort(out.sites.begin(), out.sites.end(),
              [](const SiteUsage& a, const SiteUsage& b) { return a.bytes > b.bytes; });
    if (out.sites.size() > top) out.sites.resize(top);
    return out;
  }

 private:
  struct SiteInfo {
    SiteKey key;
    std::string where;  // file:line, relative to the source tree
    std::string op;     // for display
  };

  static std::string display_op(const char* op, bool backward) {
    if (!op) return backward ? "backward" : "";
    std::string s = op;
    if (backward) return "backward of " + s;
    // A node's name is the forward op's plus "Backward<N>": show the forward op.
    size_t end = s.size();
    while (end > 0 && std::isdigit(static_cast<unsigned char>(s[end - 1]))) --end;
    if (end >= 8 && s.compare(end - 8, 8, "Backward") == 0 && end > 8) return s.substr(0, end - 8);
    return s;
  }

  static std::string where(const char* file, uint32_t line) {
    if (!file) return "<unknown>";
    std::string f = file;
    if (auto pos = f.rfind("/src/"); pos != std::string::npos) f = f.substr(pos + 1);
    while (f.starts_with("../") || f.starts_with("./")) f.erase(0, f.find('/') + 1);
    return f + ":" + std::to_string(line);
  }

  uint32_t intern(const SiteKey& k) {
    auto it = site_ids_.find(k);
    if (it != site_ids_.end()) return it->second;
    const auto id = static_cast<uint32_t>(sites_.size());
    sites_.push_back({k, where(k.file, k.line), display_op(k.op, k.backward)});
    site_ids_.emplace(k, id);
    return id;
  }

  void add(const Block& b, int sign) {
    Agg& a = aggs_[agg_key(b.site, b.category)];
    a.bytes += sign * b.bytes;
    a.count += sign;
  }

  void capture_peak() {
    peak_.clear();
    for (const auto& [k, a] : aggs_)
      if (a.count > 0) peak_.push_back({static_cast<uint32_t>(k >> 3), static_cast<MemoryCategory>(k & 7), a});
    peak_pending_ = false;
  }

  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;
  std::vector<SiteInfo> sites_;
  std::unordered_map<SiteKey, uint32_t, SiteKeyHash> site_ids_;
  std::unordered_map<uint64_t, Agg> aggs_;
  std::vector<PeakRow> peak_;
  int64_t peak_total_ = 0;
  bool peak_pending_ = false;
};

History& table() {
  static auto* h = new History();  // leaked on purpose, as the allocator
  return *h;
}

}  // namespace

void on_alloc(void* p, size_t size, MemoryCategory category, int64_t total_live) {
  table().alloc(p, size, category, total_live);
}
void on_free(void* p) { table().free(p); }
void on_recharge(void* p, MemoryCategory to) { table().recharge(p, to); }

std::string oom_report(size_t top) {
  if (!g_recording.load(std::memory_order_relaxed)) {
    return "(to see which lines hold this memory, record memory history: kiln::memory::record_history() or "
           "KILN_MEMORY_HISTORY=1)\n";
  }
  return format_sites(snapshot(top, 0), top);
}

}  // namespace history

std::string SiteUsage::label() const { return op.empty() ? site : site + " (" + op + ")"; }

void record_history(bool enabled) {
  if (!enabled) {
    history::g_recording.store(false, std::memory_order_relaxed);
    history::table().clear();
    return;
  }
  if (!history::g_recording.exchange(true, std::memory_order_relaxed)) {
    history::table().reset_peak(stats().live_bytes);
  }
}

bool recording_history() { return history::g_recording.load(std::memory_order_relaxed); }

Snapshot snapshot(size_t top_sites, size_t top_tensors) {
  Snapshot s = recording_history() ? history::table().snapshot(top_sites, top_tensors, false) : Snapshot{};
  s.stats = stats();
  return s;
}

Snapshot peak_snapshot(size_t top) {
  Snapshot s = recording_history() ? history::table().snapshot(top, 0, true) : Snapshot{};
  s.stats = stats();
  return s;
}

void reset_peak_snapshot() {
  if (recording_history()) history::table().reset_peak(stats().live_bytes);
}

namespace detail {
void annotate(const void* data, IntArrayRef sizes, DType dtype) {
  if (history::g_tracked.load(std::memory_order_relaxed) > 0) history::table().annotate(data, sizes, dtype);
}
void claim(const void* data, const char* file, uint32_t line, const char* op) {
  if (history::g_tracked.load(std::memory_order_relaxed) > 0) history::table().claim(data, file, line, op);
}
}  // namespace detail

namespace {

void json_string(std::ostream& os, std::string_view s) {
  os << '"';
  for (char c : s) {
    switch (c) {
      case '"': os << "\\\""; break;
      case '\\': os << "\\\\"; break;
      case '\n': os << "\\n"; break;
      case '\t': os << "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          os << buf;
        } else {
          os << c;
        }
    }
  }
  os << '"';
}

void json_shape(std::ostream& os, const DimVector& shape) {
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? "," : "") << shape[i];
  os << ']';
}

// `{"site":…,"op":…,"category":…,"bytes":N` (the object is left open).
void json_usage_head(std::ostream& os, const std::string& site, const std::string& op, MemoryCategory c,
                     int64_t bytes) {
  os << "{\"site\":";
  json_string(os, site);
  os << ",\"op\":";
  json_string(os, op);
  os << ",\"category\":";
  json_string(os, memory_category_name(c));
  os << ",\"bytes\":" << bytes;
}

std::string shape_str(const DimVector& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

}  // namespace

std::string snapshot_json(const Snapshot& s) {
  std::ostringstream os;
  os << "{\"history\":" << (s.history ? "true" : "false") << ",\"categories\":{";
  for (int i = 0; i < kNumMemoryCategories; ++i) {
    const auto& c = s.stats.by_category[static_cast<size_t>(i)];
    os << (i ? "," : "");
    json_string(os, memory_category_name(static_cast<MemoryCategory>(i)));
    os << ":{\"live\":" << c.live_bytes << ",\"peak\":" << c.peak_bytes << ",\"tensors\":" << c.allocations << "}";
  }
  os << "},\"live_bytes\":" << s.stats.live_bytes << ",\"peak_bytes\":" << s.stats.peak_bytes
     << ",\"cached_bytes\":" << s.stats.cached_bytes << ",\"reserved_bytes\":" << s.stats.reserved_bytes
     << ",\"limit_bytes\":" << s.stats.limit_bytes << ",\"total_bytes\":" << s.total_bytes << ",\"sites\":[";
  for (size_t i = 0; i < s.sites.size(); ++i) {
    const SiteUsage& u = s.sites[i];
    os << (i ? "," : "");
    json_usage_head(os, u.site, u.op, u.category, u.bytes);
    os << ",\"tensors\":" << u.tensors;
    if (u.largest_bytes > 0) {
      os << ",\"largest\":{\"shape\":";
      json_shape(os, u.largest_shape);
      os << ",\"dtype\":";
      json_string(os, dtype_name(u.largest_dtype));
      os << ",\"bytes\":" << u.largest_bytes << "}";
    }
    os << "}";
  }
  os << "],\"tensors\":[";
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const TensorUsage& t = s.tensors[i];
    os << (i ? "," : "");
    json_usage_head(os, t.site, t.op, t.category, t.bytes);
    if (t.has_shape) {
      os << ",\"shape\":";
      json_shape(os, t.shape);
      os << ",\"dtype\":";
      json_string(os, dtype_name(t.dtype));
    }
    os << "}";
  }
  os << "]}";
  return os.str();
}

std::string format_sites(const Snapshot& s, size_t top) {
  std::ostringstream os;
  if (!s.history) return os.str();
  if (s.sites.empty()) return "no live tensors recorded\n";
  os << "largest live memory by call site:\n";
  const size_t n = std::min(top, s.sites.size());
  for (size_t i = 0; i < n; ++i) {
    const SiteUsage& u = s.sites[i];
    const double pct =
        s.total_bytes > 0 ? 100.0 * static_cast<double>(u.bytes) / static_cast<double>(s.total_bytes) : 0;
    os << "  " << std::right << std::setw(10) << format_bytes(static_cast<double>(u.bytes)) << " " << std::setw(3)
       << static_cast<int>(pct + 0.5) << "%  " << std::left << std::setw(15) << memory_category_name(u.category) << " "
       << u.label() << "  (" << u.tensors << (u.tensors == 1 ? " tensor" : " tensors");
    if (u.largest_bytes > 0 && !u.largest_shape.empty())
      os << "; largest " << shape_str(u.largest_shape) << " " << dtype_name(u.largest_dtype);
    os << ")\n";
  }
  return os.str();
}

std::string memory_advice(const Stats& s, bool use_peaks) {
  auto bytes = [&](MemoryCategory c) {
    const auto& x = s[c];
    return static_cast<double>(use_peaks ? x.peak_bytes : x.live_bytes);
  };
  double total = 0;
  int best = 0;
  for (int i = 0; i < kNumMemoryCategories; ++i) {
    const double b = bytes(static_cast<MemoryCategory>(i));
    total += b;
    if (b > bytes(static_cast<MemoryCategory>(best))) best = i;
  }
  if (total <= 0) return "no tensor memory is live";
  const auto cat = static_cast<MemoryCategory>(best);
  const double share = bytes(cat) / total;
  const double states =
      bytes(MemoryCategory::Parameter) + bytes(MemoryCategory::Gradient) + bytes(MemoryCategory::OptimizerState);
  char pct[32];
  std::snprintf(pct, sizeof pct, "%.0f%%", 100 * share);
  std::string head = std::string(memory_category_name(cat)) + " holds the most (" + pct + "): ";
  switch (cat) {
    case MemoryCategory::Activation:
      return head +
             "activation checkpointing (nn::checkpoint, or train.activation_checkpointing = \"blocks\") keeps only "
             "block inputs and recomputes the rest; a smaller batch shrinks activations in proportion; bf16 autocast "
             "halves them";
    case MemoryCategory::OptimizerState:
      return head +
             "Adam keeps two fp32 values per parameter (SGD with momentum one, plain SGD none); sharding optimizer "
             "state across data-parallel ranks (ZeRO-1) divides it by the number of ranks — `kiln plan` compares "
             "layouts";
    case MemoryCategory::Parameter:
    case MemoryCategory::Gradient:
      return head + "parameters and gradients scale with the model (" + format_bytes(states) +
             " of model states in all): bf16 halves them; sharding gradients and parameters (ZeRO-2/3) divides "
             "them by the number of ranks; a smaller model is the other lever — `kiln plan` compares layouts";
    case MemoryCategory::Data: return head + "input batches: a smaller batch, or fewer batches in flight in the loader";
    case MemoryCategory::Workspace:
      return head + "scratch space of large ops (convolution, matmul): a smaller batch reduces it";
    case MemoryCategory::Buffer:
      return head + "module buffers (running statistics, masks, caches such as a KV cache): check their sizes";
  }
  return head;
}

}  // namespace kiln::memory

namespace kiln::capture {
uint64_t site_notes() { return memory::t_site_notes; }
}  // namespace kiln::capture
