# torch.nn.utils.clip_grad_norm_ on deterministic gradients (tests/optim/
# test_clip_grad.cpp builds the same): g_k[i] = scale_k * sin(0.37*i + k), for
# shapes (3,4), (4,), (2,2,2) with scales 1, 3, 0.5. One line per case:
# "name total_norm g0... g1... g2..." (%.17g).
import math

import torch

torch.set_num_threads(1)
SHAPES = [(3, 4), (4,), (2, 2, 2)]
SCALES = [1.0, 3.0, 0.5]


def case(name, max_norm, norm_type, dtype):
    ps = []
    for k, (shape, scale) in enumerate(zip(SHAPES, SCALES)):
        n = math.prod(shape)
        p = torch.zeros(shape, dtype=dtype, requires_grad=True)
        p.grad = torch.tensor([scale * math.sin(0.37 * i + k) for i in range(n)], dtype=torch.float64).to(dtype).reshape(shape)
        ps.append(p)
    total = torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type=norm_type)
    vals = [float(total)] + [v for p in ps for v in p.grad.reshape(-1).tolist()]
    print(name, " ".join("%.17g" % v for v in vals))


for dtype, tag in [(torch.float32, "f32"), (torch.float64, "f64")]:
    for norm_type, ntag in [(2.0, "l2"), (1.0, "l1"), (math.inf, "inf"), (3.0, "l3"), (0.5, "l05"), (0.0, "l0")]:
        case(f"{tag}_{ntag}_clip", 1.0, norm_type, dtype)
        case(f"{tag}_{ntag}_noclip", 100.0, norm_type, dtype)
