// The config schema and its checks. One table (kSchema) lists every key with
// its type, default, the condition under which it applies and its allowed
// values; docs/config.md documents the same table for people.
#include "cli/config.h"

#include <charconv>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

namespace kiln::cli {
namespace {

enum class Kind { Int, Float, Bool, String, IntArray };

struct Key {
  const char* name;      // "section.key" or a top-level "key"
  Kind kind;
  const char* def;       // default in TOML syntax; nullptr: required
  const char* when;      // "" or "model.type=cnn|vit": the key applies only then
  const char* choices;   // "" or "a|b|c" for strings
};

// clang-format off
constexpr Key kSchema[] = {
    {"name", Kind::String, "\"run\"", "", ""},
    {"seed", Kind::Int, "0", "", ""},
    {"threads", Kind::Int, "0", "", ""},
    {"amp", Kind::String, "\"off\"", "", "off|bf16|fp16"},

    {"model.type", Kind::String, nullptr, "", "mlp|cnn|resnet|vit|gpt"},
    {"model.hidden", Kind::IntArray, "[512, 512]", "model.type=mlp", ""},
    {"model.channels1", Kind::Int, "32", "model.type=cnn", ""},
    {"model.channels2", Kind::Int, "64", "model.type=cnn", ""},
    {"model.fc_hidden", Kind::Int, "128", "model.type=cnn", ""},
    {"model.stem_channels", Kind::Int, "16", "model.type=resnet", ""},
    {"model.widths", Kind::IntArray, "[16, 32, 64]", "model.type=resnet", ""},
    {"model.blocks", Kind::IntArray, "[1, 1, 1]", "model.type=resnet", ""},
    {"model.patch_size", Kind::Int, "7", "model.type=vit", ""},
    {"model.dim", Kind::Int, "64", "model.type=vit", ""},
    {"model.depth", Kind::Int, "2", "model.type=vit", ""},
    {"model.heads", Kind::Int, "4", "model.type=vit", ""},
    {"model.mlp_dim", Kind::Int, "128", "model.type=vit", ""},
    {"model.n_layer", Kind::Int, "4", "model.type=gpt", ""},
    {"model.n_head", Kind::Int, "4", "model.type=gpt", ""},
    {"model.n_embd", Kind::Int, "128", "model.type=gpt", ""},
    {"model.dropout", Kind::Float, "0.0", "model.type=gpt|vit", ""},

    {"data.dataset", Kind::String, nullptr, "", "fashion_mnist|mnist|synthetic|text|npy|safetensors|csv|image_folder"},
    {"data.root", Kind::String, "\"\"", "data.dataset=fashion_mnist|mnist", ""},
    {"data.path", Kind::String, "\"\"", "data.dataset=text|npy|safetensors|csv|image_folder", ""},
    {"data.context", Kind::Int, "128", "data.dataset=text", ""},
    {"data.val_fraction", Kind::Float, "0.05", "data.dataset=text|npy|safetensors|csv|image_folder", ""},
    // Bring-your-own data (src/cli/task_data.cpp).
    {"data.labels_path", Kind::String, "\"\"", "data.dataset=npy", ""},
    {"data.eval_path", Kind::String, "\"\"", "data.dataset=npy|safetensors|csv|image_folder", ""},
    {"data.eval_labels_path", Kind::String, "\"\"", "data.dataset=npy", ""},
    {"data.features_key", Kind::String, "\"features\"", "data.dataset=safetensors", ""},
    {"data.labels_key", Kind::String, "\"labels\"", "data.dataset=safetensors", ""},
    {"data.label_column", Kind::String, "\"-1\"", "data.dataset=csv", ""},
    {"data.channels", Kind::Int, "0", "data.dataset=image_folder", ""},
    {"data.resize", Kind::IntArray, "[]", "data.dataset=image_folder", ""},
    {"data.image_size", Kind::Int, "28", "data.dataset=synthetic", ""},
    {"data.num_classes", Kind::Int, "10", "data.dataset=synthetic", ""},
    {"data.batch_size", Kind::Int, "64", "", ""},
    {"data.eval_batch_size", Kind::Int, "500", "", ""},
    {"data.num_workers", Kind::Int, "1", "", ""},
    {"data.train_size", Kind::Int, "0", "", ""},
    {"data.eval_size", Kind::Int, "0", "", ""},
    {"data.random_crop", Kind::Int, "0", "data.dataset=fashion_mnist|mnist", ""},
    {"data.hflip", Kind::Bool, "false", "data.dataset=fashion_mnist|mnist", ""},

    {"optim.name", Kind::String, "\"adam\"", "", "sgd|adam|adamw|rmsprop"},
    {"optim.lr", Kind::Float, "1e-3", "", ""},
    {"optim.weight_decay", Kind::Float, "0.0", "", ""},
    {"optim.momentum", Kind::Float, "0.0", "optim.name=sgd|rmsprop", ""},
    {"optim.nesterov", Kind::Bool, "false", "optim.name=sgd", ""},
    {"optim.beta1", Kind::Float, "0.9", "optim.name=adam|adamw", ""},
    {"optim.beta2", Kind::Float, "0.999", "optim.name=adam|adamw", ""},
    {"optim.eps", Kind::Float, "1e-8", "optim.name=adam|adamw|rmsprop", ""},
    {"optim.grad_clip", Kind::Float, "0.0", "", ""},

    {"schedule.type", Kind::String, "\"constant\"", "", "constant|cosine|step"},
    {"schedule.warmup_steps", Kind::Int, "0", "", ""},
    {"schedule.min_lr", Kind::Float, "0.0", "schedule.type=cosine", ""},
    {"schedule.step_size", Kind::Int, "1000", "schedule.type=step", ""},
    {"schedule.gamma", Kind::Float, "0.1", "schedule.type=step", ""},

    {"train.epochs", Kind::Int, "1", "", ""},
    {"train.steps", Kind::Int, "0", "", ""},
    {"train.max_steps", Kind::Int, "0", "", ""},
    {"train.eval_every", Kind::Int, "500", "", ""},
    {"train.eval_batches", Kind::Int, "0", "", ""},
    {"train.ckpt_every", Kind::Int, "1000", "", ""},
    {"train.keep_last", Kind::Int, "3", "", ""},
    {"train.keep_best", Kind::String, "\"off\"", "", "off|accuracy|loss|bits_per_char"},
    {"train.log_every", Kind::Int, "50", "", ""},
    {"train.anomaly", Kind::Bool, "false", "", ""},
};
// clang-format on

/// The offset of the first byte that breaks UTF-8 (overlong forms, surrogates and
/// code points above U+10FFFF included), or npos when `s` is valid.
size_t invalid_utf8_at(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = p[i];
    size_t len = 0;
    uint32_t cp = 0, min = 0;
    if (c < 0x80) { ++i; continue; }
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; min = 0x80; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; min = 0x800; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; min = 0x10000; }
    else return i;
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string::npos;
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Int: return "an integer";
    case Kind::Float: return "a number";
    case Kind::Bool: return "true or false";
    case Kind::String: return "a string";
    case Kind::IntArray: return "an array of integers";
  }
  return "?";
}

const Key* find_key(const std::string& name) {
  for (const auto& k : kSchema)
    if (name == k.name) return &k;
  return nullptr;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

std::string where(const std::string& source, const toml::node& n) {
  const auto& src = n.source();
  if (src.begin.line == 0) return source;
  return source + ":" + std::to_string(src.begin.line);
}

std::string describe(const toml::node& n) {
  std::ostringstream os;
  if (n.is_string()) {
    os << '"' << n.as_string()->get() << '"';
  } else if (n.is_table()) {
    os << "a table";
  } else if (n.is_array()) {
    os << "an array";
  } else {
    n.visit([&](const auto& v) { os << v; });
  }
  return os.str();
}

bool matches(const Key& k, const toml::node& n) {
  switch (k.kind) {
    case Kind::Int: return n.is_integer();
    case Kind::Float: return n.is_floating_point() || n.is_integer();
    case Kind::Bool: return n.is_boolean();
    case Kind::String: return n.is_string();
    case Kind::IntArray: {
      const auto* a = n.as_array();
      if (!a) return false;
      for (const auto& e : *a)
        if (!e.is_integer()) return false;
      return true;
    }
  }
  return false;
}

toml::table parse_text(const std::string& text, const std::string& source) {
  try {
    return toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw ConfigError(source + ":" + std::to_string(e.source().begin.line) + ": invalid TOML: " +
                      std::string(e.description()));
  }
}

std::string section_of(const std::string& key) {
  auto dot = key.find('.');
  return dot == std::string::npos ? "" : key.substr(0, dot);
}

std::string known_keys(const std::string& section) {
  std::string out;
  for (const auto& k : kSchema) {
    std::string name = k.name;
    if (section_of(name) != section) continue;
    if (!section.empty() && name.find('.') == std::string::npos) continue;
    if (section.empty() && name.find('.') != std::string::npos) continue;
    out += (out.empty() ? "" : ", ") + (section.empty() ? name : name.substr(section.size() + 1));
  }
  return out;
}

/// TOML text of a value; floats in their shortest round-trip form (0.9, not 0.90000000000000002).
std::string value_text(const toml::node& n) {
  if (const auto* f = n.as_floating_point()) {
    const double d = f->get();
    if (std::isfinite(d)) {
      char buf[64];
      auto res = std::to_chars(buf, buf + sizeof buf, d);
      std::string t(buf, res.ptr);
      if (t.find_first_of(".e") == std::string::npos) t += ".0";
      return t;
    }
  }
  std::ostringstream s;
  n.visit([&](const auto& v) { s << toml::toml_formatter(v); });
  return s.str();
}

}  // namespace

Config Config::from_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path.string() + ": cannot read the config file (does it exist?)");
  std::stringstream ss;
  ss << in.rdbuf();
  return from_string(ss.str(), path.string());
}

Config Config::from_string(const std::string& text, const std::string& source) {
  Config c;
  c.source_ = source;
  c.user_ = parse_text(text, source);
  c.validate_and_fill();
  return c;
}

void Config::validate_and_fill() {
  table_ = user_;
  // Every key known and of its type; sections are one level deep.
  // Checked on user_ itself: copies of toml++ nodes do not keep their source lines.
  std::map<std::string, const toml::node*> given;
  for (const auto& [k1, v1] : user_) {
    const std::string top(k1.str());
    if (const auto* sec = v1.as_table()) {
      const bool is_section = !known_keys(top).empty() && !find_key(top);
      if (!is_section)
        throw ConfigError(where(source_, v1) + ": unknown section [" + top +
                          "] (known: model, data, optim, schedule, train)");
      for (const auto& [k2, v2] : *sec) {
        const std::string key = top + "." + std::string(k2.str());
        if (!find_key(key))
          throw ConfigError(where(source_, v2) + ": unknown key '" + key + "' (known in [" + top +
                            "]: " + known_keys(top) + ")");
        given[key] = &v2;
      }
    } else {
      if (!find_key(top))
        throw ConfigError(where(source_, v1) + ": unknown key '" + top + "' (known at the top: " + known_keys("") +
                          "; sections: model, data, optim, schedule, train)");
      given[top] = &v1;
    }
  }
  for (const auto& [key, node] : given) {
    const Key& k = *find_key(key);
    if (!matches(k, *node))
      throw ConfigError(where(source_, *node) + ": '" + key + "' expects " + kind_name(k.kind) + ", got " +
                        describe(*node));
    if (*k.choices) {
      const std::string v = node->as_string()->get();
      bool ok = false;
      for (const auto& c : split(k.choices, '|')) ok = ok || c == v;
      if (!ok)
        throw ConfigError(where(source_, *node) + ": '" + key + "' expects one of " + k.choices + ", got \"" + v +
                          "\"");
    }
  }
  for (const auto& k : kSchema)
    if (!k.def && !given.count(k.name)) throw ConfigError(source_ + ": missing required key '" + k.name + "'");
  // Conditional keys: given only where they apply; defaults filled in where they apply.
  auto applies = [&](const Key& k) {
    if (!*k.when) return true;
    const auto cond = split(k.when, '=');
    const std::string v = table_.at_path(cond[0]).value_or(std::string());
    for (const auto& c : split(cond[1], '|'))
      if (c == v) return true;
    return false;
  };
  for (const auto& [key, node] : given) {
    const Key& k = *find_key(key);
    if (!applies(k)) {
      const auto cond = split(k.when, '=');
      throw ConfigError(where(source_, *node) + ": '" + key + "' applies only when " + cond[0] + " is one of " +
                        cond[1] + " (this config has " + cond[0] + " = \"" +
                        table_.at_path(cond[0]).value_or(std::string()) + "\")");
    }
  }
  for (const auto& k : kSchema) {
    if (given.count(k.name) || !applies(k)) continue;
    toml::table d = toml::parse(std::string("v = ") + k.def);
    const std::string key = k.name;
    const std::string sec = section_of(key);
    if (sec.empty()) {
      table_.insert(key, *d.get("v"));
    } else {
      if (!table_.contains(sec)) table_.insert(sec, toml::table{});
      table_.get_as<toml::table>(sec)->insert(key.substr(sec.size() + 1), *d.get("v"));
    }
  }
  // Floats stored as floats, so the resolved file reads back with the same types.
  for (const auto& k : kSchema) {
    if (k.kind != Kind::Float) continue;
    auto view = table_.at_path(k.name);
    if (view.is_integer()) {
      const std::string key = k.name;
      const std::string sec = section_of(key);
      const double d = static_cast<double>(view.value_or(int64_t{0}));
      table_.get_as<toml::table>(sec)->insert_or_assign(key.substr(sec.size() + 1), d);
    }
  }
}

void Config::set(const std::string& assignment) {
  // A bare word becomes a string as given; TOML strings are UTF-8, and a value
  // that is not would be written to config.toml as something else.
  if (const size_t bad = invalid_utf8_at(assignment); bad != std::string::npos)
    throw ConfigError("--set: the assignment is not valid UTF-8 (byte " + std::to_string(bad + 1) + " of " +
                      std::to_string(assignment.size()) + ")");
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ConfigError("--set " + assignment + ": expected key=value (e.g. --set optim.lr=3e-4)");
  const std::string key = assignment.substr(0, eq);
  const std::string value = assignment.substr(eq + 1);
  if (!find_key(key)) {
    const std::string sec = section_of(key);
    throw ConfigError("--set " + assignment + ": unknown key '" + key + "'" +
                      (known_keys(sec).empty() ? "" : " (known in [" + sec + "]: " + known_keys(sec) + ")"));
  }
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    parsed = toml::table{{"v", value}};  // a bare word: a string
  }
  const std::string sec = section_of(key);
  // Re-resolve from what was given plus the new value, so defaults follow a changed choice
  // (optim.name, model.type) and conditions and types are checked in one place.
  toml::table next = user_;
  if (sec.empty()) {
    next.insert_or_assign(key, *parsed.get("v"));
  } else {
    if (!next.contains(sec)) next.insert(sec, toml::table{});
    next.get_as<toml::table>(sec)->insert_or_assign(key.substr(sec.size() + 1), *parsed.get("v"));
  }
  Config c;
  c.source_ = "--set " + assignment;
  c.user_ = std::move(next);
  c.validate_and_fill();
  user_ = std::move(c.user_);
  table_ = std::move(c.table_);
}

const toml::node& Config::at(const std::string& key) const {
  const toml::node* n = table_.at_path(key).node();
  if (!n) throw ConfigError(source_ + ": the config has no '" + key + "' (it does not apply to this model/dataset)");
  return *n;
}

int64_t Config::integer(const std::string& key) const { return at(key).value_or(int64_t{0}); }
double Config::number(const std::string& key) const { return at(key).value_or(0.0); }
bool Config::boolean(const std::string& key) const { return at(key).value_or(false); }
std::string Config::string(const std::string& key) const { return at(key).value_or(std::string()); }
std::vector<int64_t> Config::integers(const std::string& key) const {
  std::vector<int64_t> out;
  for (const auto& e : *at(key).as_array()) out.push_back(e.value_or(int64_t{0}));
  return out;
}

std::string Config::to_toml() const {
  std::ostringstream os;
  // Top-level keys first, then each section, in the schema's order (not toml++'s sorted order).
  for (const auto& k : kSchema) {
    const std::string key = k.name;
    if (!section_of(key).empty()) continue;
    os << key << " = " << value_text(*table_.get(key)) << "\n";
  }
  std::string current;
  for (const auto& k : kSchema) {
    const std::string key = k.name;
    const std::string sec = section_of(key);
    if (sec.empty()) continue;
    const toml::node* n = table_.at_path(key).node();
    if (!n) continue;
    if (sec != current) {
      os << "\n[" << sec << "]\n";
      current = sec;
    }
    os << key.substr(sec.size() + 1) << " = " << value_text(*n) << "\n";
  }
  return os.str();
}

}  // namespace kiln::cli
