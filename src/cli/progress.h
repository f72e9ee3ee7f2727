#pragma once
// What a person watching a run sees: a one-line progress bar redrawn in place
// on a terminal, or plain periodic lines when stdout is a file or a pipe (CI),
// where carriage returns would make a mess.
#include <chrono>
#include <cstdint>
#include <string>

namespace kiln::cli {

struct StepView {
  int64_t step = 0, total = 0, epoch = 0;
  double loss = 0, lr = 0, samples_per_s = 0, eta_s = 0;
  int64_t memory_bytes = 0;
};

class Progress {
 public:
  /// tty: redraw a bar; otherwise print a line every `log_every` steps.
  /// quiet: print nothing (a data-parallel rank other than 0).
  Progress(bool tty, int64_t log_every, bool quiet = false) : tty_(tty), quiet_(quiet), log_every_(log_every) {}
  /// Called after every step.
  void update(const StepView& v);
  /// Prints a message on its own line (clearing the bar first on a terminal).
  void message(const std::string& line);
  /// Ends the bar's line.
  void finish();

 private:
  bool tty_;
  bool quiet_;
  int64_t log_every_;
  bool bar_shown_ = false;
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace kiln::cli
