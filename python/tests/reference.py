"""A plain-PyTorch float64 Muon step (DESIGN.md section 1) on whole matrices: the oracle of
the Python tests, written without the library."""

import math

import torch

TABLES = {
    "simple": ([(3.4445, -4.7750, 2.0315)], True),
    "quintic": ([(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                 (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)], True),
    "polar_express": ([(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                       (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                       (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)], False),
    "cans": ([(8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
              (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)], False),
    "aol": ([(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
             (2.7215, -3.0494, 1.3169)], True),
}


def coefficients(schedule, steps, custom=None):
    if schedule == "custom":
        return [tuple(t) for t in custom]
    table, cycled = TABLES[schedule]
    return [table[k % len(table)] if cycled else table[min(k, len(table) - 1)] for k in range(steps)]


def newton_schulz(u, triples, eps):
    x = u / max(u.norm().item(), eps)
    for a, b, c in triples:
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x


def scale(mode, rows, cols):
    return {"spectral": math.sqrt(max(rows, cols)), "shape_scaling": math.sqrt(max(1.0, rows / cols)),
            "unit_rms_norm": math.sqrt(rows / cols), "none": 1.0}[mode]


def muon_step(w, g, m, *, lr, momentum=0.95, nesterov=True, weight_decay=0.01, mode="decoupled",
              schedule="quintic", steps=5, custom=None, scale_mode="spectral", extra=1.0, eps=1e-7):
    """One step on float64 whole matrices; returns the new (w, m)."""
    w, g, m = w.double(), g.double(), m.double()
    if mode == "l2":
        g = g + weight_decay * w
    m = momentum * m + (1 - momentum) * g
    u = (1 - momentum) * g + momentum * m if nesterov else m
    o = newton_schulz(u, coefficients(schedule, steps, custom), eps)
    decay = {"decoupled": 1 - lr * weight_decay, "independent": 1 - weight_decay}.get(mode, 1.0)
    w = w * decay - lr * extra * scale(scale_mode, *w.shape) * o
    return w, m


def muon_steps(w, grads, lrs, *, row_blocks=1, **options):
    """len(lrs) steps from zero momentum; returns the new w. Expert by expert for a 3D stack,
    block by block for a fused 2D weight of row_blocks stacked matrices."""
    if row_blocks > 1:
        rows, cols = w.shape
        blocks = [x.reshape(row_blocks, rows // row_blocks, cols) for x in [w] + list(grads)]
        return muon_steps(blocks[0], blocks[1:], lrs, **options).reshape(rows, cols)
    if w.ndim == 3:
        return torch.stack([muon_steps(w[e], [g[e] for g in grads], lrs, **options) for e in range(w.shape[0])])
    w, m = w.double(), torch.zeros(w.shape, dtype=torch.float64)
    for g, lr in zip(grads, lrs):
        w, m = muon_step(w, g, m, lr=lr, **options)
    return w


def relative_error(x, reference):
    return ((x.double() - reference.double()).norm() / reference.double().norm()).item()
