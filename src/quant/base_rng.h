// Quantized and fake-quantized layers subclass nn::Conv2d / nn::Linear (so that
// kiln's models keep their typed pointers), and those base constructors draw a
// weight from the default generator that the subclass throws away. These
// helpers undo the draw, so that quantizing a model or loading a quantized one
// leaves the random stream as it was (and with it everything initialised
// afterwards, such as LoRA's A):
//
//   Derived(const nn::Linear& src) : nn::Linear(detail::linear_options_saving_rng(src)) {
//     detail::restore_rng_before_base();
//
// The state passes, per thread, from the base's initialiser to the body.
#pragma once

#include "kiln/nn/layers.h"

namespace kiln::quant::detail {

nn::Conv2dOptions conv_options_saving_rng(const nn::Conv2d& src);
nn::LinearOptions linear_options_saving_rng(const nn::Linear& src);
void restore_rng_before_base();

}  // namespace kiln::quant::detail
