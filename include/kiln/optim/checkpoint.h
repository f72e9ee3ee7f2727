#pragma once
// Training checkpoints: one safetensors file holding the full state of a run —
// model state dict ("model.<name>"), optimizer state ("optim.<param>.<key>"),
// and in the file's string metadata (the safetensors __metadata__ JSON object,
// flat keys) the format version, step, scheduler state, the default generator's
// (seed, offset), the data loader's (epoch, position, seed), a free-form config
// string and an FNV-1a 64 checksum of every tensor's name and bytes.
//
// save_checkpoint writes atomically (io::save_safetensors: temp file, fsync,
// rename, fsync of the directory). load_checkpoint validates everything first — checksum, format,
// missing/unexpected keys and shape/dtype mismatches (all reported together by
// name) — and only then restores model, optimizer, scheduler and the default
// generator. The loader position comes back in CheckpointInfo::loader; pass it
// to DataLoader::load_state.
#include <cstdint>
#include <optional>
#include <string>

#include "kiln/data/loader.h"
#include "kiln/nn/module.h"
#include "kiln/optim/optimizer.h"
#include "kiln/optim/scheduler.h"

namespace kiln::optim {

/// What a checkpoint covers. model is required; the rest may be null/empty.
struct CheckpointRefs {
  nn::Module* model = nullptr;
  Optimizer* optimizer = nullptr;
  LRScheduler* scheduler = nullptr;
};

/// The non-object part of a checkpoint.
struct CheckpointInfo {
  int64_t step = 0;
  std::optional<data::LoaderState> loader;
  std::string config;
};

/// Writes model, optimizer, scheduler, default generator and `info` to `path` atomically.
void save_checkpoint(const std::string& path, const CheckpointRefs& refs, const CheckpointInfo& info);

/// Validates the file against `refs` (FormatError on a bad checksum or format,
/// ValueError listing every mismatched key), then restores the objects and the
/// default generator and returns the step, loader state and config. On any
/// error nothing has been changed.
CheckpointInfo load_checkpoint(const std::string& path, const CheckpointRefs& refs);

}  // namespace kiln::optim
