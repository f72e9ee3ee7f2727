#pragma once
// Bytes of idx files (the MNIST/Fashion-MNIST format) and gzip streams, built in
// memory for the reader tests and the fuzz seeds: one writer, so every test
// speaks the same format. Header-only: tests/fuzz links no test support library.
#include <zlib.h>

#include <cstdint>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace kiln::test {

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f << bytes;
}

inline std::string be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>((v >> 16) & 0xff), static_cast<char>((v >> 8) & 0xff),
          static_cast<char>(v & 0xff)};
}

/// The header of an unsigned-byte idx file with these dimensions.
inline std::string idx_header(const std::vector<uint32_t>& dims) {
  std::string s = {0, 0, 8, static_cast<char>(dims.size())};
  for (auto d : dims) s += be32(d);
  return s;
}

/// A one-member gzip stream of `size` bytes at `data`.
inline std::string gzip_bytes(const void* data, size_t size, int level = 6) {
  z_stream zs{};
  if (deflateInit2(&zs, level, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK)
    throw std::runtime_error("gzip_bytes: deflateInit2 failed");
  std::string out(deflateBound(&zs, size) + 64, '\0');
  zs.next_in = static_cast<Bytef*>(const_cast<void*>(data));
  zs.avail_in = static_cast<uInt>(size);
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  const int rc = deflate(&zs, Z_FINISH);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  if (rc != Z_STREAM_END) throw std::runtime_error("gzip_bytes: deflate did not finish");
  return out;
}

inline std::string gzip_bytes(const std::string& data, int level = 6) { return gzip_bytes(data.data(), data.size(), level); }

}  // namespace kiln::test
