#!/usr/bin/python3
"""What PyTorch itself says for the gallery's scenarios that PyTorch can show in
one process (docs/diagnostics.md, "what PyTorch says"): each mistake made in a
few lines of torch, and the first line of the error or warning it raises, or
"nothing" when it raises none. Run with Debian's torch:

    /usr/bin/python3 scripts/pytorch_messages.py
"""
import warnings

import torch


def show(name, mistake):
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mistake()
        said = "; ".join(str(w.message).splitlines()[0] for w in caught) or "nothing"
    except Exception as e:  # the message is what we want to see
        said = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    print(f"{name}: {said}")


def inplace_on_saved_tensor():
    x = torch.randn(4, 3, requires_grad=True)
    y = torch.sigmoid(x)
    y.mul_(2)
    y.sum().backward()


def batchnorm_batch_of_one():
    torch.nn.BatchNorm1d(3)(torch.randn(1, 3))


def frozen_model():
    m = torch.nn.Linear(3, 1)
    for p in m.parameters():
        p.requires_grad_(False)
    m(torch.randn(2, 3)).sum().backward()


def scheduler_before_optimizer():
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    sched.step()
    opt.step()


def nan_from_log_zero():
    x = torch.zeros(3, requires_grad=True)
    torch.log(x).sum().backward()


def nan_from_division_by_zero():
    x = torch.zeros(3, requires_grad=True)
    (x / x).sum().backward()


def eval_without_eval_mode():
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.Dropout(0.3))
    with torch.no_grad():
        m(torch.randn(8, 3))


def detached_branch():
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    b(a(torch.randn(2, 3)).detach()).sum().backward()


if __name__ == "__main__":
    torch.set_num_threads(1)
    for f in (inplace_on_saved_tensor, batchnorm_batch_of_one, frozen_model, scheduler_before_optimizer,
              nan_from_log_zero, nan_from_division_by_zero, eval_without_eval_mode, detached_branch):
        show(f.__name__, f)
