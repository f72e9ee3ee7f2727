// `kiln quantize RUN --method int4`: INT4 weight-only quantization of a GPT
// run's attention and MLP linears (quant::quantize_linears_int4, RTN or GPTQ),
// with bits/char on the validation text before and after, weight bytes, 1-thread
// forward time, and the int4 model written beside the run.
#pragma once

#include "cli/quantize.h"

namespace kiln::cli {

int quantize_int4_command(const QuantizeOptions& o);
/// `--method int8-dynamic`: GPT's linears in int8 with per-token activation scales (bits/char and timing only).
int quantize_gpt_int8_command(const QuantizeOptions& o);

}  // namespace kiln::cli
