#pragma once
// Training checkpoints: one safetensors file holding the full state of a run —
// model state dict ("model.<name>"), optimizer state ("optim.<param>.<key>"),
// and in the file's string metadata (the safetensors __metadata__ JSON object,
// flat keys) the format version, step, scheduler state, the default generator's
// (seed, offset), the data loader's (epoch, position, seed), a free-form config
// string and FNV-1a 64 checksums of the tensors and of the metadata. Named
// extra generators ("rng.gen.<name>.*") and any other stateful object through
// the Stateful interface ("state.<name>.<key>": tensors in the file, values in
// the metadata) ride along.
//
// save_checkpoint writes atomically (io::save_safetensors: temp file, fsync,
// rename, fsync of the directory). load_checkpoint validates everything first —
// checksums, format, then every mismatch with the objects it loads into, all
// reported together by name — and only then restores anything. The loader
// position comes back in CheckpointInfo::loader; pass it to DataLoader::load_state.
//
// CheckpointManager keeps a directory of them for a run: ckpt-<step>.safetensors
// files, a `latest` pointer updated only once the new file is complete, the
// last K kept; resuming falls back past a damaged file to the newest good one.
// docs/checkpoints.md describes the format and the guarantees. This is the
// train layer (DESIGN.md §1): it sits above nn, optim and data, whose state it
// gathers; objects of any layer join through io::Stateful.
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kiln/core/generator.h"
#include "kiln/data/loader.h"
#include "kiln/io/stateful.h"
#include "kiln/nn/module.h"
#include "kiln/optim/optimizer.h"
#include "kiln/optim/scheduler.h"

namespace kiln::train {

/// What a checkpoint covers. model is required; the rest may be null/empty.
/// Non-owning: the pointers are used only during the save_checkpoint /
/// load_checkpoint call they are passed to, so a CheckpointRefs is best made
/// at the call (refs() returning {.model = model.get(), ...}) rather than kept.
/// Names of generators and objects: non-empty, without '.' or newlines.
struct CheckpointRefs {
  nn::Module* model = nullptr;
  optim::Optimizer* optimizer = nullptr;
  optim::LRScheduler* scheduler = nullptr;
  std::map<std::string, Generator*> generators = {};  // besides the default generator, always saved
  std::map<std::string, io::Stateful*> objects = {};
};

/// The non-object part of a checkpoint.
struct CheckpointInfo {
  int64_t step = 0;
  std::optional<data::LoaderState> loader = {};
  std::string config = {};
};

/// Writes model, optimizer, scheduler, default and named generators, objects and `info` to `path` atomically.
void save_checkpoint(const std::string& path, const CheckpointRefs& refs, const CheckpointInfo& info);

/// Validates the file against `refs` (FormatError on a bad checksum or format,
/// ValueError listing every mismatch by name: model keys, shapes and dtypes,
/// generators and objects missing from the file or unexpected in it, object
/// keys, value kinds, shapes and dtypes), then restores everything and returns
/// the step, loader state and config. On any error nothing has been changed.
CheckpointInfo load_checkpoint(const std::string& path, const CheckpointRefs& refs);

struct CheckpointManagerOptions {
  int keep_last = 3;  // complete checkpoints kept after each save (>= 1)
};

/// A run's checkpoint directory. One writer per directory at a time; any
/// number of readers. Every method re-reads the directory, so a manager made
/// after a crash sees what the killed process left.
class CheckpointManager {
 public:
  /// Creates `dir` if needed (IOError if it cannot).
  explicit CheckpointManager(std::filesystem::path dir, CheckpointManagerOptions opts = {});

  /// Writes dir/ckpt-<step, 8 digits>.safetensors atomically, then points
  /// dir/latest at it (itself written atomically), then deletes all but the
  /// newest keep_last checkpoints (never the one `latest` names) and the
  /// temporary files of writers that are no longer running. Returns the path.
  std::filesystem::path save(const CheckpointRefs& refs, const CheckpointInfo& info);

  /// The checkpoint `latest` names if that file exists and its header is a
  /// kiln checkpoint's; otherwise the newest such file; nullopt if none.
  /// Cheap (headers only); load_latest also verifies the checksum.
  std::optional<std::filesystem::path> latest() const;

  /// Loads what `latest` names; if the pointer is missing or damaged, or the
  /// file fails validation (unreadable, bad format or checksum), loads the
  /// newest file that validates instead and says so on stderr, naming both.
  /// IOError if no checkpoint loads. A file that is fine but does not match
  /// `refs` (ValueError) is not skipped: the error is raised as is.
  CheckpointInfo load_latest(const CheckpointRefs& refs);

  /// Complete checkpoints (final names only, never temporary files), oldest first by step.
  std::vector<std::filesystem::path> list() const;

  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
  CheckpointManagerOptions opts_;
};

}  // namespace kiln::train
