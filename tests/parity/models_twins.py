"""PyTorch twins of kiln's model zoo (include/kiln/models/) and the exchange
used by tests/nn/test_models.cpp.

    models_twins.py IN OUT

IN (safetensors, written by kiln) holds the model's initial state_dict, the
input "__input__" and int64 class targets "__target__"; its metadata has
"model" (mlp, cnn or resnet) and "config" (JSON keyword arguments of the
twin's constructor). The twin loads the state dict with strict=True (so names
and shapes must match exactly), then:
  eval mode:  "eval_out"  = model(x)
  train mode: "train_out" = model(x); loss = cross_entropy(train_out, target);
              loss.backward()
and writes OUT (safetensors): eval_out, train_out, "loss", "grad.<name>" for
each parameter and "state.<name>" for each state_dict entry after the train
step (BatchNorm running statistics), and "torch_init.<name>" for the
state_dict of a freshly built twin (torch's own initialisation, for kiln to
load by name). Prints OK or why not.
Reads and writes safetensors with json + numpy (torch 1.13 has no
safetensors module).
"""
import json
import struct
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

NP = {"F32": np.float32, "F64": np.float64, "I64": np.int64}
ST = {np.dtype(v): k for k, v in NP.items()}


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    buf = data[8 + n:]
    meta = header.pop("__metadata__", {})
    out = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, e = info["data_offsets"]
        arr = np.frombuffer(buf[b:e], dtype=NP[info["dtype"]]).reshape(info["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out, meta


def write(path, tensors):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        arr = t.detach().cpu().contiguous().numpy()  # (np.ascontiguousarray makes 0-d 1-d)
        b = arr.tobytes()
        header[name] = {"dtype": ST[arr.dtype], "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


class MLP(nn.Module):
    def __init__(self, in_features=784, hidden=(512, 512), out_features=10, bias=True):
        super().__init__()
        mods, d = [], in_features
        for h in hidden:
            mods += [nn.Linear(d, h, bias=bias), nn.ReLU()]
            d = h
        mods.append(nn.Linear(d, out_features, bias=bias))
        self.layers = nn.Sequential(*mods)

    def forward(self, x):
        return self.layers(torch.flatten(x, 1))


class CNN(nn.Module):
    def __init__(self, in_channels=1, channels1=32, channels2=64, hidden=128, num_classes=10,
                 input_size=(28, 28)):
        super().__init__()
        if len(input_size) == 1:
            input_size = (input_size[0], input_size[0])
        self.conv1 = nn.Conv2d(in_channels, channels1, 3, padding=1)
        self.conv2 = nn.Conv2d(channels1, channels2, 3, padding=1)
        self.fc1 = nn.Linear(channels2 * (input_size[0] // 4) * (input_size[1] // 4), hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def conv3x3(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock (torchvision is not installed here)."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, in_channels=3, stem_channels=16, widths=(16, 32, 64), blocks=(1, 1, 1), num_classes=10):
        super().__init__()
        self.conv1 = conv3x3(in_channels, stem_channels)
        self.bn1 = nn.BatchNorm2d(stem_channels)
        self.relu = nn.ReLU(inplace=True)
        c = stem_channels
        for i, (w, n) in enumerate(zip(widths, blocks)):
            mods = []
            for b in range(n):
                mods.append(BasicBlock(c, w, 2 if (i > 0 and b == 0) else 1))
                c = w
            setattr(self, "layer%d" % (i + 1), nn.Sequential(*mods))
        self.nstages = len(widths)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        for i in range(self.nstages):
            x = getattr(self, "layer%d" % (i + 1))(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


MODELS = {"mlp": MLP, "cnn": CNN, "resnet": ResNet}


def main():
    torch.set_num_threads(1)
    t, meta = read(sys.argv[1])
    x = t.pop("__input__")
    target = t.pop("__target__")
    model = MODELS[meta["model"]](**json.loads(meta["config"]))
    keys = list(model.state_dict().keys())
    if keys != list(t.keys()):
        print("state_dict keys differ:\n torch: %s\n kiln:  %s" % (keys, list(t.keys())))
        return 1
    model.load_state_dict(t, strict=True)
    out = {}
    model.eval()
    with torch.no_grad():
        out["eval_out"] = model(x)
    model.train()
    y = model(x)
    loss = F.cross_entropy(y, target)
    loss.backward()
    out["train_out"] = y
    out["loss"] = loss.reshape(1)
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad
    for name, v in model.state_dict().items():
        out["state." + name] = v
    torch.manual_seed(0)
    fresh = MODELS[meta["model"]](**json.loads(meta["config"]))
    for name, v in fresh.state_dict().items():
        out["torch_init." + name] = v
    write(sys.argv[2], out)
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
