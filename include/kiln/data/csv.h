// Bring-your-own tabular data: a CSV file of numeric feature columns and one
// label column, as a classification dataset (an ArrayDataset, float32
// features [N, F], int64 labels [N]).
//
// The format is RFC 4180's: a delimiter (',' by default), fields optionally in
// double quotes (a quote inside doubled, delimiters and newlines allowed
// inside), CRLF or LF line ends, blank lines skipped, spaces around a field
// ignored. Whether the first row is a header is detected unless said: it is
// when it holds the label column's name, or when one of its fields is not a
// number where the second row's is (Python's csv.Sniffer asks much the same).
//
// Labels are integer class indices >= 0 when every label is an integer;
// otherwise they are names, numbered in sorted (byte) order, as torchvision
// numbers ImageFolder's classes — pass `class_names` to number another file's
// labels the same way (a validation split). Features must be finite numbers.
//
// The file is hostile input: every problem (a ragged row, an unterminated
// quote, a field that is not a number, an unknown class name) is a FormatError
// naming the file, the line and the column; nothing but the file itself and
// the parsed values is allocated.
#pragma once

#include <string>
#include <vector>

#include "kiln/data/arrays.h"

namespace kiln::data {

struct CsvOptions {
  std::string path = {};
  /// The label column by name (needs a header) ...
  std::string label_name = {};
  /// ... or, when label_name is empty, by 0-based index; negative counts from the end.
  int64_t label_index = -1;
  enum class Header { Auto, Yes, No };
  Header header = Header::Auto;
  char delimiter = ',';
  /// Names of textual labels in class-index order; empty: the file's sorted distinct labels.
  std::vector<std::string> class_names = {};
};

class CsvDataset : public ArrayDataset {
 public:
  explicit CsvDataset(const CsvOptions& options);

  /// The class names of textual labels, in index order (empty for integer labels).
  const std::vector<std::string>& class_names() const { return class_names_; }
  /// The feature columns' names (from the header, else "column K", 1-based).
  const std::vector<std::string>& feature_names() const { return feature_names_; }
  const std::string& label_column() const { return label_column_; }

 private:
  struct Parsed;
  static Parsed parse(const CsvOptions& options);
  explicit CsvDataset(Parsed&& parsed);
  std::vector<std::string> class_names_, feature_names_;
  std::string label_column_;
};

}  // namespace kiln::data
