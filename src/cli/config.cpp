// The config schema and its checks. One table (kSchema) lists every key with
// its type, default, the condition under which it applies and its allowed
// values; docs/config.md documents the same table for people.
#include "cli/config.h"

#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

namespace kiln::cli {
namespace {

// IntOrChoice: an integer, or one of the key's choices as a string.
enum class Kind { Int, Float, Bool, String, IntArray, IntOrChoice };

struct Key {
  const char* name;  // "section.key" or a top-level "key"
  Kind kind;
  const char* def;      // default in TOML syntax; nullptr: required
  const char* when;     // "" or "model.type=cnn|vit": the key applies only then
  const char* choices;  // "" or "a|b|c" for strings
};

// clang-format off
constexpr Key kSchema[] = {
    {"name", Kind::String, "\"run\"", "", ""},
    {"seed", Kind::Int, "0", "", ""},
    {"threads", Kind::Int, "0", "", ""},
    {"flush_denormal", Kind::Bool, "false", "", ""},
    {"amp", Kind::String, "\"off\"", "", "off|bf16|fp16"},
    // Fine-tuning (src/cli/finetune.h): start from a run's or a file's weights.
    {"init_from", Kind::String, "\"\"", "", ""},
    {"init_strict", Kind::Bool, "true", "", ""},

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

    // LoRA adapters (rank 0: none, every parameter trains); targets are comma-separated module-path patterns.
    {"lora.rank", Kind::Int, "0", "", ""},
    {"lora.alpha", Kind::Float, "16.0", "", ""},
    {"lora.dropout", Kind::Float, "0.0", "", ""},
    {"lora.targets", Kind::String, "\"attn.c_attn,attn.c_proj,mlp.*\"", "", ""},
    {"lora.quantize", Kind::String, "\"none\"", "", "none|nf4"},
    {"lora.bias", Kind::String, "\"none\"", "", "none|all|lora_only"},

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
    {"train.grad_accum_steps", Kind::Int, "1", "", ""},
    {"train.health", Kind::Bool, "true", "", ""},
    {"train.compile", Kind::Bool, "false", "", ""},
    {"train.activation_checkpointing", Kind::IntOrChoice, "\"none\"", "model.type=gpt|vit|resnet", "none|blocks"},

    {"dist.strategy", Kind::String, "\"ddp\"", "", "ddp|zero1|zero2|zero3"},
    {"dist.comm_hook", Kind::String, "\"allreduce\"", "", "allreduce|bf16_compress|fp16_compress|powersgd"},
    {"dist.powersgd_rank", Kind::Int, "1", "", ""},
    {"dist.powersgd_start_iter", Kind::Int, "1000", "", ""},
    // DDP's bucket caps (dist::DDPOptions; a test checks these defaults against it).
    {"dist.bucket_cap_mb", Kind::Float, "25.0", "", ""},
    {"dist.first_bucket_cap_mb", Kind::Float, "1.0", "", ""},
    {"dist.last_bucket_cap_mb", Kind::Float, "1.0", "", ""},

    // Model parallelism (docs/parallel.md): dp x tp x pp must be the process count.
    {"parallel.dp", Kind::Int, "0", "model.type=gpt", ""},  // 0: the processes left over by tp x pp
    {"parallel.tp", Kind::Int, "1", "model.type=gpt", ""},
    {"parallel.pp", Kind::Int, "1", "model.type=gpt", ""},
    {"parallel.micro_batches", Kind::Int, "1", "model.type=gpt", ""},
    {"parallel.schedule", Kind::String, "\"1f1b\"", "model.type=gpt", "1f1b|gpipe"},
    {"parallel.sequence_parallel", Kind::Bool, "false", "model.type=gpt", ""},

    // Profiling (cli/profile_run.h): "20:25" profiles steps 20 to 24 into RUN_DIR/profile/; "" off.
    {"profile.steps", Kind::String, "\"\"", "", ""},

    // Knowledge distillation (cli/distill.h): "" off, else the teacher's run directory.
    {"distill.teacher", Kind::String, "\"\"", "", ""},
    {"distill.kind", Kind::String, "\"soft\"", "", "soft|hard"},
    {"distill.temperature", Kind::Float, "2.0", "", ""},
    {"distill.alpha", Kind::Float, "0.5", "", ""},
};

// Allowed values, checked once on the final config (file and --set together) so
// that one message lists every bad key. Integers a kiln type narrows (threads
// and keep_last become int) have that type's upper bound.
struct Range {
  const char* key;
  double lo, hi;
  bool lo_open, hi_open;  // (lo, ...) / (..., hi)
};
constexpr double kNoMax = std::numeric_limits<double>::infinity();
constexpr double kIntMax = 2147483647.0;
constexpr Range kRanges[] = {
    {"threads", 0, kIntMax, false, false},
    {"model.hidden", 1, kNoMax, false, false},
    {"model.channels1", 1, kNoMax, false, false},
    {"model.channels2", 1, kNoMax, false, false},
    {"model.fc_hidden", 1, kNoMax, false, false},
    {"model.stem_channels", 1, kNoMax, false, false},
    {"model.widths", 1, kNoMax, false, false},
    {"model.blocks", 1, kNoMax, false, false},
    {"model.patch_size", 1, kNoMax, false, false},
    {"model.dim", 1, kNoMax, false, false},
    {"model.depth", 1, kNoMax, false, false},
    {"model.heads", 1, kNoMax, false, false},
    {"model.mlp_dim", 1, kNoMax, false, false},
    {"model.n_layer", 1, kNoMax, false, false},
    {"model.n_head", 1, kNoMax, false, false},
    {"model.n_embd", 1, kNoMax, false, false},
    {"model.dropout", 0, 1, false, true},
    {"data.context", 1, kNoMax, false, false},
    {"data.val_fraction", 0, 1, true, true},
    {"data.image_size", 1, kNoMax, false, false},
    {"data.num_classes", 1, kNoMax, false, false},
    {"data.batch_size", 1, kNoMax, false, false},
    {"data.eval_batch_size", 1, kNoMax, false, false},
    {"data.num_workers", 0, kNoMax, false, false},
    {"data.train_size", 0, kNoMax, false, false},
    {"data.eval_size", 0, kNoMax, false, false},
    {"data.random_crop", 0, kNoMax, false, false},
    {"optim.lr", 0, kNoMax, false, false},
    {"optim.weight_decay", 0, kNoMax, false, false},
    {"optim.momentum", 0, kNoMax, false, false},
    {"optim.beta1", 0, 1, false, true},
    {"optim.beta2", 0, 1, false, true},
    {"optim.eps", 0, kNoMax, false, false},
    {"optim.grad_clip", 0, kNoMax, false, false},
    {"schedule.warmup_steps", 0, kNoMax, false, false},
    {"schedule.min_lr", 0, kNoMax, false, false},
    {"schedule.step_size", 1, kNoMax, false, false},
    {"schedule.gamma", 0, kNoMax, false, false},
    {"lora.rank", 0, kNoMax, false, false},
    {"lora.alpha", 0, kNoMax, true, false},
    {"lora.dropout", 0, 1, false, true},
    {"train.epochs", 1, kNoMax, false, false},
    {"train.grad_accum_steps", 1, kNoMax, false, false},
    {"train.steps", 0, kNoMax, false, false},
    {"train.max_steps", 0, kNoMax, false, false},
    {"train.eval_every", 0, kNoMax, false, false},
    {"train.eval_batches", 0, kNoMax, false, false},
    {"train.ckpt_every", 0, kNoMax, false, false},
    {"train.keep_last", 1, kIntMax, false, false},
    {"train.log_every", 1, kNoMax, false, false},
    {"train.activation_checkpointing", 1, kNoMax, false, false},  // when an integer
    {"parallel.dp", 0, kIntMax, false, false},
    {"parallel.tp", 1, kIntMax, false, false},
    {"parallel.pp", 1, kIntMax, false, false},
    {"parallel.micro_batches", 1, kNoMax, false, false},
    {"distill.temperature", 0, kNoMax, true, false},
    {"distill.alpha", 0, 1, false, false},
};

// What `kiln resume --set KEY=...` does with each key (docs/config.md keeps the same table).
// Refused keys shaped the state the checkpoint holds (weights, optimizer moments,
// generator, loader position) or what a step means; a new value could not take effect.
struct ResumeRule {
  const char* key;  // a key, or "section." for every key of a section
  OnResume rule;
  const char* why;  // for Refused
};
constexpr ResumeRule kResume[] = {
    {"name", OnResume::Applies, ""},
    {"seed", OnResume::Refused, "the generator state comes from the checkpoint, so a new seed would not be used"},
    {"threads", OnResume::Applies, ""},
    {"flush_denormal", OnResume::Applies, ""},
    {"amp", OnResume::Refused, "the precision (and the GradScaler's state) is part of the checkpoint"},
    {"model.", OnResume::Refused, "the architecture is fixed by the checkpoint's weights"},
    {"init_from", OnResume::Refused, "the weights come from the checkpoint; init_from only starts a new run"},
    {"init_strict", OnResume::Refused, "the weights come from the checkpoint; init_from only starts a new run"},
    {"lora.", OnResume::Refused, "the adapters' shapes and which parameters train are fixed by the checkpoint"},
    {"data.root", OnResume::Applies, ""},
    {"data.path", OnResume::Applies, ""},
    {"data.eval_batch_size", OnResume::Applies, ""},
    {"data.eval_size", OnResume::Applies, ""},
    {"data.num_workers", OnResume::Applies, ""},
    {"data.", OnResume::Refused,
     "the training set, its batches and the loader's saved position were made with the old value"},
    {"optim.name", OnResume::Refused, "the optimizer's state in the checkpoint belongs to the old optimizer"},
    {"optim.lr", OnResume::Schedule, ""},
    {"optim.grad_clip", OnResume::Applies, ""},
    {"optim.", OnResume::Optimizer, ""},
    {"schedule.", OnResume::Schedule, ""},
    {"train.epochs", OnResume::Schedule, ""},
    {"train.steps", OnResume::Schedule, ""},
    {"train.grad_accum_steps", OnResume::Refused,
     "the schedule's horizon and the loader position were counted in steps of the old number of batches"},
    {"train.", OnResume::Applies, ""},
    {"dist.strategy", OnResume::Applies, ""},  // checkpoints hold the unsharded optimizer state whatever the strategy
    {"dist.comm_hook", OnResume::Applies, ""},  // how gradients travel, from the resume step on
    {"dist.powersgd_rank", OnResume::Applies, ""},  // another rank: the checkpoint's Qs do not fit, PowerSGD starts afresh
    {"dist.powersgd_start_iter", OnResume::Applies, ""},
    {"dist.bucket_cap_mb", OnResume::Applies, ""},  // how gradients are grouped, not what they average to
    {"dist.first_bucket_cap_mb", OnResume::Applies, ""},
    {"dist.last_bucket_cap_mb", OnResume::Applies, ""},
    {"parallel.", OnResume::Applies, ""},      // and the unsharded model whatever the layout
    {"profile.", OnResume::Applies, ""},       // what is recorded, not what is computed
    {"distill.", OnResume::Applies, ""},       // the loss from the resume step on; the teacher is loaded again
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
    if (c < 0x80) {
      ++i;
      continue;
    }
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
      min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
      min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
      min = 0x10000;
    } else
      return i;
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
    case Kind::IntOrChoice: return "an integer or a string";
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
    case Kind::IntOrChoice: return n.is_integer() || n.is_string();
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

constexpr const char* kInt64Range = "integers are 64-bit: -9223372036854775808 to 9223372036854775807";

bool int64_overflow(const toml::parse_error& e) {
  return e.description().find("is not representable in 64 bits") != std::string_view::npos;
}

toml::table parse_text(const std::string& text, const std::string& source) {
  try {
    return toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    const std::string at = source + ":" + std::to_string(e.source().begin.line) + ": ";
    if (int64_overflow(e))
      throw ConfigError(at + "an integer out of range: " + std::string(e.description()) + " (" + kInt64Range + ")");
    throw ConfigError(at + "invalid TOML: " + std::string(e.description()));
  }
}

std::string number_text(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, res.ptr);
}

/// "an integer >= 1", "a number in [0, 1)", "an integer in [0, 2147483647]".
std::string range_text(const Range& r, bool integer) {
  const std::string what = integer ? "an integer" : "a number";
  if (r.hi == kNoMax) return what + (r.lo_open ? " > " : " >= ") + number_text(r.lo);
  return what + " in " + (r.lo_open ? "(" : "[") + number_text(r.lo) + ", " + number_text(r.hi) +
         (r.hi_open ? ")" : "]");
}

bool in_range(const Range& r, double v) {
  if (!std::isfinite(v)) return false;
  if (r.lo_open ? v <= r.lo : v < r.lo) return false;
  if (r.hi != kNoMax && (r.hi_open ? v >= r.hi : v > r.hi)) return false;
  return true;
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
std::string node_text(const toml::node& n) {
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

Config Config::from_file(const std::filesystem::path& path, const std::vector<std::string>& sets) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path.string() + ": cannot read the config file (does it exist?)");
  std::stringstream ss;
  ss << in.rdbuf();
  return from_string(ss.str(), path.string(), sets);
}

Config Config::from_string(const std::string& text, const std::string& source, const std::vector<std::string>& sets) {
  Config c;
  c.source_ = source;
  c.user_ = parse_text(text, source);
  c.validate_and_fill();
  c.set_all(sets);
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
                          "] (known: model, data, optim, schedule, train, dist, parallel, lora, profile, distill)");
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
  auto from = [&](const std::string& key, const toml::node& node) {
    auto it = origin_.find(key);
    return it != origin_.end() ? it->second : where(source_, node);
  };
  for (const auto& [key, node] : given) {
    const Key& k = *find_key(key);
    if (!matches(k, *node)) {
      const std::string expects = k.kind == Kind::IntOrChoice
                                      ? "an integer or one of " + std::string(k.choices) + " (a string)"
                                      : std::string(kind_name(k.kind));
      throw ConfigError(from(key, *node) + ": '" + key + "' expects " + expects + ", got " + describe(*node));
    }
    if (*k.choices && node->is_string()) {
      const std::string v = node->as_string()->get();
      bool ok = false;
      for (const auto& c : split(k.choices, '|')) ok = ok || c == v;
      if (!ok)
        throw ConfigError(where(source_, *node) + ": '" + key + "' expects one of " + k.choices +
                          (k.kind == Kind::IntOrChoice ? " or an integer" : "") + ", got \"" + v + "\"");
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
      throw ConfigError(from(key, *node) + ": '" + key + "' applies only when " + cond[0] + " is one of " + cond[1] +
                        " (this config has " + cond[0] + " = \"" + table_.at_path(cond[0]).value_or(std::string()) +
                        "\")");
    }
  }
  for (const auto& [key, node] : given)
    if (!origin_.count(key)) origin_[key] = where(source_, *node);
  for (auto it = origin_.begin(); it != origin_.end();) it = given.count(it->first) ? std::next(it) : origin_.erase(it);
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

void Config::set(const std::string& assignment) { set_all({assignment}); }

void Config::set_all(const std::vector<std::string>& assignments) {
  for (const auto& a : assignments) apply(a);
  check_ranges();
}

void Config::apply(const std::string& assignment) {
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
  } catch (const toml::parse_error& e) {
    if (int64_overflow(e))
      throw ConfigError("--set " + assignment + ": '" + key + "' = " + value + " is out of range (" + kInt64Range +
                        ")");
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
  c.origin_ = origin_;
  c.origin_[key] = "--set " + assignment;
  c.validate_and_fill();
  user_ = std::move(c.user_);
  table_ = std::move(c.table_);
  origin_ = std::move(c.origin_);
}

void Config::check_ranges() const {
  std::vector<std::string> problems;
  for (const auto& r : kRanges) {
    const toml::node* n = table_.at_path(r.key).node();
    if (!n) continue;  // does not apply to this config
    const bool integer = find_key(r.key)->kind != Kind::Float;
    std::vector<const toml::node*> values;
    if (const auto* a = n->as_array())
      for (const auto& e : *a) values.push_back(&e);
    else
      values.push_back(n);
    for (const toml::node* v : values) {
      if (v->is_string()) continue;  // an IntOrChoice key's choice, checked with the types
      const double d = v->is_integer() ? static_cast<double>(v->value_or(int64_t{0})) : v->value_or(0.0);
      if (in_range(r, d)) continue;
      problems.push_back(origin(r.key) + ": '" + r.key + "'" + (n->is_array() ? " holds " : " = ") + node_text(*v) +
                         ", out of range (expects " + range_text(r, integer) +
                         (n->is_array() ? " in every entry)" : ")"));
      break;
    }
  }
  if (problems.empty()) return;
  if (problems.size() == 1) throw ConfigError(problems[0]);
  std::string msg = std::to_string(problems.size()) + " config values are out of range:";
  for (const auto& p : problems) msg += "\n  " + p;
  throw ConfigError(msg);
}

std::string Config::origin(const std::string& key) const {
  auto it = origin_.find(key);
  return it != origin_.end() ? it->second : source_ + " (the default)";
}

std::vector<std::string> Config::keys() const {
  std::vector<std::string> out;
  for (const auto& k : kSchema)
    if (table_.at_path(k.name).node()) out.emplace_back(k.name);
  return out;
}

std::string Config::value_text(const std::string& key) const {
  const toml::node* n = table_.at_path(key).node();
  return n ? node_text(*n) : std::string();
}

OnResume Config::on_resume(const std::string& key, std::string* why) {
  for (const auto& r : kResume) {
    const std::string k = r.key;
    const bool match = k.back() == '.' ? key.rfind(k, 0) == 0 : key == k;
    if (!match) continue;
    if (why) *why = r.why;
    return r.rule;
  }
  if (why) *why = "it is not known to kiln resume";
  return OnResume::Refused;
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
    os << key << " = " << node_text(*table_.get(key)) << "\n";
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
    os << key.substr(sec.size() + 1) << " = " << node_text(*n) << "\n";
  }
  return os.str();
}

}  // namespace kiln::cli
