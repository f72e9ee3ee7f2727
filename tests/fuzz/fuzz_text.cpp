// libFuzzer target: the text readers (kiln::data::CharCorpus, TokenFile).
// Bytes 0-2 choose the reader and its options (context 1-32, stride 0-15,
// Gutenberg stripping or the token width — 2, 4, or an invalid 3 that must be
// refused with ValueError); the rest is the file. The first, a middle and the
// last window are read and checked: tokens in range, targets shifted by one.
#include <algorithm>

#include "fuzz_util.h"
#include "kiln/data/text.h"

namespace {

void check_windows(const kiln::data::Dataset<kiln::data::Example>& ds, int64_t context, int64_t max_token) {
  const int64_t n = ds.size();
  for (int64_t i : {int64_t{0}, n / 2, n - 1}) {
    if (i < 0 || i >= n) continue;
    const kiln::data::Example e = ds.get(i);
    if (e.data.numel() != context || e.target.numel() != context) kiln::fuzz::die("a window of the wrong length");
    const auto* x = e.data.data_ptr<int64_t>();
    const auto* y = e.target.data_ptr<int64_t>();
    for (int64_t k = 0; k < context; ++k) {
      if (x[k] < 0 || x[k] > max_token || y[k] < 0 || y[k] > max_token) kiln::fuzz::die("a token out of range");
      if (k + 1 < context && x[k + 1] != y[k]) kiln::fuzz::die("targets are not the inputs shifted by one");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln;
  static fuzz::ShmFile file("text");
  if (size < 3) return 0;
  const bool tokens = data[0] & 1;
  const int64_t context = 1 + data[1] % 32;
  const int64_t stride = data[2] % 16;
  const std::string& path = file.write(data + 3, size - 3);
  // Two int64 windows of `context` tokens (and the CRLF copy, which is not a tensor).
  const int64_t budget = 2 * (8 * context + 64);
  if (!tokens) {
    fuzz::check_reader<ValueError>("CharCorpus", budget, [&] {
      data::CharCorpus ds({.path = path, .context = context, .stride = stride, .strip_gutenberg = (data[0] & 2) != 0});
      if (ds.text().size() > size - 3) fuzz::die("CharCorpus text longer than the file");
      check_windows(ds, context, 255);
    });
  } else {
    const int64_t width = 2 + (data[0] >> 1) % 3;  // 2, 3 (invalid) or 4
    fuzz::check_reader<ValueError>("TokenFile", budget, [&] {
      data::TokenFile ds({.path = path, .bytes_per_token = width, .context = context, .stride = stride});
      if (ds.num_tokens() * width != static_cast<int64_t>(size - 3)) fuzz::die("TokenFile miscounts its tokens");
      check_windows(ds, context, width == 2 ? 0xffff : 0xffffffffLL);
    });
  }
  return 0;
}
