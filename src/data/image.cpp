// PNG and JPEG decoding and bilinear resizing (include/kiln/data/image.h).
//
// libpng's simplified API (png_image_*) keeps its setjmp inside the library
// and reports errors as return values. libjpeg reports errors through a
// callback that must not return: jpeg_decode() below is written as C, with
// setjmp in its own frame and longjmp only ever crossing libjpeg's C frames;
// its output lives in a caller-owned struct, so no C++ destructor is skipped.
#include "kiln/data/image.h"

#include <png.h>

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include <jpeglib.h>

#include "file_io.h"
#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/ops/factory.h"

namespace kiln::data {

namespace {

using kiln::detail::concat;

enum class Codec { Png, Jpeg };

Codec codec_of(std::span<const uint8_t> b, std::string_view source) {
  static constexpr uint8_t kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (b.size() >= 8 && std::memcmp(b.data(), kPng, 8) == 0) return Codec::Png;
  if (b.size() >= 3 && b[0] == 0xff && b[1] == 0xd8 && b[2] == 0xff) return Codec::Jpeg;
  throw FormatError(concat("'", source, "': not a PNG or JPEG image (",
                           b.size() < 8 ? "too short for an image header" : "unknown signature", ")"));
}

void check_size(int64_t h, int64_t w, int64_t max_pixels, std::string_view source) {
  KILN_CHECK(h > 0 && w > 0, FormatError, "'", source, "': the image is ", w, "x", h, " pixels (expected both > 0)");
  KILN_CHECK(h <= max_pixels / w, FormatError, "'", source, "': the image is ", w, "x", h, " = ", w * h,
             " pixels, more than the limit of ", max_pixels,
             " (a decompression bomb, or an image to downscale before training)");
}

// ----------------------------------------------------------------- JPEG

struct JpegError {
  jpeg_error_mgr mgr;  // first: libjpeg hands back a pointer to it
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void jpeg_fail(j_common_ptr c) {
  auto* e = reinterpret_cast<JpegError*>(c->err);
  (*c->err->format_message)(c, e->message);
  std::longjmp(e->jump, 1);
}

// Level -1 is a warning: corrupt or truncated data that libjpeg would decode
// anyway (filling the rest with gray). For training data that is an error.
void jpeg_emit(j_common_ptr c, int level) {
  if (level < 0) jpeg_fail(c);
}

void jpeg_quiet(j_common_ptr) {}

struct JpegResult {
  int64_t height = 0, width = 0, channels = 0;
  std::vector<uint8_t> pixels;  // interleaved HWC
  bool too_large = false;
  char message[JMSG_LENGTH_MAX] = {};
};

/// Decodes (or, with header_only, probes) a JPEG; false with r->message (or
/// r->too_large) on failure.
bool jpeg_decode(const uint8_t* data, size_t size, bool header_only, int64_t max_pixels, JpegResult* r) {
  jpeg_decompress_struct cinfo;
  JpegError err;
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_fail;
  err.mgr.emit_message = jpeg_emit;
  err.mgr.output_message = jpeg_quiet;
  if (setjmp(err.jump)) {
    std::memcpy(r->message, err.message, sizeof r->message);
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  if (cinfo.num_components != 1 && cinfo.num_components != 3) {
    std::snprintf(r->message, sizeof r->message, "%d color components (CMYK?); only grayscale and RGB are supported",
                  cinfo.num_components);
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  r->channels = cinfo.num_components;
  r->height = cinfo.image_height;
  r->width = cinfo.image_width;
  if (r->height <= 0 || r->width <= 0 || r->height > max_pixels / std::max<int64_t>(1, r->width)) {
    r->too_large = true;
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  if (header_only) {
    jpeg_destroy_decompress(&cinfo);
    return true;
  }
  cinfo.out_color_space = r->channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_start_decompress(&cinfo);
  const size_t stride = static_cast<size_t>(r->width * r->channels);
  r->pixels.resize(stride * static_cast<size_t>(r->height));
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = r->pixels.data() + stride * cinfo.output_scanline;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return true;
}

JpegResult jpeg(std::span<const uint8_t> b, std::string_view source, bool header_only, int64_t max_pixels) {
  JpegResult r;
  if (!jpeg_decode(b.data(), b.size(), header_only, max_pixels, &r)) {
    if (r.too_large) check_size(r.height, r.width, max_pixels, source);
    throw FormatError(concat("'", source, "': corrupt or unsupported JPEG: ", r.message));
  }
  return r;
}

// ----------------------------------------------------------------- PNG

struct PngImage {
  png_image img;
  PngImage() {
    std::memset(&img, 0, sizeof img);
    img.version = PNG_IMAGE_VERSION;
  }
  ~PngImage() { png_image_free(&img); }
  PngImage(const PngImage&) = delete;
  PngImage& operator=(const PngImage&) = delete;
};

[[noreturn]] void png_failed(const png_image& img, std::string_view source) {
  throw FormatError(
      concat("'", source, "': corrupt or unsupported PNG: ", img.message[0] ? img.message : "libpng failed"));
}

ImageInfo png_begin(PngImage& p, std::span<const uint8_t> b, std::string_view source) {
  if (!png_image_begin_read_from_memory(&p.img, b.data(), b.size())) png_failed(p.img, source);
  return {(p.img.format & PNG_FORMAT_FLAG_COLOR) ? 3 : 1, static_cast<int64_t>(p.img.height),
          static_cast<int64_t>(p.img.width)};
}

// ----------------------------------------------------------------- channels

/// Interleaved pixels with `in` channels plus `alpha` (0 or 1) into planar [out, H, W].
Tensor to_planar(const uint8_t* px, int64_t h, int64_t w, int64_t in, int64_t alpha, int64_t out) {
  Tensor t = empty({out, h, w}, TensorOptions().dtype(kUInt8).category(MemoryCategory::Data));
  uint8_t* dst = t.data_ptr<uint8_t>();
  const int64_t hw = h * w, step = in + alpha;
  for (int64_t i = 0; i < hw; ++i) {
    const uint8_t* p = px + i * step;
    if (in == out) {
      for (int64_t c = 0; c < out; ++c) dst[c * hw + i] = p[c];
    } else if (out == 3) {
      dst[i] = dst[hw + i] = dst[2 * hw + i] = p[0];
    } else {
      dst[i] = static_cast<uint8_t>((19595u * p[0] + 38470u * p[1] + 7471u * p[2] + 0x8000u) >> 16);
    }
  }
  return t;
}

}  // namespace

ImageInfo probe_image(std::span<const uint8_t> bytes, std::string_view source) {
  if (codec_of(bytes, source) == Codec::Png) {
    PngImage p;
    return png_begin(p, bytes, source);
  }
  const JpegResult r = jpeg(bytes, source, /*header_only=*/true, std::numeric_limits<int64_t>::max());
  return {r.channels, r.height, r.width};
}

Tensor decode_image(std::span<const uint8_t> bytes, std::string_view source, int64_t channels, int64_t max_pixels) {
  KILN_CHECK(channels == 0 || channels == 1 || channels == 3, ValueError,
             "decode_image: expected channels 0, 1 or 3, got ", channels);
  KILN_CHECK(max_pixels > 0, ValueError, "decode_image: expected max_pixels > 0, got ", max_pixels);
  if (codec_of(bytes, source) == Codec::Jpeg) {
    const JpegResult r = jpeg(bytes, source, /*header_only=*/false, max_pixels);
    return to_planar(r.pixels.data(), r.height, r.width, r.channels, 0, channels ? channels : r.channels);
  }
  PngImage p;
  const ImageInfo info = png_begin(p, bytes, source);
  check_size(info.height, info.width, max_pixels, source);
  // Decoded with alpha, which to_planar drops: PIL's convert keeps the colour
  // values, where libpng would composite them onto a background.
  p.img.format = info.channels == 3 ? PNG_FORMAT_RGBA : PNG_FORMAT_GA;
  std::vector<uint8_t> px(PNG_IMAGE_SIZE(p.img));
  if (!png_image_finish_read(&p.img, nullptr, px.data(), 0, nullptr)) png_failed(p.img, source);
  return to_planar(px.data(), info.height, info.width, info.channels, 1, channels ? channels : info.channels);
}

Tensor read_image(const std::string& path, int64_t channels, int64_t max_pixels) {
  const std::string bytes = detail::read_whole_file(path, "read_image");
  return decode_image({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, path, channels, max_pixels);
}

Tensor resize_bilinear(const Tensor& image, int64_t height, int64_t width) {
  KILN_CHECK(image.dim() == 3 && image.dtype() == kUInt8, ValueError,
             "resize_bilinear: expected a uint8 image [C, H, W], got ", dtype_name(image.dtype()), " ",
             image.shape_string());
  KILN_CHECK(height > 0 && width > 0, ValueError, "resize_bilinear: expected a size > 0, got ", height, "x", width);
  const Tensor src = image.contiguous();
  const int64_t c = src.size(0), h = src.size(1), w = src.size(2);
  Tensor out = empty({c, height, width}, TensorOptions().dtype(kUInt8).category(MemoryCategory::Data));
  // Source coordinate of an output pixel centre, clamped at 0 as torch does.
  auto source = [](int64_t i, int64_t in, int64_t n, int64_t& i0, int64_t& i1, double& frac) {
    const double s =
        std::max(0.0, (static_cast<double>(i) + 0.5) * static_cast<double>(in) / static_cast<double>(n) - 0.5);
    i0 = std::min(static_cast<int64_t>(s), in - 1);
    i1 = std::min(i0 + 1, in - 1);
    frac = s - static_cast<double>(i0);
  };
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* d = out.data_ptr<uint8_t>();
  for (int64_t y = 0; y < height; ++y) {
    int64_t y0, y1;
    double fy;
    source(y, h, height, y0, y1, fy);
    for (int64_t x = 0; x < width; ++x) {
      int64_t x0, x1;
      double fx;
      source(x, w, width, x0, x1, fx);
      for (int64_t k = 0; k < c; ++k) {
        const uint8_t* p = s + k * h * w;
        const double top = p[y0 * w + x0] * (1 - fx) + p[y0 * w + x1] * fx;
        const double bottom = p[y1 * w + x0] * (1 - fx) + p[y1 * w + x1] * fx;
        const double v = top * (1 - fy) + bottom * fy;
        d[(k * height + y) * width + x] = static_cast<uint8_t>(std::min(255.0, std::max(0.0, std::nearbyint(v))));
      }
    }
  }
  return out;
}

}  // namespace kiln::data
