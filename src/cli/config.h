#pragma once
// Run configs for the `kiln` command (docs/config.md): a TOML file checked
// against one schema table, so that a typo is an error naming the key and the
// line instead of a silently ignored setting. Every key has a default; the
// resolved config (defaults filled in, --set overrides applied) is what a run
// directory's config.toml holds and what a checkpoint carries, so a run can be
// rebuilt exactly from either.
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <toml++/toml.h>

namespace kiln::cli {

/// A config problem, already phrased for the user ("FILE:LINE: what, expected, got").
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// What a key's new value does when `kiln resume --set` changes it (docs/config.md, "Changing settings on resume").
enum class OnResume {
  Applies,    // used from the resume step on, like any setting of this process (train.eval_every, threads)
  Optimizer,  // an optimizer hyperparameter, written into every param group after the checkpoint is loaded
  Schedule,   // the learning-rate schedule is recomputed from step 0 with the new value (optim.lr, schedule.*)
  Refused,    // the checkpoint's state was built from the old value: an error names the key
};

class Config {
 public:
  /// Parses and validates a file, then applies `sets` (--set assignments) and
  /// range-checks the result; ConfigError on a missing file, bad TOML, an
  /// unknown key or a wrong type (message names the file, line and key), or on
  /// values out of range (every one in one message, each with where it came from).
  static Config from_file(const std::filesystem::path& path, const std::vector<std::string>& sets = {});
  /// The same for text (`source` names it in messages: "checkpoint step_100").
  static Config from_string(const std::string& text, const std::string& source,
                            const std::vector<std::string>& sets = {});

  /// Applies "section.key=value" (value in TOML syntax; bare words are strings), then range-checks.
  void set(const std::string& assignment);
  /// Applies every assignment, then range-checks once (all problems in one message).
  void set_all(const std::vector<std::string>& assignments);

  /// Where `key`'s value came from: "FILE:LINE", "--set key=value", or "FILE (the default)".
  std::string origin(const std::string& key) const;
  /// Every key of the resolved config, in schema order.
  std::vector<std::string> keys() const;
  /// A key's value as TOML text ("" when the key does not apply to this config).
  std::string value_text(const std::string& key) const;
  /// What changing `key` on resume does; for Refused, `why` says why.
  static OnResume on_resume(const std::string& key, std::string* why = nullptr);

  int64_t integer(const std::string& key) const;
  double number(const std::string& key) const;
  bool boolean(const std::string& key) const;
  std::string string(const std::string& key) const;
  std::vector<int64_t> integers(const std::string& key) const;

  /// The resolved config as TOML: every key of the schema that applies, with its value.
  std::string to_toml() const;
  const std::string& source() const { return source_; }

  /// The config's name (key `name`); the default run directory is runs/<name>.
  std::string name() const { return string("name"); }
  /// True for the character-level language model (data.dataset = "text").
  bool is_language_model() const { return string("data.dataset") == "text"; }

 private:
  Config() = default;
  void validate_and_fill();
  void apply(const std::string& assignment);
  void check_ranges() const;
  const toml::node& at(const std::string& key) const;
  toml::table user_;   // as given (file, then --set)
  toml::table table_;  // resolved: user_ with defaults filled in
  std::string source_;
  std::map<std::string, std::string> origin_;  // key -> "FILE:LINE" or "--set ..." for every given key
};

}  // namespace kiln::cli
