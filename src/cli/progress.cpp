// The progress bar and plain log lines.
#include "cli/progress.h"

#include <cmath>
#include <cstdio>

#include "kiln/core/format.h"

namespace kiln::cli {

void Progress::update(const StepView& v) {
  if (quiet_) return;
  if (!tty_) {
    if (v.step % log_every_ != 0 && v.step != v.total) return;
    std::printf("step %lld/%lld  epoch %lld  loss %.4f  lr %.3g  %.0f samples/s  ETA %s  mem %s\n",
                static_cast<long long>(v.step), static_cast<long long>(v.total), static_cast<long long>(v.epoch),
                v.loss, v.lr, v.samples_per_s, format_duration(v.eta_s).c_str(), format_bytes(v.memory_bytes).c_str());
    std::fflush(stdout);
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  if (bar_shown_ && v.step != v.total && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  constexpr int kWidth = 24;
  const double frac = v.total > 0 ? static_cast<double>(v.step) / static_cast<double>(v.total) : 0;
  const int filled = static_cast<int>(frac * kWidth);
  std::string bar(static_cast<size_t>(filled), '=');
  if (filled < kWidth) bar += '>';
  bar.resize(kWidth, ' ');
  std::printf("\r\033[K%lld/%lld [%s] %3.0f%%  loss %.4f  lr %.2e  %.0f samples/s  ETA %s  mem %s",
              static_cast<long long>(v.step), static_cast<long long>(v.total), bar.c_str(), 100 * frac, v.loss, v.lr,
              v.samples_per_s, format_duration(v.eta_s).c_str(), format_bytes(v.memory_bytes).c_str());
  std::fflush(stdout);
  bar_shown_ = true;
}

void Progress::message(const std::string& line) {
  if (quiet_) return;
  if (tty_ && bar_shown_) std::printf("\r\033[K");
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  bar_shown_ = false;
}

void Progress::finish() {
  if (tty_ && bar_shown_) std::printf("\n");
  std::fflush(stdout);
  bar_shown_ = false;
}

}  // namespace kiln::cli
