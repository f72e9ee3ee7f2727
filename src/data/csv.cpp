// CSV tables as classification data (include/kiln/data/csv.h).
#include "kiln/data/csv.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <map>
#include <string_view>

#include "file_io.h"
#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/ops/factory.h"

namespace kiln::data {

namespace {

using kiln::detail::concat;

/// Splits the text into rows of unescaped fields (RFC 4180), tracking line numbers.
class RowReader {
 public:
  RowReader(std::string_view text, char delim, const std::string& path) : s_(text), delim_(delim), path_(path) {}

  /// The next row that is not blank; false at the end. `line` is where the row starts (1-based).
  bool next(std::vector<std::string>& fields, int64_t& line) {
    for (;;) {
      if (p_ >= s_.size()) return false;
      line = line_;
      fields.clear();
      bool content = false;
      for (;;) {
        std::string field;
        skip_blanks();
        if (peek() == '"') {
          content = true;
          quoted(field, line);
          skip_blanks();
          const char c = peek();
          if (p_ < s_.size() && c != delim_ && c != '\n' && c != '\r')
            fail(line_, concat("unexpected '", printable(c), "' after the closing quote of field ", fields.size() + 1,
                               " (a quote inside a quoted field is written twice: \"\")"));
        } else {
          const size_t from = p_;
          while (p_ < s_.size() && s_[p_] != delim_ && s_[p_] != '\n' && s_[p_] != '\r') ++p_;
          std::string_view v = s_.substr(from, p_ - from);
          while (!v.empty() && (v.back() == ' ' || (v.back() == '\t' && delim_ != '\t'))) v.remove_suffix(1);
          content = content || !v.empty();
          field.assign(v);
        }
        fields.push_back(std::move(field));
        if (p_ < s_.size() && s_[p_] == delim_) {
          content = true;
          ++p_;
          continue;
        }
        end_line();
        break;
      }
      if (content) return true;  // else a blank line: skip it
    }
  }

  [[noreturn]] void fail(int64_t line, const std::string& what) const {
    throw FormatError(concat("'", path_, "':", line, ": ", what));
  }

 private:
  char peek() const { return p_ < s_.size() ? s_[p_] : '\0'; }
  void skip_blanks() {
    while (p_ < s_.size() && (s_[p_] == ' ' || (s_[p_] == '\t' && delim_ != '\t'))) ++p_;
  }
  void end_line() {
    if (p_ < s_.size() && s_[p_] == '\r') ++p_;
    if (p_ < s_.size() && s_[p_] == '\n') ++p_;
    ++line_;
  }
  void quoted(std::string& out, int64_t start_line) {
    ++p_;
    for (;;) {
      if (p_ >= s_.size()) fail(start_line, "a quoted field is never closed (missing '\"')");
      const char c = s_[p_++];
      if (c == '"') {
        if (peek() != '"') return;
        ++p_;
      } else if (c == '\n') {
        ++line_;
      }
      out.push_back(c);
    }
  }
  static std::string printable(char c) {
    const auto u = static_cast<unsigned char>(c);
    return u >= 0x20 && u < 0x7f ? std::string(1, c)
                                 : concat("\\x", "0123456789abcdef"[u >> 4], "0123456789abcdef"[u & 15]);
  }

  std::string_view s_;
  char delim_;
  const std::string& path_;
  size_t p_ = 0;
  int64_t line_ = 1;
};

bool parse_number(std::string_view v, double& out) {
  if (!v.empty() && v.front() == '+') v.remove_prefix(1);
  if (v.empty()) return false;
  const auto r = std::from_chars(v.data(), v.data() + v.size(), out);
  return r.ec == std::errc() && r.ptr == v.data() + v.size();
}

bool is_number(std::string_view v) {
  double d = 0;
  return parse_number(v, d);
}

bool parse_integer(std::string_view v, int64_t& out) {
  if (!v.empty() && v.front() == '+') v.remove_prefix(1);
  if (v.empty()) return false;
  const auto r = std::from_chars(v.data(), v.data() + v.size(), out);
  return r.ec == std::errc() && r.ptr == v.data() + v.size();
}

std::string shown(const std::string& field) {
  std::string s = field.size() > 40 ? field.substr(0, 37) + "..." : field;
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return "\"" + s + "\"";
}

}  // namespace

struct CsvDataset::Parsed {
  Tensor features, labels;
  std::string path;
  std::vector<std::string> class_names, feature_names;
  std::string label_column;
};

CsvDataset::Parsed CsvDataset::parse(const CsvOptions& o) {
  const std::string text = detail::read_whole_file(o.path, "CsvDataset");
  RowReader rows(text, o.delimiter, o.path);
  std::vector<std::string> first, row;
  int64_t first_line = 0, line = 0;
  KILN_CHECK(rows.next(first, first_line), FormatError, "'", o.path, "': empty CSV file (no rows)");
  const bool have_second = rows.next(row, line);

  bool header = o.header == CsvOptions::Header::Yes;
  if (o.header == CsvOptions::Header::Auto) {
    if (!o.label_name.empty() && std::find(first.begin(), first.end(), o.label_name) != first.end()) header = true;
    for (size_t j = 0; !header && have_second && j < std::min(first.size(), row.size()); ++j)
      header = !is_number(first[j]) && is_number(row[j]);
    if (!have_second && !header)
      header = std::none_of(first.begin(), first.end(), [](const std::string& f) { return is_number(f); });
  }
  const auto ncols = static_cast<int64_t>(first.size());
  KILN_CHECK(ncols >= 2, FormatError, "'", o.path, "':", first_line,
             ": expected at least 2 columns (features and a label), got ", ncols,
             o.delimiter == ',' ? " (is the file delimited by something other than ','?)" : "");

  Parsed out;
  out.path = o.path;
  int64_t label = o.label_index;
  if (!o.label_name.empty()) {
    auto it = header ? std::find(first.begin(), first.end(), o.label_name) : first.end();
    if (it == first.end()) {
      std::string names;
      for (size_t j = 0; header && j < first.size() && j < 30; ++j) names += (j ? ", " : "") + shown(first[j]);
      throw FormatError(
          concat("'", o.path, "': no column named '", o.label_name, "' for the labels (",
                 header ? "the header has: " + names : "the file has no header row; give the column's index", ")"));
    }
    label = it - first.begin();
  } else {
    if (label < 0) label += ncols;
    KILN_CHECK(label >= 0 && label < ncols, FormatError, "'", o.path, "': label column index ", o.label_index,
               " is outside the file's ", ncols, " columns");
  }
  for (int64_t j = 0; j < ncols; ++j) {
    const std::string name = header ? first[static_cast<size_t>(j)] : concat("column ", j + 1);
    if (j == label)
      out.label_column = name;
    else
      out.feature_names.push_back(name);
  }

  std::vector<float> values;
  std::vector<std::string> label_text;
  std::vector<int64_t> label_line;
  auto take = [&](const std::vector<std::string>& f, int64_t at) {
    KILN_CHECK(static_cast<int64_t>(f.size()) == ncols, FormatError, "'", o.path, "':", at, ": expected ", ncols,
               " fields (as in the first row), got ", f.size());
    for (int64_t j = 0; j < ncols; ++j) {
      const std::string& v = f[static_cast<size_t>(j)];
      if (j == label) {
        KILN_CHECK(!v.empty(), FormatError, "'", o.path, "':", at, ": column ", j + 1, " ('", out.label_column,
                   "'): the label is empty");
        label_text.push_back(v);
        label_line.push_back(at);
        continue;
      }
      double d = 0;
      const std::string& col = out.feature_names[static_cast<size_t>(j < label ? j : j - 1)];
      KILN_CHECK(parse_number(v, d), FormatError, "'", o.path, "':", at, ": column ", j + 1, " ('", col,
                 "'): expected a number, got ", shown(v));
      KILN_CHECK(std::isfinite(static_cast<float>(d)), FormatError, "'", o.path, "':", at, ": column ", j + 1, " ('",
                 col, "'): ", shown(v), " is not a finite float32; clean or impute the data first");
      values.push_back(static_cast<float>(d));
    }
  };
  if (!header) take(first, first_line);
  if (have_second) {
    take(row, line);
    while (rows.next(row, line)) take(row, line);
  }
  const auto n = static_cast<int64_t>(label_text.size());
  KILN_CHECK(n > 0, FormatError, "'", o.path, "': no data rows", header ? " after the header" : "");

  std::vector<int64_t> ids(static_cast<size_t>(n));
  bool integers = o.class_names.empty();
  for (int64_t i = 0; integers && i < n; ++i)
    integers = parse_integer(label_text[static_cast<size_t>(i)], ids[static_cast<size_t>(i)]);
  if (integers) {
    for (int64_t i = 0; i < n; ++i)
      KILN_CHECK(ids[static_cast<size_t>(i)] >= 0, FormatError, "'", o.path, "':", label_line[static_cast<size_t>(i)],
                 ": label ", ids[static_cast<size_t>(i)], " is negative (expected a class index >= 0 or a class name)");
  } else {
    out.class_names = o.class_names;
    if (out.class_names.empty()) {
      out.class_names = label_text;
      std::sort(out.class_names.begin(), out.class_names.end());
      out.class_names.erase(std::unique(out.class_names.begin(), out.class_names.end()), out.class_names.end());
    }
    std::map<std::string, int64_t> index;
    for (size_t c = 0; c < out.class_names.size(); ++c) index.emplace(out.class_names[c], static_cast<int64_t>(c));
    for (int64_t i = 0; i < n; ++i) {
      auto it = index.find(label_text[static_cast<size_t>(i)]);
      KILN_CHECK(it != index.end(), FormatError, "'", o.path, "':", label_line[static_cast<size_t>(i)], ": label ",
                 shown(label_text[static_cast<size_t>(i)]), " is not one of the ", out.class_names.size(),
                 " class names of the training data");
      ids[static_cast<size_t>(i)] = it->second;
    }
  }
  const TensorOptions data = TensorOptions().category(MemoryCategory::Data);
  out.features = empty({n, ncols - 1}, data.dtype(kFloat32));
  std::memcpy(out.features.data_ptr(), values.data(), values.size() * sizeof(float));
  out.labels = empty({n}, data.dtype(kInt64));
  std::memcpy(out.labels.data_ptr(), ids.data(), ids.size() * sizeof(int64_t));
  return out;
}

CsvDataset::CsvDataset(const CsvOptions& options) : CsvDataset(parse(options)) {}

CsvDataset::CsvDataset(Parsed&& p)
    : ArrayDataset(p.features, p.labels, p.path, p.path + " (column '" + p.label_column + "')"),
      class_names_(std::move(p.class_names)),
      feature_names_(std::move(p.feature_names)),
      label_column_(std::move(p.label_column)) {}

}  // namespace kiln::data
