// LeakWatch (include/kiln/train/leak_watch.h).
#include "kiln/train/leak_watch.h"

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "kiln/core/error.h"
#include "kiln/core/format.h"
#include "kiln/core/memory_history.h"

namespace kiln::train {

namespace {

std::string site_key(const memory::SiteUsage& u) { return u.label() + " [" + memory_category_name(u.category) + "]"; }

std::string per_step(int64_t bytes) { return format_bytes(static_cast<double>(bytes)) + " per step"; }

}  // namespace

LeakWatch::LeakWatch(LeakWatchOptions options) : options_(options) {
  KILN_CHECK(options_.window >= 2, ValueError, "LeakWatch: window must be at least 2 steps, got ", options_.window);
  KILN_CHECK(options_.warmup_steps >= 0, ValueError, "LeakWatch: warmup_steps must be >= 0, got ",
             options_.warmup_steps);
  KILN_CHECK(options_.data_in_flight >= 0, ValueError, "LeakWatch: data_in_flight must be >= 0, got ",
             options_.data_in_flight);
  if (!memory::recording_history()) {
    memory::record_history(true);
    owns_history_ = true;
  }
}

LeakWatch::~LeakWatch() {
  if (owns_history_) memory::record_history(false);
}

LeakWatch::Sample LeakWatch::sample() const {
  Sample s;
  const memory::Snapshot snap = memory::snapshot(SIZE_MAX, 0);
  for (int i = 0; i < kNumMemoryCategories; ++i) s.live[static_cast<size_t>(i)] = snap.stats.by_category[i].live_bytes;
  for (const memory::SiteUsage& u : snap.sites) s.sites[site_key(u)] += u.bytes;
  s.mark = autograd::next_sequence_nr();
  s.nodes = autograd::census_size();
  return s;
}

int64_t LeakWatch::window_of(int category) const {
  if (category == static_cast<int>(MemoryCategory::Data)) return std::max(options_.window, options_.data_in_flight + 1);
  return options_.window;
}

const LeakReport* LeakWatch::step() {
  ++steps_;
  if (report_ || steps_ <= options_.warmup_steps) return nullptr;
  samples_.push_back(sample());
  // The data category's window is the longest (window_of).
  const int64_t longest = window_of(static_cast<int>(MemoryCategory::Data));
  if (samples_.size() > static_cast<size_t>(longest) + 1) samples_.pop_front();
  // Over the last `w` steps: the first sample of that span, and whether `value` grew at each.
  auto first_of = [&](int64_t w) -> const Sample& { return samples_[samples_.size() - 1 - static_cast<size_t>(w)]; };
  auto grew_each_step = [&](int64_t w, auto value) {
    for (size_t k = samples_.size() - static_cast<size_t>(w); k < samples_.size(); ++k)
      if (value(samples_[k]) <= value(samples_[k - 1])) return false;
    return true;
  };
  int found = -2;
  for (int c = 0; c < kNumMemoryCategories && found == -2; ++c) {
    const int64_t w = window_of(c);
    if (samples_.size() < static_cast<size_t>(w) + 1) continue;
    const auto i = static_cast<size_t>(c);
    const int64_t growth = samples_.back().live[i] - first_of(w).live[i];
    if (growth >= options_.min_growth_bytes * w && grew_each_step(w, [i](const Sample& x) { return x.live[i]; }))
      found = c;
  }
  const int64_t w = options_.window;
  // Flat bytes but a growing census: graphs kept after backward freed their saved tensors.
  if (found == -2 && samples_.size() >= static_cast<size_t>(w) + 1 &&
      grew_each_step(w, [](const Sample& x) { return x.nodes; }) &&
      !autograd::graphs_holding_nodes_before(first_of(w).mark).empty())
    found = -1;
  if (found == -2) return nullptr;
  const int64_t fw = window_of(found);  // the census (-1) is judged over `window`
  report_ = explain(found, first_of(fw), samples_.back(), fw);
  if (options_.print) std::cerr << "kiln warning: " << report_->message << std::endl;
  return &*report_;
}

LeakReport LeakWatch::explain(int category, const Sample& first, const Sample& last, int64_t window) const {
  LeakReport r;
  r.step = steps_;
  r.bytes_grow = category >= 0;
  std::string m;
  if (r.bytes_grow) {
    const auto i = static_cast<size_t>(category);
    r.category = static_cast<MemoryCategory>(category);
    r.growth_per_step = (last.live[i] - first.live[i]) / window;
    r.live_bytes = last.live[i];
    const std::string suffix = std::string(" [") + memory_category_name(r.category) + "]";
    for (const auto& [key, bytes] : last.sites) {
      if (!key.ends_with(suffix)) continue;
      auto it = first.sites.find(key);
      const int64_t grew = bytes - (it == first.sites.end() ? 0 : it->second);
      if (grew > 0) r.growing_sites.emplace_back(key.substr(0, key.size() - suffix.size()), grew / window);
    }
    std::sort(r.growing_sites.begin(), r.growing_sites.end(),
              [](const auto& a, const auto& b) { return a.second > b.second; });
    if (r.growing_sites.size() > 5) r.growing_sites.resize(5);
    m = std::string(memory_category_name(r.category)) + " memory grew at each of the last " + std::to_string(window) +
        " steps, by " + per_step(r.growth_per_step) + " (" + format_bytes(static_cast<double>(r.live_bytes)) +
        " live at step " + std::to_string(r.step) + "): something keeps tensors from every step.";
  } else {
    r.growth_per_step = (last.nodes - first.nodes) / window;
    m = "the autograd graph grew at each of the last " + std::to_string(window) + " steps, by " +
        std::to_string(r.growth_per_step) + " nodes per step (" + std::to_string(last.nodes) + " live at step " +
        std::to_string(r.step) + "): backward freed their saved tensors, but the nodes (host memory) pile up.";
  }
  // Graphs made before the window began and still alive were kept past their step.
  const auto kept = autograd::graphs_holding_nodes_before(first.mark);
  if (!kept.empty()) r.graph = kept.front();
  if (r.graph) {
    const std::string at = r.graph->site.str();
    m += "\n  The autograd graph behind the tensor produced at " + at + " (" + r.graph->node +
         ") is still alive and holds " + std::to_string(r.graph->old_nodes) +
         " nodes from earlier steps, with whatever they saved. A tensor that keeps its history across steps — "
         "typically a loss summed into a running total (`total += loss`) or kept in a list — holds every step's "
         "graph. Accumulate loss.item() or loss.detach() at " +
         at + " instead.";
  } else if (r.bytes_grow) {
    m += "\n  No autograd graph is kept: tensors made at the sites below are kept by a container or member that "
         "collects them each step.";
  }
  if (!r.growing_sites.empty()) {
    m += "\n  Growing call sites:";
    for (const auto& [site, bytes] : r.growing_sites) m += "\n    +" + per_step(bytes) + "  " + site;
  }
  r.message = std::move(m);
  return r;
}

}  // namespace kiln::train
