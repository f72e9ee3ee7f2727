// Checkpoints beyond model and optimizer: named generators and Stateful
// objects round-trip exactly; mismatches (missing/unexpected generators and
// objects, object keys, value kinds, shapes, dtypes) are reported together by
// name and change nothing; malformed values are FormatErrors; version-1 files
// (before generators and objects) still load.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/io/safetensors.h"
#include "kiln/models/gpt.h"
#include "kiln/nn/layers.h"
#include "kiln/train/checkpoint.h"
#include "support/test_util.h"

namespace kiln {
namespace {

using io::ObjectState;
using io::StateValue;

// A stand-in for AMP's GradScaler: a tensor and one scalar of each kind.
class Scaler : public io::Stateful {
 public:
  Tensor scale = ones({1});
  int64_t growth_tracker = 0;
  bool enabled = true;
  double backoff = 0.5;
  std::string note = "init";

  ObjectState state_dict() const override {
    return {.tensors = {{"scale", scale.clone()}},
            .values = {{"growth_tracker", growth_tracker}, {"enabled", enabled}, {"backoff", backoff}, {"note", note}}};
  }
  void load_state_dict(const ObjectState& s) override {
    scale = s.tensors.at("scale").clone();
    growth_tracker = std::get<int64_t>(s.values.at("growth_tracker"));
    enabled = std::get<bool>(s.values.at("enabled"));
    backoff = std::get<double>(s.values.at("backoff"));
    note = std::get<std::string>(s.values.at("note"));
  }
};

// An object with another schema: "scale" of another shape, "growth_tracker" a double, an extra key.
class OtherScaler : public io::Stateful {
 public:
  ObjectState state_dict() const override {
    return {.tensors = {{"scale", zeros({2})}, {"history", zeros({3})}},
            .values = {{"growth_tracker", 1.5}, {"enabled", true}, {"backoff", 0.5}, {"note", std::string("x")}}};
  }
  void load_state_dict(const ObjectState&) override { loaded = true; }
  bool loaded = false;
};

std::shared_ptr<nn::Linear> linear(uint64_t seed) {
  manual_seed(seed);
  return std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 3, .out_features = 2});
}

TEST(CheckpointState, GeneratorsAndObjectsRoundTripExactly) {
  test::TempDir dir;
  const std::string path = dir.file("c.safetensors");
  auto model = linear(1);
  Generator noise(42), augment(7);
  noise.reserve(13);
  augment.reserve(1000003);
  Scaler scaler;
  scaler.scale.fill_(65536.0);
  scaler.growth_tracker = -1234567890123LL;
  scaler.enabled = false;
  scaler.backoff = 0.1 + 0.2;  // not a short decimal: must come back bit for bit
  scaler.note = "dynamic, ünïcode";
  train::save_checkpoint(path,
                         {.model = model.get(), .optimizer = nullptr, .scheduler = nullptr,
                          .generators = {{"noise", &noise}, {"augment", &augment}}, .objects = {{"scaler", &scaler}}},
                         {.step = 5, .loader = std::nullopt, .config = ""});
  const io::SafetensorsFile f = io::load_safetensors(path);
  EXPECT_TRUE(f.contains("state.scaler.scale"));

  auto model2 = linear(2);
  Generator noise2(1), augment2(2);
  Scaler scaler2;
  train::load_checkpoint(path, {.model = model2.get(), .optimizer = nullptr, .scheduler = nullptr,
                                .generators = {{"noise", &noise2}, {"augment", &augment2}}, .objects = {{"scaler", &scaler2}}});
  EXPECT_EQ(noise2.get_state(), noise.get_state());
  EXPECT_EQ(augment2.get_state(), augment.get_state());
  EXPECT_TRUE(test::bitwise_equal(scaler2.scale, scaler.scale));
  EXPECT_EQ(scaler2.growth_tracker, scaler.growth_tracker);
  EXPECT_EQ(scaler2.enabled, false);
  EXPECT_EQ(std::memcmp(&scaler2.backoff, &scaler.backoff, sizeof(double)), 0);
  EXPECT_EQ(scaler2.note, scaler.note);
  EXPECT_TRUE(test::bitwise_equal(model2->weight, model->weight));
}

TEST(CheckpointState, SpecialDoublesRoundTrip) {
  test::TempDir dir;
  const std::string path = dir.file("c.safetensors");
  auto model = linear(1);
  for (double v : std::initializer_list<double>{0.0, -0.0, 1e-310, -INFINITY, INFINITY, 1.7976931348623157e308}) {
    Scaler s;
    s.backoff = v;
    train::save_checkpoint(path, {.model = model.get(), .objects = {{"s", &s}}}, {});
    Scaler back;
    train::load_checkpoint(path, {.model = model.get(), .objects = {{"s", &back}}});
    EXPECT_EQ(std::memcmp(&back.backoff, &v, sizeof v), 0) << v;
  }
}

TEST(CheckpointState, MismatchesAreReportedTogetherAndChangeNothing) {
  test::TempDir dir;
  const std::string path = dir.file("c.safetensors");
  auto model = linear(1);
  Generator noise(42), dropped(3);
  Scaler scaler, gone;
  train::save_checkpoint(path,
                         {.model = model.get(), .generators = {{"noise", &noise}, {"dropped", &dropped}},
                          .objects = {{"scaler", &scaler}, {"gone", &gone}}},
                         {.step = 1});

  auto model2 = linear(2);
  const Tensor w_before = model2->weight.clone();
  Generator noise2(9), fresh(10);
  noise2.reserve(4);
  OtherScaler other;
  Scaler extra;
  manual_seed(31337);
  const GeneratorState default_before = default_generator().get_state();
  try {
    train::load_checkpoint(path, {.model = model2.get(), .generators = {{"noise", &noise2}, {"fresh", &fresh}},
                                  .objects = {{"scaler", &other}, {"extra", &extra}}});
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    for (const char* want : {"missing generator 'fresh'", "unexpected generator 'dropped'", "missing object 'extra'",
                             "unexpected object 'gone'", "object 'scaler': tensor 'scale': shape [1] in the file, [2]",
                             "object 'scaler': missing tensor 'history'",
                             "object 'scaler': value 'growth_tracker': integer in the file, double in the object"})
      EXPECT_NE(msg.find(want), std::string::npos) << want << " not in: " << msg;
  }
  EXPECT_TRUE(test::bitwise_equal(model2->weight, w_before));
  EXPECT_EQ(noise2.get_state(), (GeneratorState{9, 4}));
  EXPECT_EQ(fresh.get_state(), (GeneratorState{10, 0}));
  EXPECT_FALSE(other.loaded);
  EXPECT_EQ(default_generator().get_state(), default_before);
}

// An object whose saved state depends on the run that saved it
// (loads_any_saved_state: PowerSGD's per-rank errors, docs/ddp.md) is handed
// what the file holds, whatever its keys and shapes, and decides itself.
class AnyState : public io::Stateful {
 public:
  ObjectState state_dict() const override { return {}; }
  void load_state_dict(const ObjectState& s) override { got = s; }
  bool loads_any_saved_state() const override { return true; }
  ObjectState got;
};

TEST(CheckpointState, AnObjectThatLoadsAnySavedStateGetsWhatTheFileHolds) {
  test::TempDir dir;
  const std::string path = dir.file("c.safetensors");
  auto model = linear(1);
  OtherScaler saved;
  train::save_checkpoint(path, {.model = model.get(), .objects = {{"s", &saved}}}, {});
  AnyState any;
  train::load_checkpoint(path, {.model = model.get(), .objects = {{"s", &any}}});
  ASSERT_EQ(any.got.tensors.size(), 2u);
  EXPECT_EQ(any.got.tensors.at("history").sizes(), IntArrayRef({3}));
  EXPECT_EQ(std::get<double>(any.got.values.at("growth_tracker")), 1.5);
  // Still named: an object the file lacks is missing, as any other.
  EXPECT_THROW(train::load_checkpoint(path, {.model = model.get(), .objects = {{"s", &any}, {"t", &any}}}),
               ValueError);
}

TEST(CheckpointState, BadNamesAreRejectedOnSave) {
  test::TempDir dir;
  auto model = linear(1);
  Generator g;
  Scaler s;
  for (const char* bad : {"", "a.b", "a\nb"}) {
    EXPECT_THROW(train::save_checkpoint(dir.file("c.safetensors"), {.model = model.get(), .generators = {{bad, &g}}}, {}),
                 ValueError);
    EXPECT_THROW(train::save_checkpoint(dir.file("c.safetensors"), {.model = model.get(), .objects = {{bad, &s}}}, {}),
                 ValueError);
  }
  EXPECT_THROW(train::save_checkpoint(dir.file("c.safetensors"), {.model = model.get(), .generators = {{"g", nullptr}}}, {}),
               ValueError);
}

// The metadata checksum as docs/checkpoints.md defines it (written here again, from the doc).
std::string metadata_fnv1a64(const io::Metadata& md) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const auto& [k, v] : md) {
    if (k.rfind("checksum.", 0) == 0) continue;
    for (const std::string* s : {&k, &v})
      for (size_t i = 0; i <= s->size(); ++i) h = (h ^ static_cast<unsigned char>(s->c_str()[i])) * 0x100000001b3ULL;
  }
  char hex[20];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

// Rewrites the checkpoint's metadata and, unless told not to, its metadata checksum (as a deliberate editor would).
void rewrite_metadata(const std::string& path, const std::function<void(io::Metadata&)>& edit, bool fix_checksum = true) {
  io::SafetensorsFile f = io::load_safetensors(path);
  edit(f.metadata);
  if (fix_checksum) f.metadata["checksum.metadata.fnv1a64"] = metadata_fnv1a64(f.metadata);
  io::save_safetensors(path, f.tensors, f.metadata);
}

TEST(CheckpointState, MetadataIsChecksummed) {
  test::TempDir dir;
  const std::string path = dir.file("c.safetensors");
  auto model = linear(1);
  Scaler s;
  train::save_checkpoint(path, {.model = model.get(), .objects = {{"s", &s}}}, {.step = 17});
  rewrite_metadata(path, [](io::Metadata&) {});  // the doc's definition matches the writer's
  EXPECT_EQ(train::load_checkpoint(path, {.model = model.get(), .objects = {{"s", &s}}}).step, 17);
  rewrite_metadata(path, [](io::Metadata& md) { md["step"] = "13"; }, /*fix_checksum=*/false);  // a flipped bit, say
  try {
    train::load_checkpoint(path, {.model = model.get(), .objects = {{"s", &s}}});
    FAIL() << "expected FormatError";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("metadata checksum mismatch"), std::string::npos) << e.what();
  }
}

TEST(CheckpointState, MalformedValuesAreFormatErrors) {
  test::TempDir dir;
  const std::string path = dir.file("c.safetensors");
  auto model = linear(1);
  Scaler s;
  for (const char* bad : {"", "i:", "i:12x", "i:99999999999999999999", "f:", "f:1.0junk", "b:2", "x:1", "i"}) {
    train::save_checkpoint(path, {.model = model.get(), .objects = {{"s", &s}}}, {});
    rewrite_metadata(path, [&](io::Metadata& md) { md["state.s.growth_tracker"] = bad; });
    EXPECT_THROW(train::load_checkpoint(path, {.model = model.get(), .objects = {{"s", &s}}}), FormatError) << bad;
  }
  // A value or tensor for an object the file does not list.
  train::save_checkpoint(path, {.model = model.get(), .objects = {{"s", &s}}}, {});
  rewrite_metadata(path, [](io::Metadata& md) { md["state.objects"] = "t"; });
  EXPECT_THROW(train::load_checkpoint(path, {.model = model.get(), .objects = {{"t", &s}}}), FormatError);
}

TEST(CheckpointState, HostileCountsAndNumbersAreFormatErrors) {
  test::TempDir dir;
  const std::string path = dir.file("c.safetensors");
  auto model = linear(1);
  optim::SGD opt(model->named_parameters(), {.lr = 0.1});
  optim::StepLR sched(opt, {.step_size = 2});
  const train::CheckpointRefs refs{.model = model.get(), .optimizer = &opt, .scheduler = &sched};
  const std::vector<std::pair<std::string, std::string>> edits = {
      {"step", "1e300"}, {"step", "99999999999999999999"}, {"loader.epoch", "1.5"},
      {"optim.param_groups", "18446744073709551615"}, {"sched.children", "4000000000"}, {"sched.last_epoch", "-1e30"}};
  for (const auto& [key, value] : edits) {
    train::save_checkpoint(path, refs, {.step = 1, .loader = data::LoaderState{.epoch = 0, .position = 0, .seed = 0}});
    rewrite_metadata(path, [&](io::Metadata& md) { md[key] = value; });
    EXPECT_THROW(train::load_checkpoint(path, refs), FormatError) << key << " = " << value;
  }
  // Scheduler states nested without end.
  train::save_checkpoint(path, refs, {});
  rewrite_metadata(path, [](io::Metadata& md) {
    std::string p = "sched.";
    for (int i = 0; i < 40; ++i, p.append("child.0.")) {
      for (const auto& [k, v] : std::map<std::string, std::string>{
               {"last_epoch", "0"}, {"step_count", "0"}, {"base_lrs", "0.1"}, {"last_lr", "0.1"}, {"children", "1"}})
        md[std::string(p).append(k)] = v;
    }
  });
  try {
    train::load_checkpoint(path, refs);
    FAIL() << "expected FormatError";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("nest deeper"), std::string::npos) << e.what();
  }
}

TEST(CheckpointState, OptimizerMismatchesAreReportedWithTheModelsAndObjects) {
  test::TempDir dir;
  const std::string path = dir.file("c.safetensors");
  auto model = linear(1);
  optim::SGD opt(model->named_parameters(), {.lr = 0.1, .momentum = 0.9});
  model->weight.mutable_grad() = ones_like(model->weight);
  model->bias.mutable_grad() = ones_like(model->bias);
  opt.step();
  Scaler s;
  train::save_checkpoint(path, {.model = model.get(), .optimizer = &opt, .objects = {{"s", &s}}}, {});

  manual_seed(3);
  auto other = std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 5, .out_features = 2});
  optim::SGD opt2(other->named_parameters(), {.lr = 0.1, .momentum = 0.9});
  try {
    train::load_checkpoint(path, {.model = other.get(), .optimizer = &opt2});
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    for (const char* want : {"'weight': shape [2, 3] in the file, [2, 5] in the model",
                             "optimizer: state 'weight.momentum_buffer': [2, 3] float32 in the file, parameter [2, 5]",
                             "unexpected object 's'"})
      EXPECT_NE(msg.find(want), std::string::npos) << want << " not in: " << msg;
  }
  EXPECT_TRUE(opt2.state_dict().state.empty());
}

TEST(CheckpointState, VersionOneFilesStillLoad) {
  test::TempDir dir;
  const std::string path = dir.file("c.safetensors");
  auto model = linear(1);
  train::save_checkpoint(path, {.model = model.get()}, {.step = 3});
  rewrite_metadata(path, [](io::Metadata& md) {
    md["kiln.checkpoint"] = "1";
    md.erase("rng.generators");
    md.erase("state.objects");
  });
  auto model2 = linear(2);
  EXPECT_EQ(train::load_checkpoint(path, {.model = model2.get()}).step, 3);
  EXPECT_TRUE(test::bitwise_equal(model2->weight, model->weight));
  Generator g;
  EXPECT_THROW(train::load_checkpoint(path, {.model = model2.get(), .generators = {{"g", &g}}}), ValueError);
}

TEST(CheckpointState, ASchedulerOfAnotherShapeIsRejectedBeforeTheOptimizerChanges) {
  test::TempDir dir;
  const std::string path = dir.file("c.safetensors");
  auto model = linear(1);
  optim::SGD opt(model->named_parameters(), {.lr = 0.1, .momentum = 0.9});
  optim::StepLR sched(opt, {.step_size = 2});
  model->weight.mutable_grad() = ones_like(model->weight);
  model->bias.mutable_grad() = ones_like(model->bias);
  opt.step();
  sched.step();
  train::save_checkpoint(path, {.model = model.get(), .optimizer = &opt, .scheduler = &sched}, {});

  // Same parameters and state layout, but a scheduler over a two-group optimizer.
  auto model2 = linear(2);
  optim::SGD opt2(model2->named_parameters(), {.lr = 0.1, .momentum = 0.9});
  optim::SGD two_groups(std::vector<optim::ParamGroup>{{.params = {{"a", zeros({1}).requires_grad_()}}, .options = {}},
                                                        {.params = {{"b", zeros({1}).requires_grad_()}}, .options = {}}},
                        {.lr = 0.1});
  optim::StepLR wrong(two_groups, {.step_size = 2});
  const Tensor w_before = model2->weight.clone();
  try {
    train::load_checkpoint(path, {.model = model2.get(), .optimizer = &opt2, .scheduler = &wrong});
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("scheduler: 1 base_lrs in the file, 2 param groups"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(test::bitwise_equal(model2->weight, w_before));
  EXPECT_TRUE(opt2.state_dict().state.empty());  // the optimizer was not restored either
  EXPECT_EQ(wrong.last_epoch(), 0);
}

TEST(CheckpointState, GptWithTiedWeightsRoundTripsThroughTheManager) {
  test::TempDir dir;
  const models::GPTOptions o{.vocab_size = 32, .block_size = 8, .n_layer = 1, .n_head = 2, .n_embd = 16};
  manual_seed(1);
  auto a = std::make_shared<models::GPT>(o);
  optim::AdamW opt_a(a->named_parameters(), {.lr = 1e-2, .weight_decay = 0.1});
  const Tensor idx = randint(0, 32, {2, 8}, TensorOptions().dtype(kInt64));
  a->loss(idx, idx).backward();
  opt_a.step();
  train::CheckpointManager m(dir.path());
  m.save({.model = a.get(), .optimizer = &opt_a}, {.step = 1});

  manual_seed(2);
  auto b = std::make_shared<models::GPT>(o);
  optim::AdamW opt_b(b->named_parameters(), {.lr = 1e-2, .weight_decay = 0.1});
  m.load_latest({.model = b.get(), .optimizer = &opt_b});
  EXPECT_EQ(b->lm_head->weight.data_ptr(), b->wte->weight.data_ptr());  // still one tensor
  EXPECT_TRUE(test::bitwise_equal((*b)(idx), (*a)(idx)));
  // The same next step from both.
  opt_a.zero_grad();
  a->loss(idx, idx).backward();
  opt_a.step();
  b->loss(idx, idx).backward();
  opt_b.step();
  EXPECT_TRUE(test::bitwise_equal(b->wte->weight, a->wte->weight));
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// Issue 27: warm-up + cosine saved with T_max = 100 and loaded into T_max = 50
// is one of the problems load_checkpoint reports before changing anything;
// checkpoints written before schedulers recorded their settings still load.
TEST(CheckpointState, ASchedulerWithOtherSettingsIsNamedAndOldFilesStillLoad) {
  test::TempDir dir;
  const std::string path = dir.file("c.safetensors");
  auto make = [](optim::Optimizer& o, int64_t t_max) {
    auto w = std::make_shared<optim::LinearLR>(o, optim::LinearLROptions{.start_factor = 0.5, .total_iters = 2});
    auto c = std::make_shared<optim::CosineAnnealingLR>(o, optim::CosineAnnealingLROptions{.T_max = t_max});
    return std::make_unique<optim::SequentialLR>(o, std::vector<std::shared_ptr<optim::LRScheduler>>{w, c},
                                                 std::vector<int64_t>{2});
  };
  auto model = linear(1);
  optim::SGD opt(model->named_parameters(), {.lr = 0.1});
  auto sched = make(opt, 100);
  model->weight.mutable_grad() = ones_like(model->weight);
  model->bias.mutable_grad() = ones_like(model->bias);
  for (int i = 0; i < 4; ++i) {
    opt.step();
    sched->step();
  }
  train::save_checkpoint(path, {.model = model.get(), .optimizer = &opt, .scheduler = sched.get()}, {});

  auto model2 = linear(2);
  optim::SGD opt2(model2->named_parameters(), {.lr = 0.1});
  auto other = make(opt2, 50);
  const Tensor w_before = model2->weight.clone();
  const std::string msg = test::error_message<ValueError>(
      [&] { train::load_checkpoint(path, {.model = model2.get(), .optimizer = &opt2, .scheduler = other.get()}); });
  EXPECT_NE(msg.find("scheduler 1: T_max is 100 in the saved state, 50 in this scheduler"), std::string::npos) << msg;
  EXPECT_TRUE(test::bitwise_equal(model2->weight, w_before));
  EXPECT_EQ(other->last_epoch(), 0);

  // The same file without the type and settings keys, as kiln wrote it before.
  rewrite_metadata(path, [](io::Metadata& md) {
    for (auto it = md.begin(); it != md.end();) {
      const bool recorded = it->first.rfind("sched.", 0) == 0 &&
                            (it->first.find(".setting.") != std::string::npos || it->first.ends_with(".type"));
      it = recorded ? md.erase(it) : std::next(it);
    }
  });
  train::load_checkpoint(path, {.model = model2.get(), .optimizer = &opt2, .scheduler = other.get()});
  EXPECT_EQ(other->last_epoch(), 4);
  EXPECT_EQ(other->get_last_lr(), sched->get_last_lr());
}

}  // namespace
}  // namespace kiln
