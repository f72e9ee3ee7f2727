// Internal to the kernels layer: <immintrin.h> for the kernels that use x86
// intrinsics. GCC 12 warns (falsely) that the undefined operand some AVX-512
// intrinsics start from (_mm512_undefined_ps inside sqrt, shuffles and
// widening conversions) may be, or is, used uninitialised, at every call
// (-Wmaybe-uninitialized, and -Wuninitialized where a kernel inlines several
// of them, as transpose_copy.cpp's 2-byte turn does); both warnings are
// silenced for the intrinsics' own code only, and for GCC only.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#if defined(__GNUC__) && !defined(__clang__)  // clang has no such warning (and would warn about the name)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#endif
