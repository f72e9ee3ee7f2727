#pragma once
// DistributedDataParallel: data-parallel training over a ProcessGroup, as
// torch.nn.parallel.DistributedDataParallel (DESIGN.md §6).
//
// Each rank holds a full replica of the module and runs forward and backward
// on its own share of the batch. The wrapper keeps the replicas identical:
// parameters and buffers are broadcast from rank 0 when it is built; during
// backward, gradients are packed into flat buckets (reverse registration
// order, about the order backward produces them) and each bucket's allreduce
// starts as soon as its last gradient is accumulated, so communication
// overlaps the rest of backward; when backward ends every allreduce is waited
// and each .grad holds the average over ranks. The optimizer is then stepped
// on every rank alike.
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/generator.h"
#include "kiln/dist/process_group.h"
#include "kiln/nn/module.h"

namespace kiln::dist {

/// What a bucket's communication is (torch's DDP communication hooks, the
/// built-in ones). Allreduce: the float32 average. Bf16Compress and
/// Fp16Compress (torch's bf16_compress_hook and fp16_compress_hook): each
/// float32 bucket travels as bfloat16 or float16, half the bytes; every
/// gradient is rounded to it once on the way in and the average once on the
/// way out (summed in float32 in between), so .grad holds bfloat16- or
/// float16-representable values. float16 keeps 3 more mantissa bits but
/// overflows above 65504 (a gradient that large arrives as inf, which
/// GradScaler or the anomaly checks then report); bfloat16 keeps float32's
/// range. Buckets of bfloat16 parameters are already 16-bit and are averaged
/// as they are. docs/ddp.md, "Compressed gradients".
/// PowerSGD (torch's powerSGD_hook): each gradient matrix worth it travels
/// as two rank-r factors and arrives as a rank-r approximation of the
/// average, with error feedback; see PowerSGDOptions and docs/ddp.md.
/// Custom: a function of the user's (CommHookFn), registered with register_comm_hook.
enum class CommHook { Allreduce, Bf16Compress, Fp16Compress, PowerSGD, Custom };

/// "allreduce", "bf16_compress", "fp16_compress", "powersgd" (the names torch's hooks go by), "custom".
const char* comm_hook_name(CommHook hook);

/// What a custom communication hook sees of a bucket (torch's dist.GradBucket).
struct GradBucket {
  size_t index = 0;                // in launch order: 0 is the bucket whose gradients backward makes first
  bool is_last = false;            // the last bucket of this backward
  Tensor buffer;                   // the bucket's gradients, flat (float32, or bfloat16 for bf16 parameters)
  std::vector<Tensor> gradients;   // parameter-shaped views into buffer
  std::vector<size_t> parameters;  // their indices into parameter_names()
};

/// A custom communication hook (torch's register_comm_hook(state, hook) with
/// a hook of one's own): called on the backward thread when a bucket's
/// gradients are ready, in bucket order and on every rank alike; it starts the
/// bucket's communication over `group` and returns its Work (null when it is
/// already done). When that Work's wait() returns, `bucket.buffer` must hold
/// what .grad should be: for training as DDP does, the average over ranks.
/// dist::then(work, fn) chains a last step, as torch's fut.then.
using CommHookFn = std::function<WorkPtr(ProcessGroup& group, GradBucket& bucket)>;

/// torch's PowerSGDState hyperparameters, with its defaults, for CommHook::PowerSGD.
struct PowerSGDOptions {
  /// r: a compressed [n, m] gradient travels as P [n, r] and Q [m, r].
  int64_t matrix_approximation_rank = 1;
  /// Synced backwards that average plainly before compression starts: early
  /// gradients change fast and an approximation slows training most there.
  int64_t start_powerSGD_iter = 1000;
  /// A gradient (viewed as [shape[0], rest]) is compressed when n·m exceeds
  /// (n + m)·r times this; vectors and small or thin matrices are averaged as they are.
  double min_compression_rate = 2;
  /// Each step adds back what the last approximation left out of this rank's gradient.
  bool use_error_feedback = true;
  /// Each step's power iteration starts from the last step's Q.
  bool warm_start = true;
  /// Added to a column's norm in Gram-Schmidt (0, torch's default: exact normalisation).
  double orthogonalization_epsilon = 0;
  /// Seeds the first Qs, the same on every rank.
  uint64_t random_seed = 0;
};

/// CommHook::PowerSGD's state between steps: what torch's PowerSGDState
/// holds and a checkpoint must keep for a resumed run to compute what the
/// uninterrupted run does. Gradients are named as parameter_names(); only
/// those PowerSGD compresses appear, and only once they have a Q or an error.
struct PowerSGDState {
  int64_t iter = 0;                     // synced backwards so far, the plain ones included
  GeneratorState rng;                   // the generator of new Qs, the same on every rank
  std::map<std::string, Tensor> q;      // each compressed gradient's last Q [m, r]: the same on every rank
  std::map<std::string, Tensor> error;  // this rank's error feedback [n, m], its own
};

struct DDPOptions {
  /// A bucket holds parameters while their gradients fit in this many MiB; a
  /// single larger parameter gets a bucket of its own.
  double bucket_cap_mb = 25;
  /// The first bucket (the gradients backward produces first) holds at most
  /// min(first_bucket_cap_mb, bucket_cap_mb) MiB, as PyTorch: a small first
  /// bucket starts communicating early in backward.
  double first_bucket_cap_mb = 1;
  /// The last bucket (the gradients backward produces last) holds at most
  /// this many MiB, one parameter at least; 0 leaves it as filling makes it
  /// (PyTorch's layout). kiln's addition: the last bucket's allreduce can only
  /// start when backward has ended, so its size is the communication no
  /// bucketing can hide; split off, the bucket before it runs while backward
  /// computes those last gradients (docs/ddp.md).
  double last_bucket_cap_mb = 1;
  /// After the first synced backward, rebuild the buckets in the order its
  /// gradients actually became ready (rank 0's order, broadcast at the next
  /// synced forward so that every rank lays out the same buckets). Not done
  /// with find_unused_parameters, whose ready order varies by iteration.
  bool rebuild_buckets = true;
  /// Parameters that got no gradient in a backward pass are treated as having
  /// a zero one (they then take part in the average); off, they are an error.
  bool find_unused_parameters = false;
  /// Each .grad is a view into its bucket, so no copy in or out of it.
  bool gradient_as_bucket_view = true;
  /// Broadcast buffers (BatchNorm's running statistics) from rank 0 before each forward.
  bool broadcast_buffers = true;
  /// How buckets are communicated; register_comm_hook() sets it after construction.
  CommHook comm_hook = CommHook::Allreduce;
  /// CommHook::PowerSGD's settings.
  PowerSGDOptions powersgd = {};
};

/// Parameters in one bucket: indices into parameters() order, in the order
/// they are laid out in the bucket.
struct BucketInfo {
  std::vector<size_t> params;
  int64_t bytes = 0;
  DType dtype = DType::Float32;
};

/// What the last backward pass did, for figures and tests. Times are seconds
/// since the forward that preceded it ended.
struct DDPStats {
  int64_t allreduces = 0;             // buckets launched
  double first_allreduce_start = -1;  // first bucket launched
  double last_gradient_ready = -1;    // the last hook: backward's compute has ended
  double backward_end = -1;           // the end-of-backward callback began
  double exposed_comm_seconds = 0;    // time the callback spent waiting on allreduces
  /// Bytes of gradients each rank handed to the allreduces (2 per value when compressed).
  int64_t wire_bytes = 0;
  /// The buckets of this backward went through PowerSGD (CommHook::PowerSGD past start_powerSGD_iter).
  bool powersgd = false;
  /// Parameters whose gradients were still pending when the first bucket
  /// launched: > 0 means that allreduce overlapped the rest of backward.
  int64_t pending_at_first_allreduce = 0;
  /// Bucket indices in launch order (always 0, 1, 2 ...: every rank issues them alike).
  std::vector<size_t> launch_order;
  /// Parameter indices (parameters() order) in the order their gradients
  /// became ready in this backward; unused parameters marked ready are included.
  std::vector<size_t> ready_order;
};

class DistributedDataParallel : public nn::Module {
 public:
  DistributedDataParallel(std::shared_ptr<nn::Module> module, ProcessGroupPtr group, DDPOptions options = {});
  ~DistributedDataParallel() override;

  /// Broadcasts buffers (if broadcast_buffers) and runs the wrapped module.
  Tensor forward(const Tensor& input) override;

  const std::shared_ptr<nn::Module>& module() const { return module_; }
  const ProcessGroupPtr& process_group() const { return group_; }
  const DDPOptions& options() const { return options_; }
  const std::vector<BucketInfo>& buckets() const { return buckets_; }
  /// The wrapped module's parameter names in parameters() order (BucketInfo indexes them).
  const std::vector<std::string>& parameter_names() const { return names_; }
  const DDPStats& stats() const { return stats_; }
  /// torch's register_comm_hook with one of its built-in hooks: from the next
  /// backward on, buckets are communicated as `hook` says. Every rank must
  /// register the same hook (KILN_DIST_DEBUG=1 names a rank that did not);
  /// not while a backward is running.
  void register_comm_hook(CommHook hook);
  /// register_comm_hook(CommHook::PowerSGD) with these settings (torch's
  /// register_comm_hook(PowerSGDState(...), powerSGD_hook)).
  void register_comm_hook(const PowerSGDOptions& powersgd);
  /// A hook of one's own (CommHook::Custom); every rank must register one.
  void register_comm_hook(CommHookFn hook);
  /// CommHook::PowerSGD's state now, as copies (ValueError under another hook).
  PowerSGDState powersgd_state() const;
  /// Replaces the PowerSGD state with one that powersgd_state() gave on this
  /// rank (errors are a rank's own) under the same options; each gradient's Q
  /// and error go back into its bucket when it next compresses. ValueError,
  /// with nothing changed, for a name that is not a compressed gradient or a
  /// tensor that is not its [m, r] Q or [n, m] error; not during a backward.
  void load_powersgd_state(const PowerSGDState& state);
  /// Whether the buckets were rebuilt in the order gradients became ready
  /// (rebuild_buckets; happens at the second synced forward).
  bool buckets_rebuilt() const { return rebuilt_; }

  /// While a NoSync guard lives, backward only accumulates gradients locally;
  /// the first backward after it averages everything accumulated.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool prev_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

 private:
  struct Bucket;
  /// Lays the parameters out in buckets, filling them in `order` (parameter indices).
  void assign_buckets(const std::vector<size_t>& order);
  void split_last_buckets();
  /// rebuild_buckets: agree on rank 0's ready order and lay the buckets out by it.
  void maybe_rebuild_buckets();
  void broadcast_state(bool params);
  void on_gradient_ready(size_t index);
  void launch_ready_buckets();
  void find_unused(const Tensor& out);
  void mark_unused_ready(size_t index);
  void finalize_backward();
  double now() const;

  std::shared_ptr<nn::Module> module_;
  ProcessGroupPtr group_;
  DDPOptions options_;
  std::vector<Tensor> params_;
  std::vector<std::string> names_;
  std::vector<BucketInfo> buckets_;
  std::vector<std::unique_ptr<Bucket>> state_;
  std::vector<size_t> bucket_of_;  // param index -> bucket
  std::vector<size_t> slot_of_;    // param index -> position within its bucket
  std::vector<char> ready_;
  std::vector<int64_t> had_grad_;          // 0: unused and without a gradient (for the global usage map)
  std::vector<size_t> unused_in_forward_;  // find_unused_parameters: not reached by the last forward
  std::vector<HookHandle> hooks_;
  size_t next_launch_ = 0;
  int64_t num_ready_ = 0;
  bool in_backward_ = false;
  bool sync_ = true;
  // rebuild_buckets: the first synced backward's ready order, whether one
  // began, and whether the buckets were rebuilt (or the attempt made).
  std::vector<size_t> first_ready_order_;
  bool synced_backward_seen_ = false;
  bool rebuild_decided_ = false;
  bool rebuilt_ = false;
  std::chrono::steady_clock::time_point epoch_;
  DDPStats stats_;
  // CommHook::PowerSGD: synced backwards so far, whether this one compresses,
  // and the generator of the first Qs (seeded alike on every rank).
  CommHookFn custom_hook_;      // CommHook::Custom's function
  bool hook_verified_ = false;  // the ranks' hooks were compared (at the first synced backward)
  int64_t powersgd_iter_ = 0;
  bool powersgd_now_ = false;
  Generator powersgd_rng_;
  // Parameter -> (Q, error) held outside the buckets: kept over a bucket
  // rebuild or loaded, put back when the parameter's bucket next compresses.
  std::map<size_t, std::pair<Tensor, Tensor>> powersgd_kept_;
  /// Copies of the (Q, error) of every compressed gradient in the buckets, by parameter index.
  std::map<size_t, std::pair<Tensor, Tensor>> bucket_powersgd_state() const;
};

}  // namespace kiln::dist
