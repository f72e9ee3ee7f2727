// Weights between kiln and PyTorch for the gpt workload's model (docs/interop.md).
//
//   pytorch_weights OUT.safetensors               export kiln's freshly initialised GPT
//   pytorch_weights IN.safetensors OUT.safetensors load torch's weights, then export them again
//
// IN is what docs/interop.md's save_safetensors(model.state_dict(), path) writes
// for tests/parity/models_twins_gpt.py's GPT() (nanoGPT names); OUT loads in
// torch with model.load_state_dict(load_safetensors(path), strict=True).
#include <iostream>

#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/models/gpt.h"
#include "kiln/nn/pytorch_weights.h"

using namespace kiln;

namespace {

void print_list(const char* what, const std::vector<std::string>& v) {
  for (const auto& s : v) std::cout << "  " << what << ": " << s << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::cerr << "usage: " << argv[0] << " [IN.safetensors] OUT.safetensors\n";
    return 2;
  }
  try {
    manual_seed(0);
    models::GPT gpt;  // vocab 256, context 128, 4 layers, 4 heads, width 256
    std::cout << "GPT: " << gpt.num_parameters() << " parameters, " << gpt.state_dict().size()
              << " state_dict entries (lm_head.weight tied to transformer.wte.weight)\n";
    if (argc == 3) {
      // convert_dtype: a bfloat16 or float64 file lands in the float32 model.
      auto res = nn::load_pytorch_weights(gpt, argv[1], {.convert_dtype = true, .ignore = {"*.attn.bias"}});
      std::cout << "loaded " << argv[1] << "\n";
      print_list("filled from its tie", res.tied_filled);
      if (!res.converted.empty()) std::cout << "  " << res.converted.size() << " tensors cast to float32\n";
      print_list("skipped", res.ignored_keys);
    }
    const char* out = argv[argc - 1];
    nn::save_pytorch_weights(gpt, out);
    std::cout << "wrote " << out << "; in Python (docs/interop.md):\n"
              << "  model.load_state_dict(load_safetensors(\"" << out << "\"), strict=True)\n";
  } catch (const Error& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
