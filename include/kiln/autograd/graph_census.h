// A census of live autograd nodes, to find graphs kept alive by mistake.
//
// A training step builds a graph and frees it after backward; a graph that
// survives its step — because a tensor that still has it as history is kept,
// as in `total += loss` — holds every saved activation of that step. While
// the census is on, each new Node joins a list (a mutex-guarded link per
// node), so a leak watch can ask which live graphs still hold nodes older
// than some step, and from which tensor's history: the root node's call site
// is the line that kept it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kiln/autograd/node.h"

namespace kiln::autograd {

/// RAII: nodes created while any guard lives are counted. Nodes made before
/// stay invisible to the census.
class GraphCensusGuard {
 public:
  GraphCensusGuard();
  ~GraphCensusGuard();
  GraphCensusGuard(const GraphCensusGuard&) = delete;
  GraphCensusGuard& operator=(const GraphCensusGuard&) = delete;
};

/// The sequence number the next node will get (Node::sequence_nr): a step mark.
uint64_t next_sequence_nr();
/// Live nodes in the census.
int64_t census_size();

/// A live graph that still holds nodes made before a mark.
struct KeptGraph {
  CallSite site;          // where the root node was recorded: the op whose output keeps the graph
  std::string node;       // the root's name, e.g. "AddBackward0"
  int64_t nodes = 0;      // nodes reachable from the root (AccumulateGrad excluded)
  int64_t old_nodes = 0;  // of those, made before the mark
};

/// Roots of the census's graphs that reach nodes made before `mark`, most old nodes first.
/// Call it between steps (no backward running on another thread).
std::vector<KeptGraph> graphs_holding_nodes_before(uint64_t mark);

}  // namespace kiln::autograd
