"""PyTorch twins of kiln's transformer models (include/kiln/models/gpt.h,
vit.h) and the exchange used by tests/nn/test_models_gpt.cpp.

    models_twins_gpt.py IN OUT

The exchange is that of models_twins.py (whose safetensors reader and writer
this script imports): IN holds kiln's initial state_dict, "__input__" and
"__target__"; metadata "model" (gpt or vit) and "config" (JSON keyword
arguments). The twin loads the state dict with strict=True, then writes
eval_out, train_out, "loss", "grad.<name>" per parameter, "state.<name>" per
state_dict entry, and "torch_init.<name>" (a fresh twin's state_dict).
For gpt the input is idx [B, T] int64, the output logits [B, T, V] and the
loss cross_entropy(logits.view(-1, V), targets.view(-1)) (nanoGPT's); for vit
the input is images and the loss cross_entropy(logits, classes).

The GPT twin is nanoGPT's model.py (Karpathy) written out for torch 1.13:
attention by explicit softmax (no F.scaled_dot_product_attention), the causal
mask built per call (no "bias" buffer, so state_dict has parameters only),
lm_head.weight tied to transformer.wte.weight (torch's state_dict lists both
names, named_parameters the tensor once).
"""
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models_twins import read, write  # noqa: E402


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout, causal=True):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.causal = n_head, n_embd, causal

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if self.causal:
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
            att = att.masked_fill(~mask, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd, d_ff, dropout):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, d_ff)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(d_ff, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, d_ff, dropout, causal=True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, causal)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, d_ff, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256, d_ff=0, dropout=0.0):
        super().__init__()
        d_ff = d_ff or 4 * n_embd
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(n_embd, n_head, d_ff, dropout) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        b, t = idx.size()
        assert t <= self.block_size
        pos = torch.arange(0, t, dtype=torch.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class ViT(nn.Module):
    def __init__(self, image_size=28, patch_size=7, in_channels=1, num_classes=10, dim=64, depth=2, heads=4,
                 mlp_dim=128, dropout=0.0):
        super().__init__()
        n = (image_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 1, dim))
        nn.init.trunc_normal_(self.cls_token, std=0.02, a=-0.04, b=0.04)
        nn.init.trunc_normal_(self.pos_embed, std=0.02, a=-0.04, b=0.04)
        self.patch_embed = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        self.blocks = nn.ModuleList([Block(dim, heads, mlp_dim, dropout, causal=False) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        p = self.patch_embed(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls_token.expand(x.size(0), -1, -1), p], dim=1) + self.pos_embed
        for b in self.blocks:
            t = b(t)
        return self.head(self.norm(t)[:, 0])


MODELS = {"gpt": GPT, "vit": ViT}


def loss_of(kind, y, target):
    if kind == "gpt":
        return F.cross_entropy(y.view(-1, y.size(-1)), target.view(-1))
    return F.cross_entropy(y, target)


def train(model, kind, x, target, steps):
    """The gpt workload's loop (used for vit too) on one batch: AdamW(lr 3e-4, weight_decay 0.1) over
    named_parameters (the tied weight once), train mode; writes "losses" [steps]
    (the loss before each step) and "final.<name>" for the parameters after."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    model.train()
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(kind, model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out = {"losses": torch.tensor(losses, dtype=torch.float32)}
    for name, p in model.named_parameters():
        out["final." + name] = p
    write(sys.argv[2], out)
    print("OK")
    return 0


def main():
    torch.set_num_threads(1)
    t, meta = read(sys.argv[1])
    x = t.pop("__input__")
    target = t.pop("__target__")
    kind = meta["model"]
    model = MODELS[kind](**json.loads(meta["config"]))
    keys = list(model.state_dict().keys())
    if keys != list(t.keys()):
        print("state_dict keys differ:\n torch: %s\n kiln:  %s" % (keys, list(t.keys())))
        return 1
    model.load_state_dict(t, strict=True)
    if "steps" in meta:
        return train(model, kind, x, target, int(meta["steps"]))
    out = {}
    model.eval()
    with torch.no_grad():
        out["eval_out"] = model(x)
    model.train()
    y = model(x)
    loss = loss_of(kind, y, target)
    loss.backward()
    out["train_out"] = y
    out["loss"] = loss.reshape(1)
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad
    for name, v in model.state_dict().items():
        out["state." + name] = v
    torch.manual_seed(0)
    fresh = MODELS[kind](**json.loads(meta["config"]))
    for name, v in fresh.state_dict().items():
        out["torch_init." + name] = v
    write(sys.argv[2], out)
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
