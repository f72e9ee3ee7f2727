#pragma once
// Files that are either the old version or the whole new one, never half of
// either (DESIGN.md §7: a half-written file never replaces a good one). Every
// kiln writer of small files relies on these: the checkpoint directory's
// `latest` pointer, the sharded checkpoint's index.
#include <filesystem>
#include <string_view>

namespace kiln::io {

/// Writes `bytes` to a temporary file beside `path` (<path>.tmp.<pid>),
/// fsyncs it, renames it over `path` and fsyncs the directory, so that after
/// a crash at any point a reader finds the previous `path` or the new one.
/// IOError naming the file and the failing step (the temporary is removed).
void write_file_atomically(const std::filesystem::path& path, std::string_view bytes);

/// fsync of a directory, which makes the renames and creations in it durable.
/// A file system that cannot sync directories (EINVAL, EROFS) or open them is
/// accepted; any other failure is an IOError naming the directory.
void sync_directory(const std::filesystem::path& dir);

}  // namespace kiln::io
