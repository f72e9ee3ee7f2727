#include "kiln/autograd/node.h"

#include <algorithm>
#include <atomic>

#include "kiln/autograd/graph_census.h"

namespace kiln::autograd {

namespace {
std::atomic<uint64_t> g_sequence{0};
}

// graph_census.cpp
void census_join(Node* n);
void census_leave(Node* n);

uint64_t next_sequence_nr() { return g_sequence.load(std::memory_order_relaxed); }

std::string CallSite::str() const {
  if (!file) return "<unknown>";
  std::string f = file;
  // Paths relative to the source tree read better than absolute build paths.
  if (auto pos = f.rfind("/src/"); pos != std::string::npos) f = f.substr(pos + 1);
  // Builds with relative paths (ccache's base_dir) give "../../tests/x.cpp": drop the climb.
  while (f.starts_with("../") || f.starts_with("./")) f.erase(0, f.find('/') + 1);
  return f + ":" + std::to_string(line);
}

Node::Node() : sequence_nr_(g_sequence.fetch_add(1, std::memory_order_relaxed)) { census_join(this); }
Node::~Node() {
  if (in_census_) census_leave(this);
  // Freeing a long chain would recurse once per node (each node drops the
  // last reference to the next). Instead, the outermost destructor on this
  // thread collects nodes that are about to die and frees them in a loop.
  thread_local std::vector<NodePtr> pending;
  thread_local bool draining = false;
  for (Edge& e : next_edges_) {
    if (e.function && e.function.use_count() == 1) pending.push_back(std::move(e.function));
  }
  next_edges_.clear();
  if (draining) return;
  draining = true;
  while (!pending.empty()) {
    NodePtr n = std::move(pending.back());
    pending.pop_back();
    n.reset();  // may push this node's children onto `pending`
  }
  draining = false;
}

uint32_t Node::add_input_metadata(const Tensor& output) {
  input_meta_.push_back({DimVector(output.sizes()), output.dtype()});
  return static_cast<uint32_t>(input_meta_.size() - 1);
}

void Node::add_pre_hook(uint32_t output_nr, uint64_t id, PreHook h) {
  pre_hooks_.push_back({output_nr, id, std::move(h)});
}

bool Node::remove_pre_hook(uint64_t id) {
  auto it = std::find_if(pre_hooks_.begin(), pre_hooks_.end(), [&](const PreHookEntry& e) { return e.id == id; });
  if (it == pre_hooks_.end()) return false;
  pre_hooks_.erase(it);
  return true;
}

void Node::run_pre_hooks(TensorList& grads) {
  for (auto& h : pre_hooks_) {
    if (h.output_nr >= grads.size() || !grads[h.output_nr].defined()) continue;
    Tensor r = h.fn(grads[h.output_nr]);
    if (r.defined()) grads[h.output_nr] = r;
  }
}

}  // namespace kiln::autograd
