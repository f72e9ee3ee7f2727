#include "base_rng.h"

#include "kiln/core/generator.h"

namespace kiln::quant::detail {
namespace {

thread_local GeneratorState t_rng_before_base;

}  // namespace

nn::Conv2dOptions conv_options_saving_rng(const nn::Conv2d& src) {
  t_rng_before_base = default_generator().get_state();
  return src.options;
}

nn::LinearOptions linear_options_saving_rng(const nn::Linear& src) {
  t_rng_before_base = default_generator().get_state();
  return src.options;
}

void restore_rng_before_base() { default_generator().set_state(t_rng_before_base); }

}  // namespace kiln::quant::detail
