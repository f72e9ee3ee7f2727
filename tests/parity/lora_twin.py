"""The PyTorch side of tests/nn/test_lora.cpp: LoRA on kiln's GPT and ViT twins.

    lora_twin.py IN1 OUT1 [IN2 OUT2 ...]

torch 1.13 has no PEFT, so the LoRA layer is written here as PEFT writes it
(peft/tuners/lora.py, the Linear with lora_A / lora_B / lora_dropout
ModuleDicts keyed by adapter name, forward
result + lora_B(lora_A(dropout(x))) * scaling with scaling = lora_alpha / r).

Each IN is a safetensors file (models_twins.py's exchange) holding kiln's
state_dict after nn::lora::apply (base keys plus
"<module>.lora_A.<adapter>.weight" etc.), "__input__" and "__target__";
metadata "model" (gpt or vit), "config" (twin kwargs as JSON), "targets"
(JSON list of the wrapped modules' full paths), "adapter", "r" and "alpha".
The twin wraps the same modules, loads the state dict strictly, freezes the
base, runs a train-mode forward and backward and writes to OUT: "out" (the
output), "loss", and "grad.<name>" for every parameter that got a gradient.
Prints OK.
"""
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models_twins import read, write  # noqa: E402
from models_twins_gpt import GPT, ViT, loss_of  # noqa: E402

MODELS = {"gpt": GPT, "vit": ViT}


class LoraLinear(nn.Linear):
    """PEFT's LoRA Linear for one adapter: the base weight and bias stay where they were."""

    def __init__(self, base, adapter, r, alpha):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.weight = base.weight
        self.bias = base.bias
        self.adapter = adapter
        self.lora_A = nn.ModuleDict({adapter: nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({adapter: nn.Linear(r, base.out_features, bias=False)})
        self.lora_dropout = nn.ModuleDict({adapter: nn.Identity()})
        self.scaling = alpha / r

    def forward(self, x):
        result = F.linear(x, self.weight, self.bias)
        a = self.adapter
        return result + self.lora_B[a](self.lora_A[a](self.lora_dropout[a](x))) * self.scaling


def wrap(model, targets, adapter, r, alpha):
    for path in targets:
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, leaf, LoraLinear(getattr(parent, leaf), adapter, r, alpha))


def run(inp, outp):
    t, meta = read(inp)
    x = t.pop("__input__")
    target = t.pop("__target__")
    kind = meta["model"]
    model = MODELS[kind](**json.loads(meta["config"]))
    wrap(model, json.loads(meta["targets"]), meta["adapter"], int(meta["r"]), float(meta["alpha"]))
    keys = set(model.state_dict().keys())
    if keys != set(t.keys()):
        print("state_dict keys differ:\n only torch: %s\n only kiln:  %s" % (sorted(keys - t.keys()),
                                                                           sorted(t.keys() - keys)))
        return 1
    model.load_state_dict(t, strict=True)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    model.train()
    y = model(x)
    loss = loss_of(kind, y, target)
    loss.backward()
    out = {"out": y.detach(), "loss": loss.detach().reshape(1)}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out["grad." + name] = p.grad
    write(outp, out)
    return 0


def main():
    torch.set_num_threads(1)
    args = sys.argv[1:]
    if len(args) < 2 or len(args) % 2:
        print(__doc__)
        return 2
    for i in range(0, len(args), 2):
        rc = run(args[i], args[i + 1])
        if rc:
            return rc
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
