// ONNX's own backend node tests (Debian's libonnx-testdata, onnx 1.12: a test
// suite kiln did not write) run through load_onnx + Session. A node test is
// relevant when every op of its model is in exporter::supported_ops() and every
// graph input and output has a dtype kiln has; each relevant test's outputs
// must match the expected ones as ONNX's backend tests compare them
// (numpy.testing.assert_allclose with rtol 1e-3, atol 1e-5, NaNs equal; exact
// for integer and bool outputs). The test prints
//   node tests: P of R relevant passed (N in the suite)
// and every failure with its reason, and fails when P drops below the floor
// checked in at tests/export/onnx_node_tests_floor.txt: CI's regression guard.
// Raise the floor when kernels are fixed.
#include <gtest/gtest.h>
#include <onnx/onnx_pb.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include "kiln/export/runtime.h"
#include "kiln/ops/factory.h"
#include "support/test_util.h"

namespace kiln::test {
namespace {

namespace fs = std::filesystem;

constexpr double kRtol = 1e-3, kAtol = 1e-5;
const char* const kSuite = "/usr/share/libonnx-testdata/data/node";

bool kiln_dtype(int32_t t) {
  using P = onnx::TensorProto;
  return t == P::FLOAT || t == P::DOUBLE || t == P::FLOAT16 || t == P::BFLOAT16 || t == P::INT64 || t == P::INT32 ||
         t == P::UINT8 || t == P::BOOL;
}

// Why `model` is not relevant ("" when it is): an op without a kernel, or a
// graph input or output of a dtype (or kind) kiln lacks.
std::string irrelevance(const onnx::ModelProto& model, const std::set<std::string>& supported) {
  for (const auto& n : model.graph().node())
    if (!supported.count(n.op_type()) || !(n.domain().empty() || n.domain() == "ai.onnx"))
      return "op " + n.op_type();
  for (const auto* list : {&model.graph().input(), &model.graph().output()})
    for (const auto& v : *list)
      if (!v.type().has_tensor_type() || !kiln_dtype(v.type().tensor_type().elem_type())) return "dtype";
  return "";
}

// "" when `got` matches `want` as ONNX's backend tests compare, else why not.
std::string compare(const Tensor& got, const Tensor& want) {
  if (got.dtype() != want.dtype())
    return "dtype " + std::string(dtype_name(got.dtype())) + ", expected " + std::string(dtype_name(want.dtype()));
  if (got.sizes() != want.sizes()) return "shape " + got.shape_string() + ", expected " + want.shape_string();
  const std::vector<double> g = to_doubles(got), w = to_doubles(want);
  const bool exact = !want.is_floating_point();
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(w[i]) && std::isnan(g[i])) continue;
    if (std::isinf(w[i]) && g[i] == w[i]) continue;
    const double d = std::abs(g[i] - w[i]);
    if (exact ? d != 0 : !(d <= kAtol + kRtol * std::abs(w[i])))
      return "element " + std::to_string(i) + " is " + std::to_string(g[i]) + ", expected " + std::to_string(w[i]);
  }
  return "";
}

std::vector<fs::path> sorted_files(const fs::path& dir, const std::string& prefix) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path());
  std::sort(out.begin(), out.end(), [](const fs::path& a, const fs::path& b) {
    // input_10.pb after input_9.pb.
    const auto num = [](const fs::path& p) {
      const std::string s = p.stem().string();
      return std::stoi(s.substr(s.rfind('_') + 1));
    };
    return num(a) < num(b);
  });
  return out;
}

// One TensorProto file as a tensor. ONNX 1.12 stores bfloat16 test data as
// UINT16 bit patterns; where the model says the value is BFLOAT16, the bits
// are read as bfloat16 (the file rewritten with that element type).
Tensor read_test_tensor(const fs::path& file, int32_t model_type, const TempDir& tmp) {
  onnx::TensorProto p;
  std::ifstream f(file, std::ios::binary);
  if (model_type == onnx::TensorProto::BFLOAT16 && p.ParseFromIstream(&f) &&
      p.data_type() == onnx::TensorProto::UINT16) {
    p.set_data_type(onnx::TensorProto::BFLOAT16);
    const std::string out = tmp.file("bf16.pb");
    std::ofstream o(out, std::ios::binary | std::ios::trunc);
    p.SerializeToOstream(&o);
    o.close();
    return exporter::load_onnx_tensor(out);
  }
  return exporter::load_onnx_tensor(file.string());
}

int32_t elem_type(const google::protobuf::RepeatedPtrField<onnx::ValueInfoProto>& values, size_t i) {
  return i < static_cast<size_t>(values.size()) ? values[static_cast<int>(i)].type().tensor_type().elem_type() : 0;
}

// Runs one node test; "" when every data set's outputs match.
std::string run_node_test(const fs::path& dir, const onnx::ModelProto& model) {
  const TempDir tmp;
  try {
    const exporter::Session session(exporter::load_onnx((dir / "model.onnx").string()));
    int sets = 0;
    for (const auto& e : fs::directory_iterator(dir)) {
      if (!e.is_directory() || e.path().filename().string().rfind("test_data_set_", 0) != 0) continue;
      ++sets;
      std::vector<Tensor> inputs, want;
      for (const auto& p : sorted_files(e.path(), "input_"))
        inputs.push_back(read_test_tensor(p, elem_type(model.graph().input(), inputs.size()), tmp));
      for (const auto& p : sorted_files(e.path(), "output_"))
        want.push_back(read_test_tensor(p, elem_type(model.graph().output(), want.size()), tmp));
      const std::vector<Tensor> got = session.run(inputs);
      if (got.size() != want.size())
        return std::to_string(got.size()) + " outputs, expected " + std::to_string(want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        const std::string why = compare(got[i].contiguous(), want[i]);
        if (!why.empty()) return e.path().filename().string() + " output " + std::to_string(i) + ": " + why;
      }
    }
    return sets > 0 ? "" : "no test_data_set_*";
  } catch (const std::exception& ex) {
    return ex.what();
  }
}

int64_t checked_in_floor() {
  std::ifstream f(std::string(KILN_SOURCE_DIR) + "/tests/export/onnx_node_tests_floor.txt");
  std::string line;
  while (std::getline(f, line))
    if (!line.empty() && line[0] != '#') return std::stoll(line);
  return -1;
}

TEST(OnnxNodeTests, TheComparisonRejectsWhatDiffers) {
  const Tensor a = tensor<float>({1.0f, 2.0f, 3.0f}, {3});
  EXPECT_EQ(compare(a, a), "");
  EXPECT_EQ(compare(a.add(1e-6), a), "");  // within atol
  EXPECT_NE(compare(tensor<float>({1.0f, 2.0f, 3.01f}, {3}), a), "");
  EXPECT_NE(compare(a.reshape({1, 3}), a), "");
  EXPECT_NE(compare(a.to(kFloat64), a), "");
  EXPECT_NE(compare(tensor<int64_t>({1, 2}, {2}), tensor<int64_t>({1, 3}, {2})), "");
}

TEST(OnnxNodeTests, RelevantNodeTestsPassAtLeastTheCheckedInFloor) {
  if (!fs::is_directory(kSuite)) GTEST_SKIP() << kSuite << " is missing: install libonnx-testdata (scripts/setup.sh)";
  const auto ops = exporter::supported_ops();
  const std::set<std::string> supported(ops.begin(), ops.end());
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(kSuite))
    if (e.is_directory() && fs::exists(e.path() / "model.onnx")) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end());
  int64_t relevant = 0, passed = 0;
  std::vector<std::string> failures;
  for (const fs::path& dir : dirs) {
    onnx::ModelProto model;
    std::ifstream f(dir / "model.onnx", std::ios::binary);
    ASSERT_TRUE(model.ParseFromIstream(&f)) << dir;
    if (!irrelevance(model, supported).empty()) continue;
    ++relevant;
    const std::string why = run_node_test(dir, model);
    if (why.empty())
      ++passed;
    else
      failures.push_back(dir.filename().string() + ": " + why.substr(0, 400));
  }
  std::printf("node tests: %lld of %lld relevant passed (%zu in the suite; %zu op types supported; rtol %g, atol %g)\n",
              static_cast<long long>(passed), static_cast<long long>(relevant), dirs.size(), ops.size(), kRtol, kAtol);
  for (const std::string& f : failures) std::printf("  FAIL %s\n", f.c_str());
  const int64_t floor = checked_in_floor();
  ASSERT_GT(floor, 0) << "tests/export/onnx_node_tests_floor.txt is missing or has no number";
  EXPECT_GE(passed, floor) << "fewer relevant ONNX node tests pass than the checked-in floor";
  EXPECT_GT(relevant, 0);
}

}  // namespace
}  // namespace kiln::test
