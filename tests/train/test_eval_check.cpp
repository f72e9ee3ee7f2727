// EvalCheck (kiln/train/eval_check.h): an evaluation left in training mode is named
// with the modules and what they changed; one in eval mode is silent and leaves no hook.
#include <gtest/gtest.h>

#include <iostream>
#include <sstream>

#include "kiln/kiln.h"
#include "kiln/train/eval_check.h"
#include "kiln/train/health.h"

using namespace kiln;

namespace {

// Linear -> BatchNorm1d -> ReLU -> Dropout -> Linear, a classifier as users write them.
class NormNet : public nn::Module {
 public:
  explicit NormNet(double p = 0.3) : Module("NormNet") {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 8, .out_features = 6}));
    bn = register_module("bn", std::make_shared<nn::BatchNorm1d>(nn::BatchNormOptions{.num_features = 6}));
    drop = register_module("drop", std::make_shared<nn::Dropout>(p));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 6, .out_features = 3}));
  }
  Tensor forward(const Tensor& x) override { return (*fc2)((*drop)((*bn)((*fc1)(x)).relu())); }
  std::shared_ptr<nn::Linear> fc1, fc2;
  std::shared_ptr<nn::BatchNorm1d> bn;
  std::shared_ptr<nn::Dropout> drop;
};

void evaluate(nn::Module& model, int batches) {
  NoGradGuard ng;  // not eval mode
  for (int i = 0; i < batches; ++i) model(randn({5, 8}) + 3.0);
}

TEST(EvalCheck, TrainModeEvaluationNamesBatchNormAndDropoutWithWhatChanged) {
  manual_seed(0);
  NormNet model;
  model(randn({5, 8}));  // one training step's forward: num_batches_tracked 1
  const Tensor mean_before = model.bn->running_mean.clone();
  train::EvalCheck check(model);
  evaluate(model, 3);
  const auto r = check.finish();
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->modules.size(), 2u);
  const auto& bn = r->modules[0];
  EXPECT_EQ(bn.name, "bn");
  EXPECT_EQ(bn.type, "BatchNorm1d");
  EXPECT_EQ(bn.forwards, 3);
  EXPECT_EQ(bn.batches_before, 1);
  EXPECT_EQ(bn.batches_after, 4);
  const double moved = (model.bn->running_mean - mean_before).abs().max().item<double>();
  EXPECT_GT(moved, 0.1);  // inputs shifted by 3 pull the running mean
  EXPECT_NEAR(bn.running_mean_moved, moved, 1e-6);
  const auto& drop = r->modules[1];
  EXPECT_EQ(drop.name, "drop");
  EXPECT_EQ(drop.forwards, 3);
  EXPECT_DOUBLE_EQ(drop.p, 0.3);
  EXPECT_NE(r->message.find("model.eval() was not called"), std::string::npos) << r->message;
  EXPECT_NE(r->message.find("bn (BatchNorm1d): num_batches_tracked 1 -> 4"), std::string::npos) << r->message;
  EXPECT_NE(r->message.find("drop (Dropout p=0.3): 3 forward(s)"), std::string::npos) << r->message;
  EXPECT_NE(r->message.find("NoGradGuard / InferenceMode turn off gradients, not training mode"), std::string::npos);
  EXPECT_THROW(check.finish(), ValueError);
}

TEST(EvalCheck, EvalModeIsSilentAndLeavesNoHook) {
  NormNet model;
  model.eval();
  train::EvalCheck check(model);
  EXPECT_FALSE(model.bn->has_forward_hooks());
  EXPECT_FALSE(model.drop->has_forward_hooks());
  evaluate(model, 2);
  EXPECT_FALSE(check.finish().has_value());
  EXPECT_EQ(model.bn->num_batches_tracked.item<int64_t>(), 0);
}

TEST(EvalCheck, HooksAreRemovedAtFinishAndEvalInsideTheScopeIsFine) {
  NormNet model;
  train::EvalCheck check(model);
  EXPECT_TRUE(model.bn->has_forward_hooks());
  model.eval();  // switched before the forwards: nothing ran in training mode
  evaluate(model, 2);
  EXPECT_FALSE(check.finish().has_value());
  EXPECT_FALSE(model.bn->has_forward_hooks());
  EXPECT_FALSE(model.drop->has_forward_hooks());
}

TEST(EvalCheck, DropoutOfZeroAndAnUnusedScopeAreNotReported) {
  NormNet model(/*p=*/0.0);
  model.bn->eval();
  {
    train::EvalCheck check(model);  // training mode, but dropout p = 0 and BN in eval mode
    evaluate(model, 1);
    EXPECT_FALSE(check.finish().has_value());
  }
  train::EvalCheck idle(model);
  EXPECT_FALSE(idle.finish().has_value());  // no forward ran inside the scope
}

TEST(EvalCheck, DestroyedWithoutFinishWarnsOnStderr) {
  NormNet model;
  std::ostringstream captured;
  std::streambuf* old = std::cerr.rdbuf(captured.rdbuf());
  {
    train::EvalCheck check(model);
    evaluate(model, 1);
  }
  std::cerr.rdbuf(old);
  EXPECT_NE(captured.str().find("kiln warning: the evaluation ran in training mode"), std::string::npos)
      << captured.str();
}

TEST(EvalCheck, HealthMonitorChecksTheModelItWatches) {
  NormNet model;
  train::HealthMonitor monitor(model, {.every = 1});
  train::EvalCheck check = monitor.check_evaluation();
  evaluate(model, 2);
  const auto r = check.finish();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->modules.size(), 2u);
}

}  // namespace
