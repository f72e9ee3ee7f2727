// Test only: the small models and helpers DDP's tests share (test_ddp.cpp on
// the in-process fake group, test_ddp_mpi.cpp under mpirun).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/dist/ddp.h"
#include "kiln/nn/layers.h"
#include "kiln/optim/optimizer.h"
#include "support/compare.h"

namespace kiln::test {

// Parameters of chosen sizes; the loss touches each one unless it is skipped.
class Blocks : public nn::Module {
 public:
  explicit Blocks(std::vector<int64_t> sizes) : nn::Module("Blocks") {
    for (size_t i = 0; i < sizes.size(); ++i) {
      std::string name = "p";  // not "p" + to_string(i): g++ 12 warns falsely (-Wrestrict) on that
      name += std::to_string(i);
      register_parameter(name, ones({sizes[i]}));
    }
  }
  Tensor forward(const Tensor& x) override {
    Tensor loss = zeros({});
    auto ps = parameters();
    for (size_t i = 0; i < ps.size(); ++i) {
      if (!skip.count(i)) loss = loss + (ps[i] * ps[i]).sum() * x.mean();
    }
    return loss;
  }
  std::set<size_t> skip;
};

// A small MLP; `extra` is used only when use_extra, `never` only when use_never.
class Net : public nn::Module {
 public:
  Net() : nn::Module("Net") {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 6, .out_features = 16}));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 16, .out_features = 16}));
    extra = register_module("extra", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 16, .out_features = 16}));
    never = register_module("never", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 16, .out_features = 3}));
    fc3 = register_module("fc3", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 16, .out_features = 3}));
    register_buffer("step", zeros({2}));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = (*fc1)(x).tanh();
    h = (*fc2)(h).tanh();
    if (use_extra) h = (*extra)(h).tanh();
    return use_never ? (*fc3)(h) + (*never)(h) : (*fc3)(h);
  }
  std::shared_ptr<nn::Linear> fc1, fc2, extra, never, fc3;
  bool use_extra = true;
  bool use_never = false;
};

inline std::shared_ptr<Net> make_net(uint64_t seed) {
  manual_seed(seed);
  return std::make_shared<Net>();
}

inline Tensor mse(const Tensor& out, const Tensor& y) {
  Tensor d = out - y;
  return (d * d).mean();
}

inline void expect_close(const Tensor& got, const Tensor& want, double rtol, double atol, const std::string& what) {
  auto c = compare_tensors(got, want, rtol, atol);
  EXPECT_TRUE(c.ok) << what << ": " << c.message;
}

// The float32 tolerance of the equivalence tests: the per-rank means and the
// allreduce sum the same numbers in another order than one process does, so
// results agree to rounding, |got - want| <= 1e-6 + 1e-5 |want|, after K steps.
constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;

struct Batches {
  std::vector<Tensor> xs, ys;  // [rows, 6] inputs, [rows, 3] targets
};

inline Batches make_batches(int64_t rows, int64_t count, uint64_t seed) {
  manual_seed(seed);
  Batches b;
  for (int64_t k = 0; k < count; ++k) {
    b.xs.push_back(randn({rows, 6}));
    b.ys.push_back(randn({rows, 3}));
  }
  return b;
}

/// One process on the whole batches: one SGD step per batch.
inline void train_reference(Net& net, const Batches& b, double lr = 0.1) {
  optim::SGD opt(net.named_parameters(), {.lr = lr});
  for (size_t k = 0; k < b.xs.size(); ++k) {
    opt.zero_grad();
    mse(net(b.xs[k]), b.ys[k]).backward();
    opt.step();
  }
}

/// Rank `rank` through DDP: rows [rank*B, (rank+1)*B) of each batch, one SGD step per batch.
inline void train_rank(const std::shared_ptr<Net>& net, const dist::ProcessGroupPtr& group, const Batches& b,
                       int64_t B, dist::DDPOptions options, double lr = 0.1) {
  dist::DistributedDataParallel ddp(net, group, options);
  optim::SGD opt(net->named_parameters(), {.lr = lr});
  const int64_t r = group->rank();
  for (size_t k = 0; k < b.xs.size(); ++k) {
    opt.zero_grad();
    mse(ddp(b.xs[k].narrow(0, r * B, B)), b.ys[k].narrow(0, r * B, B)).backward();
    opt.step();
  }
}

inline void expect_same_parameters(nn::Module& got, nn::Module& want, const std::string& who) {
  auto g = got.named_parameters();
  auto w = want.named_parameters();
  ASSERT_EQ(g.size(), w.size());
  for (size_t i = 0; i < w.size(); ++i) expect_close(g[i].second, w[i].second, kRtol, kAtol, who + ": " + w[i].first);
}

}  // namespace kiln::test
