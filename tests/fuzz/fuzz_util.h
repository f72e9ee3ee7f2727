// Shared by the libFuzzer targets (one per reader). Each target feeds the
// input to a reader and accepts exactly two outcomes: success, or one of the
// kiln::Error types the reader documents for bad input (FormatError always;
// the others a target names). Anything else — another exception, a crash, a
// sanitizer report, a leak, a tensor left alive, or kiln allocating more than
// the input's size can justify — aborts, which libFuzzer records as a crash.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "kiln/core/allocator.h"
#include "kiln/core/error.h"

namespace kiln::fuzz {

[[noreturn]] inline void die(const std::string& why) {
  std::fprintf(stderr, "fuzz: %s\n", why.c_str());
  std::fflush(stderr);
  std::abort();
}

/// A file under /dev/shm (memory, not the shared disk) holding the input.
/// One per process, rewritten for every input, removed at exit.
class ShmFile {
 public:
  explicit ShmFile(std::string_view tag)
      : path_("/dev/shm/kiln-fuzz-" + std::string(tag) + "-" + std::to_string(::getpid())) {}
  ~ShmFile() { ::unlink(path_.c_str()); }
  const std::string& write(const uint8_t* data, size_t size) {
    std::FILE* f = std::fopen(path_.c_str(), "wb");
    if (!f) die("cannot create " + path_);
    if (size && std::fwrite(data, 1, size, f) != size) die("cannot write " + path_);
    if (std::fclose(f) != 0) die("cannot close " + path_);
    return path_;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// Runs `body` and checks the contract above. `budget` is the most kiln may
/// hold allocated at once while reading this input (the file size, or its
/// bound for gzip, plus small per-tensor rounding); `allowed` says which
/// kiln::Error types other than FormatError the reader may raise.
template <typename... Allowed, typename F>
void check_reader(const char* reader, int64_t budget, F&& body) {
  const int64_t live_before = memory::stats().live_bytes;
  memory::reset_peak_stats();
  try {
    body();
  } catch (const FormatError& e) {
    if (std::string_view(e.what()).empty()) die(std::string(reader) + ": FormatError without a message");
  } catch (const Error& e) {
    if (!(false || ... || (dynamic_cast<const Allowed*>(&e) != nullptr))) {
      die(std::string(reader) + ": unexpected kiln::Error type: " + e.what());
    }
  } catch (const std::exception& e) {
    die(std::string(reader) + ": expected success or a kiln::Error, got std::exception: " + e.what());
  }
  const memory::Stats s = memory::stats();
  if (s.live_bytes != live_before) {
    die(std::string(reader) + ": " + std::to_string(s.live_bytes - live_before) + " bytes of tensors left alive");
  }
  // The allocator rounds each block up to its size class: at most a quarter more.
  if (s.peak_bytes - live_before > budget + budget / 4 + 64) {
    die(std::string(reader) + ": allocated " + std::to_string(s.peak_bytes - live_before) +
        " bytes of tensors at once, more than the input justifies (" + std::to_string(budget) + ")");
  }
  // Cached blocks would hide a use-after-free from ASan: give them back.
  memory::empty_cache();
}

}  // namespace kiln::fuzz
