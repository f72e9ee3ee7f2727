// Writes the seed corpora of the fuzz targets: kiln_fuzz_seeds <dir> fills
// <dir>/{safetensors,idx,text,checkpoint} with small valid (and a few nearly
// valid) inputs made by kiln's own writers, so the seeds follow the formats as
// they evolve. scripts/fuzz.sh runs it before fuzzing; the committed
// regressions under tests/fuzz/corpus/ are added to the same runs.
#include <zlib.h>

#include <cstdio>
#include <filesystem>

#include "../support/byod_bytes.h"
#include "../support/idx_bytes.h"
#include "checkpoint_fixture.h"
#include "dist/sharded_checkpoint_format.h"
#include "kiln/export/onnx.h"
#include "kiln/models/cnn.h"
#include "kiln/models/gpt.h"
#include "kiln/models/mlp.h"
#include "kiln/ops/factory.h"

namespace fs = std::filesystem;
using namespace kiln;

namespace {

fs::path g_root;

void put(const std::string& target, const std::string& name, const std::string& bytes) {
  fs::create_directories(g_root / target);
  std::FILE* f = std::fopen((g_root / target / name).c_str(), "wb");
  if (!f || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() || std::fclose(f) != 0) {
    fuzz::die("cannot write seed " + target + "/" + name);
  }
}

std::string str(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

std::string gzip(const std::string& data) { return kiln::test::gzip_bytes(data, 9); }

std::string idx(std::vector<uint32_t> dims) {
  std::string s = kiln::test::idx_header(dims);
  size_t count = 1;
  for (uint32_t d : dims) count *= d;
  for (size_t i = 0; i < count; ++i) s += static_cast<char>(i * 37);
  return s;
}

void safetensors_seeds() {
  const DType all[] = {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt32, kUInt8, kBool};
  io::NamedTensors every;
  for (DType dt : all) every.emplace_back(std::string(dtype_safetensors_name(dt)), ones({2, 3}, TensorOptions(dt)));
  put("safetensors", "every-dtype", str(io::serialize_safetensors(every, {{"format", "pt"}})));
  put("safetensors", "empty-and-scalar",
      str(io::serialize_safetensors({{"e", empty({0, 4})}, {"s", scalar_tensor(2.5)}, {"b", zeros({3}, TensorOptions(kBool))}})));
  put("safetensors", "no-tensors", str(io::serialize_safetensors({}, {{"k", "v"}})));
  put("safetensors", "one-f32", str(io::serialize_safetensors({{"w", arange(6).to(kFloat32).reshape({2, 3})}})));
}

void idx_seeds() {
  // Mode byte, then the file (mode 0), the file to gzip (mode 1), or a split point and two files (mode 2).
  const std::string images = idx({3, 2, 2}), labels = idx({3});
  put("idx", "plain-images", std::string(1, '\0') + images);
  put("idx", "plain-labels", std::string(1, '\0') + labels);
  put("idx", "gzip-images", std::string(1, '\0') + gzip(images));
  put("idx", "gzip-4d", std::string(1, '\0') + gzip(idx({2, 1, 3, 2})));
  put("idx", "to-gzip", "\x01" + images);
  // The split byte b cuts the m bytes after it at m*b/255.
  const std::string pair = images + labels;
  const size_t m = pair.size();
  const auto b = static_cast<uint8_t>((images.size() * 255 + m - 1) / m);
  std::string joined = "\x02";
  joined += static_cast<char>(b);
  joined += pair;
  put("idx", "dataset", joined);
}

void text_seeds() {
  put("text", "char-gutenberg",
      std::string("\x02\x07\x00", 3) + "header\r\n*** START OF THIS BOOK ***\r\nCall me Ishmael.\r\n*** END OF IT\r\n");
  put("text", "char-plain", std::string("\x00\x03\x02", 3) + "  some text to cut into windows\n");
  std::string tok16 = std::string("\x01\x04\x01", 3), tok32 = std::string("\x05\x04\x00", 3);
  for (int i = 0; i < 24; ++i) {
    tok16 += {static_cast<char>(i * 11), static_cast<char>(i)};
    tok32 += {static_cast<char>(i), static_cast<char>(i * 3), static_cast<char>(0), static_cast<char>(i & 1)};
  }
  put("text", "tokens-u16", tok16);
  put("text", "tokens-u32", tok32);
}

void checkpoint_seeds() {
  fuzz::CheckpointFixture fx;
  put("checkpoint", "valid", std::string(1, '\0') + fuzz::slurp(fx.base_file.path()));
  put("checkpoint", "edit-step", "\x01step=7\nconfig=x=1");
  put("checkpoint", "edit-groups", "\x01optim.param_groups=2\nsched.children=1");
  put("checkpoint", "edit-loader", "\x01loader.epoch=1e3\nloader.seed");
  std::string keys = "\x01";
  for (const auto& [k, v] : fx.base.metadata) {
    if (k != "checksum.fnv1a64") keys += k + "=" + v + "\n";
  }
  put("checkpoint", "all-keys", keys);
}

}  // namespace

void byod_seeds() {
  using kiln::test::npy_bytes;
  using kiln::test::raw_bytes;
  // npy: mode byte 0 (one file) or 1 (a split byte, then features and labels).
  put("npy", "f4", std::string(1, '\0') + npy_bytes("<f4", {2, 3}, std::string(24, '\x3f')));
  put("npy", "fortran-be", std::string(1, '\0') + npy_bytes(">i2", {3, 2}, std::string(12, '\x01'), true));
  put("npy", "v2-bool", std::string(1, '\0') + npy_bytes("|b1", {4}, std::string("\x01\x00\x01\x00", 4), false, 2));
  const std::string x = npy_bytes("|u1", {3, 2}, "abcdef"), y = npy_bytes("<i8", {3}, raw_bytes(std::vector<int64_t>{0, 2, 1}));
  const size_t total = x.size() + y.size();
  put("npy", "pair", "\x01" + std::string(1, static_cast<char>((x.size() * 255 + total - 1) / total)) + x + y);
  // image: an option byte, then the image.
  std::vector<uint8_t> px(6 * 4 * 4);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(i * 13);
  put("image", "png-rgba", std::string(1, '\0') + kiln::test::png_bytes(6, 4, 4, px));
  put("image", "png-gray", "\x02" + kiln::test::png_bytes(6, 4, 1, std::vector<uint8_t>(px.begin(), px.begin() + 24)));
  put("image", "jpeg-rgb", "\x03" + kiln::test::jpeg_bytes(6, 4, 3, std::vector<uint8_t>(px.begin(), px.begin() + 72)));
  put("image", "jpeg-gray", std::string(1, '\0') + kiln::test::jpeg_bytes(6, 4, 1, std::vector<uint8_t>(24, 200)));
  // csv: an option byte, then the table.
  put("csv", "named", "\x01x,y,label\n1.5,2,cat\n3,\"4,5\",dog\r\n");
  put("csv", "indexed", std::string(1, '\x06') + "0.5,1,2\n3,4,0\n");
}

// shard_index: index.json texts written by the sharded checkpoint's own writer.
void shard_index_seeds() {
  namespace sf = kiln::dist::shard_format;
  sf::Index two;
  two.world_size = 2;
  two.metadata = {{"kiln.fsdp", "1"}, {"step", "7"}};
  sf::IndexTensor w{kFloat32, {3, 4}, 12, {}};
  w.slices.push_back({0, sf::slice_key("model.w", 0), 0, 6, 0x1234});
  w.slices.push_back({1, sf::slice_key("model.w", 6), 6, 6, 0x5678});
  two.tensors["model.w"] = w;
  two.tensors["optim.w.step"] = sf::IndexTensor{kInt64, {1}, 1, {{0, sf::slice_key("optim.w.step", 0), 0, 1, 42}}};
  two.tensors["empty"] = sf::IndexTensor{kBFloat16, {0, 5}, 0, {}};
  put("shard_index", "two-ranks", sf::write_index(two));
  sf::Index one;
  one.world_size = 1;
  one.tensors["b"] = sf::IndexTensor{kFloat32, {2}, 2, {{0, sf::slice_key("b", 0), 0, 2, 7}}};
  put("shard_index", "one-rank", sf::write_index(one));
}

// Small models written by kiln's ONNX writer (opsets 17 and 13, symbolic dims).
void onnx_seeds() {
  fs::create_directories(g_root / "onnx");
  const std::map<std::string, std::map<int64_t, std::string>> batch{{"input", {{0, "batch"}}}};
  models::MLP mlp(models::MLPOptions{.in_features = 8, .hidden = {4}, .out_features = 3});
  exporter::to_onnx(mlp, {randn({2, 8})}, (g_root / "onnx" / "mlp-opset17").string(), {.dynamic_axes = batch});
  exporter::to_onnx(mlp, {randn({2, 8})}, (g_root / "onnx" / "mlp-opset13").string(),
                    {.dynamic_axes = batch, .opset = 13});
  models::CNN cnn(models::CNNOptions{
      .in_channels = 1, .channels1 = 2, .channels2 = 2, .hidden = 4, .num_classes = 3, .input_size = {8}});
  exporter::to_onnx(cnn, {randn({1, 1, 8, 8})}, (g_root / "onnx" / "cnn").string(), {.dynamic_axes = batch});
  models::GPT gpt(models::GPTOptions{.vocab_size = 8, .block_size = 4, .n_layer = 1, .n_head = 2, .n_embd = 4});
  exporter::to_onnx(gpt, {randint(0, 8, {1, 4}, TensorOptions(kInt64))}, (g_root / "onnx" / "gpt-opset13").string(),
                    {.dynamic_axes = {{"input", {{0, "batch"}, {1, "seq"}}}}, .opset = 13});
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  g_root = argv[1];
  safetensors_seeds();
  idx_seeds();
  text_seeds();
  checkpoint_seeds();
  byod_seeds();
  shard_index_seeds();
  onnx_seeds();
  return 0;
}
