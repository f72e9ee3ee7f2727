// Bring-your-own data: CSV tables (include/kiln/data/csv.h), PNG/JPEG images
// and ImageFolder (include/kiln/data/image.h), on small files written here.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <sstream>

#include "kiln/core/allocator.h"
#include "kiln/ops/factory.h"
#include "kiln/data/csv.h"
#include "kiln/data/image.h"
#include "support/byod_bytes.h"
#include "support/idx_bytes.h"
#include "support/test_util.h"

using namespace kiln;
using namespace kiln::data;
namespace fs = std::filesystem;

namespace {

std::span<const uint8_t> bytes_of(const std::string& s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

}  // namespace

// ---------------------------------------------------------------- CSV

TEST(Csv, HeaderNamedLabelsQuotesAndLineEnds) {
  test::TempDir dir;
  const std::string p = dir.file("iris.csv");
  test::write_bytes(p,
                    "sepal length, \"petal, width\",species\r\n"
                    "5.1,0.2,setosa\r\n"
                    "\r\n"
                    "  6.3 , \"1.8\" , \"virginica\"\n"
                    "+5.7,1.3e0,versicolor\n"
                    "4.9,.1,\"set\"\"osa\"\n");
  const CsvDataset ds({.path = p, .label_name = "species"});
  ASSERT_EQ(ds.size(), 4);
  EXPECT_EQ(ds.feature_names(), (std::vector<std::string>{"sepal length", "petal, width"}));
  EXPECT_EQ(ds.label_column(), "species");
  // Names numbered in sorted order, as ImageFolder's classes.
  EXPECT_EQ(ds.class_names(), (std::vector<std::string>{"set\"osa", "setosa", "versicolor", "virginica"}));
  EXPECT_EQ(ds.num_classes(), 4);
  EXPECT_EQ(test::to_doubles(ds.features()), (std::vector<double>{5.1f, 0.2f, 6.3f, 1.8f, 5.7f, 1.3f, 4.9f, 0.1f}));
  EXPECT_EQ(test::to_doubles(ds.labels()), (std::vector<double>{1, 3, 2, 0}));
  EXPECT_EQ(ds.features().dtype(), kFloat32);
  // A validation file numbered as the training file; a name it never saw is an error on its line.
  const std::string v = dir.file("val.csv");
  test::write_bytes(v, "a,b,species\n1,2,virginica\n3,4,setosa\n5,6,daisy\n");
  const std::string m = test::error_message<FormatError>(
      [&] { CsvDataset({.path = v, .label_name = "species", .class_names = ds.class_names()}); });
  EXPECT_NE(m.find(v + "':4: label \"daisy\" is not one of the 4 class names"), std::string::npos) << m;
}

TEST(Csv, NoHeaderIntegerLabelsByIndex) {
  test::TempDir dir;
  const std::string p = dir.file("t.csv");
  test::write_bytes(p, "2,0.5,1.5\n0,-1,1e-3\n7,3,4");
  const CsvDataset last({.path = p});  // default: the last column
  EXPECT_EQ(last.size(), 3);
  EXPECT_EQ(last.feature_names(), (std::vector<std::string>{"column 1", "column 2"}));
  // Not every label is an integer, so they are names.
  EXPECT_EQ(last.class_names(), (std::vector<std::string>{"1.5", "1e-3", "4"}));
  const CsvDataset first({.path = p, .label_index = 0});
  EXPECT_EQ(test::to_doubles(first.labels()), (std::vector<double>{2, 0, 7}));
  EXPECT_EQ(first.num_classes(), 8);
  EXPECT_EQ(test::to_doubles(first.features()), (std::vector<double>{0.5, 1.5, -1, 1e-3f, 3, 4}));
  // A header is detected where a row of names sits above a row of numbers.
  test::write_bytes(p, "x;y;label\n1;2;0\n");
  const CsvDataset semi({.path = p, .delimiter = ';'});
  EXPECT_EQ(semi.size(), 1);
  EXPECT_EQ(semi.feature_names(), (std::vector<std::string>{"x", "y"}));
}

TEST(Csv, ErrorsNameTheLineAndColumn) {
  test::TempDir dir;
  const std::string p = dir.file("bad.csv");
  auto msg = [&](const std::string& text, CsvOptions o = {}) {
    test::write_bytes(p, text);
    o.path = p;
    return test::error_message<FormatError>([&] { CsvDataset{o}; });
  };
  EXPECT_NE(msg("a,b,c\n1,2,0\n3,4\n").find(p + "':3: expected 3 fields (as in the first row), got 2"), std::string::npos);
  EXPECT_NE(msg("a,b,c\n1,2,0\n3,x4,1\n").find(p + "':3: column 2 ('b'): expected a number, got \"x4\""),
            std::string::npos);
  EXPECT_NE(msg("a,b,c\n1,nan,0\n").find("':2: column 2 ('b'): \"nan\" is not a finite float32"), std::string::npos);
  EXPECT_NE(msg("a,b,c\n1,1e39,0\n").find("is not a finite float32"), std::string::npos);
  EXPECT_NE(msg("a,b,c\n1,\"2,0\n").find(p + "':2: a quoted field is never closed"), std::string::npos);
  EXPECT_NE(msg("a,b,c\n1,\"2\"x,0\n").find("unexpected 'x' after the closing quote"), std::string::npos);
  EXPECT_NE(msg("1,2,-1\n3,4,0\n").find(p + "':1: label -1 is negative"), std::string::npos);
  EXPECT_NE(msg("a,b,c\n1,2,\n").find("':2: column 3 ('c'): the label is empty"), std::string::npos);
  EXPECT_NE(msg("").find("empty CSV file"), std::string::npos);
  EXPECT_NE(msg("a,b,c\n").find("no data rows after the header"), std::string::npos);
  EXPECT_NE(msg("1\n2\n").find("expected at least 2 columns"), std::string::npos);
  EXPECT_NE(msg("a,b\n1,2\n", {.label_name = "y"}).find("no column named 'y' for the labels (the header has: \"a\", \"b\")"),
            std::string::npos);
  EXPECT_NE(msg("1,2\n", {.label_index = 5}).find("label column index 5 is outside the file's 2 columns"),
            std::string::npos);
}

// ---------------------------------------------------------------- images

TEST(Image, PngDecodesExactlyWithPilsChannelConversions) {
  // 3x2 RGBA: alpha is dropped, not composited (PIL's convert("RGB")).
  const std::vector<uint8_t> rgba = {255, 0, 0, 0,    0, 255, 0, 128, 0, 0, 255, 255,
                                     10, 20, 30, 255, 40, 50, 60, 7,  70, 80, 90, 1};
  const std::string png = test::png_bytes(3, 2, 4, rgba);
  EXPECT_EQ(probe_image(bytes_of(png)).channels, 3);
  const Tensor rgb = decode_image(bytes_of(png));
  ASSERT_EQ(rgb.shape_string(), "[3, 2, 3]");
  EXPECT_EQ(test::to_doubles(rgb), (std::vector<double>{255, 0, 0, 10, 40, 70, 0, 255, 0, 20, 50, 80, 0, 0, 255, 30, 60, 90}));
  // RGB to grayscale by ITU-R 601-2 luma in PIL's fixed point.
  std::vector<double> luma;
  for (size_t i = 0; i < rgba.size(); i += 4)
    luma.push_back(static_cast<double>((19595u * rgba[i] + 38470u * rgba[i + 1] + 7471u * rgba[i + 2] + 0x8000u) >> 16));
  EXPECT_EQ(test::to_doubles(decode_image(bytes_of(png), "x", 1)), luma);
  // Gray (+alpha) to RGB repeats the gray value.
  const std::string ga = test::png_bytes(2, 1, 2, {9, 0, 200, 255});
  EXPECT_EQ(probe_image(bytes_of(ga)).channels, 1);
  EXPECT_EQ(test::to_doubles(decode_image(bytes_of(ga))), (std::vector<double>{9, 200}));
  EXPECT_EQ(test::to_doubles(decode_image(bytes_of(ga), "x", 3)), (std::vector<double>{9, 200, 9, 200, 9, 200}));
  EXPECT_EQ(decode_image(bytes_of(ga)).dtype(), kUInt8);
}

TEST(Image, JpegDecodesWhatLibjpegWrote) {
  // A flat image survives JPEG's DCT exactly; a gradient within its quantisation.
  const std::string gray = test::jpeg_bytes(16, 8, 1, std::vector<uint8_t>(16 * 8, 77), 100);
  const ImageInfo info = probe_image(bytes_of(gray));
  EXPECT_EQ(info.channels, 1);
  EXPECT_EQ(info.height, 8);
  EXPECT_EQ(info.width, 16);
  const Tensor g = decode_image(bytes_of(gray));
  EXPECT_EQ(g.shape_string(), "[1, 8, 16]");
  for (double v : test::to_doubles(g)) ASSERT_EQ(v, 77);
  std::vector<uint8_t> px(8 * 8 * 3);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(i % 3 == 0 ? 200 : i % 3 == 1 ? 100 : 30);
  const Tensor rgb = decode_image(bytes_of(test::jpeg_bytes(8, 8, 3, px, 100)));
  EXPECT_EQ(rgb.shape_string(), "[3, 8, 8]");
  const std::vector<double> v = test::to_doubles(rgb);
  // YCbCr round trip at quality 100: each channel within 2 of the flat colour.
  for (size_t i = 0; i < v.size(); ++i) ASSERT_NEAR(v[i], i < 64 ? 200 : i < 128 ? 100 : 30, 2) << i;
}

TEST(Image, ResizeBilinearMatchesTorchInterpolate) {
  const std::string& problem = test::python_problem(true);
  if (!problem.empty()) GTEST_SKIP() << problem;
  std::vector<uint8_t> px(2 * 3 * 5);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>((i * 37 + 11) % 256);
  Tensor img = empty({2, 3, 5}, TensorOptions().dtype(kUInt8));
  std::memcpy(img.data_ptr(), px.data(), px.size());
  std::string list;
  for (uint8_t b : px) list += std::to_string(b) + ",";
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{7, 4}, {2, 9}, {1, 1}, {3, 5}, {6, 10}};
  std::string py = "import torch\nx = torch.tensor([" + list + "], dtype=torch.float64).reshape(1, 2, 3, 5)\n";
  for (auto [h, w] : sizes)
    py += "y = torch.nn.functional.interpolate(x, size=(" + std::to_string(h) + ", " + std::to_string(w) +
          "), mode='bilinear', align_corners=False)\nprint(' '.join(str(int(v)) for v in y.round().flatten().tolist()))\n";
  std::string out;
  ASSERT_EQ(test::run_command(test::python() + " -c " + test::shell_quote(py), out), 0) << out;
  std::istringstream lines(out);
  for (auto [h, w] : sizes) {
    SCOPED_TRACE(std::to_string(h) + "x" + std::to_string(w));
    std::string line;
    ASSERT_TRUE(std::getline(lines, line)) << out;
    std::vector<double> want;
    std::istringstream in(line);
    for (double v; in >> v;) want.push_back(v);
    EXPECT_EQ(test::to_doubles(resize_bilinear(img, h, w)), want);
  }
}

TEST(ImageFolder, ClassesSortedSamplesSortedOthersSkipped) {
  test::TempDir dir;
  const fs::path root = dir.path() / "train";
  fs::create_directories(root / "dog" / "more");
  fs::create_directories(root / "cat");
  test::write_bytes((root / "notes.txt").string(), "not a class");
  test::write_bytes((root / "dog" / "b.PNG").string(), test::png_bytes(2, 2, 1, {0, 51, 102, 255}));
  test::write_bytes((root / "dog" / "more" / "a.jpeg").string(), test::jpeg_bytes(2, 2, 1, {255, 255, 255, 255}, 100));
  test::write_bytes((root / "dog" / "readme.md").string(), "skipped");
  test::write_bytes((root / "cat" / "z.png").string(), test::png_bytes(2, 2, 3, std::vector<uint8_t>(12, 10)));
  const int64_t before = memory::stats()[MemoryCategory::Data].live_bytes;
  const ImageFolder ds({.root = root.string()});
  EXPECT_EQ(ds.classes(), (std::vector<std::string>{"cat", "dog"}));
  ASSERT_EQ(ds.size(), 3);
  EXPECT_EQ(fs::path(ds.paths()[0]).filename(), "z.png");
  EXPECT_EQ(fs::path(ds.paths()[1]).filename(), "b.PNG");
  EXPECT_EQ(fs::path(ds.paths()[2]).filename(), "a.jpeg");
  EXPECT_EQ(test::to_doubles(ds.labels()), (std::vector<double>{0, 1, 1}));
  EXPECT_EQ(ds.images().shape_string(), "[3, 3, 2, 2]") << "one colour image makes every image RGB";
  EXPECT_GE(memory::stats()[MemoryCategory::Data].live_bytes - before, 3 * 3 * 2 * 2);
  const Example e = ds.get(1);
  EXPECT_EQ(e.data.shape_string(), "[3, 2, 2]");
  EXPECT_EQ(test::to_doubles(e.data.select(0, 2)),
            (std::vector<double>{0, 51 / 255.0f, 102 / 255.0f, 1}));
  EXPECT_EQ(e.target.item<int64_t>(), 1);
  // Grayscale on request; a validation folder numbered as the training one.
  const ImageFolder gray({.root = root.string(), .channels = 1});
  EXPECT_EQ(gray.images().shape_string(), "[3, 1, 2, 2]");
  const fs::path val = dir.path() / "val";
  fs::create_directories(val / "dog");
  test::write_bytes((val / "dog" / "x.png").string(), test::png_bytes(2, 2, 1, {1, 2, 3, 4}));
  const ImageFolder v({.root = val.string(), .classes = ds.classes()});
  EXPECT_EQ(v.size(), 1);
  EXPECT_EQ(v.labels().data_ptr<int64_t>()[0], 1);
  fs::create_directories(val / "cow");
  const std::string m = test::error_message<FormatError>([&] { ImageFolder({.root = val.string(), .classes = ds.classes()}); });
  EXPECT_NE(m.find("cow' is not one of the 2 classes of the training data"), std::string::npos) << m;
}

TEST(ImageFolder, SizesMustAgreeUnlessResized) {
  test::TempDir dir;
  const fs::path root = dir.path();
  fs::create_directories(root / "a");
  test::write_bytes((root / "a" / "1.png").string(), test::png_bytes(2, 2, 1, {0, 0, 0, 0}));
  test::write_bytes((root / "a" / "2.png").string(), test::png_bytes(4, 3, 1, std::vector<uint8_t>(12, 100)));
  const std::string m = test::error_message<FormatError>([&] { ImageFolder({.root = root.string()}); });
  EXPECT_NE(m.find("2.png' is 4x3 but '"), std::string::npos) << m;
  EXPECT_NE(m.find("1.png' is 2x2"), std::string::npos) << m;
  EXPECT_NE(m.find("data.resize"), std::string::npos) << m;
  const ImageFolder r({.root = root.string(), .size = {5, 6}});
  EXPECT_EQ(r.images().shape_string(), "[2, 1, 5, 6]");
  for (double x : test::to_doubles(r.images().select(0, 1))) ASSERT_EQ(x, 100) << "a flat image stays flat";
  const ImageFolder s({.root = root.string(), .size = {3}});
  EXPECT_EQ(s.images().shape_string(), "[2, 1, 3, 3]");
  // An empty class folder is an error, as in torchvision.
  fs::create_directories(root / "b");
  const std::string e = test::error_message<FormatError>([&] { ImageFolder({.root = root.string(), .size = {3}}); });
  EXPECT_NE(e.find("holds no .png, .jpg or .jpeg files"), std::string::npos) << e;
}
