// amp::GradScaler: the state machine against torch's GradScaler for scripted
// gradient sequences (tests/parity/amp_grad_scaler.py), the order
// unscale_ -> clip -> step, misuse errors, state_dict round trips and the
// telemetry messages.
#include <gtest/gtest.h>

#include <sstream>

#include "kiln/amp/grad_scaler.h"
#include "kiln/amp/mode.h"
#include "kiln/core/autocast.h"
#include "kiln/kiln.h"
#include "support/test_util.h"

namespace kiln {
namespace {

const std::map<std::string, std::vector<double>>& torch_table() {
  static const auto table = test::run_python_table("amp_grad_scaler.py");
  return table;
}

struct Case {
  const char* name;
  double init, growth, backoff;
  int64_t interval;
  const char* script;
};
// Must match CASES in tests/parity/amp_grad_scaler.py.
const Case kCases[] = {
    {"basic", 65536.0, 2.0, 0.5, 3, "F F F Fu I F F F F Fu F N N F F F F Iu F F F F F F F"},
    {"odd_factors", 1000.0, 3.0, 0.3, 2, "F F F I N I F Fu F F F F I F F"},
    {"grow_to_inf", 0x1p126, 2.0, 0.5, 1, "F F F I F F"},
    {"collapse", 4.0, 2.0, 0.5, 4, "N N N N N N N N N N F F F F F"},
};

std::vector<std::string> tokens(const char* script) {
  std::istringstream is(script);
  std::vector<std::string> out;
  for (std::string t; is >> t;) out.push_back(t);
  return out;
}

// The gradient of one scripted step, scaled as backward of scale(loss) would make it.
Tensor scripted_grad(const std::string& tok, double scale) {
  std::vector<float> g(4);
  for (int i = 0; i < 4; ++i) g[i] = static_cast<float>((i + 1) * 0.25 * scale);
  if (tok[0] == 'I') g[1] = std::numeric_limits<float>::infinity();
  if (tok[0] == 'N') g[2] = std::numeric_limits<float>::quiet_NaN();
  return tensor<float>(g, {4});
}

amp::GradScalerOptions quiet(amp::GradScalerOptions o) {
  o.print_messages = false;
  return o;
}

TEST(GradScalerParity, ScriptedSequencesMatchTorch) {
  const auto& table = torch_table();
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    amp::GradScaler scaler(quiet({.init_scale = c.init, .growth_factor = c.growth, .backoff_factor = c.backoff,
                                  .growth_interval = c.interval}));
    Tensor p = zeros({4}).requires_grad_();
    optim::SGD opt({{"p", p}}, {.lr = 0.1});
    const auto toks = tokens(c.script);
    for (size_t k = 0; k < toks.size(); ++k) {
      const std::string key = std::string(c.name) + "_" + std::to_string(k);
      ASSERT_TRUE(table.count(key)) << key;
      const std::vector<double>& want = table.at(key);
      p.mutable_grad() = scripted_grad(toks[k], scaler.get_scale());
      if (toks[k].back() == 'u') scaler.unscale_(opt);
      const bool stepped = scaler.step(opt);
      scaler.update();
      EXPECT_EQ(scaler.get_scale(), want[0]) << key;
      EXPECT_EQ(scaler.get_growth_tracker(), static_cast<int64_t>(want[1])) << key;
      EXPECT_EQ(stepped, want[2] == 1.0) << key;
      const std::vector<double> got = test::to_doubles(p);
      for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[i], want[3 + i], 1e-7) << key << " p[" << i << "]";
    }
    EXPECT_EQ(scaler.stats().steps, static_cast<int64_t>(toks.size()));
  }
}

TEST(GradScaler, UnscaleThenClipSeesTrueGradients) {
  // Reference: the true gradient g, clipped to norm 1, then one SGD step.
  const std::vector<float> g = {3.0f, -4.0f, 12.0f};  // norm 13
  Tensor ref = zeros({3}).requires_grad_();
  optim::SGD ref_opt({{"w", ref}}, {.lr = 0.5});
  ref.mutable_grad() = tensor<float>(g, {3});
  const double ref_norm = optim::clip_grad_norm_(optim::NamedParams{{"w", ref}}, 1.0);
  ref_opt.step();

  Tensor w = zeros({3}).requires_grad_();
  optim::SGD opt({{"w", w}}, {.lr = 0.5});
  amp::GradScaler scaler(quiet({.init_scale = 1024.0}));
  w.mutable_grad() = tensor<float>(g, {3}) * 1024.0;  // what backward of scale(loss) gives
  scaler.unscale_(opt);
  const double norm = optim::clip_grad_norm_(optim::NamedParams{{"w", w}}, 1.0);
  EXPECT_EQ(norm, ref_norm);  // the clip saw the true norm, not 1024 times it
  EXPECT_NEAR(norm, 13.0, 1e-5);
  EXPECT_TRUE(scaler.step(opt));  // does not unscale a second time
  scaler.update();
  EXPECT_TRUE(test::bitwise_equal(w.detach(), ref.detach()));
}

TEST(GradScaler, ScaleMultipliesTheLossInFloat32) {
  amp::GradScaler scaler(quiet({.init_scale = 256.0}));
  const Tensor loss = scalar_tensor(1.5, TensorOptions(kFloat32));
  const Tensor scaled = scaler.scale(loss);
  EXPECT_EQ(scaled.dtype(), kFloat32);
  EXPECT_EQ(scaled.item<double>(), 384.0);
}

TEST(GradScaler, MisuseIsAnErrorThatSaysWhat) {
  Tensor p = zeros({4}).requires_grad_();
  optim::SGD opt({{"p", p}}, {.lr = 0.1});
  amp::GradScaler scaler(quiet({}));
  EXPECT_THROW(scaler.update(), ValueError);  // no step or unscale_ yet
  p.mutable_grad() = ones({4});
  scaler.unscale_(opt);
  try {
    scaler.unscale_(opt);
    FAIL() << "a second unscale_ must throw";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("already been called"), std::string::npos) << e.what();
  }
  scaler.step(opt);
  EXPECT_THROW(scaler.step(opt), ValueError);
  EXPECT_THROW(scaler.unscale_(opt), ValueError);
  scaler.update();
  // update() starts a new iteration: the protocol runs again.
  p.mutable_grad() = ones({4});
  scaler.unscale_(opt);
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  EXPECT_THROW(amp::GradScaler({.backoff_factor = 1.5}), ValueError);
}

TEST(GradScaler, DisabledIsAPassThrough) {
  Tensor p = zeros({2}).requires_grad_();
  optim::SGD opt({{"p", p}}, {.lr = 1.0});
  amp::GradScaler scaler(quiet({.enabled = false}));
  const Tensor loss = scalar_tensor(2.0, TensorOptions(kFloat32));
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  p.mutable_grad() = ones({2});
  scaler.unscale_(opt);
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(test::to_doubles(p), (std::vector<double>{-1.0, -1.0}));
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_TRUE(scaler.state_dict().tensors.empty());
}

// Runs scripted steps on a scaler and its own parameter; returns the parameter.
Tensor run_steps(amp::GradScaler& scaler, Tensor p, const char* script) {
  optim::SGD opt({{"p", p}}, {.lr = 0.1});
  for (const std::string& tok : tokens(script)) {
    p.mutable_grad() = scripted_grad(tok, scaler.get_scale());
    scaler.step(opt);
    scaler.update();
  }
  return p;
}

TEST(GradScalerState, RoundTripContinuesIdentically) {
  const amp::GradScalerOptions o = quiet({.init_scale = 1000.0, .growth_factor = 3.0, .backoff_factor = 0.3,
                                          .growth_interval = 3});
  amp::GradScaler a(o);
  Tensor pa = run_steps(a, zeros({4}).requires_grad_(), "F F I F F F F N F");
  const io::ObjectState sd = a.state_dict();
  EXPECT_EQ(sd.tensors.at("scale").item<double>(), a.get_scale());
  EXPECT_EQ(sd.tensors.at("_growth_tracker").item<int64_t>(), a.get_growth_tracker());
  EXPECT_EQ(std::get<int64_t>(sd.values.at("skipped_steps")), 2);

  amp::GradScaler b(quiet({}));  // different hyperparameters: the state brings its own
  b.load_state_dict(sd);
  EXPECT_EQ(b.get_scale(), a.get_scale());
  EXPECT_EQ(b.get_growth_tracker(), a.get_growth_tracker());
  EXPECT_EQ(b.get_growth_factor(), 3.0);
  EXPECT_EQ(b.get_backoff_factor(), 0.3);
  EXPECT_EQ(b.get_growth_interval(), 3);
  EXPECT_EQ(b.stats().skipped_steps, 2);
  Tensor pb = pa.detach().clone().requires_grad_();
  const char* rest = "F F I F F F F F F N F F";
  run_steps(a, pa, rest);
  run_steps(b, pb, rest);
  EXPECT_EQ(a.get_scale(), b.get_scale());
  EXPECT_EQ(a.get_growth_tracker(), b.get_growth_tracker());
  EXPECT_TRUE(test::bitwise_equal(pa.detach(), pb.detach()));
}

TEST(GradScalerState, LoadValidatesBeforeChangingAnything) {
  amp::GradScaler a(quiet({.init_scale = 8.0}));
  io::ObjectState sd = a.state_dict();
  amp::GradScaler b(quiet({.init_scale = 4.0}));
  EXPECT_THROW(b.load_state_dict({}), ValueError);  // as torch: empty = saved from a disabled scaler
  auto missing = sd;
  missing.tensors.erase("_growth_tracker");
  EXPECT_THROW(b.load_state_dict(missing), ValueError);
  auto bad_tracker = sd;
  bad_tracker.tensors["_growth_tracker"] = scalar_tensor(int64_t{5000}, TensorOptions(kInt64));
  EXPECT_THROW(b.load_state_dict(bad_tracker), ValueError);
  auto bad_dtype = sd;
  bad_dtype.tensors["scale"] = scalar_tensor(8.0, TensorOptions(kFloat64));
  EXPECT_THROW(b.load_state_dict(bad_dtype), ValueError);
  EXPECT_EQ(b.get_scale(), 4.0);
}

TEST(GradScalerState, AValueOfTheWrongKindIsRejected) {
  amp::GradScaler a(quiet({}));
  io::ObjectState sd = a.state_dict();
  sd.values["growth_interval"] = 2000.0;  // a double where an int64 belongs
  amp::GradScaler b(quiet({.init_scale = 4.0}));
  EXPECT_THROW(b.load_state_dict(sd), ValueError);
  EXPECT_EQ(b.get_scale(), 4.0);
}

// One float16 training step of y = x * w under the scaler; the huge target
// makes the first steps overflow so the scale moves.
void fp16_step(nn::Linear& model, optim::SGD& opt, amp::GradScaler& scaler, int k) {
  Generator g(100 + k);
  const Tensor x = randn({8, 4}, {}, &g), y = randn({8, 2}, {}, &g) * 1e3;
  Tensor loss;
  {
    const AutocastGuard amp(kFloat16);
    loss = nn::functional::mse_loss(model.forward(x), y);
  }
  opt.zero_grad();
  scaler.scale(loss).backward();
  scaler.step(opt);
  scaler.update();
}

TEST(GradScalerState, CheckpointRoundTripResumesBitwise) {
  manual_seed(7);
  nn::Linear model({.in_features = 4, .out_features = 2});
  optim::SGD opt(model.named_parameters(), {.lr = 1e-4, .momentum = 0.9});
  amp::GradScaler scaler(quiet({.growth_interval = 2}));
  for (int k = 0; k < 4; ++k) fp16_step(model, opt, scaler, k);
  ASSERT_LT(scaler.get_scale(), 65536.0) << "the script should have overflowed at least once";
  test::TempDir dir;
  const std::string path = dir.file("ckpt.safetensors");
  train::save_checkpoint(path, {.model = &model, .optimizer = &opt, .objects = {{"scaler", &scaler}}}, {.step = 4});

  manual_seed(99);
  nn::Linear model2({.in_features = 4, .out_features = 2});
  optim::SGD opt2(model2.named_parameters(), {.lr = 1e-4, .momentum = 0.9});
  amp::GradScaler scaler2(quiet({.init_scale = 8.0, .growth_interval = 2}));
  // One step first, so the optimizer has momentum state of the checkpoint's shape.
  fp16_step(model2, opt2, scaler2, 0);
  const train::CheckpointInfo info =
      train::load_checkpoint(path, {.model = &model2, .optimizer = &opt2, .objects = {{"scaler", &scaler2}}});
  EXPECT_EQ(info.step, 4);
  EXPECT_EQ(scaler2.get_scale(), scaler.get_scale());
  EXPECT_EQ(scaler2.get_growth_tracker(), scaler.get_growth_tracker());
  EXPECT_EQ(scaler2.stats().skipped_steps, scaler.stats().skipped_steps);
  for (int k = 4; k < 10; ++k) {
    fp16_step(model, opt, scaler, k);
    fp16_step(model2, opt2, scaler2, k);
  }
  EXPECT_EQ(scaler2.get_scale(), scaler.get_scale());
  EXPECT_EQ(scaler2.stats().skipped_steps, scaler.stats().skipped_steps);
  EXPECT_TRUE(test::bitwise_equal(model2.weight.detach(), model.weight.detach()));
  EXPECT_TRUE(test::bitwise_equal(model2.bias.detach(), model.bias.detach()));
}

TEST(GradScalerTelemetry, RepeatedSkipsNameTheFirstNonFiniteParameter) {
  Tensor w = zeros({3}).requires_grad_(), bias = zeros({2}).requires_grad_();
  optim::SGD opt({{"layer.weight", w}, {"layer.bias", bias}}, {.lr = 0.1});
  amp::GradScaler scaler(quiet({.init_scale = 1024.0, .warn_after_skips = 3}));
  for (int k = 0; k < 4; ++k) {
    w.mutable_grad() = ones({3});
    bias.mutable_grad() = tensor<float>({1.0f, std::numeric_limits<float>::infinity()}, {2});
    EXPECT_FALSE(scaler.step(opt));
    scaler.update();
    EXPECT_EQ(scaler.messages().size(), k < 2 ? 0u : 1u) << "one message per streak, after 3 skips";
  }
  const amp::GradScalerStats st = scaler.stats();
  EXPECT_EQ(st.skipped_steps, 4);
  EXPECT_EQ(st.consecutive_skips, 4);
  EXPECT_EQ(st.first_nonfinite_param, "layer.bias");
  EXPECT_EQ(st.first_nonfinite_inf, 1);
  EXPECT_EQ(st.scale, 64.0);
  const std::string& msg = scaler.messages().at(0);
  EXPECT_NE(msg.find("3 consecutive steps skipped"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'layer.bias' (0 NaN, 1 Inf)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("anomaly mode"), std::string::npos) << msg;
  const auto m = scaler.metrics();
  EXPECT_EQ(m.at("amp_scale"), 64.0);
  EXPECT_EQ(m.at("amp_skipped_steps"), 4.0);
  EXPECT_EQ(m.at("amp_step_skipped"), 1.0);
  // A clean step ends the streak.
  w.mutable_grad() = ones({3});
  bias.mutable_grad() = ones({2});
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.stats().consecutive_skips, 0);
  EXPECT_EQ(scaler.metrics().at("amp_step_skipped"), 0.0);
}

TEST(GradScalerTelemetry, ACollapsingScaleIsReportedAsDivergence) {
  Tensor p = zeros({4}).requires_grad_();
  amp::GradScaler scaler(quiet({.init_scale = 16.0, .warn_after_skips = 100, .collapse_threshold = 1.0}));
  run_steps(scaler, p, "N N N N");
  EXPECT_TRUE(scaler.messages().empty());  // 16 -> 1: not yet below the threshold
  run_steps(scaler, p, "N N");
  ASSERT_EQ(scaler.messages().size(), 1u);
  const std::string& msg = scaler.messages()[0];
  EXPECT_NE(msg.find("collapsed to 0.5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("likely a real divergence"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'p' (1 NaN, 0 Inf)"), std::string::npos) << msg;
}

TEST(GradScalerTelemetry, Bfloat16IsLoggedOnceAsUnnecessary) {
  amp::GradScaler scaler(quiet({}));
  const Tensor loss = scalar_tensor(1.0, TensorOptions(kFloat32));
  {
    const AutocastGuard amp(kFloat16);
    scaler.scale(loss);
  }
  EXPECT_TRUE(scaler.messages().empty());
  {
    const AutocastGuard amp(kBFloat16);
  }
  scaler.scale(loss);  // after a bf16 region, outside it, as in a training loop
  scaler.scale(loss);
  ASSERT_EQ(scaler.messages().size(), 1u);
  EXPECT_NE(scaler.messages()[0].find("unnecessary"), std::string::npos);
}

TEST(AmpMode, ParsesTheConfigNames) {
  EXPECT_EQ(amp::parse_amp_mode("bf16").dtype, kBFloat16);
  EXPECT_EQ(amp::parse_amp_mode("fp16").dtype, kFloat16);
  EXPECT_FALSE(amp::parse_amp_mode("off").dtype.has_value());
  EXPECT_TRUE(amp::parse_amp_mode("half").needs_scaler());
  EXPECT_FALSE(amp::parse_amp_mode("bfloat16").needs_scaler());
  for (const char* n : {"bf16", "fp16", "off"}) EXPECT_EQ(amp::parse_amp_mode(n).name(), n);
  try {
    amp::parse_amp_mode("int8");
    FAIL() << "int8 is not a mode";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("expected bf16, fp16 or off"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("\"int8\""), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln
