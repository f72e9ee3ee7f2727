"""The PyTorch side of tests/nn/test_pytorch_weights.cpp: weights both ways
between kiln's models and their torch twins (models_twins*.py), through the
Python code of docs/interop.md itself.

    pytorch_weights.py WORKDIR

WORKDIR holds one folder per case; each has case.json ({"model": "gpt" or
"resnet", "config": twin kwargs, "seed": int, "input": [shape]}) and
kiln_model.safetensors (kiln's export of its own model). For each case:
  (a) torch builds the twin with manual_seed(seed) (for the ResNet, three
      train-mode batches give BatchNorm running statistics), saves its
      state_dict with the doc's "save" block as torch_model.safetensors, and
      its eval-mode output on a fresh input;
  (b) a second twin (other initial values) loads kiln_model.safetensors with
      the doc's "load" block (load_state_dict(strict=True)) and runs the same
      input in eval mode.
It writes outputs.safetensors: "input", "torch_out" (a), "kiln_weights_out"
(b) and "loaded.<name>" for the state_dict the twin holds after (b). The same
both ways in bfloat16: torch_model_bf16.safetensors (a's weights rounded) with
"torch_bf16_out" (the twin's output with the rounded weights), and
"kiln_bf16_weights_out" from kiln_model_bf16.safetensors (kiln's export with
dtype bfloat16, which case folders also hold).
Prints OK, or fails with the reason.
"""
import json
import os
import re
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from models_twins import ResNet  # noqa: E402
from models_twins_gpt import GPT  # noqa: E402

MODELS = {"gpt": GPT, "resnet": ResNet}


def doc_blocks():
    """The Python blocks of docs/interop.md marked '<!-- test: NAME -->'."""
    with open(os.path.join(HERE, "..", "..", "docs", "interop.md")) as f:
        text = f.read()
    blocks = dict(re.findall(r"<!-- test: (\w+) -->\s*```python\n(.*?)```", text, re.S))
    missing = {"helpers", "save", "load"} - blocks.keys()
    if missing:
        raise SystemExit("docs/interop.md lacks the tested blocks %s" % sorted(missing))
    return blocks


def run_case(folder, blocks, helpers):
    with open(os.path.join(folder, "case.json")) as f:
        spec = json.load(f)
    kind, config = spec["model"], spec["config"]
    make = MODELS[kind]
    torch.manual_seed(spec["seed"])
    model = make(**config)
    if kind == "gpt":
        x = torch.randint(0, config["vocab_size"], spec["input"])
    else:
        x = torch.randn(*spec["input"])
        model.train()
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn_like(x) * 2 + 0.5)
    model.eval()
    with torch.no_grad():
        torch_out = model(x)
    fresh = make(**config)
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        exec(blocks["save"], dict(helpers, model=model))
        exec(blocks["load"], dict(helpers, model=fresh))
    finally:
        os.chdir(cwd)
    if fresh.training:
        raise SystemExit("the doc's load block left the model in train mode")
    with torch.no_grad():
        kiln_out = fresh(x)
    out = {"input": x, "torch_out": torch_out, "kiln_weights_out": kiln_out}
    # bfloat16 files both ways through the doc's helpers: torch's weights rounded
    # for kiln to load with convert_dtype, and kiln's bfloat16 export into torch.
    half = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    helpers["save_safetensors"](half, os.path.join(folder, "torch_model_bf16.safetensors"))
    rounded = make(**config)
    rounded.load_state_dict(half, strict=True)
    rounded.eval()
    kiln_half = make(**config)
    kiln_half.load_state_dict(helpers["load_safetensors"](os.path.join(folder, "kiln_model_bf16.safetensors")),
                              strict=True)
    kiln_half.eval()
    with torch.no_grad():
        out["torch_bf16_out"] = rounded(x)
        out["kiln_bf16_weights_out"] = kiln_half(x)
    for name, t in fresh.state_dict().items():
        out["loaded." + name] = t
    helpers["save_safetensors"](out, os.path.join(folder, "outputs.safetensors"))


def main():
    torch.set_num_threads(1)
    blocks = doc_blocks()
    helpers = {}
    exec(blocks["helpers"], helpers)
    work = sys.argv[1]
    for case in sorted(os.listdir(work)):
        run_case(os.path.join(work, case), blocks, helpers)
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
