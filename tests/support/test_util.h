// Helpers shared by every test binary: running /usr/bin/python3 (the PyTorch
// oracle's interpreter), temporary directories, and comparing tensors without
// depending on the ops under test.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/tensor.h"

namespace kiln::test {

/// The message of the E (any kiln::Error by default) that f() throws, or "<no error>".
template <typename E = Error, typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no error>";
}

/// The data pointer of the gradient as it arrives at `t` (its node, or a
/// leaf's AccumulateGrad), seen through a hook that keeps no reference to it:
/// how tests see whether a backward wrote into the buffer it was handed.
struct ArrivalProbe {
  const void* ptr = nullptr;
  HookHandle handle;
  explicit ArrivalProbe(const Tensor& t)
      : handle(t.register_hook([this](const Tensor& g) {
          ptr = g.data_ptr();
          return Tensor();
        })) {}
  ArrivalProbe(const ArrivalProbe&) = delete;  // the hook holds `this`
  ArrivalProbe& operator=(const ArrivalProbe&) = delete;
};

/// Keeps the gradient that reaches `t`, as a hook that stores it would: a
/// second reference to the engine's buffer, which no backward may write over.
struct GradKeeper {
  Tensor kept;
  HookHandle handle;
  explicit GradKeeper(const Tensor& t)
      : handle(t.register_hook([this](const Tensor& g) {
          kept = g;
          return Tensor();
        })) {}
  GradKeeper(const GradKeeper&) = delete;  // the hook holds `this`
  GradKeeper& operator=(const GradKeeper&) = delete;
};

/// The interpreter with torch 1.13 (Debian's python3-torch); NOT `python3` on PATH.
inline constexpr const char* kPython = "/usr/bin/python3";

/// kPython, or $KILN_TEST_PYTHON when set (to check how tests fail without torch).
std::string python();

/// The repository root (KILN_SOURCE_DIR, set by tests/CMakeLists.txt).
std::string source_dir();

/// Quotes `s` for /bin/sh.
std::string shell_quote(const std::string& s);

/// Runs `cmd` with /bin/sh; returns the exit status (-1 if it could not run)
/// and puts stdout and stderr, interleaved, in `output`.
int run_command(const std::string& cmd, std::string& output);

/// Empty when kPython exists (and, if `need_torch`, imports torch and numpy);
/// otherwise why not, with the fix: run scripts/setup.sh. Checked once per process.
const std::string& python_problem(bool need_torch = true);

/// Runs tests/parity/<script> with the oracle's interpreter and parses its
/// output lines "name v1 v2 ..." into name -> values; throws with the output
/// when the script fails.
std::map<std::string, std::vector<double>> run_python_table(const std::string& script);

/// A fresh directory under the system temp dir, removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

/// Same dtype, same shape, same bytes (NaN payloads included).
bool bitwise_equal(const Tensor& a, const Tensor& b);

/// The elements in row-major order as doubles (bool -> 0/1).
std::vector<double> to_doubles(const Tensor& t);

/// The raw bytes of `t` in row-major order.
std::vector<uint8_t> contiguous_bytes(const Tensor& t);

/// Reads a whole file (throws std::runtime_error if it cannot).
std::string read_file(const std::string& path);

/// Whether this build has kiln's direct convolution kernels (conv_direct.cpp:
/// AVX-512 code, absent from a build for an AVX2-only CPU, where oneDNN's
/// primitives run those convolutions instead).
bool direct_conv_kernels_built();

/// Whether the CPU multiplies u8 x s8 with VNNI. Without it, int8 kernels
/// built on vpmaddubsw (ONNX Runtime's, oneDNN's jit ones) add each pair of
/// products into a saturating int16 and can be several steps off.
bool cpu_has_vnni();

}  // namespace kiln::test
