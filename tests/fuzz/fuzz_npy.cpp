// libFuzzer target: .npy files (kiln::data::parse_npy, read_npy,
// ArrayDataset::from_npy). The first byte picks a mode:
//   0: the rest is one file, read from memory and from a file; both readings
//      must agree (same outcome, same dtype, shape and bytes);
//   1: the second byte b splits the m bytes after it at m*b/255 into a
//      features file and a labels file for ArrayDataset::from_npy.
#include <string>

#include "fuzz_util.h"
#include "kiln/data/arrays.h"
#include "kiln/data/npy.h"

namespace {

// What kiln may hold for one .npy file: its elements widened to 8 bytes, plus
// the raw bytes of a conversion, plus a Fortran-order copy.
int64_t npy_budget(size_t size) { return static_cast<int64_t>(size) * 17 + 256; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln;
  static fuzz::ShmFile features("npy-x"), labels("npy-y");
  if (size < 1) return 0;
  const uint8_t* rest = data + 1;
  const size_t n = size - 1;
  if (data[0] % 2 == 0) {
    const std::string& path = features.write(rest, n);
    // Each reading as text (the error, or dtype, shape and bytes), so no tensor outlives its check.
    auto reading = [](const Tensor& t) {
      if (!t.is_contiguous()) fuzz::die("the tensor read is not contiguous");
      return std::string(dtype_name(t.dtype())) + t.shape_string() +
             std::string(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()) * t.element_size());
    };
    std::string from_mem, from_file;
    fuzz::check_reader("parse_npy", npy_budget(n), [&] {
      try {
        from_mem = reading(data::parse_npy({rest, n}, path));
      } catch (const FormatError& e) {
        from_mem = e.what();
        throw;
      }
    });
    fuzz::check_reader("read_npy", npy_budget(n), [&] {
      try {
        from_file = reading(data::read_npy(path));
      } catch (const FormatError& e) {
        from_file = e.what();
        throw;
      }
    });
    if (from_mem != from_file) fuzz::die("parse_npy and read_npy disagree: " + from_mem + " / " + from_file);
    return 0;
  }
  if (n < 1) return 0;
  const size_t m = n - 1, cut = m * rest[0] / 255;
  const std::string& xp = features.write(rest + 1, cut);
  const std::string& yp = labels.write(rest + 1 + cut, m - cut);
  // Both files, the features as float32 and the labels as int64.
  fuzz::check_reader("ArrayDataset::from_npy", npy_budget(cut) * 2 + npy_budget(m - cut) * 2, [&] {
    const data::ArrayDataset ds = data::ArrayDataset::from_npy(xp, yp);
    for (int64_t i = 0; i < std::min<int64_t>(ds.size(), 4); ++i) {
      const int64_t label = ds.get(i).target.item<int64_t>();
      if (label < 0 || label >= ds.num_classes()) fuzz::die("a label outside [0, num_classes)");
    }
  });
  return 0;
}
