// The whole public API of kiln.
#pragma once

#include "kiln/core/allocator.h"
#include "kiln/core/dtype.h"
#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/core/scalar.h"
#include "kiln/core/shape.h"
#include "kiln/core/tensor.h"
#include "kiln/core/threads.h"
#include "kiln/ops/factory.h"
