# lr trajectories of torch 1.13's schedulers (tests/optim/test_schedulers.cpp
# runs the same in kiln). Two param groups (lr 0.1 and 0.05), optimizer.step()
# then scheduler.step(), get_last_lr() recorded after construction and after
# every step. One line per case: "name v v ..." (%.17g); OneCycleLR cases also
# record the cycled momentum (group 0) after each step on a "<name>_mom" line.
import math
import warnings

import torch
from torch.optim import lr_scheduler as L

torch.set_num_threads(1)
warnings.filterwarnings("ignore")  # SequentialLR's step(0) deprecation notice


def opt(kind="sgd"):
    a = torch.zeros(2, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    if kind == "adam":
        return torch.optim.Adam([{"params": [a]}, {"params": [b], "lr": 0.05}], lr=0.1)
    return torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.05}], lr=0.1, momentum=0.9)


def emit(name, vals):
    print(name, " ".join("%.17g" % v for v in vals))


def run(name, make, steps, kind="sgd", metrics=None):
    o = opt(kind)
    s = make(o)
    lrs = list(s.get_last_lr()) if hasattr(s, "get_last_lr") and metrics is None else [g["lr"] for g in o.param_groups]
    moms = []
    for i in range(steps):
        o.step()
        if metrics is None:
            s.step()
            lrs += s.get_last_lr()
        else:
            s.step(metrics(i))
            lrs += [g["lr"] for g in o.param_groups]
        g0 = o.param_groups[0]
        moms.append(g0["betas"][0] if "betas" in g0 else g0["momentum"])
    emit(name, lrs)
    if isinstance(s, L.OneCycleLR):
        emit(name + "_mom", moms)


def plateau_metric(i):
    return 1.0 - 0.02 * i if i < 15 else 0.7 + 0.001 * math.sin(i)


run("step", lambda o: L.StepLR(o, step_size=7, gamma=0.5), 60)
run("multistep", lambda o: L.MultiStepLR(o, milestones=[10, 25, 25, 40], gamma=0.3), 60)
run("exponential", lambda o: L.ExponentialLR(o, gamma=0.95), 60)
run("cosine", lambda o: L.CosineAnnealingLR(o, T_max=20, eta_min=0.001), 70)
run("linear", lambda o: L.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=15), 30)
run("lambda", lambda o: L.LambdaLR(o, lambda e: 0.97 ** e * (1 + (e % 5))), 50)
run("lambda_groups", lambda o: L.LambdaLR(o, [lambda e: 1 / (1 + e), lambda e: 0.9 ** e]), 50)
run("sequential", lambda o: L.SequentialLR(o, [L.LinearLR(o, start_factor=0.1, total_iters=10),
                                               L.CosineAnnealingLR(o, T_max=50, eta_min=1e-4)], milestones=[10]), 70)
run("sequential3", lambda o: L.SequentialLR(o, [L.ExponentialLR(o, gamma=0.9), L.StepLR(o, step_size=4, gamma=0.5),
                                                L.CosineAnnealingLR(o, T_max=10)], milestones=[8, 20]), 60)
run("onecycle", lambda o: L.OneCycleLR(o, max_lr=0.5, total_steps=80), 79)
run("onecycle_adam", lambda o: L.OneCycleLR(o, max_lr=0.01, total_steps=60, pct_start=0.25, anneal_strategy="linear",
                                            three_phase=True, base_momentum=0.8, max_momentum=0.9), 59, kind="adam")
run("plateau", lambda o: L.ReduceLROnPlateau(o, factor=0.5, patience=3, cooldown=2, min_lr=0.01, threshold=1e-3), 60,
    metrics=plateau_metric)
run("plateau_max_abs", lambda o: L.ReduceLROnPlateau(o, mode="max", factor=0.3, patience=2, threshold=0.05,
                                                     threshold_mode="abs"), 60, metrics=lambda i: plateau_metric(59 - i))
