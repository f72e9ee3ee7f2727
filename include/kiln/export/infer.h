// infer::optimize: a kiln module as an optimised inference model that runs on
// kiln's own graph runtime (exporter::Session, runtime.h).
//
//   models::ResNet net = ...;                       // trained
//   infer::InferenceModel m = infer::optimize(net, {example});
//   Tensor logits = m.forward(images);              // any batch size
//   std::puts(m.report().str().c_str());            // nodes before/after, folds, fusions
//
// What it does (docs/export.md, "Inference optimisation"): captures the
// module's eval-mode forward (exporter::capture, with the batch axis, and a
// language model's sequence axis, left symbolic), folds BatchNorm into the
// Conv or Linear before it, removes Identity/Dropout, fuses each Conv and
// Linear with its bias, residual add and ReLU/GELU into one kiln.FusedConv /
// kiln.FusedGemm node and each attention into one kiln.Attention
// (exporter::fuse_for_kiln), and runs those nodes on
// ops::PackedConv2d / ops::PackedLinear (weights packed once into oneDNN's
// layout, the epilogue as oneDNN post-ops) and kiln's blocked attention
// kernel (ops::attention_fused), everything else on the runtime's
// built-in kernels, under InferenceMode. The model is a snapshot: it copies the
// module's weights when it is built and does not see later changes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kiln/export/graph.h"
#include "kiln/export/runtime.h"
#include "kiln/nn/module.h"

namespace kiln::infer {

struct OptimizeOptions {
  /// As exporter::CaptureOptions::dynamic_axes. Empty: the batch (axis 0) is
  /// symbolic, and for int64 token inputs the sequence (axis 1) too.
  std::map<std::string, std::map<int64_t, std::string>> dynamic_axes;
  /// false: the standard passes only (BatchNorm folds, Identity/Dropout
  /// removal), the graph stays plain ONNX and runs on the built-in kernels.
  bool fuse = true;
};

/// What optimize did to the graph.
struct OptimizeReport {
  int64_t nodes_before = 0;  // the captured graph
  int64_t nodes_after = 0;   // the graph that runs
  int64_t batch_norms_folded = 0;
  int64_t identities_removed = 0;
  int64_t fused_conv = 0;  // kiln.FusedConv nodes
  int64_t fused_gemm = 0;  // kiln.FusedGemm nodes
  int64_t attention = 0;   // kiln.Attention nodes
  int64_t absorbed = 0;    // nodes folded into the fused ones
  std::map<std::string, int64_t> ops_before, ops_after;
  /// A few lines: counts, then the op histogram before -> after.
  std::string str() const;
};

/// An optimised inference model: cheap to copy (copies share the compiled graph).
class InferenceModel {
 public:
  InferenceModel(exporter::Graph graph, OptimizeReport report);
  /// One tensor per graph input (the zoo's models have one), one per output.
  std::vector<Tensor> run(const std::vector<Tensor>& inputs) const;
  /// run({x})[0].
  Tensor forward(const Tensor& x) const;
  Tensor operator()(const Tensor& x) const { return forward(x); }
  const exporter::Graph& graph() const;
  const OptimizeReport& report() const { return report_; }

 private:
  std::shared_ptr<const exporter::Session> session_;
  OptimizeReport report_;
};

/// Captures `module` (eval mode; its mode is restored) on `example_inputs`,
/// applies every pass and compiles the result. Throws what capture throws for
/// a module it cannot export (ValueError naming the module).
InferenceModel optimize(nn::Module& module, const std::vector<Tensor>& example_inputs,
                        const OptimizeOptions& options = {});

/// The kernels of kiln's fused node types ("kiln.FusedConv", "kiln.FusedGemm", "kiln.Attention"),
/// for a Session over a graph that exporter::fuse_for_kiln rewrote.
exporter::SessionOptions fused_kernels();

}  // namespace kiln::infer
