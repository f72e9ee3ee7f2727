// The oneDNN engine, streams, cache keys and execution helpers
// (Note [oneDNN primitive cache] in dnnl_common.h).
#include "dnnl_common.h"

#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string_view>
#include <vector>

#include "kiln/core/allocator.h"
#include "kiln/kernels/dnnl.h"

namespace kiln::kernels::dnnl_detail {

namespace {

std::atomic<int64_t> g_created{0};
std::atomic<int64_t> g_threaded_calls{0};  // kernels::dnnl_threaded_calls

std::mutex g_clear_mu;
// Functions that clear one per-thread cache kind on the calling thread.
std::vector<void (*)()>& clear_fns() {
  static auto* fns = new std::vector<void (*)()>();
  return *fns;
}

}  // namespace

const dnnl::engine& engine() {
  static const auto* eng = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *eng;
}

const dnnl::stream& stream() {
  thread_local const dnnl::stream s(engine());
  return s;
}

dnnl::memory::data_type to_dnnl(DType dt) {
  using T = dnnl::memory::data_type;
  switch (dt) {
    case DType::Float32: return T::f32;
    case DType::BFloat16: return T::bf16;
    case DType::Float16: return T::f16;
    case DType::Int32: return T::s32;
    case DType::UInt8: return T::u8;
    default: break;
  }
  KILN_ASSERT(false, "oneDNN has no data type for ", dtype_name(dt));
  return T::undef;
}

void note_created() { g_created.fetch_add(1, std::memory_order_relaxed); }

Key::Key(PrimKind kind) { add(static_cast<int64_t>(kind)); }

bool Key::operator==(const Key& o) const {
  return n == o.n && std::memcmp(v, o.v, sizeof(int64_t) * static_cast<size_t>(n)) == 0;
}

size_t KeyHash::operator()(const Key& k) const {
  uint64_t h = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < k.n; ++i) {
    h ^= static_cast<uint64_t>(k.v[i]) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  }
  return static_cast<size_t>(h);
}

void register_clear(void (*clear)()) {
  std::lock_guard<std::mutex> lock(g_clear_mu);
  clear_fns().push_back(clear);
}

ScratchBlock::~ScratchBlock() {
  if (ptr_) memory::deallocate(ptr_, bytes_, MemoryCategory::Workspace);
}

void ScratchBlock::reset(size_t bytes) {
  if (ptr_) memory::deallocate(ptr_, bytes_, MemoryCategory::Workspace);
  ptr_ = nullptr;
  bytes_ = bytes;
  if (bytes) ptr_ = static_cast<char*>(memory::allocate(bytes, MemoryCategory::Workspace));
}

dnnl::memory make_memory(const dnnl::memory::desc& md) { return dnnl::memory(md, engine(), DNNL_MEMORY_NONE); }

dnnl::primitive_attr default_attr() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

void execute(const dnnl::primitive& p, std::initializer_list<Arg> args) {
  constexpr int kMaxArgs = 8;
  KILN_ASSERT(args.size() <= kMaxArgs, "too many oneDNN arguments");
  dnnl_exec_arg_t c_args[kMaxArgs];
  int n = 0;
  for (const Arg& a : args) {
    // Handles are only const at the API boundary: oneDNN writes through dst ones.
    dnnl_status_t st = dnnl_memory_set_data_handle_v2(a.mem->get(), const_cast<void*>(a.handle), nullptr);
    KILN_ASSERT(st == dnnl_success, "oneDNN refused a data handle (status ", static_cast<int>(st), ")");
    c_args[n++] = {a.arg, a.mem->get()};
  }
  // omp_get_max_threads, not kiln's setting: a SerialScope has it at 1 for a small product.
  if (omp_get_max_threads() > 1 && !omp_in_parallel()) g_threaded_calls.fetch_add(1, std::memory_order_relaxed);
  dnnl_status_t st = dnnl_primitive_execute(p.get(), stream().get(), n, c_args);
  KILN_ASSERT(st == dnnl_success, "oneDNN primitive execution failed (status ", static_cast<int>(st), ")");
}

void rethrow(const dnnl::error& e, const char* what) {
  throw InternalError(detail::concat("oneDNN could not create a primitive for ", what, ": ", e.what(), " (status ",
                                     static_cast<int>(e.status), "); this is a kiln bug"));
}

int64_t max_threads() { return omp_get_max_threads(); }

SerialScope::SerialScope(bool serial) {
  if (!serial || omp_in_parallel()) return;
  const int n = omp_get_max_threads();
  if (n <= 1) return;
  saved_ = n;
  omp_set_num_threads(1);
}

SerialScope::~SerialScope() {
  if (saved_) omp_set_num_threads(saved_);
}

uint64_t fnv1a(const void* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

uint64_t desc_hash(const dnnl::memory::desc& md) { return fnv1a(&md.data, sizeof(md.data)); }

bool isa_has(unsigned bits) { return (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & bits) == bits; }

}  // namespace kiln::kernels::dnnl_detail

namespace kiln::kernels {

int64_t dnnl_threaded_calls() { return dnnl_detail::g_threaded_calls.load(std::memory_order_relaxed); }

int64_t dnnl_primitives_created() { return dnnl_detail::g_created.load(std::memory_order_relaxed); }

void dnnl_clear_cache() {
  std::vector<void (*)()> fns;
  {
    std::lock_guard<std::mutex> lock(dnnl_detail::g_clear_mu);
    fns = dnnl_detail::clear_fns();
  }
  for (auto* f : fns) f();
}

namespace {

bool env_says_off(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string_view(v) == "0";
}

}  // namespace

bool dnnl_supports(DType dt) {
  auto probe = [](dnnl::memory::data_type t) {
    try {
      using tag = dnnl::memory::format_tag;
      dnnl::memory::desc md({16, 16}, t, tag::ab);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(md, md, md), dnnl_detail::default_attr(),
                                      dnnl_detail::engine());
      // The reference implementation accepts anything; only a real kernel counts.
      return std::strncmp(pd.impl_info_str(), "ref", 3) != 0;
    } catch (const dnnl::error&) {
      return false;
    }
  };
  switch (dt) {
    case DType::Float32: return true;
    case DType::BFloat16: {
      // KILN_ONEDNN_BF16=0 takes the path of a CPU without bfloat16 kernels
      // on any CPU, so that the tests cover it where the figures are made.
      static const bool ok = !env_says_off("KILN_ONEDNN_BF16") && probe(dnnl::memory::data_type::bf16);
      return ok;
    }
    case DType::Float16: {
      static const bool ok = probe(dnnl::memory::data_type::f16);
      return ok;
    }
    default: return false;
  }
}

}  // namespace kiln::kernels
