// The autograd graph (DESIGN.md §3): a Node is one backward function; its
// next_edges point at the Nodes that produced its forward inputs. A tensor
// that requires grad holds (grad_fn, output_nr): which Node produced it and
// which of that Node's outputs it is.
//
// Note [Backward nodes save only what they need]
// A forward op builds a small Node subclass holding exactly the tensors and
// values its formula needs (flashlight's style), wrapped in SavedVariable so
// that an in-place change before backward is caught with names attached.
#pragma once

#include <cstdint>
#include <functional>
#include <source_location>
#include <string>
#include <vector>

#include "kiln/core/intrusive_ptr.h"
#include "kiln/core/tensor.h"

namespace kiln::autograd {

class Node;

/// Where a gradient goes: input `input_nr` of `function`. An edge without a
/// function means "this input needs no gradient".
struct Edge {
  IntrusivePtr<Node> function;
  uint32_t input_nr = 0;
  bool is_valid() const { return static_cast<bool>(function); }
};

/// Shape and dtype of one forward output, so the engine can check the
/// gradient a backward formula returns for it (and reduce broadcast dims).
struct InputMeta {
  DimVector shape;
  DType dtype = kFloat32;
};

/// A call site: file:line of the forward op that built the node, or of an in-place op.
struct CallSite {
  const char* file = nullptr;
  uint32_t line = 0;
  bool known() const { return file != nullptr; }
  /// Also notes the site for the allocator (memory::note_call_site): the op about to run allocates for it.
  static CallSite from(const std::source_location& loc) {
    memory::note_call_site(loc.file_name(), loc.line());
    return {loc.file_name(), loc.line()};
  }
  std::string str() const;
};

class Node : public RefCounted {
 public:
  Node();
  ~Node() override;

  /// "MulBackward0"-style names, as PyTorch prints them.
  virtual const char* name() const = 0;
  /// grads[i]: gradient w.r.t. forward output i (undefined means zero).
  /// Returns one gradient per next edge (undefined where none flows).
  virtual TensorList apply(TensorList&& grads) = 0;
  /// Frees saved tensors once backward has run without retain_graph.
  virtual void release_variables() {}

  const std::vector<Edge>& next_edges() const { return next_edges_; }
  std::vector<Edge>& mutable_next_edges() { return next_edges_; }
  void add_next_edge(Edge e) { next_edges_.push_back(std::move(e)); }

  /// Registers a forward output; returns its output_nr.
  uint32_t add_input_metadata(const Tensor& output);
  const std::vector<InputMeta>& input_metadata() const { return input_meta_; }
  size_t num_inputs() const { return input_meta_.size(); }

  /// Creation order: the engine runs later nodes first among ready ones.
  uint64_t sequence_nr() const { return sequence_nr_; }
  CallSite site() const { return site_; }
  void set_site(CallSite s) { site_ = s; }

  /// Hooks on the gradients flowing into this node (tensor hooks of non-leaves live here).
  using PreHook = std::function<Tensor(const Tensor&)>;
  void add_pre_hook(uint32_t output_nr, uint64_t id, PreHook h);
  bool remove_pre_hook(uint64_t id);
  void run_pre_hooks(TensorList& grads);
  /// For retain_grad() on non-leaves: stores into the tensor's .grad.
  bool has_pre_hooks() const { return !pre_hooks_.empty(); }

 private:
  struct PreHookEntry {
    uint32_t output_nr;
    uint64_t id;
    PreHook fn;
  };
  std::vector<Edge> next_edges_;
  std::vector<InputMeta> input_meta_;
  std::vector<PreHookEntry> pre_hooks_;
  uint64_t sequence_nr_;
  CallSite site_;
  // Links in the census of live nodes (graph_census.h), set only while it is on.
  Node* census_prev_ = nullptr;
  Node* census_next_ = nullptr;
  bool in_census_ = false;
  friend struct NodeCensus;
};

using NodePtr = IntrusivePtr<Node>;

}  // namespace kiln::autograd
