// The mixed-precision mode of a run, as a config or the command line names it
// (`amp = "bf16"`, `--set amp=fp16|bf16|off`): which autocast dtype, if any, and
// whether the run needs a GradScaler (float16 only).
//
//   const amp::AmpMode mode = amp::parse_amp_mode(cfg.amp);
//   amp::GradScaler scaler({.enabled = mode.needs_scaler()});
//   std::optional<AutocastGuard> guard;
//   if (mode.dtype) guard.emplace(*mode.dtype);
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "kiln/core/dtype.h"

namespace kiln::amp {

struct AmpMode {
  std::optional<DType> dtype;  // kBFloat16, kFloat16, or none (off)
  bool needs_scaler() const { return dtype == kFloat16; }
  /// "bf16", "fp16" or "off": what parse_amp_mode reads back.
  std::string name() const;
};

/// "bf16"/"bfloat16", "fp16"/"float16"/"half", "off"/"none"/"fp32"/"float32"
/// (case-sensitive, as config values); anything else is a ValueError listing these.
AmpMode parse_amp_mode(std::string_view text);

}  // namespace kiln::amp
