#include "support/test_util.h"

#include "kernels/cpu/conv_direct.h"
#include "kernels/cpu/dnnl_common.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace kiln::test {

std::string source_dir() {
#ifdef KILN_SOURCE_DIR
  return KILN_SOURCE_DIR;
#else
  return ".";
#endif
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') out += "'\\''";
    else out += c;
  }
  return out + "'";
}

int run_command(const std::string& cmd, std::string& output) {
  output.clear();
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) {
    output = std::string("popen failed: ") + std::strerror(errno);
    return -1;
  }
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) output.append(buf, n);
  const int status = ::pclose(p);
  if (status == -1) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string python() {
  const char* env = std::getenv("KILN_TEST_PYTHON");
  return env && *env ? env : kPython;
}

const std::string& python_problem(bool need_torch) {
  static const std::string no_python = [] {
    if (::access(python().c_str(), X_OK) != 0) {
      return python() +
             " is missing: the PyTorch oracle needs Debian's python3 with python3-torch and python3-numpy; "
             "run scripts/setup.sh";
    }
    return std::string();
  }();
  if (!no_python.empty() || !need_torch) return no_python;
  static const std::string no_torch = [] {
    std::string out;
    const int rc = run_command(shell_quote(python()) + " -c 'import torch, numpy'", out);
    if (rc != 0) {
      return python() + " cannot import torch and numpy (exit " + std::to_string(rc) + "): " + out +
             "\nrun scripts/setup.sh to install python3-torch and python3-numpy";
    }
    return std::string();
  }();
  return no_torch;
}

TempDir::TempDir() {
  static std::atomic<int> counter{0};
  const auto base = std::filesystem::temp_directory_path();
  for (int attempt = 0;; ++attempt) {
    path_ = base / ("kiln-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    if (std::filesystem::create_directory(path_)) break;
    if (attempt > 100) throw std::runtime_error("TempDir: cannot create a directory under " + base.string());
  }
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::vector<uint8_t> contiguous_bytes(const Tensor& t) {
  const Tensor c = t.contiguous();
  std::vector<uint8_t> out(static_cast<size_t>(c.nbytes()));
  if (!out.empty()) std::memcpy(out.data(), c.data_ptr(), out.size());
  return out;
}

bool direct_conv_kernels_built() {
  kernels::Conv2dParams p;
  p.n = 1, p.c = 1, p.h = p.w = 8, p.o = 8, p.kh = p.kw = 3, p.oh = p.ow = 6;
  p.output_nhwc = true;
  return kernels::detail::conv_weight_direct_fits(p);
}

bool cpu_has_vnni() { return kernels::dnnl_detail::int8_jit_is_exact(); }

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.dtype() == b.dtype() && a.sizes() == b.sizes() && contiguous_bytes(a) == contiguous_bytes(b);
}

std::vector<double> to_doubles(const Tensor& t) {
  const Tensor c = t.contiguous();
  std::vector<double> out(static_cast<size_t>(c.numel()));
  visit_dtype(c.dtype(), [&]<typename T>() {
    const T* p = static_cast<const T*>(c.data_ptr());
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<double>(static_cast<compute_t<T>>(p[i]));
  });
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

std::map<std::string, std::vector<double>> run_python_table(const std::string& script) {
  std::string out;
  if (run_command(shell_quote(python()) + " " + shell_quote(source_dir() + "/tests/parity/" + script), out) != 0) {
    throw std::runtime_error(script + " failed: " + out);
  }
  std::map<std::string, std::vector<double>> table;
  std::istringstream is(out);
  std::string line;
  while (std::getline(is, line)) {
    std::istringstream ls(line);
    std::string name;
    ls >> name;
    double v;
    while (ls >> v) table[name].push_back(v);
  }
  return table;
}

}  // namespace kiln::test
