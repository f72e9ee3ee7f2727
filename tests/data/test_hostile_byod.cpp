// Hostile input to the bring-your-own data readers (DESIGN.md §7), with the
// idx reader's guarantees: .npy headers and data, CSV text, PNG and JPEG
// images. Each malformed input must raise FormatError naming the file (IOError
// for a path that is not a regular file), leave no tensor alive and allocate
// nothing beyond what the file's size justifies.
#include <gtest/gtest.h>
#include <zlib.h>

#include <filesystem>
#include <random>

#include "kiln/data/arrays.h"
#include "kiln/data/csv.h"
#include "kiln/data/image.h"
#include "kiln/data/npy.h"
#include "support/byod_bytes.h"
#include "support/hostile.h"
#include "support/idx_bytes.h"
#include "support/test_util.h"

using namespace kiln;
using namespace kiln::data;
using test::expect_error;
using test::write_bytes;

namespace {

std::string npy_with_dict(const std::string& dict, const std::string& data = "", int major = 1) {
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  const size_t len = dict.size();
  for (int b = 0; b < (major == 1 ? 2 : 4); ++b) out += static_cast<char>((len >> (8 * b)) & 0xff);
  return out + dict + data;
}

std::string dict(const std::string& descr, const std::string& shape, const std::string& fortran = "False") {
  return "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }\n";
}

// Every outcome of reading mutated bytes: success, or the documented error naming the file.
template <typename F>
void mutate(const std::string& good, const std::string& path, int iters, F&& read) {
  std::mt19937_64 rng(11);
  int parsed = 0, rejected = 0;
  for (int iter = 0; iter < iters; ++iter) {
    std::string b = good;
    for (int k = 0, flips = 1 + static_cast<int>(rng() % 4); k < flips; ++k) b[rng() % b.size()] = static_cast<char>(rng());
    if (iter % 5 == 0) b.resize(rng() % b.size());
    write_bytes(path, b);
    try {
      read();
      ++parsed;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << iter << ": expected FormatError or success, got: " << e.what();
    }
  }
  EXPECT_GT(rejected, 0);
}

}  // namespace

// ---------------------------------------------------------------- .npy

TEST(HostileNpy, WrongMagicVersionAndTruncatedPreamble) {
  test::TempDir dir;
  const std::string p = dir.file("x.npy");
  write_bytes(p, "PK\x03\x04 a zip (np.savez), not a .npy");
  expect_error([&] { read_npy(p); }, p, {"not a .npy file"});
  write_bytes(p, npy_with_dict(dict("<f4", "(1,)"), "abcd", 4));
  expect_error([&] { read_npy(p); }, p, {"unsupported .npy format version 4.0"});
  // Every truncation of a valid file.
  const std::string good = test::npy_bytes("<i4", {2, 2}, std::string(16, '\x01'));
  for (size_t n = 0; n < good.size(); ++n) {
    write_bytes(p, good.substr(0, n));
    expect_error([&] { read_npy(p); }, p, {});
  }
  write_bytes(p, good);
  EXPECT_EQ(read_npy(p).shape_string(), "[2, 2]");
}

TEST(HostileNpy, AbsurdHeaderLengthsAndShapesFailBeforeAllocating) {
  test::TempDir dir;
  const std::string p = dir.file("x.npy");
  write_bytes(p, std::string("\x93NUMPY\x01\x00\xff\xff", 10) + "{}");
  expect_error([&] { read_npy(p); }, p, {"the header length field says 65535 bytes, the file has 2"});
  write_bytes(p, std::string("\x93NUMPY\x02\x00\xff\xff\xff\xff", 12) + "{}");
  expect_error([&] { read_npy(p); }, p, {"4294967295 bytes, more than the 1048576"});
  // 4 TB promised by a 100-byte file; and a shape whose element count wraps.
  write_bytes(p, npy_with_dict(dict("<f4", "(1000000000000,)"), "abcd"));
  expect_error([&] { read_npy(p); }, p, {"truncated", "needs 4000000000000 bytes of data, the file has 4"});
  write_bytes(p, npy_with_dict(dict("<f4", "(4294967296, 4294967296, 4294967296)")));
  expect_error([&] { read_npy(p); }, p, {"more elements than any file can hold"});
  write_bytes(p, npy_with_dict(dict("<f4", "(0, 4294967296, 4294967296, 4294967296)")));
  expect_error([&] { read_npy(p); }, p, {"more elements than any file can hold"});
  write_bytes(p, npy_with_dict(dict("<f4", "(99999999999999999999,)")));
  expect_error([&] { read_npy(p); }, p, {"a dimension too large for int64"});
  std::string many = "(";
  for (int i = 0; i < 40; ++i) many += "1, ";
  write_bytes(p, npy_with_dict(dict("<f4", many + ")"), "abcd"));
  expect_error([&] { read_npy(p); }, p, {"more than 32 dimensions"});
  write_bytes(p, npy_with_dict(dict("<f4", "(2,)"), "abcdefghij"));
  expect_error([&] { read_npy(p); }, p, {"2 trailing bytes after the 8 bytes of data"});
}

TEST(HostileNpy, HeadersThatAreNotTheDictNpSaveWrites) {
  test::TempDir dir;
  const std::string p = dir.file("h.npy");
  auto bad = [&](const std::string& d, std::initializer_list<std::string> parts) {
    write_bytes(p, npy_with_dict(d, "abcd"));
    expect_error([&] { read_npy(p); }, p, parts);
  };
  bad("__import__('os').system('true')", {"bad .npy header at byte 0", "expected a dict"});
  bad("{'descr': '<f4', 'shape': (1,), }", {"lacks 'fortran_order'"});
  bad("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'extra': 1}", {"unexpected key 'extra'"});
  bad("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (1,)}", {"key 'descr' given twice"});
  bad("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,)}", {"structured arrays"});
  bad(dict("|O", "(1,)"), {"unsupported .npy dtype '|O'", "pickled"});
  bad(dict("<c8", "(1,)"), {"complex"});
  bad(dict("|S4", "(1,)"), {"string arrays"});
  bad(dict("<M8", "(1,)"), {"datetime"});
  bad(dict("<f3", "(1,)"), {"expected f2/f4/f8"});
  bad(dict("|i4", "(1,)"), {"only valid for one-byte elements"});
  bad(dict("f4", "(1,)"), {"expected a byte order"});
  bad(dict("<f4", "(-1,)"), {"expected a non-negative integer in shape"});
  bad(dict("<f4", "(1,)", "Maybe"), {"expected True or False"});
  bad("{'descr': '<f4, 'fortran_order': False, 'shape': (1,)}", {"expected ',' or '}' after a value"});
  bad("{'descr' '<f4', 'fortran_order': False, 'shape': (1,)}", {"expected ':' after the key"});
  bad("{'descr': '<f4', 'fortran_order': False, 'shape': (1,)", {"expected ',' or '}' after a value"});
  bad("{'descr': '<f4', 'fortran_order': False, 'shape': (1,)} trailing", {"unexpected text after the dict"});
  bad("{'descr': '<f4', 'fortran_order': False, 'shape': (1,", {"expected a non-negative integer", "at its end"});
  bad(dict("<f4\x01", "(1,)"), {"unsupported .npy dtype", "expected a size in bytes"});
}

TEST(HostileNpy, ElementsThatAreNotValuesOfTheirType) {
  test::TempDir dir;
  const std::string p = dir.file("v.npy");
  write_bytes(p, test::npy_bytes("|b1", {3}, std::string("\x01\x00\x07", 3)));
  expect_error([&] { read_npy(p); }, p, {"bool element 2 is 7 (expected 0 or 1)"});
  write_bytes(p, test::npy_bytes("<u8", {1}, std::string(8, '\xff')));
  expect_error([&] { read_npy(p); }, p, {"element 0 is 18446744073709551615, beyond int64"}, 64 * 1024);
}

TEST(HostileNpy, RandomMutationsParseOrRaiseFormatError) {
  test::TempDir dir;
  const std::string p = dir.file("m.npy");
  mutate(test::npy_bytes("<f4", {2, 3}, std::string(24, '\x3f')), p, 400, [&] { read_npy(p); });
  mutate(test::npy_bytes(">i2", {3, 2}, std::string(12, '\x05'), true), p, 200, [&] { read_npy(p); });
}

TEST(HostileNpy, PathsThatAreNotRegularFiles) {
  test::TempDir dir;
  expect_error<IOError>([] { read_npy("/dev/zero"); }, "/dev/zero", {"regular file"});
  expect_error<IOError>([&] { read_npy(dir.path().string()); }, dir.path().string(), {"regular file"});
  expect_error<IOError>([&] { ArrayDataset::from_npy(dir.file("x.npy"), dir.file("y.npy")); }, dir.file("x.npy"),
                        {"cannot open"});
}

// ---------------------------------------------------------------- CSV

TEST(HostileCsv, BinaryJunkAndMutationsRaiseFormatErrorWithTheLine) {
  test::TempDir dir;
  const std::string p = dir.file("t.csv");
  write_bytes(p, std::string("a,b,c\n1,\0,0\n", 12));
  expect_error([&] { CsvDataset({.path = p}); }, p, {"t.csv':2: column 2 ('b'): expected a number, got \"?\""});
  write_bytes(p, "\x89PNG\r\n\x1a\n\0\0\0\rIHDR");
  expect_error([&] { CsvDataset({.path = p}); }, p, {});
  mutate("x,y,label\n1.5,2,cat\n3,4e1,dog\n\"5\",6,\"cat\"\n", p, 400, [&] { CsvDataset({.path = p, .label_name = "label"}); });
  expect_error<IOError>([] { CsvDataset({.path = "/dev/zero"}); }, "/dev/zero", {"regular file"});
}

// ---------------------------------------------------------------- images

namespace {

/// A PNG whose IHDR claims width x height (with a correct CRC, so only the size is wrong).
std::string png_claiming(uint32_t width, uint32_t height) {
  std::string png = test::png_bytes(2, 2, 1, {1, 2, 3, 4});
  const size_t ihdr = png.find("IHDR");
  png.replace(ihdr + 4, 8, test::be32(width) + test::be32(height));
  const uLong crc = crc32(0, reinterpret_cast<const Bytef*>(png.data() + ihdr), 4 + 13);
  png.replace(ihdr + 4 + 13, 4, test::be32(static_cast<uint32_t>(crc)));
  return png;
}

/// A JPEG whose SOF0 claims width x height.
std::string jpeg_claiming(uint16_t width, uint16_t height) {
  std::string jpg = test::jpeg_bytes(8, 8, 1, std::vector<uint8_t>(64, 9));
  const size_t sof = jpg.find("\xff\xc0");
  jpg[sof + 5] = static_cast<char>(height >> 8);
  jpg[sof + 6] = static_cast<char>(height & 0xff);
  jpg[sof + 7] = static_cast<char>(width >> 8);
  jpg[sof + 8] = static_cast<char>(width & 0xff);
  return jpg;
}

}  // namespace

TEST(HostileImage, DecompressionBombsAreRefusedBeforeDecoding) {
  test::TempDir dir;
  const std::string p = dir.file("bomb.png");
  write_bytes(p, png_claiming(100000, 100000));
  expect_error([&] { read_image(p); }, p, {"100000x100000 = 10000000000 pixels, more than the limit of 89478485"});
  const std::string j = dir.file("bomb.jpg");
  write_bytes(j, jpeg_claiming(65000, 65000));
  expect_error([&] { read_image(j); }, j, {"65000x65000", "more than the limit"});
  // The caller's limit applies too; a zero-sized JPEG is an error, not an empty tensor.
  write_bytes(j, jpeg_claiming(8, 8));
  expect_error([&] { read_image(j, 0, 63); }, j, {"8x8 = 64 pixels, more than the limit of 63"});
  write_bytes(j, jpeg_claiming(0, 8));
  expect_error([&] { read_image(j); }, j, {});
}

TEST(HostileImage, TruncatedOrCorruptFilesRaiseFormatError) {
  test::TempDir dir;
  const std::string p = dir.file("i.img");
  std::vector<uint8_t> px(16 * 16 * 3);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(i * 7);
  const std::string png = test::png_bytes(16, 16, 3, px);
  for (const std::string& good : {png, test::jpeg_bytes(16, 16, 3, px)}) {
    // Every truncation before the end of the pixel data (a PNG's last 12 bytes
    // are its IEND chunk); libjpeg's "premature end of data" warning is an
    // error here, not gray fill, so for a JPEG that is every truncation.
    const size_t end = good == png ? good.size() - 12 : good.size();
    for (size_t n = 0; n < end; n += (n < 64 || n + 16 > end ? 1 : 7)) {
      write_bytes(p, good.substr(0, n));
      SCOPED_TRACE("truncated to " + std::to_string(n) + " of " + std::to_string(good.size()) + " bytes");
      expect_error([&] { read_image(p); }, p, {}, 64 * 1024);
    }
    mutate(good, p, 300, [&] { read_image(p); });
  }
  // Pixel data complete and checksummed, only the IEND trailer cut: the image
  // decodes (as PIL loads it), to the same pixels.
  const Tensor whole = decode_image({reinterpret_cast<const uint8_t*>(png.data()), png.size()});
  for (size_t cut = 1; cut <= 12; ++cut) {
    const Tensor t = decode_image({reinterpret_cast<const uint8_t*>(png.data()), png.size() - cut});
    EXPECT_EQ(test::to_doubles(t), test::to_doubles(whole)) << "cut " << cut;
  }
  write_bytes(p, "GIF89a....");
  expect_error([&] { read_image(p); }, p, {"not a PNG or JPEG image (unknown signature)"});
  write_bytes(p, "");
  expect_error([&] { read_image(p); }, p, {"too short for an image header"});
  expect_error<IOError>([] { read_image("/dev/zero"); }, "/dev/zero", {"regular file"});
}

TEST(HostileImage, ImageFolderNamesTheBadFile) {
  test::TempDir dir;
  namespace fs = std::filesystem;
  fs::create_directories(dir.path() / "a");
  write_bytes((dir.path() / "a" / "good.png").string(), test::png_bytes(2, 2, 1, {1, 2, 3, 4}));
  const std::string bad = (dir.path() / "a" / "zbad.jpg").string();
  write_bytes(bad, test::jpeg_bytes(2, 2, 1, {1, 2, 3, 4}).substr(0, 100));
  expect_error([&] { ImageFolder({.root = dir.path().string()}); }, bad, {"JPEG"});
  expect_error<IOError>([&] { ImageFolder({.root = dir.file("absent")}); }, dir.file("absent"), {"not a directory"});
}
