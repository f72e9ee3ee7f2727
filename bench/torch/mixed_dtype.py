"""PyTorch twins of bench/micro/bench_mixed_dtype.cpp (issue 28): binary ops on
operands of mixed dtypes, [4096, 1024], at one thread. Prints the best of five
timeit runs per case, in ms and GB/s (each array counted once at its dtype).
Out-of-place cases write into a preallocated `out=` tensor: kiln's allocator
reuses freed blocks, while torch returns a 16 MiB result to the system and
faults it in again each time, which on this sandbox costs ~170 ms per op and
would swamp the kernel time.

    /usr/bin/python3 bench/torch/mixed_dtype.py
"""
import timeit

import torch

torch.set_num_threads(1)
R, C = 4096, 1024


def filled(shape, dt):
    g = torch.Generator().manual_seed(7)
    t = torch.randn(shape, generator=g)
    if not dt.is_floating_point:
        t = t * 100
    return t.to(dt)


def nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts)


def case(name, fn, *arrays):
    out = fn()
    n = 20
    best = min(timeit.repeat(fn, number=n, repeat=5)) / n
    print(f"{name:40s} {best * 1e3:8.3f} ms {nbytes(*arrays, out) / best / 1e9:7.1f} GB/s")


f32 = filled((R, C), torch.float32)
bf16 = filled((R, C), torch.bfloat16)
f16 = filled((R, C), torch.float16)
f64 = filled((R, C), torch.float64)
i64 = filled((R, C), torch.int64)
row_bf16 = filled((C,), torch.bfloat16)
f32b = filled((R, C), torch.float32)

o32 = torch.empty((R, C))
o64 = torch.empty((R, C), dtype=torch.float64)
case("f32 + bf16", lambda: torch.add(f32, bf16, out=o32), f32, bf16)
case("bf16 + f32", lambda: torch.add(bf16, f32, out=o32), bf16, f32)
case("f32 + f16", lambda: torch.add(f32, f16, out=o32), f32, f16)
case("f64 + f32", lambda: torch.add(f64, f32, out=o64), f64, f32)
case("f32 * i64", lambda: torch.mul(f32, i64, out=o32), f32, i64)
case("f32 + bf16[1024] (broadcast row)", lambda: torch.add(f32, row_bf16, out=o32), f32, row_bf16)
acc = f32.clone()
case("f32.add_(bf16) (in place)", lambda: acc.add_(bf16), acc, bf16)
case("f32 + f32 (reference)", lambda: torch.add(f32, f32b, out=o32), f32, f32b)
