# Parameter trajectories of torch.optim's SGD, Adam, AdamW and RMSprop over 50
# steps on a deterministic quadratic (tests/optim/test_optimizers.cpp runs the
# same in kiln). Gradients: g = c * (p - target) + 0.1*sin(0.7*i + 1.3*step),
# every constant computed in double with math.sin/cos and cast to the dtype.
# Prints one line per config: "name w0 w1 ... b0 b1 ..." (final params, %.17g).
import math
import sys

import torch

torch.set_num_threads(1)
STEPS = 50


def consts(n, dtype, salt):
    c = torch.tensor([0.5 + 0.25 * (1 + math.cos(1.1 * i + salt)) for i in range(n)], dtype=torch.float64).to(dtype)
    t = torch.tensor([math.sin(0.3 * i + salt) for i in range(n)], dtype=torch.float64).to(dtype)
    p0 = torch.tensor([math.cos(0.9 * i + 2 * salt) for i in range(n)], dtype=torch.float64).to(dtype)
    return c, t, p0


def noise(n, step, dtype):
    return torch.tensor([0.1 * math.sin(0.7 * i + 1.3 * step) for i in range(n)], dtype=torch.float64).to(dtype)


def run(name, make, dtype=torch.float32):
    cw, tw, w0 = consts(12, dtype, 0.0)
    cb, tb, b0 = consts(4, dtype, 1.0)
    w = w0.clone().reshape(3, 4).requires_grad_(True)
    b = b0.clone().requires_grad_(True)
    opt = make(w, b)
    for s in range(STEPS):
        opt.zero_grad()
        with torch.no_grad():
            w.grad = (cw * (w.reshape(-1) - tw) + noise(12, s, dtype)).reshape(3, 4)
            b.grad = cb * (b - tb) + noise(4, s, dtype)
        opt.step()
    vals = w.detach().reshape(-1).tolist() + b.detach().tolist()
    print(name, " ".join("%.17g" % v for v in vals))


O = torch.optim
run("sgd", lambda w, b: O.SGD([w, b], lr=0.1))
run("sgd_momentum", lambda w, b: O.SGD([w, b], lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01))
run("sgd_nesterov", lambda w, b: O.SGD([w, b], lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01))
run("adam", lambda w, b: O.Adam([w, b], lr=0.01))
run("adam_l2_amsgrad", lambda w, b: O.Adam([w, b], lr=0.01, weight_decay=0.1, amsgrad=True))
run("adamw", lambda w, b: O.AdamW([w, b], lr=0.01, weight_decay=0.1))
run("adamw_amsgrad", lambda w, b: O.AdamW([w, b], lr=0.02, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=True))
run("rmsprop", lambda w, b: O.RMSprop([w, b], lr=0.01))
run("rmsprop_full", lambda w, b: O.RMSprop([w, b], lr=0.01, alpha=0.9, momentum=0.5, centered=True, weight_decay=0.01))
run("sgd_groups", lambda w, b: O.SGD([{"params": [w]}, {"params": [b], "lr": 0.01, "momentum": 0.9}], lr=0.1))
run("adamw_groups", lambda w, b: O.AdamW([{"params": [w]}, {"params": [b], "lr": 0.001, "weight_decay": 0.0}],
                                         lr=0.01, weight_decay=0.1))
run("adam_f64", lambda w, b: O.Adam([w, b], lr=0.01, weight_decay=0.1, amsgrad=True), torch.float64)
run("rmsprop_f64", lambda w, b: O.RMSprop([w, b], lr=0.01, momentum=0.5, centered=True), torch.float64)
run("sgd_f64", lambda w, b: O.SGD([w, b], lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), torch.float64)
sys.stdout.flush()
