// An installed kiln's ONNX export (find_package(kiln COMPONENTS export)):
// an MLP written as an ONNX file, which must exist and be non-empty, then read
// back (load_onnx) and run by kiln's graph runtime at another batch size.
#include <cstdio>
#include <filesystem>

#include "kiln/core/guards.h"
#include "kiln/export/onnx.h"
#include "kiln/export/runtime.h"
#include "kiln/models/mlp.h"
#include "kiln/ops/factory.h"

int main() {
  kiln::models::MLP mlp({.in_features = 16, .hidden = {8}, .out_features = 3});
  const auto path = std::filesystem::temp_directory_path() / "kiln_install_export.onnx";
  const auto r = kiln::exporter::to_onnx(mlp, {kiln::randn({1, 16})}, path.string(),
                                         {.dynamic_axes = {{"input", {{0, "batch"}}}}});
  bool ok = r.nodes == 3 && std::filesystem::file_size(path) == static_cast<uintmax_t>(r.bytes);
  const kiln::exporter::Session session(kiln::exporter::load_onnx(path.string()));
  const kiln::Tensor x = kiln::randn({4, 16});
  const kiln::Tensor got = session.run({x})[0];
  kiln::Tensor want;
  {
    const kiln::NoGradGuard no_grad;
    mlp.eval();
    want = mlp(x);
  }
  ok = ok && got.allclose(want, 1e-5, 1e-6);
  std::filesystem::remove(path);
  std::printf("export_app: %lld nodes, %lld bytes, run back by the runtime: %s\n", static_cast<long long>(r.nodes),
              static_cast<long long>(r.bytes), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
