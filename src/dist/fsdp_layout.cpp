// FSDP units: which parameters belong to which unit, and that every rank
// wrapped the model the same way. See fsdp_unit.h.
#include <map>
#include <sstream>
#include <unordered_map>

#include "fsdp_unit.h"
#include "kiln/core/error.h"
#include "kiln/ops/factory.h"

namespace kiln::dist::detail {

namespace {

constexpr const char* kRoot = "(root)";

std::string describe_layout(const FSDPLayout& layout) {
  std::ostringstream os;
  for (const auto& u : layout.units) {
    int64_t numel = 0;
    for (const auto& [n, p] : u.params) numel += p.numel();
    os << u.name << '\t' << numel << '\n';
  }
  return os.str();
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// "blocks.1" (8320 elements), or "no unit" past the end.
std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) {
    const auto tab = line.find('\t');
    out.push_back(tab == std::string::npos ? line
                                           : "'" + line.substr(0, tab) + "' (" + line.substr(tab + 1) + " elements)");
  }
  return out;
}

}  // namespace

FSDPLayout plan_units(nn::Module& model, const std::vector<std::string>& unit_names) {
  std::unordered_map<std::string, nn::Module*> by_name;
  for (auto& [name, m] : model.named_modules()) by_name[name] = m;
  for (size_t i = 0; i < unit_names.size(); ++i) {
    const std::string& name = unit_names[i];
    KILN_CHECK(!name.empty() && by_name.count(name), ValueError, "FullyShardedDataParallel: units names '", name,
               "', which is not a submodule of the wrapped ", model.type_name(),
               " (expected a dotted name as named_modules() gives it, e.g. 'blocks.0')");
    for (size_t j = 0; j < unit_names.size(); ++j) {
      if (i == j) continue;
      KILN_CHECK(unit_names[j] != name, ValueError, "FullyShardedDataParallel: unit '", name, "' is listed twice");
      KILN_CHECK(unit_names[j].rfind(name + ".", 0) != 0, ValueError, "FullyShardedDataParallel: unit '", unit_names[j],
                 "' is inside unit '", name, "'; units may not nest");
    }
  }
  const auto all = model.named_parameters();
  std::unordered_map<const TensorImpl*, size_t> index;
  for (size_t i = 0; i < all.size(); ++i) {
    const auto& [name, p] = all[i];
    KILN_CHECK(p.dtype() == kFloat32, DTypeError, "FullyShardedDataParallel: parameter '", name, "' is ",
               dtype_name(p.dtype()), "; the flat shards are float32 (autocast gives bfloat16 compute)");
    KILN_CHECK(p.is_contiguous(), ValueError, "FullyShardedDataParallel: parameter '", name,
               "' is not contiguous (shape ", p.sizes(), ")");
    index[p.impl()] = i;
  }
  // Which units hold each parameter.
  std::vector<std::vector<size_t>> holders(all.size());
  for (size_t u = 0; u < unit_names.size(); ++u) {
    for (auto& [n, p] : by_name[unit_names[u]]->named_parameters()) holders[index.at(p.impl())].push_back(u);
  }
  FSDPLayout layout;
  PlannedUnit root{kRoot, nullptr, {}};
  std::vector<PlannedUnit> units;
  for (size_t u = 0; u < unit_names.size(); ++u) units.push_back({unit_names[u], by_name[unit_names[u]], {}});
  for (size_t i = 0; i < all.size(); ++i) {
    if (holders[i].size() == 1) {
      units[holders[i][0]].params.push_back(all[i]);
    } else {
      root.params.push_back(all[i]);  // outside every unit, or shared by several (tied weights)
    }
  }
  if (!root.params.empty()) layout.units.push_back(std::move(root));
  for (auto& u : units) {
    if (!u.params.empty()) layout.units.push_back(std::move(u));
  }
  KILN_CHECK(!layout.units.empty(), ValueError, "FullyShardedDataParallel: the wrapped ", model.type_name(),
             " has no parameters");
  return layout;
}

void check_same_layout(ProcessGroup& group, const FSDPLayout& layout) {
  const int n = group.size();
  if (n == 1) return;
  const std::string mine = describe_layout(layout);
  CollectiveLabel label("FullyShardedDataParallel: comparing the ranks' units");
  Tensor sig = empty({2}, kInt64);
  sig.data_ptr<int64_t>()[0] = static_cast<int64_t>(fnv1a(mine) & 0x7fffffffffffffffull);
  sig.data_ptr<int64_t>()[1] = static_cast<int64_t>(mine.size());
  Tensor sigs = empty({2 * n}, kInt64);
  group.allgather_into_tensor(sigs, sig)->wait();
  const int64_t* s = sigs.data_ptr<int64_t>();
  bool same = true;
  int64_t longest = 0;
  for (int r = 0; r < n; ++r) {
    same &= s[2 * r] == s[0] && s[2 * r + 1] == s[1];
    longest = std::max(longest, s[2 * r + 1]);
  }
  if (same) return;
  // Exchange the descriptions (as int64 characters) to say what differs.
  Tensor text = zeros({longest}, kInt64);
  for (size_t i = 0; i < mine.size(); ++i) text.data_ptr<int64_t>()[i] = static_cast<unsigned char>(mine[i]);
  Tensor texts = empty({n * longest}, kInt64);
  group.allgather_into_tensor(texts, text)->wait();
  std::vector<std::vector<std::string>> units(n);
  for (int r = 0; r < n; ++r) {
    std::string t;
    for (int64_t i = 0; i < s[2 * r + 1]; ++i) t += static_cast<char>(texts.data_ptr<int64_t>()[r * longest + i]);
    units[r] = lines_of(t);
  }
  const std::vector<int> world = group.ranks();
  std::ostringstream os;
  os << "FullyShardedDataParallel over " << group.describe()
     << ": the ranks wrap the model differently, so their all-gathers and reduce-scatters would not match:";
  bool first = true;
  for (int r = 1; r < n; ++r) {
    if (units[r] == units[0]) continue;
    size_t k = 0;
    while (k < units[0].size() && k < units[r].size() && units[0][k] == units[r][k]) ++k;
    auto at = [&](int q) {
      return k < units[q].size() ? "unit #" + std::to_string(k) + " " + units[q][k] : "no unit #" + std::to_string(k);
    };
    os << (first ? " " : "; ") << at(0) << " on rank 0 but " << at(r) << " on rank " << r;
    if (world[r] != r) os << " (world rank " << world[r] << ")";
    first = false;
  }
  os << ". Give every rank the same FSDPOptions::units and the same model";
  throw DistributedError(os.str());
}

}  // namespace kiln::dist::detail
