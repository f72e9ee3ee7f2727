// libFuzzer target: PNG and JPEG images (kiln::data::probe_image,
// decode_image through libpng and libjpeg). The first byte picks the channels
// asked for (0, 1 or 3) and a pixel limit; the rest is the image. A decoded
// image must have the probed size and the channels asked for.
#include "fuzz_util.h"
#include "kiln/data/image.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln;
  if (size < 1) return 0;
  const int64_t channels = (data[0] & 3) == 3 ? 3 : (data[0] & 3) == 2 ? 1 : 0;
  // A small limit keeps each decode cheap (and is itself a code path to fuzz).
  const int64_t max_pixels = (data[0] & 4) ? 64 : 1 << 16;
  const std::span<const uint8_t> bytes(data + 1, size - 1);
  data::ImageInfo info;
  bool probed = false;
  fuzz::check_reader("probe_image", 0, [&] {
    info = data::probe_image(bytes, "fuzz");
    probed = true;
  });
  fuzz::check_reader("decode_image", 3 * max_pixels + 256, [&] {
    const Tensor t = data::decode_image(bytes, "fuzz", channels, max_pixels);
    if (!probed) fuzz::die("decode_image read an image that probe_image refused");
    if (t.dtype() != kUInt8 || t.dim() != 3 || t.size(1) != info.height || t.size(2) != info.width)
      fuzz::die("decode_image disagrees with probe_image about the size");
    if (t.size(0) != (channels ? channels : info.channels)) fuzz::die("decode_image gave the wrong channel count");
  });
  return 0;
}
