# torch's powerSGD_hook on one bucket, in one process (gloo, world size 1), for
# tests/dist/test_powersgd.cpp. The bucket holds four gradients (8x6, 8, 5x8,
# 5) whose values at step s are g_k[i] = scale_k * sin(0.37*i + k + 1.3*s);
# the first Q of each compressed matrix is q[i] = cos(0.11*i + k) (row-major
# [m, r]), put where torch's warm start looks for it, so the two sides start
# from the same Q. Per (rank, error feedback) case, two steps; one line per
# step: "name g..." with the bucket after the hook (%.17g).
import math
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

torch.set_num_threads(1)
SHAPES = [(8, 6), (8,), (5, 8), (5,)]
SCALES = [1.0, 0.5, 2.0, 0.25]


def grads(step):
    out = []
    for k, (shape, scale) in enumerate(zip(SHAPES, SCALES)):
        n = math.prod(shape)
        out.append(torch.tensor([scale * math.sin(0.37 * i + k + 1.3 * step) for i in range(n)],
                                dtype=torch.float64).float().reshape(shape))
    return out


class Bucket:
    """What powerSGD_hook reads of a dist.GradBucket."""

    def __init__(self, flat, shapes):
        self.flat = flat
        self.views, at = [], 0
        for s in shapes:
            n = math.prod(s)
            self.views.append(flat[at:at + n].view(s))
            at += n

    def buffer(self):
        return self.flat

    def index(self):
        return 0

    def gradients(self):
        return self.views

    def is_last(self):
        return True


def run(rank, feedback):
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                               min_compression_rate=0, use_error_feedback=feedback, warm_start=True)
    state.iter = 2  # past the plain steps
    ps, qs = 0, 0
    q0 = []
    for k, s in enumerate(SHAPES):
        n = s[0]
        m = math.prod(s) // n
        r = min(n, m, rank)
        ps += n * r
        qs += m * r
        q0 += [math.cos(0.11 * i + k) for i in range(m * r)]
    state.p_memory_dict[0] = torch.zeros(ps)
    state.q_memory_dict[0] = torch.tensor(q0, dtype=torch.float64).float()
    name = "r%d_%s" % (rank, "ef" if feedback else "noef")
    for step in range(2):
        flat = torch.cat([g.reshape(-1) for g in grads(step)])
        fut = psgd.powerSGD_hook(state, Bucket(flat, SHAPES))
        out = fut.wait()
        print("%s_step%d" % (name, step), " ".join("%.17g" % v for v in out.tolist()))


with tempfile.TemporaryDirectory() as d:
    dist.init_process_group("gloo", init_method="file://" + os.path.join(d, "store"), rank=0, world_size=1)
    for rank in (1, 2):
        for feedback in (True, False):
            run(rank, feedback)
    sys.stdout.flush()
    shutil.rmtree(d, ignore_errors=True)
    # gloo's threads can abort the interpreter's exit ("Resource deadlock
    # avoided"); the results are out, so leave at once.
    os._exit(0)
