"""PyTorch side of tests/nn/test_training_parity.cpp: trains a twin of a kiln
zoo model (the classes of models_twins.py) for some steps and reports what
kiln compares against.

    training_twins.py IN OUT

IN (safetensors, written by kiln) holds the model's initial state_dict, the
training data "__inputs__" ([steps * batch, ...]) with int64 labels
"__labels__", and "__eval_input__". Its metadata: "model" and "config" (as
models_twins.py), "steps", "batch", "optimizer" (JSON: {"name": "sgd" | "adam"
| "adamw" | "rmsprop", keyword arguments of the torch optimizer}) and
"scheduler" (JSON, may be null: {"name": "step" | "cosine" | "linear", keyword
arguments} or {"name": "sequential", "schedulers": [...], "milestones": [...]}).

Each step i: train mode, zero_grad, loss = cross_entropy(model(x_i), y_i),
backward, optimizer.step(), scheduler.step(), where x_i, y_i are rows
[i * batch, (i + 1) * batch) of the data. OUT (safetensors): "losses" [steps]
and "lrs" [steps] (float64; lrs[i] is the learning rate step i used),
"state.<name>" for every state_dict entry after training (BatchNorm running
statistics included) and "eval_out" = model(__eval_input__) in eval mode.
With metadata "reference64" = "1" the same run is repeated in float64 from
the same start and its final state is added as "state64.<name>" (and its
eval() output as "eval_out64"): the rounding
noise of float32 itself, for elements that a noise-level gradient decides
(Adam turns a gradient of 1e-9 into a step of lr times a ratio that the
gradient's last bits set). Prints OK or why not.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models_twins import MODELS, read, write  # noqa: E402

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
              "rmsprop": torch.optim.RMSprop}
SCHEDULERS = {"step": torch.optim.lr_scheduler.StepLR, "cosine": torch.optim.lr_scheduler.CosineAnnealingLR,
              "linear": torch.optim.lr_scheduler.LinearLR}


def make_scheduler(opt, spec):
    spec = dict(spec)
    name = spec.pop("name")
    if name == "sequential":
        children = [make_scheduler(opt, s) for s in spec["schedulers"]]
        return torch.optim.lr_scheduler.SequentialLR(opt, children, milestones=spec["milestones"])
    return SCHEDULERS[name](opt, **spec)


def main():
    torch.set_num_threads(1)
    t, meta = read(sys.argv[1])
    xs = t.pop("__inputs__")
    ys = t.pop("__labels__")
    eval_x = t.pop("__eval_input__")
    steps, batch = int(meta["steps"]), int(meta["batch"])
    if xs.shape[0] < steps * batch or ys.shape[0] < steps * batch:
        print("need %d samples, got %d inputs and %d labels" % (steps * batch, xs.shape[0], ys.shape[0]))
        return 1
    model = MODELS[meta["model"]](**json.loads(meta["config"]))
    keys = list(model.state_dict().keys())
    if keys != list(t.keys()):
        print("state_dict keys differ:\n torch: %s\n kiln:  %s" % (keys, list(t.keys())))
        return 1
    out = train(model, t, meta, xs, ys, eval_x, steps, batch, torch.float32)
    if meta.get("reference64") == "1":
        model64 = MODELS[meta["model"]](**json.loads(meta["config"]))
        ref = train(model64, t, meta, xs, ys, eval_x, steps, batch, torch.float64)
        for name in list(ref):
            if name.startswith("state."):
                out["state64." + name[len("state."):]] = ref[name]
        out["eval_out64"] = ref["eval_out"]
    write(sys.argv[2], out)
    print("OK")
    return 0


def train(model, t, meta, xs, ys, eval_x, steps, batch, dtype):
    model.load_state_dict(t, strict=True)
    model.to(dtype)
    xs = xs.to(dtype) if xs.is_floating_point() else xs
    eval_x = eval_x.to(dtype) if eval_x.is_floating_point() else eval_x
    ospec = json.loads(meta["optimizer"])
    oname = ospec.pop("name")
    opt = OPTIMIZERS[oname](model.parameters(), **ospec)
    sspec = json.loads(meta.get("scheduler", "null"))
    sched = make_scheduler(opt, sspec) if sspec else None
    losses, lrs = [], []
    model.train()
    for i in range(steps):
        x, y = xs[i * batch:(i + 1) * batch], ys[i * batch:(i + 1) * batch]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    out = {"losses": torch.tensor(losses, dtype=torch.float64), "lrs": torch.tensor(lrs, dtype=torch.float64)}
    for name, v in model.state_dict().items():
        out["state." + name] = v
    model.eval()
    with torch.no_grad():
        out["eval_out"] = model(eval_x)
    return out


if __name__ == "__main__":
    sys.exit(main())
