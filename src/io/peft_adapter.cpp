// Hugging Face PEFT LoRA adapter directories (include/kiln/io/peft_adapter.h).
#include "kiln/io/peft_adapter.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/io/atomic_file.h"

namespace kiln::io {

namespace {

using json = nlohmann::ordered_json;
using detail::concat;

constexpr std::string_view kPrefix = "base_model.model.";
constexpr std::string_view kSuffixA = ".lora_A.weight";
constexpr std::string_view kSuffixB = ".lora_B.weight";
// A config file is a few hundred bytes; anything far larger is not one.
constexpr uintmax_t kMaxConfigBytes = 1 << 20;
// PEFT's ranks are small; a bound keeps a hostile r from sizing anything.
constexpr int64_t kMaxRank = 1 << 16;

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw FormatError(concat("PEFT adapter '", source, "': ", what));
}

std::string read_text(const std::filesystem::path& p) {
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(p, ec);
  if (ec) throw IOError(concat("PEFT adapter: cannot read '", p.string(), "': ", ec.message()));
  if (size > kMaxConfigBytes)
    fail(p.string(), concat("expected a JSON config of at most ", kMaxConfigBytes, " bytes, got ", size, " bytes"));
  std::ifstream in(p, std::ios::binary);
  if (!in) throw IOError(concat("PEFT adapter: cannot open '", p.string(), "'"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string peft_lora_key(const std::string& module_path, char which) {
  KILN_CHECK(which == 'A' || which == 'B', ValueError, "peft_lora_key: which must be 'A' or 'B', got '", which, "'");
  return std::string(kPrefix) + module_path + std::string(which == 'A' ? kSuffixA : kSuffixB);
}

std::string peft_lora_module(const std::string& key, char* which) {
  if (!key.starts_with(kPrefix)) return {};
  for (auto [suffix, w] : {std::pair{kSuffixA, 'A'}, std::pair{kSuffixB, 'B'}}) {
    if (key.size() > kPrefix.size() + suffix.size() && key.ends_with(suffix)) {
      if (which) *which = w;
      return key.substr(kPrefix.size(), key.size() - kPrefix.size() - suffix.size());
    }
  }
  return {};
}

std::string peft_bias_parameter(const std::string& key) {
  constexpr std::string_view kBias = ".bias";
  if (!key.starts_with(kPrefix) || !key.ends_with(kBias) || key.size() <= kPrefix.size() + kBias.size()) return {};
  std::string name = key.substr(kPrefix.size());
  // A parameter inside an adapter is never a trained base bias.
  for (std::string_view part : {".lora_A.", ".lora_B."})
    if (name.find(part) != std::string::npos) return {};
  return name;
}

PeftLoraConfig parse_peft_lora_config(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail(source, "expected JSON, got text that does not parse");
  if (!j.is_object()) fail(source, concat("expected a JSON object, got ", j.type_name()));
  auto need = [&](const char* key) -> const json& {
    auto it = j.find(key);
    if (it == j.end()) fail(source, concat("missing key \"", key, "\""));
    return *it;
  };
  const json& type = need("peft_type");
  if (!type.is_string() || type.get<std::string>() != "LORA")
    fail(source, concat("expected \"peft_type\": \"LORA\", got ", type.dump()));
  PeftLoraConfig c;
  const json& r = need("r");
  if (!r.is_number_integer() || r.get<int64_t>() < 1 || r.get<int64_t>() > kMaxRank)
    fail(source, concat("expected \"r\" an integer in [1, ", kMaxRank, "], got ", r.dump()));
  c.r = r.get<int64_t>();
  const json& alpha = need("lora_alpha");
  if (!alpha.is_number() || !std::isfinite(alpha.get<double>()))
    fail(source, concat("expected \"lora_alpha\" a finite number, got ", alpha.dump()));
  c.lora_alpha = alpha.get<double>();
  if (auto it = j.find("lora_dropout"); it != j.end()) {
    if (!it->is_number() || !(it->get<double>() >= 0.0 && it->get<double>() < 1.0))
      fail(source, concat("expected \"lora_dropout\" a number in [0, 1), got ", it->dump()));
    c.lora_dropout = it->get<double>();
  }
  const json& targets = need("target_modules");
  // PEFT also accepts one regular expression as a string; kiln writes and reads the list form.
  if (!targets.is_array()) fail(source, concat("expected \"target_modules\" a list of names, got ", targets.dump()));
  for (const json& t : targets) {
    if (!t.is_string() || t.get<std::string>().empty())
      fail(source, concat("expected each of \"target_modules\" a non-empty string, got ", t.dump()));
    c.target_modules.push_back(t.get<std::string>());
  }
  if (auto it = j.find("bias"); it != j.end()) {
    const std::string b = it->is_string() ? it->get<std::string>() : "";
    if (b != "none" && b != "all" && b != "lora_only")
      fail(source, concat("expected \"bias\" one of \"none\", \"all\", \"lora_only\", got ", it->dump()));
    c.bias = b;
  }
  if (auto it = j.find("fan_in_fan_out"); it != j.end() && !(it->is_boolean() && !it->get<bool>()))
    fail(source, concat("expected \"fan_in_fan_out\": false (weights stored [out, in]), got ", it->dump()));
  if (auto it = j.find("base_model_name_or_path"); it != j.end() && it->is_string())
    c.base_model_name_or_path = it->get<std::string>();
  return c;
}

void save_peft_adapter(const std::string& dir, const PeftAdapter& adapter) {
  const bool biases = adapter.config.bias != "none";
  for (const auto& [name, t] : adapter.tensors)
    KILN_CHECK(!peft_lora_module(name).empty() || (biases && !peft_bias_parameter(name).empty()), ValueError,
               "save_peft_adapter: expected tensor names of the form ", kPrefix, "<module>", kSuffixA, " or ", kSuffixB,
               biases ? concat(" or ", kPrefix, "<parameter>.bias") : std::string(), ", got '", name, "'");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw IOError(concat("save_peft_adapter: cannot create '", dir, "': ", ec.message()));
  const PeftLoraConfig& c = adapter.config;
  json j;
  // PEFT's LoraConfig fields; PEFT versions that predate a field ignore it or use its default.
  j["peft_type"] = "LORA";
  j["task_type"] = nullptr;
  j["base_model_name_or_path"] = c.base_model_name_or_path;
  j["r"] = c.r;
  j["lora_alpha"] = c.lora_alpha;
  j["lora_dropout"] = c.lora_dropout;
  j["target_modules"] = c.target_modules;
  j["bias"] = c.bias;
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["modules_to_save"] = nullptr;
  save_safetensors((std::filesystem::path(dir) / "adapter_model.safetensors").string(), adapter.tensors,
                   {{"format", "pt"}});
  write_file_atomically(std::filesystem::path(dir) / "adapter_config.json", j.dump(2) + "\n");
}

PeftAdapter load_peft_adapter(const std::string& dir) {
  const auto config_path = std::filesystem::path(dir) / "adapter_config.json";
  const auto tensors_path = std::filesystem::path(dir) / "adapter_model.safetensors";
  PeftAdapter a;
  a.config = parse_peft_lora_config(read_text(config_path), config_path.string());
  const std::string src = tensors_path.string();
  SafetensorsFile f = load_safetensors(src);
  std::map<std::string, std::pair<int, int>> seen;  // module -> (A count, B count)
  const bool biases = a.config.bias != "none";
  for (auto& [name, t] : f.tensors) {
    char which = 0;
    const std::string module = peft_lora_module(name, &which);
    if (module.empty() && biases && !peft_bias_parameter(name).empty()) {
      if (!is_floating_point(t.dtype()))
        fail(src, concat("tensor '", name, "': expected a floating-point tensor, got ", dtype_name(t.dtype())));
      if (t.dim() != 1)
        fail(src, concat("tensor '", name, "': expected a bias of 1 dim, got shape ", t.shape_string()));
      continue;
    }
    if (module.empty())
      fail(src,
           concat("tensor '", name, "': expected a name of the form ", kPrefix, "<module>", kSuffixA, " or ", kSuffixB,
                  biases ? concat(" or ", kPrefix, "<parameter>.bias")
                         : std::string(" (bias tensors only when adapter_config.json's \"bias\" is not \"none\")")));
    if (!is_floating_point(t.dtype()))
      fail(src, concat("tensor '", name, "': expected a floating-point tensor, got ", dtype_name(t.dtype())));
    if (t.dim() != 2) fail(src, concat("tensor '", name, "': expected 2 dims, got shape ", t.shape_string()));
    const int64_t rank_dim = which == 'A' ? t.size(0) : t.size(1);
    if (rank_dim != a.config.r)
      fail(src, concat("tensor '", name, "': expected rank ", a.config.r, " (adapter_config.json's r) in dim ",
                       which == 'A' ? 0 : 1, ", got shape ", t.shape_string()));
    auto& counts = seen[module];
    (which == 'A' ? counts.first : counts.second)++;
  }
  if (seen.empty()) fail(src, "expected LoRA tensors, got none");
  for (const auto& [module, counts] : seen)
    if (counts.first != 1 || counts.second != 1)
      fail(src, concat("module '", module, "': expected one lora_A and one lora_B, got ", counts.first, " and ",
                       counts.second));
  a.tensors = std::move(f.tensors);
  return a;
}

}  // namespace kiln::io
