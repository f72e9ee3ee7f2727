"""Loads a state dict kiln wrote (safetensors) into the same model built with
torch.nn, strict=True, and checks torch's eval-mode output equals kiln's.

    nn_state_dict.py PATH   # exit 0 and print OK, or print the difference

The file holds the model's state_dict entries plus "__input__" and
"__output__". Reads safetensors with json + numpy (torch 1.13 has no
safetensors module). The model must match tests/nn/test_parity.cpp.
"""
import json
import struct
import sys

import numpy as np
import torch

NP = {"F32": np.float32, "F64": np.float64, "I64": np.int64}


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    buf = data[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        arr = np.frombuffer(buf[b:e], dtype=NP[info["dtype"]]).reshape(info["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out


def main():
    torch.set_num_threads(1)
    t = read(sys.argv[1])
    x = t.pop("__input__")
    y = t.pop("__output__")
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 5),
        nn.LayerNorm(5),
        nn.GELU(),
        nn.Dropout(0.5),
    )
    keys = list(model.state_dict().keys())
    if keys != list(t.keys()):
        print("key order differs:\n torch: %s\n kiln:  %s" % (keys, list(t.keys())))
        return 1
    model.load_state_dict(t, strict=True)
    model.eval()
    with torch.no_grad():
        out = model(x)
    if not torch.allclose(out, y, rtol=1e-5, atol=1e-5):
        print("outputs differ:\n torch: %s\n kiln:  %s" % (out, y))
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
