#pragma once
// `kiln train --profile 20:25` ([profile] steps): a kiln::profiler::Profiler
// over a window of training steps, and the files it leaves in RUN_DIR/profile/:
//   trace.json   Chrome trace (Perfetto, chrome://tracing); a data-parallel
//                run's ranks each write trace.rank<R>.json and rank 0 merges
//                them, their clocks aligned at a barrier taken as the window opens
//   ops.txt      the op table (key_averages, by self time)
//   ops.json     the same rows as JSON (Profiler::key_averages_json)
//   steps.json   each profiled step's breakdown: data, forward, backward,
//                optimizer, exposed communication, other (ms)
//   memory.json  the window's peak live bytes per memory category, the tensors
//                live at the total peak, and a short timeline
// `kiln profile RUN_DIR` (cli/profile_files.h) and report.html read them back.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "kiln/dist/process_group.h"

namespace kiln::profiler {
class Profiler;
}

namespace kiln::cli {

/// Training steps first .. end - 1, numbered as the train lines number them (1 is the first step).
struct ProfileWindow {
  int64_t first = 0;
  int64_t end = 0;
};

/// Steps a window of a single number covers ("20" is "20:25").
inline constexpr int64_t kDefaultProfileSteps = 5;

/// "20:25" or "20" (= 20:25); nullopt for "" (no profile). A ConfigError names
/// `origin` (the config file, or --profile) and the form expected otherwise.
std::optional<ProfileWindow> parse_profile_steps(const std::string& spec, const std::string& origin);

/// One process's profile of its training loop. The loop calls before_step()
/// before each optimizer step and after_step() when it completed, and finish()
/// when it leaves; every rank of a data-parallel run calls them alike (they
/// take barriers when the window opens and when the files are written).
class ProfileRun {
 public:
  /// `done_steps`: the steps the run had completed when this process began (a resume's checkpoint step).
  ProfileRun(ProfileWindow window, int64_t done_steps, std::filesystem::path run_dir, dist::ProcessGroupPtr group);
  ~ProfileRun();
  ProfileRun(const ProfileRun&) = delete;
  ProfileRun& operator=(const ProfileRun&) = delete;

  /// Before step `step` (1-based): aligns the ranks' clocks when the recorded steps begin.
  void before_step(int64_t step);
  /// After each completed step: advances the profiler; writes the files when the window closed.
  void after_step();
  /// The loop ended: a window it cut short is written with the steps it recorded.
  void finish();
  /// What the run says about the profile once, when its files are written (or why none were); then "".
  std::string take_message();

 private:
  void write_files();

  ProfileWindow window_;
  int64_t first_run_ = 0;      // the first step this process runs
  int64_t recorded_from_ = 0;  // the window's first step this process runs
  int64_t sync_step_ = 0;      // the step before which the ranks align their clocks (the warm-up step)
  std::filesystem::path dir_;
  dist::ProcessGroupPtr group_;
  std::unique_ptr<profiler::Profiler> prof_;
  bool ready_ = false, written_ = false, synced_ = false;
  int64_t steps_done_ = 0;  // after_step calls
  std::string message_;
};

}  // namespace kiln::cli
