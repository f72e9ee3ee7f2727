// Bring-your-own datasets from a config (src/cli/task_data.h).
#include "cli/task_data.h"

#include <charconv>
#include <cmath>
#include <numeric>

#include "kiln/core/error.h"
#include "kiln/data/arrays.h"
#include "kiln/data/csv.h"
#include "kiln/data/image.h"

namespace kiln::cli {
namespace {

/// Samples `indices` of another dataset: the held-out split of one file.
class Subset : public data::Dataset<> {
 public:
  Subset(std::shared_ptr<const data::Dataset<>> base, std::vector<int64_t> indices)
      : base_(std::move(base)), indices_(std::move(indices)) {}
  int64_t size() const override { return static_cast<int64_t>(indices_.size()); }
  data::Example get(int64_t i) const override { return base_->get(indices_.at(static_cast<size_t>(i))); }

 private:
  std::shared_ptr<const data::Dataset<>> base_;
  std::vector<int64_t> indices_;
};

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// Splits `base` into train and held-out samples: a Fisher-Yates permutation
/// from the config's seed (the same on every machine and library), so the
/// split does not depend on how the file is sorted and is the same on resume and eval.
void hold_out(const Config& c, std::shared_ptr<const data::Dataset<>> base, UserData& u) {
  const int64_t n = base->size();
  const double frac = c.number("data.val_fraction");
  const int64_t n_val = std::max<int64_t>(1, static_cast<int64_t>(std::llround(frac * static_cast<double>(n))));
  if (!(frac > 0 && frac < 1) || n_val >= n)
    throw ConfigError(c.source() + ": data.val_fraction = " + std::to_string(frac) + " of the " + std::to_string(n) +
                      " samples in data.path leaves " + (n_val >= n ? "nothing" : "no held-out set") +
                      " to train on; give a fraction in (0, 1) of a larger file, or data.eval_path");
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  uint64_t state = static_cast<uint64_t>(c.integer("seed")) ^ 0x6B696C6E64617461ULL;  // "klndata"
  for (int64_t i = n - 1; i > 0; --i)
    std::swap(perm[static_cast<size_t>(i)], perm[splitmix64(state) % static_cast<uint64_t>(i + 1)]);
  std::vector<int64_t> val(perm.end() - n_val, perm.end()), train(perm.begin(), perm.end() - n_val);
  std::sort(val.begin(), val.end());
  std::sort(train.begin(), train.end());
  u.train = std::make_shared<Subset>(base, std::move(train));
  u.eval = std::make_shared<Subset>(std::move(base), std::move(val));
}

std::string required_path(const Config& c, const char* key) {
  const std::string p = c.string(key);
  if (p.empty())
    throw ConfigError(c.source() + ": data.dataset = \"" + c.string("data.dataset") + "\" needs '" + key +
                      "' (the file to read)");
  return p;
}

/// Runs a reader; its errors about the user's file become ConfigErrors naming the key.
template <typename F>
auto read(const Config& c, const char* key, F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    throw ConfigError(c.source() + ": " + key + " = \"" + c.string(key) + "\": " + e.what());
  }
}

void from_arrays(const Config& c, const std::shared_ptr<const data::ArrayDataset>& train,
                 const std::shared_ptr<const data::ArrayDataset>& eval, UserData& u) {
  const auto& f = train->features();
  u.sample_shape.assign(f.sizes().begin() + 1, f.sizes().end());
  u.num_classes = std::max(train->num_classes(), eval ? eval->num_classes() : 0);
  if (eval) {
    const auto& g = eval->features();
    if (std::vector<int64_t>(g.sizes().begin() + 1, g.sizes().end()) != u.sample_shape)
      throw ConfigError(c.source() + ": data.eval_path's samples are " +
                        shape_str(std::vector<int64_t>(g.sizes().begin() + 1, g.sizes().end())) +
                        " but data.path's are " + shape_str(u.sample_shape));
    u.train = train;
    u.eval = eval;
  } else {
    hold_out(c, train, u);
  }
}

void npy(const Config& c, UserData& u) {
  const std::string x = required_path(c, "data.path"), y = required_path(c, "data.labels_path");
  auto train =
      read(c, "data.path", [&] { return std::make_shared<data::ArrayDataset>(data::ArrayDataset::from_npy(x, y)); });
  std::shared_ptr<data::ArrayDataset> eval;
  const std::string ex = c.string("data.eval_path"), ey = c.string("data.eval_labels_path");
  if (ex.empty() != ey.empty())
    throw ConfigError(
        c.source() +
        ": give both data.eval_path and data.eval_labels_path (the held-out features and labels), or neither");
  if (!ex.empty())
    eval = read(c, "data.eval_path",
                [&] { return std::make_shared<data::ArrayDataset>(data::ArrayDataset::from_npy(ex, ey)); });
  from_arrays(c, train, eval, u);
}

void safetensors(const Config& c, UserData& u) {
  const std::string fk = c.string("data.features_key"), lk = c.string("data.labels_key");
  const std::string p = required_path(c, "data.path"), e = c.string("data.eval_path");
  auto train = read(c, "data.path", [&] {
    return std::make_shared<data::ArrayDataset>(data::ArrayDataset::from_safetensors(p, fk, lk));
  });
  std::shared_ptr<data::ArrayDataset> eval;
  if (!e.empty())
    eval = read(c, "data.eval_path",
                [&] { return std::make_shared<data::ArrayDataset>(data::ArrayDataset::from_safetensors(e, fk, lk)); });
  from_arrays(c, train, eval, u);
}

void csv(const Config& c, UserData& u) {
  data::CsvOptions o{.path = required_path(c, "data.path")};
  const std::string col = c.string("data.label_column");
  int64_t index = 0;
  const auto r = std::from_chars(col.data(), col.data() + col.size(), index);
  if (!col.empty() && r.ec == std::errc() && r.ptr == col.data() + col.size())
    o.label_index = index;
  else
    o.label_name = col;
  auto train = read(c, "data.path", [&] { return std::make_shared<data::CsvDataset>(o); });
  std::shared_ptr<data::CsvDataset> eval;
  if (const std::string e = c.string("data.eval_path"); !e.empty()) {
    o.path = e;
    o.class_names = train->class_names();
    eval = read(c, "data.eval_path", [&] { return std::make_shared<data::CsvDataset>(o); });
  }
  from_arrays(c, train, eval, u);
}

void image_folder(const Config& c, UserData& u) {
  const std::vector<int64_t> resize = c.integers("data.resize");
  const int64_t channels = c.integer("data.channels");
  if (channels != 0 && channels != 1 && channels != 3)
    throw ConfigError(c.source() + ": 'data.channels' expects 0 (as the images), 1 or 3, got " +
                      std::to_string(channels));
  if (!(resize.empty() || ((resize.size() == 1 || resize.size() == 2) &&
                           std::all_of(resize.begin(), resize.end(), [](int64_t s) { return s > 0; }))))
    throw ConfigError(c.source() + ": 'data.resize' expects [] (no resizing), [S] or [H, W] with positive sizes, got " +
                      shape_str(resize));
  data::ImageFolderOptions o{.root = required_path(c, "data.path"), .channels = channels, .size = resize};
  auto train = read(c, "data.path", [&] { return std::make_shared<data::ImageFolder>(o); });
  const auto& im = train->images();
  u.sample_shape = {im.size(1), im.size(2), im.size(3)};
  u.num_classes = static_cast<int64_t>(train->classes().size());
  const std::string e = c.string("data.eval_path");
  if (e.empty()) return hold_out(c, train, u);
  // The held-out images get the training set's classes, channels and size.
  o.root = e;
  o.classes = train->classes();
  o.channels = im.size(1);
  o.size = {im.size(2), im.size(3)};
  u.train = train;
  u.eval = read(c, "data.eval_path", [&] { return std::make_shared<data::ImageFolder>(o); });
}

}  // namespace

bool is_user_data(const Config& c) {
  const std::string d = c.string("data.dataset");
  return d == "npy" || d == "safetensors" || d == "csv" || d == "image_folder";
}

UserData make_user_data(const Config& c) {
  UserData u;
  const std::string d = c.string("data.dataset");
  if (d == "npy")
    npy(c, u);
  else if (d == "safetensors")
    safetensors(c, u);
  else if (d == "csv")
    csv(c, u);
  else
    image_folder(c, u);
  return u;
}

}  // namespace kiln::cli
