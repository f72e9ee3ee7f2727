// A byte-level text corpus as a dataset of fixed context windows (DESIGN.md §5).
//
// CharCorpus memory-maps a text file, keeps the text between Project
// Gutenberg's "*** START OF" and "*** END OF" marker lines (when present and
// strip_gutenberg is set), normalises CRLF to LF (this needs a private copy;
// otherwise the mapping itself is read) and trims surrounding whitespace.
// Sample i is the window starting at byte i * stride: data = the `context`
// bytes there, target = the same window shifted by one (next-token targets),
// both int64 tokens in [0, 256).
//
// TokenFile is the same over a memory-mapped file of little-endian uint16 or
// uint32 token ids (nanoGPT's train.bin), for corpora too large to hold twice.
#pragma once

#include <string>
#include <string_view>

#include "kiln/data/dataset.h"

namespace kiln::data {

/// Moby-Dick, as Debian's golang-github-colinmarc-hdfs-dev installs it.
inline constexpr const char* kMobyDickPath = "/usr/share/gocode/src/github.com/colinmarc/hdfs/testdata/mobydick.txt";
/// The Adventures of Sherlock Holmes, as Debian's golang-github-jdkato-prose-dev installs it.
inline constexpr const char* kSherlockPath = "/usr/share/gocode/src/github.com/jdkato/prose/testdata/sherlock.txt";

struct CharCorpusOptions {
  std::string path = kMobyDickPath;
  int64_t context = 128;
  /// Bytes between window starts; 0 means `context` (non-overlapping windows).
  int64_t stride = 0;
  bool strip_gutenberg = true;
};

class CharCorpus : public Dataset<Example> {
 public:
  explicit CharCorpus(CharCorpusOptions options = {});
  ~CharCorpus() override;
  CharCorpus(const CharCorpus&) = delete;
  CharCorpus& operator=(const CharCorpus&) = delete;

  int64_t size() const override { return num_windows_; }
  Example get(int64_t index) const override;
  /// The cleaned text the windows are cut from.
  std::string_view text() const { return text_; }
  static constexpr int64_t vocab_size() { return 256; }

 private:
  CharCorpusOptions options_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::string copy_;  // used when the text needed CRLF normalisation
  std::string_view text_;
  int64_t num_windows_ = 0;
};

struct TokenFileOptions {
  std::string path;
  /// 2 (uint16) or 4 (uint32) bytes per token.
  int64_t bytes_per_token = 2;
  int64_t context = 128;
  /// Tokens between window starts; 0 means `context`.
  int64_t stride = 0;
};

class TokenFile : public Dataset<Example> {
 public:
  explicit TokenFile(TokenFileOptions options);
  ~TokenFile() override;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  int64_t size() const override { return num_windows_; }
  Example get(int64_t index) const override;
  int64_t num_tokens() const { return num_tokens_; }
  /// Token i of the file.
  int64_t token(int64_t i) const;

 private:
  TokenFileOptions options_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  int64_t num_tokens_ = 0;
  int64_t num_windows_ = 0;
};

}  // namespace kiln::data
