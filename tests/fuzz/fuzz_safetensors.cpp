// libFuzzer target: safetensors (kiln::io). Each input is read three ways —
// parse_safetensors from memory, load_safetensors and read_safetensors_header
// from a file under /dev/shm — and the three must agree: all succeed with the
// same tensors, bit for bit, and metadata, or all fail with a FormatError.
#include <cstring>
#include <optional>

#include "fuzz_util.h"
#include "kiln/io/safetensors.h"

namespace {

bool same(const kiln::io::SafetensorsFile& a, const kiln::io::SafetensorsFile& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [na, ta] = a.tensors[i];
    const auto& [nb, tb] = b.tensors[i];
    if (na != nb || ta.dtype() != tb.dtype() || ta.sizes() != tb.sizes() || ta.nbytes() != tb.nbytes()) return false;
    if (ta.nbytes() && std::memcmp(ta.data_ptr(), tb.data_ptr(), static_cast<size_t>(ta.nbytes())) != 0) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln;
  static fuzz::ShmFile file("safetensors");
  const std::string& path = file.write(data, size);
  // Both copies live at once, each at most the buffer's bytes plus 64-byte
  // rounding per tensor (every header entry takes more than 32 bytes of text).
  const auto budget = static_cast<int64_t>(6 * size + 128);
  fuzz::check_reader("safetensors", budget, [&] {
    std::optional<io::SafetensorsFile> mem, disk;
    try {
      mem = io::parse_safetensors({data, size}, "fuzz-input");
    } catch (const FormatError&) {
    }
    try {
      disk = io::load_safetensors(path);
    } catch (const FormatError& e) {
      if (std::string_view(e.what()).find(path) == std::string_view::npos) {
        fuzz::die(std::string("load_safetensors: the FormatError does not name the file: ") + e.what());
      }
    }
    try {
      const io::SafetensorsHeader h = io::read_safetensors_header(path);
      if (disk && h.tensors.size() != disk->tensors.size()) fuzz::die("the header and the loaded file disagree");
    } catch (const FormatError&) {
      // The header alone may be valid where the data is not (a BOOL byte of 2).
      if (disk) fuzz::die("read_safetensors_header rejected a file load_safetensors accepted");
    }
    if (mem.has_value() != disk.has_value()) fuzz::die("parse_safetensors and load_safetensors disagree");
    if (mem && !same(*mem, *disk)) fuzz::die("parse_safetensors and load_safetensors read different contents");
  });
  return 0;
}
