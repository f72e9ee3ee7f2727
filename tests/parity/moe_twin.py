# A PyTorch twin of parallel::MoE (tests/dist/test_moe.cpp builds the same
# layer with the same deterministic weights and inputs): Mixtral top-k gating
# (softmax over the k chosen logits), capacity C = ceil(cf * N * k / E) with
# first choices admitted before second ones (token order within a choice),
# dropped assignments contributing zero, and Switch's load-balancing loss over
# k choices, E * sum_e f_e * P_e. For each case, lines (%.17g):
#   <case>_aux, <case>_dropped, <case>_dropped_tokens, <case>_routed [E], <case>_kept [E],
#   <case>_y [N*d], <case>_gx [N*d], <case>_grouter [E*d]
# where the gradients are of sum(y * cos(0.17 i)) + aux.
import math

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
D, DFF, E, K, N = 8, 16, 4, 2, 12


def det(shape, a, b, scale, fn=math.sin):
    n = math.prod(shape)
    return torch.tensor([scale * fn(a * i + b) for i in range(n)], dtype=torch.float64).float().reshape(shape)


def weights(skew):
    router = det((E, D), 0.73, 1.0, 0.5)
    if skew:
        router[0] += 0.5
    experts = []
    for e in range(E):
        experts.append((det((DFF, D), 0.11, e, 0.2), det((DFF,), 0.05, e, 0.1, math.cos),
                        det((D, DFF), 0.07, 2 * e, 0.2), det((D,), 0.13, e, 0.1, math.cos)))
    return router, experts


def inputs(skew):
    x = det((N, D), 0.31, 0.5, 1.0)
    if skew:
        x = x + 1.0
    return x


def moe(x, router, experts, cf):
    logits = x @ router.t()
    top = torch.topk(logits, K, dim=1).indices  # no ties in these inputs
    gates = F.softmax(torch.gather(logits, 1, top), dim=1)
    cap = math.ceil(cf * N * K / E) if cf > 0 else None
    kept = [0] * E
    routed = [0] * E
    keep = torch.zeros(N, K, dtype=torch.bool)
    for j in range(K):
        for n in range(N):
            e = int(top[n, j])
            routed[e] += 1
            if cap is None or kept[e] < cap:
                kept[e] += 1
                keep[n, j] = True
    y = torch.zeros(N, D)
    for n in range(N):
        for j in range(K):
            if keep[n, j]:
                w1, b1, w2, b2 = experts[int(top[n, j])]
                hdn = F.gelu(x[n] @ w1.t() + b1, approximate="tanh")
                y[n] = y[n] + gates[n, j] * (hdn @ w2.t() + b2)
    f = torch.tensor(routed, dtype=torch.float32) / (N * K)
    P = F.softmax(logits, dim=1).mean(0)
    aux = E * (f * P).sum()
    dropped = N * K - int(keep.sum())
    dropped_tokens = int((~keep.any(1)).sum())
    return y, aux, dropped, dropped_tokens, routed, kept


def line(name, vals):
    print(name, " ".join("%.17g" % float(v) for v in vals))


for skew in (False, True):
    for cf, ctag in ((1.0, "cf1"), (100.0, "cf100")):
        name = ("skew_" if skew else "mixed_") + ctag
        router, experts = weights(skew)
        router.requires_grad_(True)
        x = inputs(skew).requires_grad_(True)
        y, aux, dropped, dropped_tokens, routed, kept = moe(x, router, experts, cf)
        w = torch.tensor([math.cos(0.17 * i) for i in range(N * D)], dtype=torch.float32).reshape(N, D)
        gx, gr = torch.autograd.grad((y * w).sum() + aux, (x, router))
        line(name + "_aux", [aux])
        line(name + "_dropped", [dropped])
        line(name + "_dropped_tokens", [dropped_tokens])
        line(name + "_routed", routed)
        line(name + "_kept", kept)
        line(name + "_y", y.detach().reshape(-1))
        line(name + "_gx", gx.reshape(-1))
        line(name + "_grouter", gr.reshape(-1))
