// libFuzzer target: CSV tables (kiln::data::CsvDataset). The first byte picks
// the label column (by index, or the name "label") and the delimiter; the rest
// is the file. A parsed table must have a label in [0, num_classes) per row.
#include "fuzz_util.h"
#include "kiln/data/csv.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln;
  static fuzz::ShmFile file("csv");
  if (size < 1) return 0;
  data::CsvOptions o;
  o.path = file.write(data + 1, size - 1);
  if (data[0] & 1) o.label_name = "label";
  o.label_index = static_cast<int64_t>((data[0] >> 1) & 7) - 4;
  o.delimiter = (data[0] & 16) ? ';' : ',';
  // Every field is at least a byte and a delimiter: the floats take at most twice the file's size.
  fuzz::check_reader("CsvDataset", static_cast<int64_t>(size) * 8 + 256, [&] {
    const data::CsvDataset ds(o);
    const int64_t* labels = ds.labels().data_ptr<int64_t>();
    for (int64_t i = 0; i < ds.size(); ++i)
      if (labels[i] < 0 || labels[i] >= ds.num_classes()) fuzz::die("a label outside [0, num_classes)");
  });
  return 0;
}
