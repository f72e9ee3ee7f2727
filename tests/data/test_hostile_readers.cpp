// Hostile input to the data readers (issue 6, DESIGN.md §7): idx files plain
// and gzipped, gzip streams (truncated, concatenated, trailing garbage, bombs),
// token and text files, and paths that are not regular files. Each case must
// raise the documented error naming the file, leave no tensor alive, and
// allocate nothing beyond what the file's size can justify — checked with the
// allocator's peak statistics. Inputs the fuzzers (tests/fuzz) found are kept
// here as regressions.
#include <gtest/gtest.h>
#include <zlib.h>

#include <fstream>
#include <random>

#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/data/idx.h"
#include "kiln/data/text.h"
#include "support/hostile.h"
#include "support/idx_bytes.h"
#include "support/test_util.h"

using namespace kiln;
using namespace kiln::data;

namespace {

using test::be32;
using test::expect_error;
using test::idx_header;
using test::write_bytes;

std::string gzip(const std::string& data) { return test::gzip_bytes(data, 9); }

void write(const std::string& path, const std::string& bytes) { write_bytes(path, bytes); }

}  // namespace

// ---------------------------------------------------------------- idx

TEST(HostileIdx, ShapeWhoseElementCountOverflows) {
  test::TempDir dir;
  // 2^16 four times is 2^64: a size_t product wraps to 0 and matched an empty file.
  const std::string p = dir.file("wrap.idx");
  write(p, idx_header({65536, 65536, 65536, 65536}));
  expect_error([&] { read_idx(p); }, p, {"more elements than any file can hold"});
  write(p, gzip(idx_header({65536, 65536, 65536, 65536})));
  expect_error([&] { read_idx(p); }, p, {"more elements than any file can hold"});
  // Found by fuzz_idx (tests/fuzz/corpus/idx/empty-shape-overflow): a zero dim makes the
  // count 0, but the other dims' product still overflows int64 strides; it was a ValueError from empty().
  write(p, idx_header({0, 838860800, 16777216, 50331648}));
  expect_error([&] { read_idx(p); }, p, {"more elements than any file can hold"});
}

TEST(HostileIdx, AbsurdShapesFailBeforeAllocating) {
  test::TempDir dir;
  const std::string p = dir.file("big.idx");
  write(p, idx_header({0xffffffffu, 0x10000u}) + "abc");  // 256 TiB promised
  expect_error([&] { read_idx(p); }, p, {"truncated", "promises 281474976645120 bytes", "the file has 3"});
  write(p, idx_header({0xffffffffu, 0xffffffffu}) + "abc");  // more than int64 can count
  expect_error([&] { read_idx(p); }, p, {"more elements than any file can hold"});
  // Behind gzip the data's size is unknown until inflated; deflate's 1032:1 bound refuses it up front.
  const std::string g = dir.file("big.idx.gz");
  write(g, gzip(idx_header({60000, 28, 28})));
  expect_error([&] { read_idx(g); }, g, {"promises 47040000 bytes", "more than a gzip file of", "1032"});
}

TEST(HostileIdx, GzipBombStopsAtTheDeclaredSize) {
  test::TempDir dir;
  // 16 MiB of zeros compress to ~16 KiB; the header declares 8 bytes.
  const std::string p = dir.file("bomb.idx.gz");
  write(p, gzip(idx_header({2, 2, 2}) + std::string(size_t{16} << 20, '\0')));
  expect_error([&] { read_idx(p); }, p, {"trailing bytes after the 8 bytes", "gzip"}, 4096);
  // The same bomb, declared: inflating it is legitimate, and bounded by the header.
  const std::string q = dir.file("declared.idx.gz");
  write(q, gzip(idx_header({16, 1024, 1024}) + std::string(size_t{16} << 20, '\0')));
  const int64_t live = memory::stats().live_bytes;
  memory::reset_peak_stats();
  EXPECT_EQ(read_idx(q).numel(), int64_t{16} << 20);
  EXPECT_LE(memory::stats().peak_bytes - live, (int64_t{16} << 20) + 4096) << "inflated straight into the tensor";
}

TEST(HostileIdx, GzipStreamsTruncatedConcatenatedOrFollowedByGarbage) {
  test::TempDir dir;
  const std::string img = idx_header({2, 3}) + "abcdef";
  // Concatenated members are one stream, as gzip -d reads them; the header may straddle them.
  const std::string two = dir.file("two.gz");
  write(two, gzip(img.substr(0, 6)) + gzip(img.substr(6)));
  EXPECT_EQ(read_maybe_gzipped(two), img);
  EXPECT_EQ(read_idx(two).shape_string(), "[2, 3]");
  const std::string junk = dir.file("junk.gz");
  write(junk, gzip(img) + "not gzip");
  expect_error([&] { read_idx(junk); }, junk, {"corrupt gzip stream"});
  expect_error([&] { read_maybe_gzipped(junk); }, junk, {"corrupt gzip stream"});
  // Every truncation of a gzipped and a plain file: a FormatError naming it, nothing left allocated.
  const std::string gz = gzip(img), cut = dir.file("cut");
  for (size_t n = 0; n < gz.size(); ++n) {
    write(cut, gz.substr(0, n));
    expect_error([&] { read_idx(cut); }, cut, {}, 4096);
  }
  for (size_t n = 0; n < img.size(); ++n) {
    write(cut, img.substr(0, n));
    expect_error([&] { read_idx(cut); }, cut, {}, 4096);
  }
  write(cut, gzip(img.substr(0, 9)));
  expect_error([&] { read_idx(cut); }, cut, {"truncated header"});
}

TEST(HostileIdx, RandomMutationsParseOrRaiseFormatError) {
  test::TempDir dir;
  const std::string img = idx_header({3, 2, 2}) + std::string(12, '\x07');
  const std::string path = dir.file("m");
  std::mt19937_64 rng(7);
  int parsed = 0, rejected = 0;
  for (int iter = 0; iter < 400; ++iter) {
    std::string b = iter % 2 ? gzip(img) : img;
    for (int k = 0, flips = 1 + static_cast<int>(rng() % 3); k < flips; ++k) {
      b[rng() % b.size()] = static_cast<char>(rng());
    }
    write(path, b);
    try {
      read_idx(path);
      ++parsed;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << iter << ": expected FormatError or success, got: " << e.what();
    }
  }
  EXPECT_GT(parsed, 0);
  EXPECT_GT(rejected, 0);
}

TEST(HostileIdx, PathsThatAreNotRegularFiles) {
  test::TempDir dir;
  // /dev/zero would feed a reader forever; a directory opens but has no bytes.
  expect_error<IOError>([] { read_idx("/dev/zero"); }, "/dev/zero", {"regular file"});
  expect_error<IOError>([] { read_maybe_gzipped("/dev/zero"); }, "/dev/zero", {"regular file"});
  expect_error<IOError>([&] { read_idx(dir.path().string()); }, dir.path().string(), {"regular file"});
  expect_error<IOError>([&] { read_idx(dir.file("absent")); }, dir.file("absent"), {"cannot open"});
}

// ---------------------------------------------------------------- text and token files

TEST(HostileText, TokenFilesOfTheWrongSize) {
  test::TempDir dir;
  const std::string p = dir.file("train.bin");
  write(p, std::string(7, '\x01'));
  expect_error([&] { TokenFile({.path = p, .bytes_per_token = 2}); }, p, {"7 bytes", "not a multiple of 2"});
  expect_error([&] { TokenFile({.path = p, .bytes_per_token = 4}); }, p, {"not a multiple of 4"});
  write(p, "");
  TokenFile empty_file({.path = p, .context = 4});
  EXPECT_EQ(empty_file.size(), 0);
  EXPECT_THROW(empty_file.get(0), IndexError);
  // Fewer tokens than a window needs: no windows, not a read past the end.
  write(p, std::string(8, '\xff'));
  TokenFile short_file({.path = p, .bytes_per_token = 4, .context = 2});
  EXPECT_EQ(short_file.size(), 0);
  EXPECT_EQ(short_file.token(1), 0xffffffffLL);
  EXPECT_THROW(short_file.token(2), IndexError);
}

TEST(HostileText, ArbitraryBytesAreTokensAndMarkersMayBeCutShort) {
  test::TempDir dir;
  const std::string p = dir.file("bytes.txt");
  write(p, std::string("\xff\x00\x80\r\xc3", 5));  // not UTF-8, a NUL, a lone CR: all just bytes
  CharCorpus c({.path = p, .context = 2, .stride = 1});
  ASSERT_EQ(c.size(), 3);
  EXPECT_EQ(test::to_doubles(c.get(0).data), (std::vector<double>{255, 0}));
  EXPECT_EQ(test::to_doubles(c.get(2).target), (std::vector<double>{13, 195}));
  write(p, "*** START OF a book with no newline after the marker");
  EXPECT_EQ(CharCorpus({.path = p, .context = 1}).text(), "");
  write(p, "*** END OF\r\n");
  EXPECT_EQ(CharCorpus({.path = p, .context = 1}).size(), 0);
}

TEST(HostileText, PathsThatAreNotRegularFiles) {
  test::TempDir dir;
  expect_error<IOError>([] { CharCorpus({.path = "/dev/zero", .context = 4}); }, "/dev/zero", {"not a regular file"});
  expect_error<IOError>([&] { TokenFile({.path = dir.path().string()}); }, dir.path().string(), {"not a regular file"});
  expect_error<IOError>([&] { TokenFile({.path = dir.file("absent")}); }, dir.file("absent"), {"cannot open"});
}
