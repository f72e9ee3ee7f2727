// CharCorpus on the real Moby-Dick file (expected values from /usr/bin/python3:
// text between the Gutenberg markers, CRLF -> LF, stripped) and on small files.
#include <gtest/gtest.h>

#include <fstream>

#include "kiln/core/error.h"
#include "kiln/data/loader.h"
#include "kiln/data/text.h"
#include "support/test_util.h"

using namespace kiln;
using namespace kiln::data;

TEST(DataText, MobyDickIsStrippedAndNormalised) {
  CharCorpus c({.context = 64});
  EXPECT_EQ(c.text().size(), 1215875u);
  EXPECT_EQ(c.text().substr(0, 45), "Produced by Daniel Lazarus and Jonesey\n\n\n\n\n\nM");
  EXPECT_TRUE(c.text().ends_with("y Dick; or The Whale, by Herman Melville"));
  EXPECT_EQ(c.text().find('\r'), std::string_view::npos);
  EXPECT_EQ(c.text().find("*** START"), std::string_view::npos);
  EXPECT_EQ(c.size(), (1215875 - 64 - 1) / 64 + 1);
  Example e = c.get(0);
  EXPECT_EQ(e.data.shape_string(), "[64]");
  auto x = test::to_doubles(e.data), y = test::to_doubles(e.target);
  EXPECT_EQ(x[0], 'P');
  EXPECT_EQ(y[0], 'r');
  for (size_t i = 0; i + 1 < x.size(); ++i) EXPECT_EQ(y[i], x[i + 1]) << "targets are the next tokens";
  auto last = c.get(c.size() - 1);
  EXPECT_EQ(test::to_doubles(last.target).back(),
            static_cast<unsigned char>(c.text()[static_cast<size_t>((c.size() - 1) * 64 + 64)]));

  DataLoader<> loader(std::make_shared<CharCorpus>(CharCorpusOptions{.context = 32}),
                      {.batch_size = 8, .shuffle = true, .num_workers = 2, .drop_last = true});
  int64_t n = 0;
  for (auto& b : loader) {
    EXPECT_EQ(b.data.shape_string(), "[8, 32]");
    if (++n == 3) break;
  }
  EXPECT_EQ(n, 3);
}

TEST(DataText, SherlockIsTheSecondCorpus) {
  // Expected from /usr/bin/python3: bytes between the Gutenberg markers, CRLF -> LF, stripped.
  CharCorpus c({.path = kSherlockPath, .context = 128});
  EXPECT_EQ(c.text().size(), 562530u);
  EXPECT_TRUE(c.text().starts_with("Produced by an anonymous Project Gutenbe"));
  EXPECT_TRUE(c.text().ends_with(" Sherlock Holmes, by \nArthur Conan Doyle"));
  EXPECT_EQ(c.text().find('\r'), std::string_view::npos);
  EXPECT_EQ(c.size(), (562530 - 128 - 1) / 128 + 1);
}

TEST(DataText, SmallFileWindowsAndStride) {
  test::TempDir dir;
  {
    std::ofstream f(dir.file("t.txt"), std::ios::binary);
    f << "header\r\n*** START OF X ***\r\nabc\r\ndefgh\r\n*** END OF X ***\r\nfooter";
  }
  CharCorpus c({.path = dir.file("t.txt"), .context = 3, .stride = 2});
  EXPECT_EQ(c.text(), "abc\ndefgh");
  EXPECT_EQ(c.size(), 3);  // starts 0, 2, 4; a window at 6 would need bytes 6..9 of 9
  EXPECT_EQ(test::to_doubles(c.get(1).data), (std::vector<double>{'c', '\n', 'd'}));
  EXPECT_EQ(test::to_doubles(c.get(2).data), (std::vector<double>{'d', 'e', 'f'}));
  EXPECT_EQ(test::to_doubles(c.get(2).target), (std::vector<double>{'e', 'f', 'g'}));
  EXPECT_THROW(c.get(3), IndexError);
  CharCorpus raw({.path = dir.file("t.txt"), .context = 3, .strip_gutenberg = false});
  EXPECT_TRUE(raw.text().starts_with("header\n*** START"));
  EXPECT_THROW(CharCorpus({.path = dir.file("none.txt")}), IOError);
}

TEST(DataText, TokenFileUint16AndUint32) {
  test::TempDir dir;
  for (int64_t width : {2, 4}) {
    std::string bytes;
    std::vector<int64_t> toks;
    for (int64_t i = 0; i < 10; ++i) {
      int64_t t = width == 2 ? 65000 - i * 7 : 3000000000LL + i;
      toks.push_back(t);
      for (int64_t b = 0; b < width; ++b) bytes.push_back(static_cast<char>((t >> (8 * b)) & 0xff));
    }
    std::string path = dir.file("tok" + std::to_string(width) + ".bin");
    {
      std::ofstream f(path, std::ios::binary);
      f << bytes;
    }
    TokenFile tf({.path = path, .bytes_per_token = width, .context = 4});
    EXPECT_EQ(tf.num_tokens(), 10);
    EXPECT_EQ(tf.size(), 2);  // windows at 0 and 4; one at 8 would need tokens 8..12
    Example e = tf.get(1);
    EXPECT_EQ(test::to_doubles(e.data), (std::vector<double>{double(toks[4]), double(toks[5]), double(toks[6]),
                                                             double(toks[7])}));
    EXPECT_EQ(test::to_doubles(e.target).back(), double(toks[8]));
    EXPECT_THROW(tf.get(2), IndexError);
    {
      std::ofstream f(path, std::ios::binary | std::ios::app);
      f << 'x';
    }
    try {
      TokenFile bad({.path = path, .bytes_per_token = width, .context = 4});
      FAIL() << "no FormatError";
    } catch (const FormatError& err) {
      EXPECT_NE(std::string(err.what()).find(path), std::string::npos) << err.what();
    }
  }
  EXPECT_THROW(TokenFile({.path = dir.file("tok2.bin"), .bytes_per_token = 3}), ValueError);
}
