#pragma once
// The memory model behind `kiln plan` (docs/memory.md, "Planning memory"):
// bytes per rank by category for a model under a parallel layout (data
// parallelism with ZeRO stages 0-3, tensor and pipeline parallelism,
// micro-batches, precision, optimizer, activation checkpointing). Pure
// arithmetic, no I/O, so every formula is unit-tested; the CLI (cli/plan.h)
// fills PlanModel from flags or from a zoo config and prints the result.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace kiln::cli {

enum class PlanPrecision { FP32, BF16, FP16 };
enum class PlanOptimizer { SGD, Momentum, Adam, AdamW, RMSprop, RMSpropMomentum };

const char* plan_precision_name(PlanPrecision p);
const char* plan_optimizer_name(PlanOptimizer o);

/// Figures traced from one real training step of a zoo model (bytes, this rank).
struct PlanTrace {
  double activation = 0;  // peak of the Activation category
  double workspace = 0;   // peak of the Workspace category (oneDNN scratchpads: temporaries)
  double data = 0;        // input batches the loader holds (current + prefetched)
};

struct PlanModel {
  double params = 0;  // Ψ, all parameters
  // Transformer dimensions for the activation formula (0: unknown, activations not estimated).
  int64_t layers = 0, d_model = 0, heads = 0, vocab = 0, seq = 0;
  // kiln's own mixed precision (`amp`): autocast over fp32 weights, so parameters and
  // gradients stay fp32 and there is no master copy. Off: the Megatron/ZeRO scheme
  // (16-bit parameters and gradients, fp32 master weights in the optimizer).
  bool autocast_weights = false;
  // fp32 parameter bytes as kiln's allocator charges them (each tensor rounded up to
  // 64 B); 0: 4 Ψ.
  double fp32_param_bytes = 0;
  // Zoo configs: activations and temporaries traced from one step at this precision,
  // micro-batch and checkpointing (cli/plan.cpp); empty: the transformer formulas.
  std::function<PlanTrace(PlanPrecision, int64_t micro_batch, bool checkpointing)> trace;
  bool has_dims() const { return layers > 0 && d_model > 0 && heads > 0 && vocab > 0 && seq > 0; }
};

struct PlanLayout {
  int64_t dp = 1, zero = 0, tp = 1, pp = 1, micro_batches = 1;
  int64_t batch = 1;  // samples per data-parallel replica per optimizer step
  PlanPrecision precision = PlanPrecision::BF16;
  PlanOptimizer optimizer = PlanOptimizer::Adam;
  bool checkpointing = false;  // per transformer block
  int64_t micro_batch() const { return batch / micro_batches; }
};

struct PlanRow {
  std::string category;  // parameters, gradients, optimizer_state, master_weights, activations, ...
  double bytes = 0;
  std::string formula;       // how the figure was obtained, for the table
  bool model_state = false;  // parameters, gradients, optimizer state, master weights
};

struct PlanResult {
  std::vector<PlanRow> rows;
  double model_states = 0;  // the ZeRO paper's Table 1 figure
  double total = 0;
  std::string dominant;  // the largest row's category
  const PlanRow& row(const std::string& category) const;
};

/// The per-rank prediction. Throws std::invalid_argument when the layout does not
/// apply to the model (a message naming the flag, e.g. "--tp 3: ...").
PlanResult plan_memory(const PlanModel& model, const PlanLayout& layout);

/// One change to the layout and its effect.
struct PlanLever {
  std::string name;    // checkpointing, zero, bf16, tp, pp, micro_batches, batch
  std::string change;  // "--zero 3", "--checkpointing blocks"
  PlanLayout layout;
  double total = 0;
  bool fits = false;
};

/// Every lever that applies, each alone, in the order they are worth trying
/// (checkpointing, a higher ZeRO stage, bf16, more tensor then pipeline parallelism,
/// more micro-batches, a smaller batch); for the stepped ones (ZeRO stage, tp, pp,
/// micro-batches, batch) the smallest step that fits, or else the largest tried.
std::vector<PlanLever> plan_levers(const PlanModel& model, const PlanLayout& layout, double device_mem);

/// Parameters of a GPT (nanoGPT layout: learned positions, tied embedding, biases):
/// 12 L h² + 13 L h + V h + s h + 2 h.
double gpt_param_count(int64_t layers, int64_t d_model, int64_t vocab, int64_t seq);

/// "80GiB", "80GB", "1.5TiB", "512MiB", "1e9" (bytes): decimal units are powers of
/// 1000, binary ones of 1024. nullopt when not a size.
std::optional<double> parse_byte_size(const std::string& text);

}  // namespace kiln::cli
