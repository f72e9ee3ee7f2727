// Shapes and strides: IntArrayRef (a non-owning view that accepts {2, 3},
// vectors and single integers, like c10::IntArrayRef) and DimVector (an owning
// vector with inline storage, so a tensor of up to 6 dims costs no heap
// allocation for its sizes and strides).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

namespace kiln {

class IntArrayRef {
 public:
  constexpr IntArrayRef() = default;
  constexpr IntArrayRef(const int64_t* data, size_t size) : data_(data), size_(size) {}
  constexpr IntArrayRef(const int64_t& single) : data_(&single), size_(1) {}  // NOLINT
  // Like c10::ArrayRef: valid for the full expression the braced list appears in.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"
  constexpr IntArrayRef(std::initializer_list<int64_t> il)  // NOLINT
      : data_(il.begin()), size_(il.size()) {}
#pragma GCC diagnostic pop
  IntArrayRef(const std::vector<int64_t>& v) : data_(v.data()), size_(v.size()) {}  // NOLINT

  constexpr const int64_t* data() const { return data_; }
  constexpr size_t size() const { return size_; }
  constexpr bool empty() const { return size_ == 0; }
  constexpr const int64_t* begin() const { return data_; }
  constexpr const int64_t* end() const { return data_ + size_; }
  constexpr int64_t operator[](size_t i) const { return data_[i]; }
  constexpr int64_t back() const { return data_[size_ - 1]; }
  std::vector<int64_t> vec() const { return {begin(), end()}; }
  bool equals(IntArrayRef o) const { return size_ == o.size_ && std::equal(begin(), end(), o.begin()); }

 private:
  const int64_t* data_ = nullptr;
  size_t size_ = 0;
};

inline bool operator==(IntArrayRef a, IntArrayRef b) { return a.equals(b); }

/// Owning, inline-capacity vector of int64 for sizes and strides.
class DimVector {
 public:
  static constexpr size_t kInline = 6;

  DimVector() = default;
  explicit DimVector(size_t n, int64_t value = 0) { resize(n, value); }
  DimVector(IntArrayRef r) { assign(r); }  // NOLINT
  DimVector(std::initializer_list<int64_t> il) { assign(IntArrayRef(il)); }
  DimVector(const DimVector& o) { assign(o); }
  DimVector(DimVector&& o) noexcept { steal(o); }
  DimVector& operator=(const DimVector& o) {
    if (this != &o) assign(o);
    return *this;
  }
  DimVector& operator=(DimVector&& o) noexcept {
    if (this != &o) {
      release();
      steal(o);
    }
    return *this;
  }
  ~DimVector() { release(); }

  void assign(IntArrayRef r) {
    reserve(r.size());
    if (r.size()) std::memmove(ptr(), r.data(), r.size() * sizeof(int64_t));
    size_ = r.size();
  }
  void resize(size_t n, int64_t value = 0) {
    reserve(n);
    for (size_t i = size_; i < n; ++i) ptr()[i] = value;
    size_ = n;
  }
  void push_back(int64_t v) {
    if (size_ == capacity_) reserve(capacity_ * 2);
    ptr()[size_++] = v;
  }
  void insert(size_t pos, int64_t v) {
    push_back(0);
    int64_t* p = ptr();
    std::memmove(p + pos + 1, p + pos, (size_ - 1 - pos) * sizeof(int64_t));
    p[pos] = v;
  }
  void erase(size_t pos) {
    int64_t* p = ptr();
    std::memmove(p + pos, p + pos + 1, (size_ - pos - 1) * sizeof(int64_t));
    --size_;
  }
  void pop_back() { --size_; }
  void clear() { size_ = 0; }
  void reserve(size_t n) {
    if (n <= capacity_) return;
    auto* heap = new int64_t[n];
    if (size_) std::memcpy(heap, ptr(), size_ * sizeof(int64_t));
    release();
    heap_ = heap;
    capacity_ = n;
  }

  int64_t* data() { return ptr(); }
  const int64_t* data() const { return ptr(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  int64_t& operator[](size_t i) { return ptr()[i]; }
  int64_t operator[](size_t i) const { return ptr()[i]; }
  int64_t& back() { return ptr()[size_ - 1]; }
  int64_t* begin() { return ptr(); }
  int64_t* end() { return ptr() + size_; }
  const int64_t* begin() const { return ptr(); }
  const int64_t* end() const { return ptr() + size_; }
  operator IntArrayRef() const { return {ptr(), size_}; }  // NOLINT
  IntArrayRef ref() const { return {ptr(), size_}; }
  std::vector<int64_t> vec() const { return {begin(), end()}; }

 private:
  int64_t* ptr() { return heap_ ? heap_ : inline_; }
  const int64_t* ptr() const { return heap_ ? heap_ : inline_; }
  void release() {
    delete[] heap_;
    heap_ = nullptr;
    capacity_ = kInline;
  }
  void steal(DimVector& o) {
    if (o.heap_) {
      heap_ = o.heap_;
      capacity_ = o.capacity_;
      o.heap_ = nullptr;
      o.capacity_ = kInline;
    } else {
      std::memcpy(inline_, o.inline_, o.size_ * sizeof(int64_t));
    }
    size_ = o.size_;
    o.size_ = 0;
  }

  int64_t inline_[kInline];
  int64_t* heap_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = kInline;
};

/// "[2, 3, 4]": the form shapes take in every error message.
std::string shape_str(IntArrayRef s);
std::ostream& operator<<(std::ostream& os, IntArrayRef s);
inline std::ostream& operator<<(std::ostream& os, const DimVector& s) { return os << s.ref(); }

int64_t shape_numel(IntArrayRef sizes);
DimVector contiguous_strides(IntArrayRef sizes);

/// Wraps a possibly negative dim into [0, ndim); throws IndexError naming `op`.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);

/// Broadcast two shapes by NumPy rules; throws ShapeError naming `op` and both shapes.
DimVector broadcast_shapes(IntArrayRef a, IntArrayRef b, const char* op);

}  // namespace kiln
