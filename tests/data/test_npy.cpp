// .npy files (include/kiln/data/npy.h): bytes written by hand and files numpy
// wrote, every supported dtype, Fortran order, big endian, format 2.0, and the
// arrays dataset built on them.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "kiln/core/allocator.h"
#include "kiln/ops/factory.h"
#include "kiln/data/arrays.h"
#include "kiln/data/npy.h"
#include "kiln/io/safetensors.h"
#include "support/byod_bytes.h"
#include "support/idx_bytes.h"
#include "support/test_util.h"

using namespace kiln;
using namespace kiln::data;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// One file per case, written by numpy; each output line is
// "name ndim d0 .. dn-1 v0 v1 ..." with the values in C order.
constexpr const char* kNumpyCases = R"PY(
import sys, numpy as np
from numpy.lib import format as fmt
d = sys.argv[1]
cases = {
    'f4': np.arange(6, dtype='<f4').reshape(2, 3) / 4,
    'f8': np.array([[1e-300, -2.5], [np.pi, 7.0]], dtype='<f8'),
    'f2': np.array([0.5, -1.25, 65504.0], dtype='<f2'),
    'f4be': np.array([1.5, -2.0, 3.25], dtype='>f4'),
    'i1': np.array([-128, -1, 0, 127], dtype='i1'),
    'i2be': np.array([-300, 2, 32767], dtype='>i2'),
    'i4': np.array([[-2**31, 5]], dtype='<i4'),
    'i8': np.array([-2**53, 2**53], dtype='<i8'),
    'u1': np.array([0, 200, 255], dtype='u1'),
    'u2': np.array([65535, 1], dtype='<u2'),
    'u4': np.array([4294967295, 0], dtype='<u4'),
    'u8': np.array([2**53, 3], dtype='<u8'),
    'b1': np.array([True, False, True]),
    'fortran': np.asfortranarray(np.arange(12, dtype='<f4').reshape(3, 4)),
    'fortran3d': np.asfortranarray(np.arange(24, dtype='>f8').reshape(2, 3, 4)),
    'scalar': np.array(3.5, dtype='<f8'),
    'empty': np.zeros((0, 5), dtype='<f4'),
}
for name, a in cases.items():
    np.save(f'{d}/{name}.npy', a)
with open(f'{d}/v2.npy', 'wb') as f:
    fmt.write_array(f, cases['f4'], version=(2, 0))
cases['v2'] = cases['f4']
for name, a in cases.items():
    vals = ' '.join(repr(float(x)) for x in np.ascontiguousarray(a).ravel())
    print(name, a.ndim, *a.shape, vals)
)PY";

struct NumpyCase {
  std::vector<int64_t> shape;
  std::vector<double> values;
};

std::map<std::string, NumpyCase> numpy_files(const std::string& dir) {
  const std::string script = dir + "/cases.py";
  test::write_bytes(script, kNumpyCases);
  std::string out;
  const int rc = test::run_command(test::python() + " " + test::shell_quote(script) + " " + test::shell_quote(dir), out);
  if (rc != 0) throw std::runtime_error("numpy script failed: " + out);
  std::map<std::string, NumpyCase> cases;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream ls(line);
    std::string name;
    int64_t ndim = 0;
    ls >> name >> ndim;
    NumpyCase c;
    c.shape.resize(static_cast<size_t>(ndim));
    for (auto& d : c.shape) ls >> d;
    for (double v; ls >> v;) c.values.push_back(v);
    cases[name] = c;
  }
  return cases;
}

}  // namespace

TEST(Npy, HandWrittenBytesMatchNumpysFileAndRead) {
  const std::string& problem = test::python_problem(false);
  if (!problem.empty()) GTEST_SKIP() << problem;
  test::TempDir dir;
  const auto cases = numpy_files(dir.path().string());
  // np.save's exact bytes: the writer the other tests (and the fuzz seeds) use speaks numpy's format.
  std::vector<float> f4 = {0, 0.25f, 0.5f, 0.75f, 1, 1.25f};
  EXPECT_EQ(test::npy_bytes("<f4", {2, 3}, test::raw_bytes(f4)), slurp(dir.file("f4.npy")));
  const std::string v2 = test::npy_bytes("<f4", {2, 3}, test::raw_bytes(f4), false, 2);
  EXPECT_EQ(v2, slurp(dir.file("v2.npy")));
  const Tensor t = parse_npy({reinterpret_cast<const uint8_t*>(v2.data()), v2.size()});
  EXPECT_EQ(t.dtype(), kFloat32);
  EXPECT_EQ(t.shape_string(), "[2, 3]");
  EXPECT_EQ(test::to_doubles(t), (std::vector<double>{0, 0.25, 0.5, 0.75, 1, 1.25}));
}

TEST(Npy, EveryDtypeNumpyWritesReadsAsNpLoadGivesIt) {
  const std::string& problem = test::python_problem(false);
  if (!problem.empty()) GTEST_SKIP() << problem;
  test::TempDir dir;
  const auto cases = numpy_files(dir.path().string());
  const std::map<std::string, DType> dtypes = {
      {"f4", kFloat32},   {"f8", kFloat64},    {"f2", kFloat16},      {"f4be", kFloat32}, {"i1", kInt64},
      {"i2be", kInt64},   {"i4", kInt32},      {"i8", kInt64},        {"u1", kUInt8},     {"u2", kInt64},
      {"u4", kInt64},     {"u8", kInt64},      {"b1", kBool},         {"fortran", kFloat32},
      {"fortran3d", kFloat64}, {"scalar", kFloat64}, {"empty", kFloat32}, {"v2", kFloat32}};
  ASSERT_EQ(cases.size(), dtypes.size());
  for (const auto& [name, c] : cases) {
    SCOPED_TRACE(name);
    const int64_t before = memory::stats()[MemoryCategory::Data].live_bytes;
    const Tensor t = read_npy(dir.file(name + ".npy"));
    EXPECT_EQ(t.dtype(), dtypes.at(name));
    EXPECT_EQ(t.shape_string(), shape_str(c.shape));
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_EQ(test::to_doubles(t), c.values);
    if (t.numel() > 0) {
      EXPECT_GE(memory::stats()[MemoryCategory::Data].live_bytes - before, t.numel() * int64_t(t.element_size()))
          << "the array is charged to MemoryCategory::Data";
    }
  }
}

TEST(Npy, ArrayDatasetFromTwoNpyFilesAndFromSafetensors) {
  test::TempDir dir;
  const std::vector<uint8_t> pixels = {0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110};
  test::write_bytes(dir.file("x.npy"), test::npy_bytes("|u1", {3, 2, 2}, test::raw_bytes(pixels)));
  test::write_bytes(dir.file("y.npy"), test::npy_bytes("<f8", {3}, test::raw_bytes(std::vector<double>{2, 0, 4})));
  const ArrayDataset ds = ArrayDataset::from_npy(dir.file("x.npy"), dir.file("y.npy"));
  ASSERT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.num_classes(), 5);
  const Example e = ds.get(1);
  EXPECT_EQ(e.data.dtype(), kFloat32);
  EXPECT_EQ(test::to_doubles(e.data), (std::vector<double>{40, 50, 60, 70})) << "values as stored, not rescaled";
  EXPECT_EQ(e.target.dtype(), kInt64);
  EXPECT_EQ(e.target.item<int64_t>(), 0);
  EXPECT_THROW(ds.get(3), IndexError);

  const std::string st = dir.file("train.safetensors");
  io::save_safetensors(st, io::NamedTensors{{"x", tensor<float>({1, 2, 3, 4, 5, 6}, {3, 2})},
                                            {"y", tensor<int64_t>({1, 0, 1}, {3, 1})}});
  const ArrayDataset s = ArrayDataset::from_safetensors(st, "x", "y");
  EXPECT_EQ(s.size(), 3);
  EXPECT_EQ(s.num_classes(), 2);
  EXPECT_EQ(test::to_doubles(s.get(2).data), (std::vector<double>{5, 6}));
  EXPECT_EQ(s.get(2).target.item<int64_t>(), 1);
  const std::string missing = test::error_message<FormatError>([&] { ArrayDataset::from_safetensors(st); });
  EXPECT_NE(missing.find("no tensor named 'features'"), std::string::npos) << missing;
  EXPECT_NE(missing.find("x, y"), std::string::npos) << missing;
}

TEST(Npy, ArrayDatasetRefusesLabelsThatAreNotClassIndices) {
  const Tensor x = zeros({3, 2});
  auto msg = [&](const Tensor& y) { return test::error_message<FormatError>([&] { ArrayDataset(x, y, "x", "y.npy"); }); };
  EXPECT_NE(msg(tensor<double>({0, 1.5, 2})).find("label 1 is 1.5"), std::string::npos);
  EXPECT_NE(msg(tensor<int64_t>({0, -1, 2})).find("label 1 is -1"), std::string::npos);
  EXPECT_NE(msg(tensor<int64_t>({0, 1})).find("'x' has 3 samples but 'y.npy' has 2 labels"), std::string::npos);
  EXPECT_NE(msg(tensor<int64_t>({0, 1, 2, 3, 4, 5}, {3, 2})).find("expected labels of shape [N]"), std::string::npos);
  Tensor nan_x = zeros({3, 2});
  nan_x.data_ptr<float>()[3] = std::nanf("");
  const std::string m = test::error_message<FormatError>([&] { ArrayDataset(nan_x, tensor<int64_t>({0, 1, 2})); });
  EXPECT_NE(m.find("sample 1 has a non-finite feature"), std::string::npos) << m;
}
