// Private to src/dist: the directory operations of a sharded checkpoint save
// (sharded_checkpoint_fs.cpp), each synced so that a crash leaves either the
// old complete checkpoint or the new one under the final name.
#pragma once

#include <filesystem>
#include <string>

namespace kiln::dist::shard_format {

/// "<dir>.partial": where a save builds the checkpoint before it takes dir's name.
std::filesystem::path partial_path(const std::filesystem::path& dir);
/// True for the names a save creates in its directory: index.json,
/// shard-*-of-*.safetensors and their writers' temporary files.
bool is_ours(const std::string& file_name);
/// Removes a leftover `partial` (only if it holds nothing but our files:
/// ValueError otherwise, rather than deleting what a user put there), checks
/// that `dir`, if present, is a sharded checkpoint or an empty directory
/// (ValueError otherwise), and creates `partial` afresh.
void prepare_partial(const std::filesystem::path& dir, const std::filesystem::path& partial);
/// Removes our files in `d` and then `d` if it is left empty; never throws.
void remove_ours(const std::filesystem::path& d) noexcept;
/// Writes `text` to `path` through a temporary file: write, fsync, rename, fsync the directory.
void write_file_synced(const std::filesystem::path& path, const std::string& text);
void sync_directory(const std::filesystem::path& d);
/// Makes the complete `partial` be `dir`: a plain rename when `dir` does not
/// exist (or is empty); otherwise an atomic exchange of the two (Linux
/// renameat2), then removal of the old one, now at `partial`. Where the file
/// system cannot exchange, `dir` is first renamed to "<dir>.old": a crash in
/// between leaves no `dir` but the complete old and new ones beside it.
void replace_directory(const std::filesystem::path& partial, const std::filesystem::path& dir);

}  // namespace kiln::dist::shard_format
