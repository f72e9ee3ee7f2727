// A tour of kiln's foundation, run by scripts/demo.sh: tensors and views,
// broadcasting and type promotion, reductions, oneDNN matmul/conv/pooling,
// the caching allocator's per-category accounting, and safetensors.
// Each step prints what it did so a reader can follow along.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "kiln/kiln.h"

using namespace kiln;

namespace {

double gflops_matmul(int64_t n, DType dt, int iters) {
  Tensor a = randn({n, n}).to(dt), b = randn({n, n}).to(dt);
  a.matmul(b);  // warm-up: builds and caches the oneDNN primitive
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) a.matmul(b);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * n * n * n * iters / s / 1e9;
}

}  // namespace

int main() {
  manual_seed(0);
  std::cout << "kiln tour — " << get_num_threads() << " threads\n\n";

  std::cout << "1. Tensors and views\n";
  Tensor x = arange(12, kFloat32).view({3, 4});
  Tensor xt = x.t();
  std::cout << "x =\n"
            << x << "\nx.t() is a view: contiguous=" << xt.is_contiguous() << ", shares storage=" << xt.is_alias_of(x)
            << ", strides=" << xt.strides() << "\n";
  xt.select(0, 1).fill_(-1);
  std::cout << "after x.t()[1].fill_(-1), x =\n" << x << "\nversion counter bumped to " << x.version() << "\n\n";

  std::cout << "2. Broadcasting and type promotion\n";
  Tensor col = tensor<float>({1, 2, 3}).view({3, 1});
  Tensor ints = arange(4);
  std::cout << "[3,1] float32 + [4] int64 -> " << (col + ints).sizes() << " " << dtype_name((col + ints).dtype())
            << "\nint64 / 2 -> " << ints / 2 << "\n\n";

  std::cout << "3. Reductions and softmax\n";
  Tensor logits = randn({2, 5});
  std::cout << "softmax rows sum to " << logits.softmax(-1).sum(-1) << "\nargmax " << logits.argmax(1) << ", logsumexp "
            << logits.logsumexp(1) << "\n\n";

  std::cout << "4. oneDNN: linear, conv2d, pooling\n";
  Tensor img = randn({8, 3, 32, 32});
  Tensor w = randn({16, 3, 3, 3}) * 0.1;
  Tensor feat = max_pool2d(conv2d(img, w, {}, {1, 1}, {1, 1}).relu(), {2, 2});
  Tensor pooled = adaptive_avg_pool2d(feat, {1, 1}).flatten(1);
  Tensor out = linear(pooled, randn({10, 16}), zeros({10}));
  std::cout << "conv3x3 -> relu -> maxpool2 -> global avg pool -> linear: " << img.sizes() << " -> " << feat.sizes()
            << " -> " << out.sizes() << "\n";
  std::cout << "matmul 512x512: " << static_cast<int>(gflops_matmul(512, kFloat32, 20)) << " GFLOP/s float32, "
            << static_cast<int>(gflops_matmul(512, kBFloat16, 20)) << " GFLOP/s bfloat16\n\n";

  std::cout << "5. Memory by category (the caching allocator)\n";
  {
    MemoryCategoryGuard params(MemoryCategory::Parameter);
    Tensor weights = randn({1024, 1024});
    std::cout << memory::summary();
  }
  std::cout << "after the parameter tensor died its block is cached for reuse:\n" << memory::summary() << "\n";

  std::cout << "6. safetensors\n";
  const auto path = std::filesystem::temp_directory_path() / "kiln_tour.safetensors";
  io::save_safetensors(path.string(), {{"x", x}, {"out", out}});
  auto loaded = io::load_safetensors(path.string());
  std::cout << "wrote and read back " << path.string() << ": out equal = " << loaded.at("out").equal(out) << "\n";
  std::filesystem::remove(path);

  std::cout << "\n7. Errors that say what was expected and what was got\n";
  try {
    randn({2, 3}).matmul(randn({4, 5}));
  } catch (const Error& e) {
    std::cout << "  " << e.what() << "\n";
  }
  try {
    memory::set_limit(1 << 20);
    Tensor big = empty({1 << 20});
  } catch (const OutOfMemory& e) {
    std::cout << "  " << e.what() << "\n";
  }
  memory::set_limit(0);
  std::cout << "\ntour complete\n";
  return 0;
}
