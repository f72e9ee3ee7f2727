// Advanced indexing with index tensors (torch's x[i, j] and x[i, j] = v):
// Tensor::index, index_put_ and index_put.
//
// Both resolve the index tensors first — bool masks become the positions of
// their true elements, integers are broadcast together, wrapped and bounds
// checked — so a bad index raises before anything is written. index is
// composed of flatten + index_select (its gradient and double backward come
// from those); index_put_ writes with a strided loop and records
// IndexPutBackward0, whose formulas are index and index_put again, so it is
// differentiable twice. An index_put_ into a view of a tensor that requires
// grad rewrites the base's history like every in-place op (CopySlices).
#include <type_traits>

#include "grad_ops.h"
#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/capture.h"
#include "kiln/ops/factory.h"
#include "op_record.h"

namespace kiln {

using autograd::CallSite;
using autograd::SavedVariable;

namespace {

// The indexed dims [first, first + count) of self with their sizes and
// strides, the broadcast shape of the index tensors, and per index position
// its row-major position over the indexed sizes (from which index_put_ gets
// its element offset within self).
//
// Note [Index values are read on replay]: the index values are data, so
// everything computed from them on the host (`linear`, the offsets written
// through) is computed in closures that kiln::compile records (capture::host_write)
// and a replay runs again on the step's new index values; only the shapes are
// fixed at capture.
struct Resolved {
  int64_t first = 0, count = 0;
  DimVector index_shape;
  DimVector dim_sizes, dim_strides;  // self's, of the indexed dims
  Tensor linear;                     // int64 [index_shape]: the row-major position, for index_select
};

// Positions of the true elements of `mask` (over self's dims d0, d0+1, ...),
// one int64 tensor per mask dim.
std::vector<Tensor> mask_positions(const Tensor& self, const Tensor& mask, int64_t d0, const char* op) {
  KILN_CHECK(mask.dim() > 0, IndexError, op, ": a 0-dim bool index is not supported; index with a 1-element mask");
  KILN_CHECK(d0 + mask.dim() <= self.dim(), IndexError, op, ": too many indices for a tensor of dimension ", self.dim(),
             " (a bool mask of shape ", mask.sizes(), " indexes ", mask.dim(), " dims from dim ", d0, ")");
  for (int64_t j = 0; j < mask.dim(); ++j) {
    KILN_CHECK(mask.sizes()[j] == self.sizes()[d0 + j], IndexError, op, ": the shape of the mask ", mask.sizes(),
               " at index ", j, " does not match the shape of the indexed tensor ", self.sizes(), " at dim ", d0 + j);
  }
  // The positions' count is the result's size: a replay could not follow a new mask.
  capture::graph_break_if_recording("indexing with a boolean mask (x[mask]) reads the mask on the host");
  const Tensor m = ops::copy_no_grad(mask, kBool, MemoryFormat::Contiguous);
  const bool* p = m.data_ptr<bool>();
  const int64_t nd = mask.dim();
  std::vector<std::vector<int64_t>> pos(static_cast<size_t>(nd));
  const DimVector strides = contiguous_strides(mask.sizes());
  for (int64_t e = 0; e < m.numel(); ++e) {
    if (!p[e]) continue;
    for (int64_t j = 0; j < nd; ++j) pos[j].push_back((e / strides[j]) % mask.sizes()[j]);
  }
  std::vector<Tensor> out;
  for (auto& v : pos) {
    Tensor t = empty({static_cast<int64_t>(v.size())}, kInt64);
    capture::host_write("index (mask positions)",
                        [p = t.data_ptr<int64_t>(), v = std::move(v)]() { std::copy(v.begin(), v.end(), p); });
    out.push_back(std::move(t));
  }
  return out;
}

Resolved resolve(const Tensor& self, const std::vector<Tensor>& indices, const char* op) {
  std::vector<Tensor> per_dim;  // undefined: the whole dim (torch's `:`)
  for (size_t i = 0; i < indices.size(); ++i) {
    const Tensor& t = indices[i];
    if (!t.defined()) {
      per_dim.emplace_back();
    } else if (t.dtype() == kBool || t.dtype() == kUInt8) {
      for (Tensor& p : mask_positions(self, t, static_cast<int64_t>(per_dim.size()), op)) per_dim.push_back(p);
    } else {
      KILN_CHECK(t.dtype() == kInt64 || t.dtype() == kInt32, IndexError, op,
                 ": tensors used as indices must be int64, int32, bool or uint8, got ", dtype_name(t.dtype()),
                 " for index ", i);
      per_dim.push_back(ops::copy_no_grad(t, kInt64, MemoryFormat::Contiguous));
    }
  }
  KILN_CHECK(static_cast<int64_t>(per_dim.size()) <= self.dim(), IndexError, op, ": too many indices for a tensor of ",
             "dimension ", self.dim(), " (shape ", self.sizes(), "): got ", per_dim.size());
  Resolved r;
  int64_t first = -1, last = -1;
  for (size_t d = 0; d < per_dim.size(); ++d) {
    if (!per_dim[d].defined()) continue;
    if (first < 0) first = static_cast<int64_t>(d);
    last = static_cast<int64_t>(d);
  }
  KILN_CHECK(first >= 0, IndexError, op, ": expects at least one index tensor, got none");
  for (int64_t d = first; d <= last; ++d) {
    KILN_CHECK(per_dim[d].defined(), IndexError, op,
               ": the index tensors must index adjacent dims (kiln does not move separated advanced-index dims to "
               "the front as torch does); dim ",
               d, " between indexed dims ", first, " and ", last, " has none. permute() so they are adjacent");
  }
  r.first = first;
  r.count = last - first + 1;
  DimVector shape = DimVector(per_dim[first].sizes());
  for (int64_t d = first + 1; d <= last; ++d) shape = broadcast_shapes(shape, per_dim[d].sizes(), op);
  r.index_shape = shape;
  for (int64_t d = first; d <= last; ++d) {
    r.dim_sizes.push_back(self.sizes()[d]);
    r.dim_strides.push_back(self.strides()[d]);
  }
  const int64_t n = shape_numel(shape);
  r.linear = empty(shape, kInt64);
  // The broadcast index values of dims last .. first (kept alive until the write has run).
  std::vector<Tensor> values;
  std::vector<const int64_t*> value_ptrs;
  for (int64_t d = last; d >= first; --d) {
    values.push_back(per_dim[d].expand(shape).contiguous());
    value_ptrs.push_back(values.back().data_ptr<int64_t>());
  }
  // Note [Index values are read on replay]; the bounds check stays in the
  // closure so that a replay with a bad index raises instead of writing out of bounds.
  capture::host_write("index (resolve)", [lin = r.linear.data_ptr<int64_t>(), value_ptrs = std::move(value_ptrs),
                                          sizes = r.dim_sizes, n, last, op]() {
    for (int64_t i = 0; i < n; ++i) lin[i] = 0;
    int64_t row = 1;
    for (size_t j = 0; j < value_ptrs.size(); ++j) {
      const int64_t d = last - static_cast<int64_t>(j);
      const int64_t size = sizes[sizes.size() - 1 - j];
      const int64_t* p = value_ptrs[j];
      for (int64_t i = 0; i < n; ++i) {
        int64_t k = p[i];
        KILN_CHECK(k >= -size && k < size, IndexError, op, ": index ", k, " is out of bounds for dimension ", d,
                   " with size ", size);
        if (k < 0) k += size;
        lin[i] += k * row;
      }
      row *= size;
    }
  });
  return r;
}

// self's shape with the indexed dims replaced by the index shape.
DimVector indexed_shape(const Tensor& self, const Resolved& r) {
  DimVector out;
  for (int64_t d = 0; d < r.first; ++d) out.push_back(self.sizes()[d]);
  for (int64_t s : r.index_shape) out.push_back(s);
  for (int64_t d = r.first + r.count; d < self.dim(); ++d) out.push_back(self.sizes()[d]);
  return out;
}

// Element offsets (from self's strides) of every position of dims [begin, end), row-major.
std::vector<int64_t> dim_offsets(const Tensor& self, int64_t begin, int64_t end) {
  std::vector<int64_t> offs{0};
  for (int64_t d = begin; d < end; ++d) {
    std::vector<int64_t> next;
    next.reserve(offs.size() * static_cast<size_t>(self.sizes()[d]));
    for (int64_t o : offs)
      for (int64_t k = 0; k < self.sizes()[d]; ++k) next.push_back(o + k * self.strides()[d]);
    offs = std::move(next);
  }
  return offs;
}

void write_indexed(Tensor& self, const Resolved& r, const Tensor& values, bool accumulate) {
  const DimVector shape = indexed_shape(self, r);
  if (shape_numel(shape) == 0) return;
  const Tensor v = ops::copy_no_grad(values.expand(shape), self.dtype(), MemoryFormat::Contiguous);
  std::vector<int64_t> pre = dim_offsets(self, 0, r.first);
  std::vector<int64_t> post = dim_offsets(self, r.first + r.count, self.dim());
  const int64_t n = shape_numel(r.index_shape);
  visit_dtype<kAllTypes>(self.dtype(), "index_put_", [&]<typename T>() {
    // Note [Index values are read on replay]: the offsets come from `linear` each time.
    capture::host_write(
        "index_put_",
        [base = self.data_ptr<T>(), src0 = v.data_ptr<T>(), lin = r.linear.data_ptr<int64_t>(), n, sizes = r.dim_sizes,
         strides = r.dim_strides, pre = std::move(pre), post = std::move(post), accumulate]() {
          std::vector<int64_t> element_offset(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) {
            int64_t rest = lin[i], off = 0;
            for (int64_t j = static_cast<int64_t>(sizes.size()) - 1; j >= 0; --j) {
              off += (rest % sizes[j]) * strides[j];
              rest /= sizes[j];
            }
            element_offset[static_cast<size_t>(i)] = off;
          }
          const T* src = src0;
          for (int64_t p : pre) {
            for (int64_t e : element_offset) {
              for (int64_t q : post) {
                T& dst = base[p + e + q];
                if (!accumulate) {
                  dst = *src;
                } else if constexpr (std::is_arithmetic_v<T>) {
                  dst = static_cast<T>(dst + *src);
                } else {
                  dst = T(static_cast<float>(dst) + static_cast<float>(*src));
                }
                ++src;
              }
            }
          }
        });
  });
}

struct IndexPutBackward final : autograd::Node {
  std::vector<SavedVariable> indices;
  bool accumulate = false;
  const char* name() const override { return "IndexPutBackward0"; }
  TensorList apply(TensorList&& g) override {
    if (!g[0].defined()) return {Tensor(), Tensor()};
    std::vector<Tensor> idx;
    for (const SavedVariable& s : indices) idx.push_back(s.unpack(this));
    // The positions written lost their old values; the values' gradient is
    // what reached those positions (summed to values' shape by the engine).
    Tensor self_grad = accumulate ? g[0] : g[0].index_put(idx, zeros({}, g[0].dtype()));
    return {self_grad, g[0].index(idx)};
  }
  void release_variables() override {
    for (SavedVariable& s : indices) s.reset();
  }
};

}  // namespace

Tensor Tensor::index(const std::vector<Tensor>& indices, std::source_location loc) const {
  ops::OpScope rs("index", {this, ops::nth_input(indices, 0), ops::nth_input(indices, 1), ops::nth_input(indices, 2)});
  ops::check_defined(*this, "index", "self");
  const Resolved r = resolve(*this, indices, "index");
  const int64_t last = r.first + r.count - 1;
  const Tensor flat = r.count == 1 ? *this : flatten(r.first, last, loc);
  Tensor out = flat.index_select(r.first, r.linear.reshape({-1}), loc);
  if (r.index_shape.empty()) return out.select(r.first, 0, loc);
  return r.index_shape.size() == 1 ? out : out.unflatten(r.first, r.index_shape, loc);
}

Tensor& Tensor::index_put_(const std::vector<Tensor>& indices, const Tensor& values, bool accumulate,
                           std::source_location loc) {
  ops::OpScope rs("index_put_", {this, &values, ops::nth_input(indices, 0), ops::nth_input(indices, 1)});
  const CallSite site = CallSite::from(loc);
  ops::check_defined(*this, "index_put_", "self");
  ops::check_defined(values, "index_put_", "values");
  KILN_CHECK(values.dtype() == dtype(), DTypeError,
             "index_put_: the values' dtype must match self's (as torch's index_put_ requires), got ",
             dtype_name(values.dtype()), " values for a ", dtype_name(dtype()), " tensor; convert them with .to(",
             dtype_name(dtype()), ")");
  const Resolved r = resolve(*this, indices, "index_put_");
  const DimVector target = indexed_shape(*this, r);
  bool fits = values.dim() <= static_cast<int64_t>(target.size());
  for (int64_t i = 1; fits && i <= values.dim(); ++i) {
    const int64_t v = values.sizes()[values.dim() - i], t = target[target.size() - i];
    fits = v == 1 || v == t;
  }
  KILN_CHECK(fits, ShapeError, "index_put_: values of shape ", values.sizes(),
             " cannot be broadcast to the indexed shape ", target);
  autograd::check_inplace(*this, "index_put_", site, {&values});
  IntrusivePtr<IndexPutBackward> node;
  if (is_floating_point() && autograd::compute_requires_grad({this, &values})) {
    node = make_intrusive<IndexPutBackward>();
    node->accumulate = accumulate;
    for (const Tensor& t : indices) node->indices.emplace_back(t, false);
  }
  write_indexed(*this, r, values, accumulate);
  bump_version();
  if (node) autograd::rebase_history(*this, node, {&values}, site);
  return *this;
}

Tensor Tensor::index_put(const std::vector<Tensor>& indices, const Tensor& values, bool accumulate,
                         std::source_location loc) const {
  ops::OpScope rs("index_put", {this, &values, ops::nth_input(indices, 0), ops::nth_input(indices, 1)});
  Tensor out = clone(loc);
  return out.index_put_(indices, values, accumulate, loc);
}

}  // namespace kiln
