// libFuzzer target: run configs (kiln::cli::Config, the TOML reader of the
// `kiln` command). The input is TOML text, optionally followed by a line
// "#--set" and one `key=value` assignment per line, as `--set` passes them.
// Accepted outcomes: a config that resolves (and whose resolved TOML parses
// back to the same text), or a ConfigError with a message. Anything else —
// another exception, a crash, a sanitizer report — aborts.
#include <string>
#include <string_view>

#include "cli/config.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kiln::cli::Config;
  using kiln::cli::ConfigError;
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t cut = input.find("\n#--set\n");
  const std::string text = input.substr(0, cut);
  try {
    Config c = Config::from_string(text, "fuzz.toml");
    if (cut != std::string::npos) {
      std::string_view rest = std::string_view(input).substr(cut + 8);
      while (!rest.empty()) {
        const size_t nl = rest.find('\n');
        c.set(std::string(rest.substr(0, nl)));
        rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
      }
    }
    const std::string resolved = c.to_toml();
    // What a run directory stores must read back as the same config.
    if (Config::from_string(resolved, "resolved.toml").to_toml() != resolved)
      kiln::fuzz::die("the resolved config does not read back as itself:\n" + resolved);
  } catch (const ConfigError& e) {
    if (std::string_view(e.what()).empty()) kiln::fuzz::die("ConfigError without a message");
  } catch (const std::exception& e) {
    kiln::fuzz::die(std::string("Config: expected success or a ConfigError, got std::exception: ") + e.what());
  }
  return 0;
}
