// libFuzzer target: idx files, plain and gzipped (kiln::data::read_idx,
// read_maybe_gzipped, IdxClassificationDataset). The first byte picks a mode:
//   0: the rest is the file, as it is (plain, or gzip when it starts 1f 8b);
//   1: the rest is gzipped first, so mutations reach the idx header behind a
//      valid gzip stream;
//   2: the second byte b splits the m bytes after it at m*b/255 into an
//      images file and a labels file, and the dataset's first samples are read.
#include <zlib.h>

#include <algorithm>

#include "../support/idx_bytes.h"
#include "fuzz_util.h"
#include "kiln/data/idx.h"

namespace {

std::string gzip(const uint8_t* data, size_t size) { return kiln::test::gzip_bytes(data, size); }

bool is_gzip(const std::string& s) {
  return s.size() >= 2 && static_cast<uint8_t>(s[0]) == 0x1f && static_cast<uint8_t>(s[1]) == 0x8b;
}

// What kiln may allocate for one idx file: its bytes, or deflate's 1032:1 bound.
int64_t idx_budget(const std::string& file) {
  return static_cast<int64_t>((is_gzip(file) ? 1032 : 1) * file.size() + 64);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln;
  static fuzz::ShmFile images("idx-images"), labels("idx-labels");
  if (size < 1) return 0;
  const int mode = data[0] % 3;
  const uint8_t* rest = data + 1;
  const size_t n = size - 1;
  if (mode == 0 || mode == 1) {
    const std::string file = mode == 0 ? std::string(reinterpret_cast<const char*>(rest), n) : gzip(rest, n);
    const std::string& path = images.write(reinterpret_cast<const uint8_t*>(file.data()), file.size());
    fuzz::check_reader("read_idx", idx_budget(file), [&] {
      const Tensor t = data::read_idx(path);
      if (t.dtype() != kUInt8 || t.dim() < 1 || t.dim() > 4) fuzz::die("read_idx returned an impossible tensor");
    });
    fuzz::check_reader("read_maybe_gzipped", 0, [&] {
      const std::string bytes = data::read_maybe_gzipped(path);
      if (!is_gzip(file) && bytes != file) fuzz::die("read_maybe_gzipped changed a plain file");
      if (bytes.size() > 1032 * file.size()) fuzz::die("read_maybe_gzipped inflated past deflate's limit");
    });
    return 0;
  }
  if (n < 1) return 0;
  const char* body = reinterpret_cast<const char*>(rest + 1);
  const size_t m = n - 1, cut = m * rest[0] / 255;
  const std::string a(body, cut), b(body + cut, m - cut);
  const std::string& ip = images.write(reinterpret_cast<const uint8_t*>(a.data()), a.size());
  const std::string& lp = labels.write(reinterpret_cast<const uint8_t*>(b.data()), b.size());
  // The raw files plus one float32 sample (4 bytes a pixel) and its label.
  const int64_t budget = idx_budget(a) * 5 + idx_budget(b) + 256;
  fuzz::check_reader("IdxClassificationDataset", budget, [&] {
    data::IdxClassificationDataset ds(ip, lp);
    for (int64_t i = 0; i < std::min<int64_t>(ds.size(), 8); ++i) {
      const data::Example e = ds.get(i);
      const int64_t label = e.target.item<int64_t>();
      if (label < 0 || label > 255) fuzz::die("a label outside [0, 255]");
    }
  });
  return 0;
}
