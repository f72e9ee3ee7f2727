// Note [PowerSGD in checkpoints]
// PowerSGD carries state from step to step: each compressed gradient's last Q
// (warm start) and each rank's error feedback (what the approximation left
// out of that rank's gradient), besides its count of steps and the generator
// of new Qs. A resumed run without them starts PowerSGD afresh and computes
// other gradients from its first step on. torch leaves the saving to the user
// (PowerSGDState pickles, per rank); `kiln train` saves it in the run's one
// checkpoint file, which rank 0 writes: the Qs and counts as rank 0 has them
// (every rank has the same), and the errors of every rank, gathered before the
// save, as [world, n, m] stacks. On resume each rank takes its own row. At
// another world size the errors have no owner: the Qs and the count are still
// restored, and the run says that the error feedback starts from zero. Under
// other PowerSGD settings (another rank) the state does not fit and PowerSGD
// starts afresh, which the run says too.
#include "cli/powersgd_checkpoint.h"

#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"

namespace kiln::cli {

namespace {

constexpr std::string_view kQ = "q.";  // tensor keys: "q.<parameter>", "error.<parameter>"
constexpr std::string_view kError = "error.";

}  // namespace

PowerSgdCheckpoint::PowerSgdCheckpoint(dist::DistributedDataParallel* ddp, dist::ProcessGroupPtr group,
                                       std::string unused_because)
    : ddp_(ddp), group_(std::move(group)), unused_because_(std::move(unused_because)) {}

void PowerSgdCheckpoint::gather() {
  if (ddp_ == nullptr) return;
  const dist::PowerSGDState s = ddp_->powersgd_state();
  const int world = group_ ? group_->size() : 1;
  io::ObjectState o;
  o.values["iter"] = s.iter;
  // The generator's words as int64 bit patterns (a state value has no unsigned kind).
  o.values["rng_seed"] = static_cast<int64_t>(s.rng.seed);
  o.values["rng_offset"] = static_cast<int64_t>(s.rng.offset);
  o.values["world_size"] = static_cast<int64_t>(world);
  o.values["matrix_approximation_rank"] = ddp_->options().powersgd.matrix_approximation_rank;
  for (const auto& [name, q] : s.q) o.tensors[std::string(kQ) + name] = q;
  // Every rank has errors for the same gradients (all compress the same
  // matrices at the same steps), so the allgathers pair up across ranks.
  for (const auto& [name, e] : s.error) {
    std::vector<Tensor> all(static_cast<size_t>(world));
    if (world == 1) {
      all[0] = e;
    } else {
      for (auto& a : all) a = empty(e.sizes());
      const dist::CollectiveLabel label("PowerSGD state for the checkpoint");
      group_->allgather(all, e.contiguous())->wait();
    }
    o.tensors[std::string(kError) + name] = stack(all);
  }
  if (!group_ || group_->rank() == 0) gathered_ = std::move(o);  // the rank that writes the file
}

void PowerSgdCheckpoint::load_state_dict(const io::ObjectState& state) {
  loaded_ = state;
  has_loaded_ = true;
}

std::string PowerSgdCheckpoint::apply() {
  if (!has_loaded_)
    return ddp_ == nullptr ? ""
                           : "PowerSGD starts afresh: the checkpoint holds no PowerSGD state (its run did not use "
                             "PowerSGD, or kept no state for it), so the resumed run's gradients leave the ones an "
                             "uninterrupted run would have had";
  if (ddp_ == nullptr) return "the checkpoint's PowerSGD state is left unused: " + unused_because_;
  const auto value = [&](const char* key) -> int64_t {
    const auto it = loaded_.values.find(key);
    KILN_CHECK(it != loaded_.values.end() && std::holds_alternative<int64_t>(it->second), ValueError,
               "the checkpoint's PowerSGD state has no integer '", key, "'");
    return std::get<int64_t>(it->second);
  };
  const int world = group_ ? group_->size() : 1, rank = group_ ? group_->rank() : 0;
  dist::PowerSGDState s;
  std::string afresh;
  try {
    s.iter = value("iter");
    s.rng = {static_cast<uint64_t>(value("rng_seed")), static_cast<uint64_t>(value("rng_offset"))};
    const int64_t saved_world = value("world_size");
    const bool errors_fit = saved_world == world;
    bool had_errors = false;
    for (const auto& [key, t] : loaded_.tensors) {
      if (key.starts_with(kQ)) {
        s.q[key.substr(kQ.size())] = t;
      } else if (key.starts_with(kError)) {
        had_errors = true;
        KILN_CHECK(t.dim() >= 1 && t.size(0) == saved_world, ValueError, "the checkpoint's PowerSGD error '", key,
                   "' has shape ", t.sizes(), ", not one row for each of its ", saved_world, " ranks");
        if (errors_fit) s.error[key.substr(kError.size())] = t.select(0, rank).contiguous();
      }
    }
    ddp_->load_powersgd_state(s);
    if (had_errors && !errors_fit)
      return "PowerSGD: its Qs and step count restored (step " + std::to_string(s.iter) +
             "); its error feedback was saved on " + std::to_string(saved_world) + " ranks and this run has " +
             std::to_string(world) + ", so it starts from zero";
    return "PowerSGD: its state restored (step " + std::to_string(s.iter) + ", " + std::to_string(s.q.size()) +
           " compressed gradients" + (had_errors ? " with their error feedback" : "") + ")";
  } catch (const ValueError& e) {
    afresh = e.what();
  }
  return "PowerSGD starts afresh: the checkpoint's state does not fit this run's settings (" + afresh + ")";
}

}  // namespace kiln::cli
