"""The PyTorch oracle for kiln's tests (DESIGN.md section 9).

    /usr/bin/python3 tests/parity/oracle.py WORKDIR

WORKDIR holds manifest.json ({"cases": [{"id", "expr", "inputs", "strides"}]})
and inputs.safetensors. Each case's expression is evaluated with torch, F
(torch.nn.functional), math, inf, nan and x0, x1, ... in scope; the results
go to WORKDIR/outputs.safetensors (tensor k of case i is "c<i>.<k>") and
WORKDIR/results.json (one {"ok", "kinds"} or {"ok": false, "error"} per case).
An expression may return a tensor, a tuple/list of tensors or numbers, or a
Python number or bool (sent back as a 0-dim tensor of kind "number"); None
(in a tuple, or alone) comes back as kind "none" (an undefined kiln tensor).

A gradient case also has "grad_inputs" (indices i of the x_i to differentiate)
and "grad_outputs" (per output of the expression, the name of its gradient
tensor in inputs.safetensors, or null). The x_i are made leaves that require
grad (same layout), the expression is evaluated, and the case returns
torch.autograd.grad(outputs that require grad, x_i, their grad_outputs,
allow_unused=True): one result per grad input, of kind "none" where torch
returned None; "requires_grad" lists, per output, whether it required grad.

safetensors is read and written with json + numpy (torch 1.13 has no
safetensors module); bfloat16 travels as raw uint16 bits. Everything here
runs on one thread so results do not depend on the machine.
"""
import json
import math
import os
import struct
import sys

import numpy as np

try:
    import torch
    import torch.nn.functional as F
except Exception as e:  # noqa: BLE001 - any import failure means the same fix
    print(f"oracle.py: cannot import torch ({type(e).__name__}: {e}); run scripts/setup.sh", file=sys.stderr)
    sys.exit(3)

torch.set_num_threads(1)


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def float32_sums(fn):
    """fn on bfloat16 tensors computed in float32 and rounded once.

    torch convolves bfloat16 with oneDNN's kernels (float32 sums, one rounding)
    only where the CPU has AVX-512 (avx512bw, vl and dq); elsewhere (an
    AVX2-only CPU) its fallback adds in bfloat16, up to 0.1 off for a 27-term
    sum. The oracle stands for torch on the CPUs it is accurate on, which is
    also what kiln computes on every CPU (docs/decisions.md, Note [Kernels
    without AVX-512]).
    """
    def widen(a):
        return a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a

    def wrapped(*args, **kwargs):
        if not any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in list(args) + list(kwargs.values())):
            return fn(*args, **kwargs)
        return fn(*[widen(a) for a in args], **{k: widen(v) for k, v in kwargs.items()}).bfloat16()
    return wrapped


if not {"avx512bw", "avx512vl", "avx512dq"} <= cpu_flags():
    F.conv2d = float32_sums(F.conv2d)

NP = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "BF16": np.int16,
      "I64": np.int64, "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}
TORCH_TO_ST = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    buf = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        arr = np.frombuffer(buf[b:e], dtype=NP[info["dtype"]]).reshape(info["shape"]).copy()
        t = torch.from_numpy(arr)
        if info["dtype"] == "BF16":
            t = t.view(torch.bfloat16)
        out[name] = t
    return out


def encode(t):
    t = t.detach().contiguous()
    if t.dtype not in TORCH_TO_ST:
        raise TypeError(f"torch returned dtype {t.dtype}, which kiln does not have")
    dt = TORCH_TO_ST[t.dtype]
    if dt == "BF16":
        t = t.view(torch.int16)
    return dt, list(t.shape), t.numpy().tobytes()


def write_safetensors(path, named):
    header, blobs, offset = {}, [], 0
    for name, (dt, shape, raw) in named:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def restride(t, strides):
    """The same values with kiln's strides (expanded dims stay stride 0), so
    layout-dependent torch behaviour (view errors, in-place on expanded) matches."""
    if t.dim() == 0 or list(t.stride()) == list(strides) or t.numel() == 0:
        return t
    try:
        base = t
        for d, s in enumerate(strides):
            if s == 0 and t.shape[d] > 1:
                base = base.narrow(d, 0, 1)
        out = torch.empty_strided(tuple(base.shape), tuple(strides), dtype=t.dtype)
        out.copy_(base)
        return out.expand(t.shape)
    except RuntimeError:
        return t  # overlapping layouts torch cannot build: fall back to the values


def as_outputs(v):
    """[(tensor, kind)] for a tensor, a number, None, or a tuple/list of them."""
    if isinstance(v, torch.Tensor):
        return [(v, "tensor")]
    if v is None:  # e.g. an unused input's gradient from torch.autograd.grad(..., allow_unused=True)
        return [(None, "none")]
    if isinstance(v, bool):
        return [(torch.tensor(v, dtype=torch.bool), "number")]
    if isinstance(v, int):
        return [(torch.tensor(v, dtype=torch.int64), "number")]
    if isinstance(v, float):
        return [(torch.tensor(v, dtype=torch.float64), "number")]
    if isinstance(v, (tuple, list)):
        out = []
        for e in v:
            if isinstance(e, (tuple, list)):
                raise TypeError("nested tuples are not supported by the oracle")
            out.extend(as_outputs(e))
        return out
    raise TypeError(f"the expression returned {type(v).__name__}; expected a tensor, number or tuple of them")


def gradients(case, scope, inputs, outs):
    """torch.autograd.grad of the expression's outputs w.r.t. the grad inputs."""
    xs = [scope[f"x{i}"] for i in case["grad_inputs"]]
    names = case["grad_outputs"]
    if len(names) != len(outs):
        raise ValueError(f"the expression returned {len(outs)} outputs but kiln sent {len(names)} grad_outputs "
                         "(kiln and torch disagree on the number of outputs)")
    req = [kind == "tensor" and t.requires_grad for t, kind in outs]
    used, grads = [], []
    for (t, _), name, r in zip(outs, names, req):
        if name is not None and r:
            used.append(t)
            grads.append(inputs[name].to(t.dtype))
    if not used:
        return [(None, "none") for _ in xs], req
    gs = torch.autograd.grad(used, xs, grads, allow_unused=True)
    return [(g, "tensor") if g is not None else (None, "none") for g in gs], req


def main(workdir):
    with open(os.path.join(workdir, "manifest.json")) as f:
        cases = json.load(f)["cases"]
    inputs = read_safetensors(os.path.join(workdir, "inputs.safetensors"))
    results, named = [], []
    for i, case in enumerate(cases):
        scope = {"torch": torch, "F": F, "math": math, "inf": math.inf, "nan": math.nan}
        try:
            for k, (name, strides) in enumerate(zip(case["inputs"], case["strides"])):
                scope[f"x{k}"] = restride(inputs[name].clone(), strides)
            grad_case = "grad_inputs" in case
            if grad_case:
                for k in case["grad_inputs"]:
                    x = scope[f"x{k}"]
                    if not x.is_floating_point():
                        raise TypeError(f"grad input x{k} has dtype {x.dtype}; only floating inputs can require grad")
                    scope[f"x{k}"] = x.detach().requires_grad_()
            outs = as_outputs(eval(case["expr"], scope))  # noqa: S307 - test expressions from our own registry
            extra = {}
            if grad_case:
                outs, extra["requires_grad"] = gradients(case, scope, inputs, outs)
            encoded = [encode(t) if t is not None else None for t, _ in outs]
            named.extend((f"c{i}.{k}", e) for k, e in enumerate(encoded) if e is not None)
            results.append({"ok": True, "kinds": [kind for _, kind in outs], **extra})
        except Exception as e:  # noqa: BLE001 - a failing case is reported, not fatal
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    write_safetensors(os.path.join(workdir, "outputs.safetensors"), named)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
