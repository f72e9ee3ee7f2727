"""PyTorch twins of kiln's benchmark workloads (bench/workloads/workloads.cpp).

    /usr/bin/python3 bench/torch/workloads.py --workload gpt[,mlp,...] [--threads N]
                                              [--warmup 10] [--steps 50] [--amp bf16|off]

Prints one JSON line per workload, with the same fields as kiln_bench, so
bench/compare.py treats both alike. Same architectures, shapes, optimizers and
float32 as the kiln side; parameters and batches come from the same closed-form
hash of (tensor name, element index) (see workloads.h), so both start from
bitwise-identical values and their first-step losses must agree.

The models are written as a PyTorch 1.13 user would: the zoo twins of
tests/parity (torchvision's BasicBlock written out, nanoGPT's model.py with
attention by explicit softmax: torch 1.13 has no scaled_dot_product_attention).
Thread counts: the caller sets OMP_NUM_THREADS / OPENBLAS_NUM_THREADS in the
environment (bench/compare.py does) and --threads calls torch.set_num_threads.
--amp bf16 runs each forward and loss under PyTorch's own CPU autocast
(torch.autocast("cpu", dtype=torch.bfloat16)), as kiln_bench --amp bf16 does
under kiln's AutocastGuard: the twin of the bf16 rows (bench/bf16_bench.py).
"""
import contextlib
import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


# ---- synthetic values (workloads.h: fnv1a, mix, synthetic_uniform, synthetic_classes) ----

def fnv1a(s):
    h = 2166136261
    for c in s.encode():
        h = ((h ^ c) * 16777619) & 0xFFFFFFFF
    return h


def mix(n, salt):
    m = np.uint64(0xFFFFFFFF)
    x = (np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B1) + np.uint64(salt)) & m
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x85EBCA6B)) & m
    x ^= x >> np.uint64(13)
    x = (x * np.uint64(0xC2B2AE35)) & m
    x ^= x >> np.uint64(16)
    return x


def synthetic_uniform(name, shape, scale):
    n = int(np.prod(shape))
    v = (2.0 * mix(n, fnv1a(name)).astype(np.float64) / 4294967296.0 - 1.0) * scale
    return torch.from_numpy(v.astype(np.float32).reshape(shape))


def synthetic_classes(name, shape, n):
    v = mix(int(np.prod(shape)), fnv1a(name)) % np.uint64(n)
    return torch.from_numpy(v.astype(np.int64).reshape(shape))


def synthetic_init(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if p.dim() >= 2:
                v = synthetic_uniform(name, shape, 1.0 / math.sqrt(p.numel() // p.size(0)))
            elif name.endswith("weight"):
                v = synthetic_uniform(name, shape, 0.1) + 1.0
            else:
                v = synthetic_uniform(name, shape, 0.02)
            p.copy_(v)


# ---- models (include/kiln/models, twins as in tests/parity) ----

# MLP, CNN and ResNet are the parity tests' twins of the zoo models (their defaults are the workloads'
# shapes); the GPT below is nanoGPT's model.py without dropout.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "parity"))
from models_twins import CNN, MLP, ResNet  # noqa: E402


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd, n_head, d_ff):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(n_embd, d_ff)
        self.mlp.c_proj = nn.Linear(d_ff, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256):
        super().__init__()
        self.vocab_size, self.n_layer, self.n_embd = vocab_size, n_layer, n_embd
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, 4 * n_embd) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT

    def forward(self, idx):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpt_train_flops(params, batch, seq, layers, d_model):
    """workloads.h: 6 N D plus attention, 12 L T^2 d per sequence (forward + backward)."""
    return 6.0 * params * batch * seq + 12.0 * layers * seq * seq * d_model * batch


# ---- workloads: step(want_loss) -> loss or None ----

AMP = None  # --amp bf16: torch.bfloat16


def autocast():
    return torch.autocast("cpu", dtype=AMP) if AMP is not None else contextlib.nullcontext()


class Classifier:
    def __init__(self, model, input_shape, make_opt):
        self.model = model
        synthetic_init(model)
        self.x = synthetic_uniform("input", input_shape, 1.0)
        self.y = synthetic_classes("target", (input_shape[0],), 10)
        self.opt = make_opt(model.parameters())
        self.flops = 0.0

    def step(self, want_loss):
        self.opt.zero_grad(set_to_none=True)
        with autocast():
            loss = F.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        return loss.item() if want_loss else None


class GptTrain:
    B, T = 16, 128

    def __init__(self):
        self.model = GPT()
        synthetic_init(self.model)
        v = self.model.vocab_size
        self.idx = synthetic_classes("input", (self.B, self.T), v)
        self.targets = synthetic_classes("target", (self.B, self.T), v)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1)
        n = sum(p.numel() for p in self.model.parameters())
        self.flops = gpt_train_flops(n, self.B, self.T, self.model.n_layer, self.model.n_embd)

    def step(self, want_loss):
        self.opt.zero_grad(set_to_none=True)
        with autocast():
            logits = self.model(self.idx)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), self.targets.view(-1))
        loss.backward()
        self.opt.step()
        return loss.item() if want_loss else None


class GptInfer:
    T = 128

    def __init__(self):
        self.model = GPT()
        synthetic_init(self.model)
        self.model.eval()
        v = self.model.vocab_size
        self.idx = synthetic_classes("input", (1, self.T), v)
        self.targets = synthetic_classes("target", (1, self.T), v)
        self.flops = 0.0

    def step(self, want_loss):
        with torch.no_grad(), autocast():
            logits = self.model(self.idx)
            if not want_loss:
                return None
            return F.cross_entropy(logits.view(-1, logits.size(-1)), self.targets.view(-1)).float().item()


def make_workload(name):
    if name == "tiny":
        return Classifier(MLP(32, (64, 64), 10), (8, 32), lambda p: torch.optim.SGD(p, lr=0.01))
    if name == "mlp":
        return Classifier(MLP(), (128, 784), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    if name == "cnn":
        return Classifier(CNN(), (64, 1, 28, 28), lambda p: torch.optim.Adam(p, lr=1e-3))
    if name == "resnet":
        return Classifier(ResNet(), (32, 3, 32, 32),
                          lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4))
    if name == "gpt":
        return GptTrain()
    if name == "gpt_infer":
        return GptInfer()
    raise SystemExit("workloads.py: unknown workload %r; expected tiny, mlp, cnn, resnet, gpt or gpt_infer" % name)


def run(name, threads, warmup, steps):
    w = make_workload(name)
    loss_first = w.step(True)
    for _ in range(warmup - 1):
        w.step(False)
    ms = []
    for _ in range(steps):
        t0 = time.perf_counter()
        w.step(False)
        ms.append((time.perf_counter() - t0) * 1e3)
    loss_last = w.step(True)
    params = sum(p.numel() for p in w.model.parameters())
    print(json.dumps({
        "framework": "torch", "workload": name, "amp": "bf16" if AMP is not None else "off", "threads": threads,
        "warmup": warmup, "steps": steps,
        "median_ms": statistics.median(ms), "loss_first": loss_first, "loss_last": loss_last, "params": params,
        "flops_per_step": w.flops, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "step_ms": [round(x, 6) for x in ms],
    }), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--amp", choices=["bf16", "off"], default="off")
    a = ap.parse_args()
    global AMP
    AMP = torch.bfloat16 if a.amp == "bf16" else None
    if a.warmup < 1 or a.steps < 1:
        ap.error("--warmup and --steps must be at least 1")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    for name in a.workload.split(","):
        run(name, torch.get_num_threads(), a.warmup, a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
