// NumPy .npy files (format versions 1.0, 2.0 and 3.0), as np.save writes them.
//
// Layout: the magic "\x93NUMPY", a major and a minor version byte, the header
// length (2 bytes little-endian in 1.0, 4 bytes in 2.0 and 3.0), a header that
// is a Python dict literal
//   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
// padded with spaces and ended by '\n', then the raw elements.
//
// The file is hostile input, as every reader's (DESIGN.md §7): the header is
// parsed by a bounds-checked scanner (never evaluated), its length is checked
// against the file before it is read, the element count is computed with
// overflow checks and must match the bytes that follow exactly (no truncated
// data, no trailing bytes), and nothing is allocated before those checks pass.
// Any problem raises kiln::FormatError naming the file and what is wrong.
//
// Element types: float16/32/64, int8/16/32/64, uint8/16/32/64 and bool, little
// or big endian. kiln has no int8, int16 or wider unsigned types, so those
// arrive as int64 (uint64 values above int64's range are an error); big-endian
// data is byte-swapped; a Fortran-order array arrives in C order with the same
// shape and values, as np.load gives it. Structured, object (pickled),
// complex, string and datetime arrays are refused by name. The tensor is
// charged to MemoryCategory::Data.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "kiln/core/tensor.h"

namespace kiln::data {

/// The array in `path` as a tensor (see the top of this file for dtypes).
/// IOError if it cannot be read, FormatError if it is not a valid .npy file.
Tensor read_npy(const std::string& path);

/// The same from bytes in memory (tests, fuzzing); `source` names them in messages.
Tensor parse_npy(std::span<const uint8_t> bytes, std::string_view source = "<memory>");

}  // namespace kiln::data
