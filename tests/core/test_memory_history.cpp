// Memory history (kiln/core/memory_history.h): every live block knows the call
// site in user code that made it, its op, shape and dtype; snapshots group by
// site; the peak table survives the free; OutOfMemory lists the sites and
// picks the lever. The allocator is process-wide, so tests look for their own
// lines rather than totals.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "kiln/kiln.h"

using namespace kiln;
using json = nlohmann::json;

namespace {

// Turns history on for one test and off (clearing it) after.
struct History {
  History() { memory::record_history(true); }
  ~History() { memory::record_history(false); }
};

struct LimitGuard {
  int64_t prev = memory::limit();
  ~LimitGuard() { memory::set_limit(prev); }
};

std::string here(int line) { return "test_memory_history.cpp:" + std::to_string(line); }

// The site row for `line` (and `category`), or nullptr.
const memory::SiteUsage* find_site(const memory::Snapshot& s, int line, MemoryCategory category) {
  for (const auto& u : s.sites)
    if (u.site.ends_with(here(line)) && u.category == category) return &u;
  return nullptr;
}

}  // namespace

TEST(MemoryHistory, OffByDefaultAndSnapshotSaysSo) {
  ASSERT_FALSE(memory::recording_history());
  Tensor a = zeros({1000});
  const memory::Snapshot s = memory::snapshot();
  EXPECT_FALSE(s.history);
  EXPECT_TRUE(s.sites.empty());
  EXPECT_GE(s.stats.live_bytes, 4000);
  EXPECT_EQ(json::parse(memory::snapshot_json(s))["history"], false);
}

TEST(MemoryHistory, FactoriesAndOpsAreChargedToTheCallersLine) {
  History h;
  const int l_factory = __LINE__ + 1;
  Tensor a = randn({256, 128});
  Tensor w = randn({128, 64});
  const int l_op = __LINE__ + 1;
  Tensor y = a.matmul(w);
  const int l_nested = __LINE__ + 1;  // log_softmax runs other ops inside kiln: still this line
  Tensor z = y.log_softmax(1);
  const memory::Snapshot s = memory::snapshot(1000);
  ASSERT_TRUE(s.history);

  const auto* fa = find_site(s, l_factory, MemoryCategory::Activation);
  ASSERT_NE(fa, nullptr) << memory::format_sites(s, 50);
  EXPECT_EQ(fa->bytes, static_cast<int64_t>(memory::rounded_size(256 * 128 * 4)));
  EXPECT_EQ(fa->tensors, 1);
  EXPECT_EQ(fa->largest_shape, DimVector({256, 128}));
  EXPECT_EQ(fa->largest_dtype, kFloat32);

  const auto* fy = find_site(s, l_op, MemoryCategory::Activation);
  ASSERT_NE(fy, nullptr) << memory::format_sites(s, 50);
  EXPECT_EQ(fy->largest_shape, DimVector({256, 64}));
  EXPECT_EQ(fy->op, "") << "no autograd record, so no op name";
  ASSERT_NE(find_site(s, l_nested, MemoryCategory::Activation), nullptr) << memory::format_sites(s, 50);
  for (const auto& u : s.sites) {
    EXPECT_EQ(u.site.find("src/ops/"), std::string::npos) << "an ops-internal site leaked out: " << u.site;
    EXPECT_EQ(u.site.find("src/autograd/"), std::string::npos) << u.site;
  }
  // The largest live tensors carry shape and dtype.
  bool seen = false;
  for (const auto& t : memory::snapshot(1000, 1000).tensors)
    if (t.site.ends_with(here(l_factory)) && t.shape == DimVector({256, 128}) && t.dtype == kFloat32) seen = true;
  EXPECT_TRUE(seen);
}

TEST(MemoryHistory, AutogradNamesTheOpAndBackwardChargesTheForwardLine) {
  History h;
  Tensor x = randn({64, 32});
  Tensor w = randn({32, 16}, TensorOptions().requires_grad(true));
  const int l_mm = __LINE__ + 1;
  Tensor y = x.matmul(w);
  const int l_view = __LINE__ + 1;
  Tensor v = y.view({-1});  // a view: the bytes stay the matmul's
  {
    const memory::Snapshot s = memory::snapshot(1000);
    const auto* u = find_site(s, l_mm, MemoryCategory::Activation);
    ASSERT_NE(u, nullptr) << memory::format_sites(s, 50);
    EXPECT_EQ(u->op, "Mm");
    EXPECT_EQ(find_site(s, l_view, MemoryCategory::Activation), nullptr);
  }
  v.sum().backward();
  const memory::Snapshot s = memory::snapshot(1000);
  const auto* g = find_site(s, l_mm, MemoryCategory::Gradient);
  ASSERT_NE(g, nullptr) << memory::format_sites(s, 50);
  EXPECT_EQ(g->op, "backward of MmBackward0");
  EXPECT_EQ(g->bytes, static_cast<int64_t>(memory::rounded_size(32 * 16 * 4)));
}

TEST(MemoryHistory, ModuleParametersAndOptimizerStateHaveTheirOwnSites) {
  History h;
  nn::Linear lin({.in_features = 64, .out_features = 32});
  optim::Adam opt(lin, optim::AdamOptions{.lr = 1e-3});
  Tensor x = randn({8, 64});
  lin(x).sum().backward();
  opt.step();
  const memory::Snapshot s = memory::snapshot(1000);
  int64_t params = 0, states = 0;
  for (const auto& u : s.sites) {
    if (u.category == MemoryCategory::Parameter) {
      params += u.bytes;
      EXPECT_NE(u.site.find("src/nn/"), std::string::npos) << "parameters come from the module's code: " << u.site;
    }
    if (u.category == MemoryCategory::OptimizerState) {
      states += u.bytes;
      EXPECT_NE(u.site.find("src/optim/"), std::string::npos) << u.site;
    }
  }
  EXPECT_EQ(params, static_cast<int64_t>(memory::rounded_size(64 * 32 * 4) + memory::rounded_size(32 * 4)));
  EXPECT_GE(states, 2 * params) << "Adam keeps exp_avg and exp_avg_sq per parameter";
}

TEST(MemoryHistory, PeakSnapshotKeepsWhatWasLiveAtThePeak) {
  History h;
  memory::reset_peak_snapshot();
  const int l_big = __LINE__ + 1;
  { Tensor big = zeros({1 << 20}); }  // 4 MiB, freed at once
  const memory::Snapshot now = memory::snapshot(1000);
  EXPECT_EQ(find_site(now, l_big, MemoryCategory::Activation), nullptr);
  const memory::Snapshot peak = memory::peak_snapshot(1000);
  const auto* u = find_site(peak, l_big, MemoryCategory::Activation);
  ASSERT_NE(u, nullptr) << memory::format_sites(peak, 50);
  EXPECT_EQ(u->bytes, int64_t{4} << 20);
  EXPECT_GE(peak.total_bytes, int64_t{4} << 20);
}

TEST(MemoryHistory, SnapshotJson) {
  History h;
  const int line = __LINE__ + 1;
  Tensor a = ones({300, 7}, kFloat64);
  const json j = json::parse(memory::snapshot_json(memory::snapshot(1000, 1000)));
  EXPECT_EQ(j["history"], true);
  for (const char* c : {"parameter", "gradient", "optimizer_state", "activation", "buffer", "data", "workspace"})
    EXPECT_TRUE(j["categories"].contains(c)) << c;
  bool site = false, tensor = false;
  for (const auto& u : j["sites"])
    if (u["site"].get<std::string>().ends_with(here(line))) {
      site = true;
      EXPECT_EQ(u["category"], "activation");
      EXPECT_EQ(u["largest"]["shape"], json::array({300, 7}));
      EXPECT_EQ(u["largest"]["dtype"], "float64");
    }
  for (const auto& t : j["tensors"])
    if (t["site"].get<std::string>().ends_with(here(line))) tensor = t["shape"] == json::array({300, 7});
  EXPECT_TRUE(site);
  EXPECT_TRUE(tensor);
}

TEST(MemoryHistory, OutOfMemoryNamesTheLinesThatHoldMemoryAndTheLever) {
  LimitGuard restore;
  History h;
  const int l_held = __LINE__ + 1;
  Tensor held = zeros({4, 1 << 18});  // 4 MiB of activations
  memory::set_limit(memory::stats().live_bytes + (int64_t{1} << 20));
  try {
    Tensor big = empty({int64_t{4} << 20});
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    for (const std::string& part :
         {std::string("largest live memory by call site"), here(l_held), std::string("[4, 262144] float32"),
          std::string("memory by category"), std::string("hint: activation holds the most"),
          std::string("activation checkpointing"), std::string("KILN_MEMORY_LIMIT")})
      EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in:\n" << msg;
  }
}

TEST(MemoryHistory, OutOfMemoryWithoutHistorySaysHowToGetIt) {
  LimitGuard restore;
  ASSERT_FALSE(memory::recording_history());
  memory::set_limit(memory::stats().live_bytes + 1024);
  try {
    Tensor big = empty({1 << 20});
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("KILN_MEMORY_HISTORY=1"), std::string::npos) << e.what();
  }
}

TEST(MemoryHistory, AdvicePicksTheLeverForTheLargestCategory) {
  memory::Stats s;
  auto set = [&](MemoryCategory c, int64_t b) { s.by_category[static_cast<size_t>(c)].live_bytes = b; };
  set(MemoryCategory::Parameter, 100);
  set(MemoryCategory::OptimizerState, 200);
  set(MemoryCategory::Activation, 50);
  EXPECT_NE(memory::memory_advice(s, false).find("ZeRO-1"), std::string::npos) << memory::memory_advice(s, false);
  set(MemoryCategory::Activation, 1000);
  EXPECT_NE(memory::memory_advice(s, false).find("checkpointing"), std::string::npos);
  EXPECT_NE(memory::memory_advice(s, false).find("77%"), std::string::npos) << memory::memory_advice(s, false);
  set(MemoryCategory::Parameter, 5000);
  EXPECT_NE(memory::memory_advice(s, false).find("bf16"), std::string::npos);
  EXPECT_EQ(memory::memory_advice(memory::Stats{}, true), "no tensor memory is live");
}

TEST(MemoryHistory, TurningItOffForgetsAndLaterFreesAreFine) {
  memory::record_history(true);
  Tensor a = zeros({1000});
  memory::record_history(false);
  EXPECT_FALSE(memory::snapshot().history);
  a = Tensor();  // freed after the table was cleared: nothing to find, nothing breaks
  memory::record_history(true);
  EXPECT_TRUE(memory::snapshot().history);
  memory::record_history(false);
}
