// The whole public API of kiln.
#pragma once

#include "kiln/core/allocator.h"
#include "kiln/core/dtype.h"
#include "kiln/core/error.h"
#include "kiln/core/factory.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/core/scalar.h"
#include "kiln/core/shape.h"
#include "kiln/core/tensor.h"
#include "kiln/core/threads.h"

#include "kiln/autograd/anomaly.h"
#include "kiln/autograd/custom_function.h"
#include "kiln/autograd/engine.h"
#include "kiln/autograd/gradcheck.h"

#include "kiln/ops/conv.h"
#include "kiln/ops/elementwise.h"
#include "kiln/ops/index.h"
#include "kiln/ops/linalg.h"
#include "kiln/ops/promotion.h"
#include "kiln/ops/reduce.h"

#include "kiln/io/safetensors.h"

#include "kiln/data/dataset.h"
#include "kiln/data/idx.h"
#include "kiln/data/iterable.h"
#include "kiln/data/loader.h"
#include "kiln/data/sampler.h"
#include "kiln/data/text.h"
#include "kiln/data/transforms.h"

#include "kiln/models/cnn.h"
#include "kiln/models/gpt.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/models/vit.h"

#include "kiln/nn/attention.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/init.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/module.h"
#include "kiln/nn/norm.h"
#include "kiln/nn/transformer.h"

#include "kiln/optim/checkpoint.h"
#include "kiln/optim/clip_grad.h"
#include "kiln/optim/optimizer.h"
#include "kiln/optim/scheduler.h"
