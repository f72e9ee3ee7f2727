// quant internals: swapping a Conv2d / Linear child of a model for another
// one, shared by PTQ's convert (src/quant/ptq.cpp) and QAT's prepare / convert
// (src/quant/qat.cpp).
#pragma once

#include <memory>
#include <string>

#include "kiln/nn/module.h"

namespace kiln::quant::detail {

/// Points `parent`'s typed member `name` (models::CNN, BasicBlock, ResNet) at
/// `layer` (an nn::Conv2d or nn::Linear) and registers it under `name`; a
/// container parent (Sequential, ModuleList, ModuleDict) needs only the
/// registration. False, and nothing changed, for a parent whose typed member
/// quant does not know; with dry_run only the check (`layer` may then be a
/// non-owning alias of the model's own module: only its type is read).
bool replace_layer(nn::Module& parent, const std::string& name, const std::shared_ptr<nn::Module>& layer, bool dry_run);

}  // namespace kiln::quant::detail
