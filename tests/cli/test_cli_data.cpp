// Bring-your-own data through the `kiln` command (data.dataset = "npy",
// "safetensors", "csv", "image_folder"; "text" is covered by the GPT runs in
// test_cli_train.cpp): a few steps on each from small files written here, the
// evaluation split the config names, `kiln eval` rebuilding the same data, and
// a bad file or a missing key refused with exit status 2 and a clear message.
#include <gtest/gtest.h>

#include "cli/cli_util.h"
#include "kiln/ops/factory.h"
#include "kiln/io/safetensors.h"
#include "support/byod_bytes.h"
#include "support/idx_bytes.h"

namespace kiln::test {
namespace {
namespace fs = std::filesystem;

/// A short classifier run on `data` (the [data] keys besides the batch sizes).
std::string data_config(const std::string& model, const std::string& data) {
  return "name = \"byod\"\nseed = 5\n\n[model]\n" + model + "\n[data]\n" + data +
         "batch_size = 4\neval_batch_size = 8\nnum_workers = 1\n\n[optim]\nlr = 1e-2\n\n"
         "[train]\nsteps = 6\neval_every = 3\nckpt_every = 6\nlog_every = 1\n";
}

constexpr const char* kMlp = "type = \"mlp\"\nhidden = [8]\n";

/// 40 samples of 3 features; the label is whether the first feature is positive.
void write_arrays(const TempDir& dir, std::vector<float>& x, std::vector<int64_t>& y, int n = 40) {
  x.clear();
  y.clear();
  for (int i = 0; i < n; ++i) {
    const float a = static_cast<float>((i * 7) % 11) - 5.0f;
    x.insert(x.end(), {a, 0.5f * static_cast<float>(i % 3), -1.0f});
    y.push_back(a > 0 ? 1 : 0);
  }
}

/// Runs the config; checks the run completed, trained and evaluated, and
/// charged its data to the `data` memory category; returns `kiln eval`'s output.
std::string train_and_eval(const TempDir& dir, const std::string& config) {
  write_text(dir.path() / "c.toml", config);
  const fs::path run = dir.path() / "run";
  const auto r = kiln_cli("train " + dir.file("c.toml") + " --out " + run.string());
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("completed at step 6 of 6"), std::string::npos) << r.output;
  const auto train = metrics_lines(run, "train");
  EXPECT_EQ(train.size(), 6u);
  if (!train.empty()) {
    EXPECT_GT(train.back()["memory"]["data"].get<int64_t>(), 0) << train.back().dump();
  }
  const auto eval = metrics_lines(run, "eval");
  EXPECT_FALSE(eval.empty());
  if (!eval.empty()) {
    EXPECT_TRUE(eval.back().contains("accuracy")) << eval.back().dump();
  }
  const auto e = kiln_cli("eval " + run.string());
  EXPECT_EQ(e.rc, 0) << e.output;
  return e.output;
}

TEST(CliData, NpyPairWithAHeldOutFraction) {
  TempDir dir;
  std::vector<float> x;
  std::vector<int64_t> y;
  write_arrays(dir, x, y);
  write_bytes(dir.file("x.npy"), npy_bytes("<f4", {40, 3}, raw_bytes(x)));
  write_bytes(dir.file("y.npy"), npy_bytes("<i8", {40}, raw_bytes(y)));
  const std::string out = train_and_eval(
      dir, data_config(kMlp, "dataset = \"npy\"\npath = \"" + dir.file("x.npy") + "\"\nlabels_path = \"" +
                                 dir.file("y.npy") + "\"\nval_fraction = 0.25\n"));
  EXPECT_NE(out.find("test split, 10 samples"), std::string::npos) << "a quarter of 40 held out: " << out;
}

TEST(CliData, SafetensorsWithAnEvalFile) {
  TempDir dir;
  std::vector<float> x;
  std::vector<int64_t> y;
  write_arrays(dir, x, y);
  io::save_safetensors(dir.file("train.safetensors"),
                       io::NamedTensors{{"inputs", tensor<float>(x, {40, 3})}, {"targets", tensor<int64_t>(y)}});
  write_arrays(dir, x, y, 12);
  io::save_safetensors(dir.file("val.safetensors"),
                       io::NamedTensors{{"inputs", tensor<float>(x, {12, 3})}, {"targets", tensor<int64_t>(y)}});
  const std::string out = train_and_eval(
      dir, data_config(kMlp, "dataset = \"safetensors\"\npath = \"" + dir.file("train.safetensors") +
                                 "\"\neval_path = \"" + dir.file("val.safetensors") +
                                 "\"\nfeatures_key = \"inputs\"\nlabels_key = \"targets\"\n"));
  EXPECT_NE(out.find("test split, 12 samples"), std::string::npos) << out;
}

TEST(CliData, CsvWithNamedLabels) {
  TempDir dir;
  std::string table = "length,width,kind\n";
  for (int i = 0; i < 40; ++i) {
    // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on a chain of operator+.
    table += std::to_string(i % 9);
    table += ",";
    table += std::to_string(0.25 * (i % 4));
    table += i % 9 > 4 ? ",big\n" : ",small\n";
  }
  write_text(dir.path() / "t.csv", table);
  write_text(dir.path() / "v.csv", "length,width,kind\n1,0.5,small\n8,0.25,big\n7,0,big\n");
  const std::string out = train_and_eval(
      dir, data_config(kMlp, "dataset = \"csv\"\npath = \"" + dir.file("t.csv") + "\"\neval_path = \"" +
                                 dir.file("v.csv") + "\"\nlabel_column = \"kind\"\n"));
  EXPECT_NE(out.find("test split, 3 samples"), std::string::npos) << out;
}

TEST(CliData, ImageFolderOfPngAndJpegIntoACnn) {
  TempDir dir;
  for (const char* split : {"train", "val"}) {
    for (int c = 0; c < 2; ++c) {
      const fs::path folder = dir.path() / split / (c ? "bright" : "dark");
      fs::create_directories(folder);
      for (int i = 0; i < (split[0] == 't' ? 8 : 2); ++i) {
        std::vector<uint8_t> px(8 * 8, static_cast<uint8_t>(c ? 200 + i : 20 + i));
        // Mixed formats and sizes: data.resize brings every image to 8x8.
        if (i % 2)
          write_bytes((folder / ("im" + std::to_string(i) + ".jpg")).string(), jpeg_bytes(8, 8, 1, px));
        else
          write_bytes((folder / ("im" + std::to_string(i) + ".png")).string(),
                      png_bytes(4, 4, 1, std::vector<uint8_t>(16, px[0])));
      }
    }
  }
  const std::string out = train_and_eval(
      dir, data_config("type = \"cnn\"\nchannels1 = 4\nchannels2 = 4\nfc_hidden = 8\n",
                       "dataset = \"image_folder\"\npath = \"" + (dir.path() / "train").string() + "\"\neval_path = \"" +
                           (dir.path() / "val").string() + "\"\nresize = [8, 8]\n"));
  EXPECT_NE(out.find("test split, 4 samples"), std::string::npos) << out;
}

TEST(CliData, ABadFileOrAMissingKeyExitsTwoNamingIt) {
  TempDir dir;
  std::vector<float> x;
  std::vector<int64_t> y;
  write_arrays(dir, x, y);
  const std::string good_x = npy_bytes("<f4", {40, 3}, raw_bytes(x));
  write_bytes(dir.file("x.npy"), good_x.substr(0, good_x.size() - 5));  // truncated
  write_bytes(dir.file("y.npy"), npy_bytes("<i8", {40}, raw_bytes(y)));
  const std::string data = "dataset = \"npy\"\npath = \"" + dir.file("x.npy") + "\"\nlabels_path = \"" +
                           dir.file("y.npy") + "\"\n";
  write_text(dir.path() / "c.toml", data_config(kMlp, data));
  auto r = kiln_cli("train " + dir.file("c.toml") + " --out " + dir.file("run"));
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("kiln: error: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("data.path = \"" + dir.file("x.npy") + "\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("truncated: shape [40, 3] of '<f4' needs 480 bytes of data, the file has 475"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(count_lines(r.output), 1) << "one message, no trace: " << r.output;

  write_text(dir.path() / "c.toml", data_config(kMlp, "dataset = \"npy\"\npath = \"" + dir.file("y.npy") + "\"\n"));
  r = kiln_cli("train " + dir.file("c.toml") + " --out " + dir.file("run2"));
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("needs 'data.labels_path'"), std::string::npos) << r.output;

  // Image samples for a model that needs them, a table for one that does not.
  write_text(dir.path() / "t.csv", "a,b\n1,0\n2,1\n3,0\n4,1\n5,0\n");
  write_text(dir.path() / "c.toml",
             data_config("type = \"cnn\"\n", "dataset = \"csv\"\npath = \"" + dir.file("t.csv") + "\"\n"));
  r = kiln_cli("train " + dir.file("c.toml") + " --out " + dir.file("run3"));
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("needs image samples [C, H, W], and data.path gives [1]"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace kiln::test
