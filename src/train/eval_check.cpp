// EvalCheck (include/kiln/train/eval_check.h).
#include "kiln/train/eval_check.h"

#include <cmath>
#include <cstdio>
#include <exception>
#include <iostream>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/norm.h"

namespace kiln::train {

namespace {

std::vector<float> as_floats(const Tensor& t) {
  NoGradGuard ng;
  Tensor c = t.detach().to(kFloat32).contiguous();
  const float* p = c.data_ptr<float>();
  return std::vector<float>(p, p + c.numel());
}

int64_t batches_of(const nn::BatchNorm& bn) {
  return bn.num_batches_tracked.defined() ? bn.num_batches_tracked.item<int64_t>() : -1;
}

std::string g3(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

}  // namespace

struct EvalCheck::State {
  struct Watched {
    TrainModeModule info;
    nn::Module* module = nullptr;
    nn::BatchNorm* bn = nullptr;
    std::vector<float> running_mean;  // before the evaluation
  };
  std::vector<Watched> watched;
  // Forward counts live apart from `watched` so the hooks' closures hold a stable address.
  std::shared_ptr<std::vector<int64_t>> forwards = std::make_shared<std::vector<int64_t>>();
  std::vector<HookHandle> hooks;
  bool finished = false;

  void remove_hooks() {
    for (auto& h : hooks) h.remove();
    hooks.clear();
  }
};

EvalCheck::EvalCheck(nn::Module& model) : state_(std::make_unique<State>()) {
  for (auto& [path, m] : model.named_modules()) {
    if (!m->is_training()) continue;
    State::Watched w;
    w.info.name = path.empty() ? std::string("(root)") : path;
    w.info.type = m->type_name();
    w.module = m;
    if (auto* d = dynamic_cast<nn::Dropout*>(m)) {
      if (d->p <= 0) continue;  // p = 0 is the identity in either mode
      w.info.p = d->p;
    } else if (auto* bn = dynamic_cast<nn::BatchNorm*>(m)) {
      w.bn = bn;
      w.info.batches_before = batches_of(*bn);
      if (bn->running_mean.defined()) w.running_mean = as_floats(bn->running_mean);
    } else {
      continue;
    }
    state_->watched.push_back(std::move(w));
  }
  state_->forwards->assign(state_->watched.size(), 0);
  for (size_t i = 0; i < state_->watched.size(); ++i) {
    std::shared_ptr<std::vector<int64_t>> counts = state_->forwards;
    state_->hooks.push_back(
        state_->watched[i].module->register_forward_pre_hook([counts, i](nn::Module& self, const Tensor&) {
          if (self.is_training()) ++(*counts)[i];  // a model switched to eval inside the scope is fine
          return Tensor();
        }));
  }
}

EvalCheck::EvalCheck(EvalCheck&&) noexcept = default;

EvalCheck::~EvalCheck() {
  if (!state_ || state_->finished) return;
  if (std::uncaught_exceptions() > 0) {
    state_->remove_hooks();
    return;
  }
  try {
    if (auto r = finish()) std::cerr << "kiln warning: " << r->message << "\n";
  } catch (...) {
    // A destructor reports what it can; a failure to read a buffer is not worth terminating for.
  }
}

std::optional<EvalModeReport> EvalCheck::finish() {
  KILN_CHECK(state_ && !state_->finished, ValueError, "EvalCheck::finish: expected one call, got a second");
  state_->finished = true;
  state_->remove_hooks();
  EvalModeReport r;
  std::string bn_text, dropout_text;
  for (size_t i = 0; i < state_->watched.size(); ++i) {
    State::Watched& w = state_->watched[i];
    w.info.forwards = (*state_->forwards)[i];
    if (w.info.forwards == 0) continue;
    if (w.bn) {
      w.info.batches_after = batches_of(*w.bn);
      if (!w.running_mean.empty() && w.bn->running_mean.defined()) {
        const std::vector<float> now = as_floats(w.bn->running_mean);
        for (size_t k = 0; k < now.size() && k < w.running_mean.size(); ++k)
          w.info.running_mean_moved =
              std::max(w.info.running_mean_moved, std::abs(static_cast<double>(now[k]) - w.running_mean[k]));
      }
      bn_text += (bn_text.empty() ? "" : "; ") + w.info.name + " (" + w.info.type + "): ";
      if (w.info.batches_before >= 0)
        bn_text += "num_batches_tracked " + std::to_string(w.info.batches_before) + " -> " +
                   std::to_string(w.info.batches_after) + ", running_mean moved by up to " +
                   g3(w.info.running_mean_moved);
      else
        bn_text += std::to_string(w.info.forwards) + " forward(s) normalised with the batch's own statistics";
    } else {
      dropout_text += (dropout_text.empty() ? "" : "; ") + w.info.name + " (" + w.info.type + " p=" + g3(w.info.p) +
                      "): " + std::to_string(w.info.forwards) + " forward(s) dropping units";
    }
    r.modules.push_back(w.info);
  }
  if (r.modules.empty()) return std::nullopt;
  r.message = "the evaluation ran in training mode (model.eval() was not called): " + std::to_string(r.modules.size()) +
              " module(s) behaved as in training";
  if (!bn_text.empty()) r.message += "; BatchNorm updated its running statistics from the evaluation data: " + bn_text;
  if (!dropout_text.empty()) r.message += "; Dropout was active: " + dropout_text;
  r.message +=
      ". Call model.eval() before evaluating and model.train() after; NoGradGuard / InferenceMode turn off "
      "gradients, not training mode";
  return r;
}

}  // namespace kiln::train
