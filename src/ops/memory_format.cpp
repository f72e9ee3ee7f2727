// Channels-last predicates and allocation (include/kiln/ops/memory_format.h).
#include "kiln/ops/memory_format.h"

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "op_record.h"

namespace kiln {

namespace {

// Dense in the dim order `order` (outermost first), ignoring size-1 dims.
bool dense_in_order(const Tensor& t, const int (&order)[4]) {
  int64_t expected = 1;
  for (int i = 3; i >= 0; --i) {
    const int d = order[i];
    const int64_t size = t.size(d);
    if (size == 1) continue;
    if (t.stride(d) != expected) return false;
    expected *= size;
  }
  return true;
}

constexpr int kNhwc[4] = {0, 2, 3, 1};

}  // namespace

const char* memory_format_name(MemoryFormat f) {
  switch (f) {
    case MemoryFormat::Contiguous: return "contiguous_format";
    case MemoryFormat::ChannelsLast: return "channels_last";
    case MemoryFormat::Preserve: return "preserve_format";
  }
  return "?";
}

bool is_contiguous(const Tensor& t, MemoryFormat f) {
  switch (f) {
    case MemoryFormat::Contiguous: return t.is_contiguous();
    case MemoryFormat::ChannelsLast: return t.dim() == 4 && (t.numel() == 0 || dense_in_order(t, kNhwc));
    case MemoryFormat::Preserve: break;
  }
  KILN_CHECK(false, ValueError, "is_contiguous: expected contiguous_format or channels_last, got preserve_format");
  return false;
}

MemoryFormat suggest_memory_format(const Tensor& t) {
  if (t.dim() == 4 && !t.is_contiguous() && is_contiguous(t, MemoryFormat::ChannelsLast)) {
    return MemoryFormat::ChannelsLast;
  }
  return MemoryFormat::Contiguous;
}

Tensor empty(IntArrayRef sizes, TensorOptions options, MemoryFormat f) {
  ops::OpScope rs("empty", {});
  if (f != MemoryFormat::ChannelsLast) return empty(sizes, options);
  KILN_CHECK(sizes.size() == 4, ShapeError, "empty: channels_last needs a 4-D shape [N, C, H, W], got ", sizes);
  const int64_t c = sizes[1], h = sizes[2], w = sizes[3];
  return empty_strided(sizes, {h * w * c, 1, w * c, c}, options);
}

}  // namespace kiln
