#pragma once
// Run configs for the `kiln` command (docs/config.md): a TOML file checked
// against one schema table, so that a typo is an error naming the key and the
// line instead of a silently ignored setting. Every key has a default; the
// resolved config (defaults filled in, --set overrides applied) is what a run
// directory's config.toml holds and what a checkpoint carries, so a run can be
// rebuilt exactly from either.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <toml++/toml.h>

namespace kiln::cli {

/// A config problem, already phrased for the user ("FILE:LINE: what, expected, got").
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Config {
 public:
  /// Parses and validates a file; ConfigError on a missing file, bad TOML, an
  /// unknown key or a wrong type (message names the file, line and key).
  static Config from_file(const std::filesystem::path& path);
  /// The same for text (`source` names it in messages: "checkpoint step_100").
  static Config from_string(const std::string& text, const std::string& source);

  /// Applies "section.key=value" (value in TOML syntax; bare words are strings).
  void set(const std::string& assignment);

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
  const toml::node& at(const std::string& key) const;
  toml::table user_;   // as given (file, then --set)
  toml::table table_;  // resolved: user_ with defaults filled in
  std::string source_;
};

}  // namespace kiln::cli
