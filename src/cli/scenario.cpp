// `kiln scenario` (cli/scenario.h): lists the gallery and runs one scenario.
#include "cli/scenario.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>

#include "cli/config.h"
#include "cli/doctor.h"
#include "cli/train.h"
#include "kiln/core/error.h"

namespace kiln::cli {
namespace fs = std::filesystem;

namespace {

std::string trim(const std::string& s) {
  const auto a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t\r");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

/// A config scenario's header: "# scenario:", "# symptom:" and "# expect: a | b" lines.
Scenario read_config_scenario(const fs::path& file) {
  Scenario s{file.stem().string(), "config", "", {}, file, nullptr};
  std::ifstream in(file);
  for (std::string line; std::getline(in, line) && line.rfind("#", 0) == 0;) {
    const std::string body = trim(line.substr(1));
    if (body.rfind("symptom:", 0) == 0) s.symptom = trim(body.substr(8));
    if (body.rfind("expect:", 0) == 0) {
      std::string rest = body.substr(7);
      for (size_t at; !rest.empty();) {
        at = rest.find('|');
        const std::string code = trim(rest.substr(0, at));
        if (!code.empty()) s.expect.push_back("[" + code + "]");
        rest = at == std::string::npos ? std::string() : rest.substr(at + 1);
      }
    }
  }
  if (s.expect.empty())
    throw ConfigError(file.string() + ": a scenario config needs a '# expect: CODE | CODE' header line");
  return s;
}

/// Runs `fn` with stdout captured into the returned string (and echoed), so that
/// what kiln printed can be checked.
template <typename Fn>
std::string capture_stdout(Fn&& fn) {
  std::fflush(stdout);
  char path[] = "/tmp/kiln-scenario-XXXXXX";
  const int fd = ::mkstemp(path);
  if (fd < 0) {
    fn();
    return {};
  }
  const int saved = ::dup(STDOUT_FILENO);
  ::dup2(fd, STDOUT_FILENO);
  try {
    fn();
  } catch (...) {
    std::fflush(stdout);
    ::dup2(saved, STDOUT_FILENO);
    ::close(saved);
    ::close(fd);
    ::unlink(path);
    throw;
  }
  std::fflush(stdout);
  ::dup2(saved, STDOUT_FILENO);
  ::close(saved);
  ::close(fd);
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ::unlink(path);
  std::fputs(text.c_str(), stdout);
  return text;
}

/// Trains the scenario's config into `run`, then reads it with the doctor; what they said.
std::string run_config(const Scenario& s, const fs::path& run) {
  std::string said;
  if (fs::exists(run)) fs::remove_all(run);
  try {
    said += capture_stdout([&] { train(Config::from_file(s.config), run, s.config.string()); });
  } catch (const Error& e) {
    said += std::string("kiln: error: ") + e.what() + "\n";
    std::printf("kiln: error: %s\n", e.what());
  }
  if (fs::exists(run / "metrics.jsonl")) {
    const std::vector<Finding> findings = diagnose(run);
    const std::string text = "\n$ kiln doctor " + run.string() + "\n" + format_findings(findings);
    std::fputs(text.c_str(), stdout);
    said += text;
  }
  return said;
}

}  // namespace

fs::path scenarios_dir(const fs::path& dir) {
  if (!dir.empty()) return dir;
  if (fs::is_directory("examples/scenarios")) return "examples/scenarios";
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path near = self.parent_path().parent_path().parent_path().parent_path() / "examples" / "scenarios";
    if (fs::is_directory(near)) return near;
  }
  return "examples/scenarios";
}

std::vector<Scenario> all_scenarios(const fs::path& dir) {
  std::vector<Scenario> out;
  if (fs::is_directory(dir)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".toml") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) out.push_back(read_config_scenario(f));
  }
  for (auto& s : program_scenarios()) out.push_back(std::move(s));
  return out;
}

int scenario_command(const std::string& action, const std::string& name, const fs::path& dir_in, const fs::path& out) {
  const fs::path dir = scenarios_dir(dir_in);
  const std::vector<Scenario> all = all_scenarios(dir);
  if (action == "list") {
    size_t width = 0;
    for (const auto& s : all) width = std::max(width, s.name.size());
    for (const auto& s : all)
      std::printf("%-*s  %-7s  %s\n", static_cast<int>(width), s.name.c_str(), s.kind.c_str(), s.symptom.c_str());
    if (std::none_of(all.begin(), all.end(), [](const Scenario& s) { return s.kind == "config"; }))
      std::printf("(no config scenarios: %s is not a directory; pass --dir examples/scenarios)\n",
                  dir.string().c_str());
    return 0;
  }
  if (action != "run") throw ConfigError("kiln scenario: expected list or run NAME, got \"" + action + "\"");
  auto it = std::find_if(all.begin(), all.end(), [&](const Scenario& s) { return s.name == name; });
  if (it == all.end()) {
    std::string names;
    for (const auto& s : all) names += (names.empty() ? "" : ", ") + s.name;
    throw ConfigError("kiln scenario run: no scenario \"" + name + "\" (have: " + names + ")");
  }
  const Scenario& s = *it;
  std::printf("scenario %s (%s): %s\n\n", s.name.c_str(), s.kind.c_str(), s.symptom.c_str());
  std::fflush(stdout);
  const fs::path work = out.empty() ? fs::temp_directory_path() / ("kiln-scenario-" + s.name) : out;
  std::string said;
  if (s.kind == "config") {
    said = run_config(s, work);
  } else {
    if (fs::exists(work)) fs::remove_all(work);
    fs::create_directories(work);
    said = s.program(work);
    std::fputs(said.c_str(), stdout);
  }
  std::string found;
  for (const auto& e : s.expect)
    if (said.find(e) != std::string::npos) {
      found = e;
      break;
    }
  std::string wanted;
  for (const auto& e : s.expect) wanted += (wanted.empty() ? "" : " or ") + ("\"" + e + "\"");
  if (found.empty()) {
    std::printf("\nscenario %s: kiln's diagnosis does NOT name the cause (expected %s)\n", s.name.c_str(),
                wanted.c_str());
    return 1;
  }
  std::printf("\nscenario %s: kiln names the cause (\"%s\")\n", s.name.c_str(), found.c_str());
  return 0;
}

}  // namespace kiln::cli
