"""safetensors interop between kiln and Python, with json + numpy only
(torch 1.13 has no safetensors module).

    safetensors_interop.py write PATH   # write the reference file for kiln to read
    safetensors_interop.py check PATH   # check a file kiln wrote; exit 0 and print OK

Both sides compute the same values from a formula (tests/io/test_safetensors.cpp
mirrors expected_values below), so neither trusts the other's encoder.
bfloat16 travels as raw uint16 bits.
"""
import json
import struct
import sys

import numpy as np

NP = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "BF16": np.uint16,
      "I64": np.int64, "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}
SHAPES = {"3d": (2, 3, 4), "scalar": (), "empty": (0, 3)}
SPECIAL_FLOATS = [float("nan"), float("inf"), float("-inf"), -0.0, 61440.0, 2.0 ** -14, -3.5]
SPECIAL_INTS = {"I64": [-(2 ** 63), 2 ** 63 - 1, 0, -1, 2 ** 53 + 1],
                "I32": [-(2 ** 31), 2 ** 31 - 1, 0, -1, 7],
                "U8": [0, 255, 128, 1, 7]}
METADATA = {"writer": "python", "format": "pt", "note": "caf\u00e9 \u2713"}


def expected_values(dt, n):
    i = np.arange(n)
    if dt in ("F32", "F64", "F16", "BF16"):
        return (i - 6) * 0.25
    if dt == "I64":
        return i * 3_000_000_007 - 5
    if dt == "I32":
        return i * 7 - 20
    if dt == "U8":
        return (i * 37) % 256
    return i % 3 == 0


def expected_tensors():
    out = {}
    for dt in NP:
        for tag, shape in SHAPES.items():
            out[f"{dt}_{tag}"] = (dt, shape, expected_values(dt, int(np.prod(shape, dtype=np.int64))))
        if dt in ("F32", "F64", "F16", "BF16"):
            out[f"{dt}_special"] = (dt, (len(SPECIAL_FLOATS),), np.array(SPECIAL_FLOATS))
        elif dt in SPECIAL_INTS:
            out[f"{dt}_special"] = (dt, (len(SPECIAL_INTS[dt]),), SPECIAL_INTS[dt])
    return out


def encode(dt, values):
    if dt == "BF16":
        f = np.asarray(values, dtype=np.float32).reshape(-1)
        bits = f.view(np.uint32)
        out = (bits >> 16).astype(np.uint16)  # values are exact in bf16, except NaN
        out[np.isnan(f)] = 0x7FC0
        return out.tobytes()
    if dt in ("I64", "I32", "U8"):
        return np.array([int(v) for v in np.asarray(values, dtype=object).reshape(-1)], dtype=NP[dt]).tobytes()
    return np.asarray(values).astype(NP[dt]).tobytes()


def decode(dt, raw, shape):
    if dt == "BF16":
        bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype=NP[dt]).reshape(shape)


def write(path):
    tensors = expected_tensors()
    # Buffer order is the reverse of the header's key order: readers must follow data_offsets.
    blobs, offset, header = {}, 0, {"__metadata__": METADATA}
    for name in reversed(sorted(tensors)):
        dt, shape, values = tensors[name]
        blobs[name] = encode(dt, values)
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + len(blobs[name])]}
        offset += len(blobs[name])
    text = json.dumps({k: header[k] for k in ["__metadata__"] + sorted(tensors)}, ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in reversed(sorted(tensors)):
            f.write(blobs[name])


def check(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    problems = []
    if n % 8:
        problems.append(f"header length {n} is not a multiple of 8")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    buf = data[8 + n:]
    meta = header.pop("__metadata__", {})
    want_meta = dict(METADATA, writer="kiln")
    if meta != want_meta:
        problems.append(f"metadata {meta!r} != {want_meta!r}")
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    cursor = 0
    for b, e in spans:
        if b != cursor:
            problems.append(f"buffer not covered exactly: span {b}..{e} at cursor {cursor}")
        cursor = e
    if cursor != len(buf):
        problems.append(f"tensors cover {cursor} bytes of a {len(buf)}-byte buffer")
    tensors = expected_tensors()
    if set(header) != set(tensors):
        problems.append(f"names differ: missing {set(tensors) - set(header)}, extra {set(header) - set(tensors)}")
    for name, (dt, shape, values) in tensors.items():
        if name not in header:
            continue
        info = header[name]
        if info["dtype"] != dt or tuple(info["shape"]) != shape:
            problems.append(f"{name}: dtype/shape {info['dtype']} {info['shape']} != {dt} {list(shape)}")
            continue
        b, e = info["data_offsets"]
        got = decode(dt, buf[b:e], shape)
        if dt in ("I64", "I32", "U8"):
            want = np.array([int(v) for v in np.asarray(values, dtype=object).reshape(-1)], dtype=NP[dt]).reshape(shape)
            ok = np.array_equal(got, want)
        elif dt == "BOOL":
            ok = np.array_equal(got, np.asarray(values, dtype=np.bool_).reshape(shape))
        else:
            want = np.asarray(values, dtype=np.float64).reshape(shape)
            g = got.astype(np.float64)
            ok = np.array_equal(np.isnan(g), np.isnan(want)) and np.array_equal(
                np.nan_to_num(g, nan=0.0), np.nan_to_num(want, nan=0.0)) and np.array_equal(
                np.signbit(g), np.signbit(want))
        if not ok:
            problems.append(f"{name}: values {got.reshape(-1)[:8]} != expected {np.asarray(values).reshape(-1)[:8]}")
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    {"write": write, "check": check}[sys.argv[1]](sys.argv[2])
