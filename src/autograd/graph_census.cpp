// The live-node census (kiln/autograd/graph_census.h).
#include "kiln/autograd/graph_census.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "kiln/autograd/functions.h"

namespace kiln::autograd {

namespace {
std::atomic<int> g_census_users{0};
}  // namespace

/// Node's friend: owns the intrusive list of census nodes.
struct NodeCensus {
  static NodeCensus& get() {
    static auto* c = new NodeCensus();  // leaked: nodes may die after main returns
    return *c;
  }
  void add(Node* n) {
    std::lock_guard<std::mutex> lock(mu);
    n->census_next_ = head;
    if (head) head->census_prev_ = n;
    head = n;
    n->in_census_ = true;
    ++size;
  }
  void remove(Node* n) {
    std::lock_guard<std::mutex> lock(mu);
    if (!n->in_census_) return;
    if (n->census_prev_)
      n->census_prev_->census_next_ = n->census_next_;
    else
      head = n->census_next_;
    if (n->census_next_) n->census_next_->census_prev_ = n->census_prev_;
    n->census_prev_ = n->census_next_ = nullptr;
    n->in_census_ = false;
    --size;
  }
  std::vector<KeptGraph> kept(uint64_t mark) {
    std::lock_guard<std::mutex> lock(mu);
    std::unordered_set<const Node*> referenced;
    for (Node* n = head; n; n = n->census_next_)
      for (const Edge& e : n->next_edges())
        if (e.function) referenced.insert(e.function.get());
    std::vector<KeptGraph> out;
    for (Node* n = head; n; n = n->census_next_) {
      if (referenced.count(n) || is_accumulate_grad(*n)) continue;
      KeptGraph g{n->site(), n->name(), 0, 0};
      std::unordered_set<const Node*> seen{n};
      std::vector<const Node*> stack{n};
      while (!stack.empty()) {
        const Node* x = stack.back();
        stack.pop_back();
        if (is_accumulate_grad(*x)) continue;
        ++g.nodes;
        if (x->sequence_nr() < mark) ++g.old_nodes;
        for (const Edge& e : x->next_edges())
          if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
      }
      if (g.old_nodes > 0) out.push_back(std::move(g));
    }
    std::sort(out.begin(), out.end(), [](const KeptGraph& a, const KeptGraph& b) { return a.old_nodes > b.old_nodes; });
    return out;
  }

  std::mutex mu;
  Node* head = nullptr;
  int64_t size = 0;
};

void census_join(Node* n) {
  if (g_census_users.load(std::memory_order_relaxed) > 0) NodeCensus::get().add(n);
}
void census_leave(Node* n) { NodeCensus::get().remove(n); }

GraphCensusGuard::GraphCensusGuard() { g_census_users.fetch_add(1, std::memory_order_relaxed); }
GraphCensusGuard::~GraphCensusGuard() { g_census_users.fetch_sub(1, std::memory_order_relaxed); }

int64_t census_size() {
  auto& c = NodeCensus::get();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.size;
}

std::vector<KeptGraph> graphs_holding_nodes_before(uint64_t mark) { return NodeCensus::get().kept(mark); }

}  // namespace kiln::autograd
