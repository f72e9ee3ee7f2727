// ReLU's backward (torch's threshold_backward) as one elementwise pass: the
// compare and the select are a vector compare and a blend, and the driver of
// elementwise_loop.h supplies dtypes, strides, broadcasts and threads.
#include "kiln/kernels/threshold.h"

#include <type_traits>

#include "elementwise_loop.h"
#include "kiln/core/capture.h"
#include "kiln/core/capture_loop.h"
#include "loop_capture.h"

namespace kiln::kernels {

void threshold_backward(const LoopSpec& s, DType dt, const void* threshold) {
  // The threshold points at the caller's stack: the record keeps a copy (made only when recording).
  const capture::KernelScope cap("threshold_backward", capture::kDeferrable);
  if (cap.recording()) {
    const int es = static_cast<int>(element_size(dt));
    const bool deferred = ew::record_loop(
        cap, s, ew::sizes_all(es),
        [=, th = capture::ScalarBytes(threshold, es)](const LoopSpec& t) { threshold_backward(t, dt, th.ptr()); });
    // kiln::compile's ReLU-pooling rewrite holds only for a threshold >= 0 (docs/compile.md, "Rewrites").
    if (dt != kBool)
      visit_dtype(dt, [&]<typename T>() {
        if constexpr (!std::is_same_v<T, bool>)
          capture::note_scalar(static_cast<double>(static_cast<compute_t<T>>(*static_cast<const T*>(threshold))));
      });
    if (deferred) return;
  }
  KILN_ASSERT(dt != kBool, "threshold_backward kernel called with bool; the ops layer should have rejected it");
  visit_dtype(dt, [&]<typename T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      using C = compute_t<T>;
      const C t = static_cast<C>(*static_cast<const T*>(threshold));
      // `v <= t ? 0 : g` rather than `v > t ? g : 0`: a NaN v compares false
      // and passes g, as torch's kernel does.
      ew::run_binary<T, T>(s, [t](C g, C v) { return v <= t ? C(0) : g; });
    }
  });
}

}  // namespace kiln::kernels
