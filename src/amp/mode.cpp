#include "kiln/amp/mode.h"

#include "kiln/core/error.h"

namespace kiln::amp {

std::string AmpMode::name() const {
  if (!dtype) return "off";
  return *dtype == kBFloat16 ? "bf16" : "fp16";
}

AmpMode parse_amp_mode(std::string_view text) {
  if (text == "bf16" || text == "bfloat16") return {kBFloat16};
  if (text == "fp16" || text == "float16" || text == "half") return {kFloat16};
  if (text == "off" || text == "none" || text == "fp32" || text == "float32") return {std::nullopt};
  KILN_CHECK(false, ValueError,
             "amp: expected bf16, fp16 or off (also bfloat16, float16, half, none, fp32, float32), got \"",
             std::string(text), "\"");
  return {};
}

}  // namespace kiln::amp
