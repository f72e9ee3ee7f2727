// Test only: a listener on core's record hook (kiln/core/record.h) that keeps
// a copy of every closed scope, for tests of the sites that open them (the
// data loader, collectives, checkpoints) without going through the profiler.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "kiln/core/record.h"

namespace kiln::test {

struct RecordedEvent {
  record::Kind kind = record::Kind::Op;
  std::string name, detail, thread_name;
  int64_t start_ns = 0, end_ns = 0, bytes = 0;
  uint32_t thread = 0;
  uint64_t id = 0, parent = 0;
};

/// Records while alive (switches recording on and, when it goes, off again).
class RecordCollector {
 public:
  RecordCollector() {
    handle_ = record::add_callbacks(&RecordCollector::on_event, nullptr, this);
    record::set_enabled(true);
  }
  ~RecordCollector() {
    record::set_enabled(false);
    record::remove_callbacks(handle_);
  }
  RecordCollector(const RecordCollector&) = delete;
  RecordCollector& operator=(const RecordCollector&) = delete;

  /// The events of one kind (and name, unless empty), in the order they closed.
  std::vector<RecordedEvent> events(record::Kind kind, const std::string& name = "") const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<RecordedEvent> out;
    for (const auto& e : events_)
      if (e.kind == kind && (name.empty() || e.name == name)) out.push_back(e);
    return out;
  }

 private:
  static void on_event(const record::Event& e, void* self) {
    auto* c = static_cast<RecordCollector*>(self);
    RecordedEvent r{e.kind,     std::string(e.name), std::string(e.detail), record::thread_name(e.thread),
                    e.start_ns, e.end_ns,            e.bytes,               e.thread,
                    e.id,       e.parent};
    std::lock_guard<std::mutex> lock(c->mu_);
    c->events_.push_back(std::move(r));
  }
  mutable std::mutex mu_;
  std::vector<RecordedEvent> events_;
  int handle_ = -1;
};

}  // namespace kiln::test
