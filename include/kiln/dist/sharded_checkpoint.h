#pragma once
// Sharded checkpoints (DESIGN.md §7): one logical checkpoint that every rank
// writes its own part of, and that loads at any world size.
//
// A training run sharded over N ranks (ZeRO, FSDP) holds each tensor as
// contiguous ranges of its flattened elements spread over the ranks. Gathering
// them on one rank to write a single file costs that rank the whole model's
// memory and serialises the write; instead every rank writes the ranges it
// holds to its own safetensors file, and an index says where each range of
// each tensor lives. A reader at another world size (or one process) then
// asks for whatever ranges its own split needs and gets them assembled from
// whichever files hold them: resharding is a read, not a conversion step.
//
// On disk, a directory:
//   <dir>/index.json                    format, version, world size, metadata,
//                                       tensor -> dtype, shape, slices
//                                       {file, key, begin, length, checksum};
//                                       itself checksummed
//   <dir>/shard-<r>-of-<N>.safetensors  rank r's slices, 1-D, one key each
// docs/checkpoints.md ("Sharded checkpoints") gives the full format.
//
// Guarantees: a save either leaves the complete new checkpoint under <dir> or
// leaves what was there before (it is built in <dir>.partial and renamed into
// place only once every rank's file and the index are synced); the reader
// treats the index and the shard files as hostile input (every malformed
// field, missing or truncated file, bad checksum, gap or overlap is a kiln
// error naming the file and what was expected, never a crash or an allocation
// the files cannot back). This is the dist layer (DESIGN.md §1): the files are
// written with io's safetensors writer, the agreement between ranks goes
// through a ProcessGroup.
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/dist/process_group.h"

namespace kiln::dist {

/// A contiguous range of one logical tensor, flattened row-major: elements
/// [begin, begin + data.numel()) of the tensor called `name`.
struct ShardSlice {
  /// The logical tensor's name ("model.blocks.0.attn.qkv.weight", "optim.<param>.exp_avg").
  std::string name;
  /// The full logical shape, which every slice of the tensor (on every rank) must agree on.
  std::vector<int64_t> shape;
  /// The flattened index of the first element held here.
  int64_t begin = 0;
  /// The elements, in flattened order (any shape and strides: read as data.reshape({-1})).
  /// Its dtype is the logical tensor's; every dtype kiln has is accepted.
  Tensor data;
};

/// Everything else a checkpoint holds (step, config, RNG, loader position...):
/// string key -> string value, as in a single-file checkpoint's metadata.
using ShardedMetadata = std::map<std::string, std::string>;

/// Collective over `group` (every member calls it, in the same order relative
/// to its other collectives on the group). Each rank passes the slices it
/// holds: none for some tensors, several for others; empty slices are
/// ignored. Together they must cover every element of every named tensor
/// exactly once, with one dtype and shape per tensor; this is checked on the
/// descriptions of all ranks' slices before anything is written, and a gap,
/// an overlap or a disagreement is a ValueError naming the tensor, the ranks
/// and the element ranges, raised on every rank. `metadata` must be the same
/// on every rank (checked likewise).
///
/// Writes <dir>.partial/shard-<r>-of-<N>.safetensors on each rank r, then on
/// rank 0 index.json, then moves <dir>.partial to <dir>, replacing an older
/// sharded checkpoint there only once the new one is complete and synced.
/// A leftover <dir>.partial from a crashed save is removed first. `dir` must
/// be on a file system every rank of the group sees (one machine, or shared
/// storage). Any rank's failure (disk full, permissions) is raised on every
/// rank, and <dir> is then as it was. One writer per `dir` at a time.
void save_sharded_checkpoint(const std::filesystem::path& dir, const std::vector<ShardSlice>& mine,
                             const ShardedMetadata& metadata, ProcessGroup& group);

/// A reader of a sharded checkpoint, at any world size: ranks of a run
/// open one each and read the ranges their own split needs. Opening reads
/// and validates index.json and every shard file's header (IOError for a
/// file that cannot be read; FormatError, naming the file, for anything
/// malformed or inconsistent); tensor data is read, and its checksum
/// verified, only by read(). Not a collective. Const methods are safe to
/// call from several threads at once.
class ShardedCheckpoint {
 public:
  explicit ShardedCheckpoint(const std::filesystem::path& dir);
  ~ShardedCheckpoint();
  ShardedCheckpoint(ShardedCheckpoint&&) noexcept;
  ShardedCheckpoint& operator=(ShardedCheckpoint&&) noexcept;

  const std::filesystem::path& dir() const;
  /// The world size it was saved at.
  int world_size() const;
  const ShardedMetadata& metadata() const;
  /// The tensors' names, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  /// The logical shape and dtype; ValueError naming the tensor (and some that exist) if absent.
  std::vector<int64_t> shape(const std::string& name) const;
  DType dtype(const std::string& name) const;
  int64_t numel(const std::string& name) const;

  /// Elements [begin, begin + length) of the flattened tensor, as a fresh 1-D
  /// tensor, assembled from whichever shard files hold them. Reads only the
  /// slices that overlap the range, each one whole, and verifies each one's
  /// checksum before using it (FormatError naming the file on a mismatch).
  /// IndexError if the range is not within the tensor.
  Tensor read(const std::string& name, int64_t begin, int64_t length) const;
  /// The whole tensor, in its logical shape.
  Tensor read_full(const std::string& name) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// True if `dir` holds a complete sharded checkpoint: its index.json exists
/// and parses as one (the shard files are not opened; ShardedCheckpoint does that).
bool is_sharded_checkpoint(const std::filesystem::path& dir);

}  // namespace kiln::dist
