// The generic op test (DESIGN.md §4, §9): walks kiln::ops::op_registry() and,
// for every OpSpec x dtype, runs each sample in kiln and compares it with the
// sample's torch expression evaluated by the PyTorch oracle; then checks
// every error case throws the named kiln::Error class with the named text.
// Tolerance: spec.tolerance(dtype) if set, else default_tolerance of each
// result's dtype (so an integer op returning floats is not held to 0).
//
// Backward ("<op>_<dtype>_grad", for specs marked differentiable): every
// floating sample with grad_inputs is run with those inputs made leaves that
// require grad (same layout), and kiln::autograd::grad of its floating outputs
// for deterministic random grad_outputs is compared with torch.autograd.grad of
// the sample's expression for the same grad_outputs; then a float64 gradcheck
// (fast mode when the differentiated inputs or the outputs hold more than 64
// elements) checks kiln's gradient against central differences.
//
// All samples of this binary (forward and gradient cases) go to the oracle in
// ONE batch, built lazily by the first test that needs it. Test names come
// from the samples alone (no python), so --gtest_list_tests stays fast.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <set>

#include "kiln/kiln.h"
#include "ops/specs/op_spec.h"
#include "ops/registry_grad.h"
#include "support/compare.h"
#include "support/oracle.h"

using namespace kiln;
using kiln::ops::OpSample;
using kiln::ops::OpSpec;

namespace {

std::string sanitize(const std::string& s) {
  std::string out;
  for (char c : s) out += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return out.empty() ? "_" : out;
}

struct ForwardParam {
  size_t op;
  DType dtype;
  std::string name;  // "add_float32"
};

struct ErrorParam {
  size_t op;
  std::string name;  // "add"
};

// gtest prints parameters of failed tests; the name says it all.
[[maybe_unused]] void PrintTo(const ForwardParam& p, std::ostream* os) { *os << p.name; }
[[maybe_unused]] void PrintTo(const ErrorParam& p, std::ostream* os) { *os << p.name; }

// gtest names must be unique; overloads registered under one op name get _2, _3...
std::string unique_name(std::set<std::string>& used, const std::string& base) {
  std::string n = base;
  for (int k = 2; !used.insert(n).second; ++k) n = base + "_" + std::to_string(k);
  return n;
}

using Key = std::pair<size_t, DType>;

// Every sample of the registry, built once per process without python (test names need them).
struct RegistrySamples {
  std::map<Key, std::vector<OpSample>> samples;
  std::map<Key, std::string> errors;  // samples() itself threw
};

const RegistrySamples& registry_samples() {
  static const RegistrySamples* all = [] {
    auto* r = new RegistrySamples();
    const auto& reg = ops::op_registry();
    for (size_t i = 0; i < reg.size(); ++i) {
      for (DType dt : reg[i].dtypes) {
        try {
          r->samples[{i, dt}] = reg[i].samples ? reg[i].samples(dt) : std::vector<OpSample>{};
        } catch (const std::exception& e) {
          r->errors[{i, dt}] = e.what();
        }
      }
    }
    return r;
  }();
  return *all;
}

bool has_grad_samples(const std::vector<OpSample>& samples) {
  return std::any_of(samples.begin(), samples.end(), [](const OpSample& s) { return !s.grad_inputs.empty(); });
}

// The backward of a spec is checked at its floating dtypes whose samples list grad inputs.
bool checks_backward(const OpSpec& spec, DType dt) {
  if (!spec.differentiable || !is_floating_point(dt)) return false;
  const auto& all = registry_samples().samples;
  const auto it = all.find({static_cast<size_t>(&spec - ops::op_registry().data()), dt});
  return it != all.end() && has_grad_samples(it->second);
}

// forward_params(true): one "<op>_<dtype>_grad" per (differentiable spec, dtype) with grad samples.
std::vector<ForwardParam> forward_params(bool grad = false) {
  std::vector<ForwardParam> out;
  std::set<std::string> used;
  const auto& reg = ops::op_registry();
  for (size_t i = 0; i < reg.size(); ++i) {
    for (DType dt : reg[i].dtypes) {
      const std::string name = unique_name(used, sanitize(reg[i].name) + "_" + std::string(dtype_name(dt)));
      if (!grad) out.push_back({i, dt, name});
      else if (checks_backward(reg[i], dt)) out.push_back({i, dt, name + "_grad"});
    }
  }
  return out;
}

std::vector<ErrorParam> error_params() {
  std::vector<ErrorParam> out;
  std::set<std::string> used;
  const auto& reg = ops::op_registry();
  for (size_t i = 0; i < reg.size(); ++i) {
    if (reg[i].errors && !reg[i].errors().empty()) out.push_back({i, unique_name(used, sanitize(reg[i].name))});
  }
  return out;
}

// Every sample's oracle cases (forward, and gradient where checked); one python run per process.
struct RegistryBatch {
  std::map<Key, std::vector<size_t>> cases;
  std::map<Key, std::vector<test::GradCase>> grad_cases;  // per sample; default (no case) without grad_inputs
  test::OracleBatch oracle;
  std::string oracle_error;
};

const RegistryBatch& registry_batch() {
  static RegistryBatch* batch = [] {
    auto* b = new RegistryBatch();
    const auto& reg = ops::op_registry();
    for (const auto& [key, samples] : registry_samples().samples) {
      const OpSpec& spec = reg[key.first];
      const std::string id = spec.name + "/" + std::string(dtype_name(key.second)) + "/";
      const bool grad = checks_backward(spec, key.second);
      for (const OpSample& s : samples) {
        b->cases[key].push_back(b->oracle.add(id + s.label, s.torch, s.inputs));
        if (!grad) continue;
        b->grad_cases[key].push_back(s.grad_inputs.empty() ? test::GradCase{}
                                                           : test::add_grad_case(b->oracle, id + s.label + "/grad", s));
      }
    }
    try {
      b->oracle.run();
    } catch (const std::exception& e) {
      b->oracle_error = e.what();
    }
    return b;
  }();
  return *batch;
}

bool is_error_class(const std::exception& e, const std::string& cls) {
  if (cls == "ShapeError") return dynamic_cast<const ShapeError*>(&e) != nullptr;
  if (cls == "DTypeError") return dynamic_cast<const DTypeError*>(&e) != nullptr;
  if (cls == "ValueError") return dynamic_cast<const ValueError*>(&e) != nullptr;
  if (cls == "IndexError") return dynamic_cast<const IndexError*>(&e) != nullptr;
  if (cls == "OutOfMemory") return dynamic_cast<const OutOfMemory*>(&e) != nullptr;
  if (cls == "FormatError") return dynamic_cast<const FormatError*>(&e) != nullptr;
  if (cls == "IOError") return dynamic_cast<const IOError*>(&e) != nullptr;
  if (cls == "Error") return dynamic_cast<const Error*>(&e) != nullptr;
  return false;
}

class OpRegistryForward : public ::testing::TestWithParam<ForwardParam> {};
class OpRegistryErrors : public ::testing::TestWithParam<ErrorParam> {};
class OpRegistryBackward : public ::testing::TestWithParam<ForwardParam> {};

}  // namespace

using test::describe_inputs;

TEST_P(OpRegistryForward, MatchesTorch) {
  const ForwardParam& p = GetParam();
  const OpSpec& spec = ops::op_registry()[p.op];
  const auto key = std::make_pair(p.op, p.dtype);
  if (auto it = registry_samples().errors.find(key); it != registry_samples().errors.end()) {
    FAIL() << spec.name << ": samples(" << dtype_name(p.dtype) << ") threw: " << it->second;
  }
  const RegistryBatch& b = registry_batch();
  ASSERT_TRUE(b.oracle_error.empty()) << b.oracle_error;
  const auto& samples = registry_samples().samples.at(key);
  ASSERT_FALSE(samples.empty()) << spec.name << " has no samples for " << dtype_name(p.dtype);
  for (size_t s = 0; s < samples.size(); ++s) {
    const OpSample& smp = samples[s];
    const test::OracleOutcome& want = b.oracle.outcome(b.cases.at(key)[s]);
    const std::string where = spec.name + " [" + smp.label + "] " + std::string(dtype_name(p.dtype)) + " (" +
                              describe_inputs(smp.inputs) + "), torch: " + smp.torch;
    std::vector<Tensor> got;
    try {
      got = smp.run(smp.inputs);
    } catch (const std::exception& e) {
      ADD_FAILURE() << where << "\n  kiln threw: " << e.what()
                    << (want.ok ? "" : "\n  torch raised too: " + want.error);
      continue;
    }
    if (!want.ok) {
      ADD_FAILURE() << where << "\n  torch raised: " << want.error << "\n  (kiln returned " << got.size()
                    << " outputs; fix the sample's torch expression or make it an error case)";
      continue;
    }
    if (got.size() != want.outputs.size()) {
      ADD_FAILURE() << where << "\n  kiln returned " << got.size() << " outputs, torch " << want.outputs.size();
      continue;
    }
    for (size_t k = 0; k < got.size(); ++k) {
      const bool number = want.is_number[k];
      // The spec's tolerance when it has one; else the default for the result's dtype (an int
      // op may return floats), for a Python number the dtype kiln computed it in.
      const DType result_dt = number && got[k].defined() ? got[k].dtype() : want.outputs[k].dtype();
      const ops::Tolerance tol = spec.tolerance ? spec.tolerance(p.dtype) : ops::default_tolerance(result_dt);
      const auto c = test::compare_tensors(got[k], want.outputs[k], tol.rtol, tol.atol, !number);
      if (!c.ok) {
        ADD_FAILURE() << where << "\n  output " << k << ": " << c.message;
      }
    }
  }
}

// Float64 gradcheck runs once per sample: in the float64 test, or in the float32 test of a
// spec without float64 (the float32 sample converted); other dtypes only compare with torch.
TEST_P(OpRegistryBackward, MatchesTorchAndGradcheck) {
  const ForwardParam& p = GetParam();
  const OpSpec& spec = ops::op_registry()[p.op];
  const RegistryBatch& b = registry_batch();
  ASSERT_TRUE(b.oracle_error.empty()) << b.oracle_error;
  const auto key = std::make_pair(p.op, p.dtype);
  const auto& samples = registry_samples().samples.at(key);
  const auto& grad_cases = b.grad_cases.at(key);
  const bool has_f64 = std::count(spec.dtypes.begin(), spec.dtypes.end(), kFloat64) > 0;
  const bool run_gradcheck = p.dtype == kFloat64 || (p.dtype == kFloat32 && !has_f64);
  const ops::Tolerance tol = test::grad_tolerance(spec, p.dtype);
  for (size_t s = 0; s < samples.size(); ++s) {
    const OpSample& smp = samples[s];
    if (smp.grad_inputs.empty()) continue;
    const test::GradCase& gc = grad_cases[s];
    const std::string where = spec.name + " [" + smp.label + "] " + std::string(dtype_name(p.dtype)) + " (" +
                              describe_inputs(smp.inputs) + "), grad w.r.t. x" +
                              [&] {
                                std::string l;
                                for (int i : smp.grad_inputs) l += (l.empty() ? "" : ", x") + std::to_string(i);
                                return l;
                              }() +
                              ", torch: " + smp.torch;
    const test::OracleOutcome none;
    const test::OracleOutcome& want = gc.error.empty() ? b.oracle.outcome(gc.oracle_case) : none;
    bool missing_backward = false;
    for (const std::string& f : test::check_grad_against_torch(spec.name, smp, gc, want, tol)) {
      ADD_FAILURE() << where << "\n  " << f;
      missing_backward |= f.find("backward not implemented") != std::string::npos;
    }
    if (!run_gradcheck || !smp.gradcheck || missing_backward) continue;  // gradcheck would only repeat it
    for (const std::string& f : test::check_gradcheck(spec.name, smp)) ADD_FAILURE() << where << "\n  " << f;
  }
}

TEST_P(OpRegistryErrors, ThrowNamedErrors) {
  const ErrorParam& p = GetParam();
  const OpSpec& spec = ops::op_registry()[p.op];
  for (const auto& ec : spec.errors()) {
    const std::string where = spec.name + " [" + ec.label + "]";
    try {
      ec.run();
      ADD_FAILURE() << where << ": expected " << ec.error_type << " containing '" << ec.message_contains
                    << "', nothing was thrown";
    } catch (const std::exception& e) {
      EXPECT_TRUE(is_error_class(e, ec.error_type))
          << where << ": expected a kiln::" << ec.error_type << ", got: " << e.what();
      EXPECT_NE(std::string(e.what()).find(ec.message_contains), std::string::npos)
          << where << ": the message should contain '" << ec.message_contains << "', got: " << e.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Registry, OpRegistryForward, ::testing::ValuesIn(forward_params()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Registry, OpRegistryErrors, ::testing::ValuesIn(error_params()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Registry, OpRegistryBackward, ::testing::ValuesIn(forward_params(/*grad=*/true)),
                         [](const auto& info) { return info.param.name; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(OpRegistryForward);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(OpRegistryErrors);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(OpRegistryBackward);

TEST(OpRegistrySanity, EveryOpHasSamplesPerDTypeAndTorchExpressions) {
  const auto& reg = ops::op_registry();
  ASSERT_FALSE(reg.empty()) << "the op registry is empty";
  const RegistrySamples& all = registry_samples();
  for (size_t i = 0; i < reg.size(); ++i) {
    const OpSpec& spec = reg[i];
    EXPECT_FALSE(spec.name.empty()) << "registry entry " << i << " has no name";
    EXPECT_FALSE(spec.dtypes.empty()) << spec.name << " lists no dtypes";
    EXPECT_TRUE(static_cast<bool>(spec.samples)) << spec.name << " has no sample generator";
    std::set<DType> seen;
    for (DType dt : spec.dtypes) {
      EXPECT_TRUE(seen.insert(dt).second) << spec.name << " lists " << dtype_name(dt) << " twice";
      const auto key = std::make_pair(i, dt);
      if (all.errors.count(key)) continue;  // reported by the forward test
      const auto& samples = all.samples.at(key);
      EXPECT_FALSE(samples.empty()) << spec.name << " has no samples for " << dtype_name(dt);
      for (const auto& s : samples) {
        EXPECT_FALSE(s.torch.empty()) << spec.name << " [" << s.label << "] has no torch expression";
        EXPECT_TRUE(static_cast<bool>(s.run)) << spec.name << " [" << s.label << "] has no kiln function";
        EXPECT_FALSE(s.label.empty()) << spec.name << " has a sample without a label";
        for (const std::string& problem : test::grad_inputs_problems(s)) {
          ADD_FAILURE() << spec.name << " [" << s.label << "] " << dtype_name(dt) << ": " << problem;
        }
      }
    }
    if (spec.differentiable) {
      bool any = false;
      for (DType dt : spec.dtypes) any |= checks_backward(spec, dt);
      EXPECT_TRUE(any) << spec.name << " is marked differentiable, but none of its floating samples lists "
                       << "grad_inputs, so its backward is never checked";
    }
    if (spec.errors) {
      for (const auto& ec : spec.errors()) {
        static const std::set<std::string> known = {"ShapeError", "DTypeError", "ValueError", "IndexError",
                                                    "OutOfMemory", "FormatError", "IOError", "Error"};
        EXPECT_TRUE(known.count(ec.error_type))
            << spec.name << " [" << ec.label << "]: unknown error_type '" << ec.error_type << "'";
        EXPECT_FALSE(ec.message_contains.empty()) << spec.name << " [" << ec.label << "]: no message substring";
      }
    }
  }
}
