# torch.cuda.amp.GradScaler (torch 1.13) run on CPU over a scripted sequence of
# finite/non-finite gradients; tests/amp/test_grad_scaler.cpp runs the same script
# through amp::GradScaler and compares scale, growth tracker, skip decisions and
# parameters after every update().
#
# torch's GradScaler is the reference for the state machine (stages, unscale,
# the skip decision in _maybe_opt_step, update's bookkeeping). Two of its
# kernels exist for CUDA only in 1.13, so they are written out below from
# aten/src/ATen/native/cuda/AmpKernels.cu: _amp_foreach_non_finite_check_and_unscale_
# (grad *= inv_scale, found_inf = 1 if any grad value is non-finite) and
# _amp_update_scale_ (back off on inf; else grow after growth_interval clean
# steps, keeping the old scale if the grown one is not finite). The class
# refuses to enable itself without CUDA, so the enabled attributes are set by hand;
# scale() and the per-device replicator assert a CUDA tensor, so the
# replicator's assert is dropped and the script multiplies by get_scale() itself.
#
# Gradient of step k: "F" -> g[i] = (i + 1) * 0.25 * scale, "I" -> element 1 is
# +inf, "N" -> element 2 is NaN. A "u" suffix calls unscale_ before step.
# One line per case and step: "<case>_<k> scale growth_tracker stepped p0 p1 p2 p3".
from collections import defaultdict

import torch
import torch.cuda.amp.grad_scaler as gs

torch.set_num_threads(1)


def non_finite_check_and_unscale_(grads, found_inf, inv_scale):
    for g in grads:
        if not torch.isfinite(g).all():
            found_inf.fill_(1.0)
        g.mul_(inv_scale.item())


def update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    # The CUDA kernel computes in float32 with double factors promoted: scale * factor in double, stored as float.
    if found_inf.item():
        scale.fill_(float(torch.tensor(scale.item() * backoff_factor, dtype=torch.float32)))
        growth_tracker.fill_(0)
    else:
        successful = int(growth_tracker.item()) + 1
        if successful == growth_interval:
            new_scale = float(torch.tensor(scale.item() * growth_factor, dtype=torch.float32))
            if new_scale != float("inf"):
                scale.fill_(new_scale)
            growth_tracker.fill_(0)
        else:
            growth_tracker.fill_(successful)
    return scale


def replicator_init(self, master_tensor):  # the original only asserts the tensor is on CUDA
    self.master = master_tensor
    self._per_device_tensors = {}


torch._amp_foreach_non_finite_check_and_unscale_ = non_finite_check_and_unscale_
gs._MultiDeviceReplicator.__init__ = replicator_init
torch._amp_update_scale_ = update_scale_


def make_scaler(init_scale, growth_factor, backoff_factor, growth_interval):
    s = gs.GradScaler(enabled=False)
    s._enabled = True
    s._init_scale = init_scale
    s._scale = None
    s._growth_factor = growth_factor
    s._backoff_factor = backoff_factor
    s._growth_interval = growth_interval
    s._init_growth_tracker = 0
    s._growth_tracker = None
    s._per_optimizer_states = defaultdict(gs._refresh_per_optimizer_state)
    s._lazy_init_scale_growth_tracker(torch.device("cpu"))  # what scale() would do on its first call
    return s


CASES = {
    # name: (init_scale, growth_factor, backoff_factor, growth_interval, script)
    "basic": (65536.0, 2.0, 0.5, 3, "F F F Fu I F F F F Fu F N N F F F F Iu F F F F F F F"),
    "odd_factors": (1000.0, 3.0, 0.3, 2, "F F F I N I F Fu F F F F I F F"),
    "grow_to_inf": (2.0 ** 126, 2.0, 0.5, 1, "F F F I F F"),
    "collapse": (4.0, 2.0, 0.5, 4, "N N N N N N N N N N F F F F F"),
}

for name, (init, gf, bf, gi, script) in CASES.items():
    scaler = make_scaler(init, gf, bf, gi)
    p = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    for k, tok in enumerate(script.split()):
        scale = scaler.get_scale()
        g = torch.tensor([(i + 1) * 0.25 * scale for i in range(4)], dtype=torch.float32)
        if tok[0] == "I":
            g[1] = float("inf")
        elif tok[0] == "N":
            g[2] = float("nan")
        before = p.detach().clone()
        p.grad = g
        if tok.endswith("u"):
            scaler.unscale_(opt)
        scaler.step(opt)
        stepped = 0 if torch.equal(before, p.detach()) else 1
        scaler.update()
        vals = [scaler.get_scale(), scaler._get_growth_tracker(), stepped] + p.detach().tolist()
        print("%s_%d %s" % (name, k, " ".join("%.17g" % v for v in vals)))
