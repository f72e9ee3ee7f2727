// `kiln quantize RUN --method qat`: quantization-aware fine-tuning of a run's
// image model (quant::prepare_qat / convert_qat, kiln/quant/qat.h), then the
// same int8 model, report, timing and file as post-training quantization.
#pragma once

#include "cli/quantize.h"

namespace kiln::cli {

/// Adds --qat-steps, --qat-lr, --freeze-after, --qat-observer and --qat-control to `quantize`.
void add_quantize_qat_options(CLI::App& quantize, QuantizeOptions& o);
int quantize_qat_command(const QuantizeOptions& o);

}  // namespace kiln::cli
