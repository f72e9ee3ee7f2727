// libFuzzer target: training checkpoints through the public API
// (kiln::train::load_checkpoint) with a small fixed model (Linear 3 -> 2),
// Adam after one step, and StepLR. Each input is written to a file under
// /dev/shm and loaded. The first byte picks a mode:
//   0: the rest is the checkpoint file as it is;
//   1: the rest edits a valid checkpoint's metadata, one "key=value" per line
//      ("key" alone deletes it), and the file is written with the tensors and
//      checksum untouched — so inputs get past the checksum and reach the
//      parsing of every metadata field.
// A load either succeeds or raises FormatError/ValueError; a failed load must
// leave model, optimizer, scheduler and generator exactly as they were
// (compared through a checkpoint saved before and after).
#include <fstream>
#include <iterator>
#include <memory>

#include "checkpoint_fixture.h"
#include "fuzz_util.h"
#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/io/safetensors.h"
#include "kiln/nn/layers.h"
#include "kiln/train/checkpoint.h"

namespace {

using namespace kiln;

// Applies "key=value" / "key" lines to the metadata.
io::Metadata edited(io::Metadata md, std::string_view text) {
  while (!text.empty()) {
    const size_t eol = std::min(text.find('\n'), text.size());
    const std::string_view line = text.substr(0, eol);
    text.remove_prefix(std::min(eol + 1, text.size()));
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos) md.erase(std::string(line));
    else md[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
  }
  return md;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static kiln::fuzz::CheckpointFixture fx;
  if (size < 1) return 0;
  const std::string& path = fx.input_file.path();
  if (data[0] % 2 == 0) {
    fx.input_file.write(data + 1, size - 1);
  } else {
    const io::Metadata md = edited(fx.base.metadata, {reinterpret_cast<const char*>(data + 1), size - 1});
    try {
      io::save_safetensors(path, fx.base.tensors, md);
    } catch (const ValueError&) {
      return 0;  // a key or value that is not UTF-8: the writer refuses it, nothing to load
    }
  }
  const std::string before = fx.snapshot();
  const std::string file = kiln::fuzz::slurp(path);
  // The file's tensors, the model's and optimizer's copies of them, 64-byte rounding.
  const auto budget = static_cast<int64_t>(4 * file.size() + 4096);
  fuzz::check_reader<ValueError>("load_checkpoint", budget, [&] {
    try {
      train::load_checkpoint(path, fx.refs());
    } catch (const Error&) {
      if (fx.snapshot() != before) fuzz::die("a failed load_checkpoint changed the objects");
      throw;
    }
    train::load_checkpoint(fx.base_file.path(), fx.refs());  // back to the fixed state
  });
  return 0;
}
