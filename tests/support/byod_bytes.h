#pragma once
// Bytes of bring-your-own data files (.npy, PNG, JPEG), built in memory for
// the data tests, the CLI tests and the fuzz seeds. PNG and JPEG are written
// by libpng and libjpeg themselves, so the readers are tested against files
// the reference libraries made. Header-only: tests/fuzz links no test support library.
#include <png.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include <jpeglib.h>

namespace kiln::test {

/// A .npy file (format 1.0 unless `major` says 2 or 3) of `data`, the raw
/// elements, laid out as numpy's np.save writes it: the header dict padded
/// with spaces to a multiple of 64 bytes, ending in '\n'.
inline std::string npy_bytes(const std::string& descr, const std::vector<int64_t>& shape, const std::string& data,
                             bool fortran = false, int major = 1) {
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") + ", 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) dict += (i ? ", " : "") + std::to_string(shape[i]);
  dict += shape.size() == 1 ? ",), }" : "), }";
  const size_t pre = major == 1 ? 10 : 12;
  const size_t total = (pre + dict.size() + 1 + 63) / 64 * 64;
  dict += std::string(total - pre - dict.size() - 1, ' ') + "\n";
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  const size_t len = dict.size();
  for (size_t b = 0; b < pre - 8; ++b) out += static_cast<char>((len >> (8 * b)) & 0xff);
  return out + dict + data;
}

/// The raw bytes of a vector of trivially copyable values (little-endian machine).
template <typename T>
std::string raw_bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

/// A PNG of interleaved 8-bit pixels: channels 1 (gray), 2 (gray+alpha), 3 (RGB) or 4 (RGBA).
inline std::string png_bytes(int width, int height, int channels, const std::vector<uint8_t>& pixels) {
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = static_cast<png_uint_32>(width);
  img.height = static_cast<png_uint_32>(height);
  img.format = channels == 1 ? PNG_FORMAT_GRAY : channels == 2 ? PNG_FORMAT_GA : channels == 3 ? PNG_FORMAT_RGB
                                                                                              : PNG_FORMAT_RGBA;
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&img, nullptr, &size, 0, pixels.data(), 0, nullptr))
    throw std::runtime_error(std::string("png_bytes: ") + img.message);
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&img, out.data(), &size, 0, pixels.data(), 0, nullptr))
    throw std::runtime_error(std::string("png_bytes: ") + img.message);
  out.resize(size);
  return out;
}

/// A baseline JPEG of interleaved 8-bit pixels, channels 1 (gray) or 3 (RGB).
inline std::string jpeg_bytes(int width, int height, int channels, const std::vector<uint8_t>& pixels,
                              int quality = 95) {
  jpeg_compress_struct c;
  jpeg_error_mgr err;
  c.err = jpeg_std_error(&err);  // errors exit: only valid images are written here
  jpeg_create_compress(&c);
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &buf, &size);
  c.image_width = static_cast<JDIMENSION>(width);
  c.image_height = static_cast<JDIMENSION>(height);
  c.input_components = channels;
  c.in_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, quality, TRUE);
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(pixels.data()) + static_cast<size_t>(c.next_scanline) * width * channels;
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  std::string out(reinterpret_cast<const char*>(buf), size);
  std::free(buf);
  return out;
}

}  // namespace kiln::test
