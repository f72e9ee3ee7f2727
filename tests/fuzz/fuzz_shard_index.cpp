// libFuzzer target: a sharded checkpoint's index.json (dist::ShardedCheckpoint
// reads it before any shard file; docs/checkpoints.md). The input is the index
// text. Accepted outcomes: a FormatError with a message, or an index that is
// consistent (every tensor's slices cover it exactly, as the parser promises)
// and that write_index writes back to text which parses to the same index.
// Anything else — another exception, a crash, a sanitizer report — aborts.
#include <string>
#include <string_view>

#include "dist/sharded_checkpoint_format.h"
#include "fuzz_util.h"

namespace sf = kiln::dist::shard_format;

namespace {

bool same(const sf::Index& a, const sf::Index& b) {
  if (a.world_size != b.world_size || a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (const auto& [name, t] : a.tensors) {
    auto it = b.tensors.find(name);
    if (it == b.tensors.end()) return false;
    const sf::IndexTensor& u = it->second;
    if (t.dtype != u.dtype || t.shape != u.shape || t.numel != u.numel || t.slices.size() != u.slices.size())
      return false;
    for (size_t i = 0; i < t.slices.size(); ++i) {
      const auto &x = t.slices[i], &y = u.slices[i];
      if (x.file != y.file || x.key != y.key || x.begin != y.begin || x.length != y.length || x.checksum != y.checksum)
        return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  sf::Index index;
  try {
    index = sf::parse_index(text, "fuzz/index.json");
  } catch (const kiln::FormatError& e) {
    if (std::string_view(e.what()).empty()) kiln::fuzz::die("FormatError without a message");
    return 0;
  } catch (const std::exception& e) {
    kiln::fuzz::die(std::string("parse_index: expected an index or a FormatError, got std::exception: ") + e.what());
  }
  for (const auto& [name, t] : index.tensors) {
    std::vector<sf::Range> ranges;
    for (const auto& s : t.slices) ranges.push_back({s.begin, s.length, "shard " + std::to_string(s.file)});
    const std::string problem = sf::coverage_problem(name, t.numel, ranges);
    if (!problem.empty()) kiln::fuzz::die("parse_index accepted an index whose slices do not cover '" + name + "': " + problem);
    if (t.slices.size() > 0 && t.slices.back().file >= index.world_size)
      kiln::fuzz::die("parse_index accepted a slice in a file beyond the world size");
  }
  try {
    const std::string again = sf::write_index(index);
    if (!same(sf::parse_index(again, "rewritten index.json"), index))
      kiln::fuzz::die("an accepted index does not read back as itself after write_index");
  } catch (const std::exception& e) {
    kiln::fuzz::die(std::string("an accepted index failed to round-trip: ") + e.what());
  }
  return 0;
}
