// Per-sample transforms of image tensors [C, H, W] (torchvision.transforms).
//
// Each factory returns a data::Transform (a function Tensor -> Tensor) to pass
// to a dataset (e.g. FashionMNISTOptions::transform). Random transforms draw
// from sample_generator(), which the DataLoader seeds per sample from (seed,
// epoch, rank, index), so augmented batches do not depend on num_workers.
// Inputs must be floating point with 3 dims; outputs are new float32 tensors.
#pragma once

#include <vector>

#include "kiln/data/idx.h"

namespace kiln::data::transforms {

/// (x - mean[c]) / std[c] per channel; mean and std hold 1 or C values.
Transform normalize(std::vector<double> mean, std::vector<double> std);

/// Pads each side with `padding` zeros, then cuts a random size x size window.
Transform random_crop(int64_t size, int64_t padding = 0);

/// Reverses the last dim (width) with probability p.
Transform random_horizontal_flip(double p = 0.5);

/// Applies the transforms in order.
Transform compose(std::vector<Transform> transforms);

}  // namespace kiln::data::transforms
