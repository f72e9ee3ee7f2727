#pragma once
// Bring-your-own data for the `kiln` command: data.dataset = "npy",
// "safetensors", "csv" or "image_folder" (docs/config.md). task.cpp builds
// every other dataset; this file turns the data keys of these four into
// datasets and tells the model builder what a sample looks like.
#include <cstdint>
#include <memory>
#include <vector>

#include "cli/config.h"
#include "kiln/data/dataset.h"

namespace kiln::cli {

/// True for the dataset kinds built here.
bool is_user_data(const Config& config);

struct UserData {
  std::shared_ptr<const data::Dataset<>> train, eval;
  std::vector<int64_t> sample_shape;  // one input: [F] for a table, [C, H, W] for images
  int64_t num_classes = 0;            // over both splits
};

/// The datasets the config names. The evaluation split is data.eval_path
/// (numbered as the training data: same class names and folders), or else a
/// fixed random data.val_fraction of the training file, drawn from `seed`.
/// A file that cannot be read or is malformed is a ConfigError (exit status 2)
/// naming the key, the file and the reader's complaint.
UserData make_user_data(const Config& config);

}  // namespace kiln::cli
