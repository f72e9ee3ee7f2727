// Autocast (mixed precision, torch.autocast) state: a thread-local mode that
// ops consult at their entry, behind the RAII AutocastGuard (DESIGN.md §2).
// Which op runs in which precision is the policy table in kiln/ops/autocast.h;
// this header holds only the mode and the per-region cast cache, so core stays
// free of op knowledge.
//
//   {
//     kiln::AutocastGuard amp(kiln::kBFloat16);  // matmul/linear/conv/attention in bf16
//     Tensor loss = criterion(model.forward(x), y);  // losses, softmax, norms in float32
//     {
//       kiln::AutocastGuard off(false);  // a region that must stay in full precision
//     }
//   }  // the outermost guard's exit drops the cached parameter casts
//   loss.backward();  // gradients reach the float32 parameters (master weights)
#pragma once

#include <cstdint>
#include <optional>

#include "kiln/core/dtype.h"
#include "kiln/core/tensor.h"

namespace kiln {

/// True when autocast is on for this thread (an enabled guard is alive and no
/// op is running with autocast suspended).
bool autocast_enabled();
/// The lower-precision dtype of the innermost guard (kBFloat16 when none).
DType autocast_dtype();
/// The dtype of the most recent enabled autocast region on this thread, if
/// any: GradScaler reads it to notice that it runs beside bfloat16, which needs no scaling.
std::optional<DType> autocast_last_dtype();

/// torch.autocast(device_type="cpu", dtype=..., enabled=...). Nestable: the
/// innermost guard decides; AutocastGuard(false) turns autocast off in a region
/// and keeps the dtype. dtype must be kBFloat16 or kFloat16.
class AutocastGuard {
 public:
  explicit AutocastGuard(DType dtype, bool enabled = true);
  explicit AutocastGuard(bool enabled);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool prev_enabled_;
  DType prev_dtype_;
};

namespace autocast_detail {

/// Runs an op body with autocast off without ending the region (the cache stays),
/// as torch excludes the Autocast dispatch key inside an autocast kernel.
class SuspendGuard {
 public:
  SuspendGuard();
  ~SuspendGuard();
  SuspendGuard(const SuspendGuard&) = delete;
  SuspendGuard& operator=(const SuspendGuard&) = delete;

 private:
  bool prev_;
};

/// The cache of parameter casts for the current region, keyed by the source's
/// TensorImpl identity, its version, the target dtype and grad mode (a cast
/// made under no_grad has no graph and must not serve a later differentiable
/// use). Holding the source keeps its address from being reused while cached.
/// Returns an undefined tensor on a miss.
Tensor cache_lookup(const Tensor& src, DType dtype);
void cache_store(const Tensor& src, DType dtype, const Tensor& cast);
/// Outside any guard there is no region to cache for.
bool cache_active();
void clear_cache();

}  // namespace autocast_detail

/// Counts for tests and telemetry (this thread): casts autocast made, of which
/// parameter casts, and parameter uses served from the cache.
struct AutocastCounters {
  int64_t casts = 0;
  int64_t param_casts = 0;
  int64_t cache_hits = 0;
};
AutocastCounters autocast_counters();
void reset_autocast_counters();
namespace autocast_detail {
AutocastCounters& counters();
}

}  // namespace kiln
