"""shardmuon.torch.TorchMuon (Muon under torch.optim.Muon's arguments) on one process (CPU)
against the float64 reference step. Debian's PyTorch 1.13 has no torch.optim.Muon: the
comparison with it runs on the GPU machine (python/tests/gpu/check_torch_gpu.py)."""

import numpy
import pytest
import torch

import reference
import reuse
import shardmuon.torch as st

# torch.optim.Muon's group keys (PyTorch 2.9 to 2.11), besides "params".
TORCH_GROUP_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
                    "adjust_lr_fn")
SIMPLE = (3.4445, -4.775, 2.0315)


def matrices(shape, count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = 0.05 * torch.randn(*shape, generator=generator, dtype=torch.float64)
    return weight, [torch.randn(*shape, generator=generator, dtype=torch.float64) for _ in range(count)]


def reference_step(w, g, m, *, lr=1e-3, ns_coefficients=SIMPLE, ns_steps=5, adjust_lr_fn=None):
    """torch.optim.Muon's step (its defaults but for those given) by the float64 reference."""
    scale_mode, extra = ("spectral", 0.2) if adjust_lr_fn == "match_rms_adamw" else ("shape_scaling", 1.0)
    return reference.muon_step(w, g, m, lr=lr, momentum=0.95, nesterov=True, weight_decay=0.1,
                               schedule="custom", steps=ns_steps, custom=[ns_coefficients] * ns_steps,
                               scale_mode=scale_mode, extra=extra)


@pytest.mark.parametrize("shape", [(37, 53), (53, 37)])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("ns_coefficients,ns_steps", [(SIMPLE, 5), ((3.0, -3.2, 1.2), 3)])
def test_steps_match_torch_optim_muons_definition(shape, adjust_lr_fn, ns_coefficients, ns_steps):
    weight, grads = matrices(shape, 3)
    param = torch.nn.Parameter(weight.clone())
    optimizer = st.TorchMuon([param], lr=0.02, ns_coefficients=ns_coefficients, ns_steps=ns_steps,
                             adjust_lr_fn=adjust_lr_fn, ns_dtype=None)  # float64: exact to the reference
    w, m = weight, torch.zeros(shape, dtype=torch.float64)
    for g in grads:
        param.grad = g.clone()
        optimizer.step()
        w, m = reference_step(w, g, m, lr=0.02, ns_coefficients=ns_coefficients, ns_steps=ns_steps,
                              adjust_lr_fn=adjust_lr_fn)
    assert reference.relative_error(param.detach(), w) < 1e-11
    assert reference.relative_error(optimizer.state[param]["momentum_buffer"], m) < 1e-11


def test_defaults_are_torch_optim_muons_and_the_iteration_is_bf16():
    param = torch.nn.Parameter(torch.zeros(4, 6))
    optimizer = st.TorchMuon([param])
    group = optimizer.param_groups[0]
    assert {key: group[key] for key in TORCH_GROUP_KEYS} == {
        "lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "ns_coefficients": SIMPLE,
        "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None}
    assert group["ns_dtype"] is torch.bfloat16
    for key in st._TORCH_DERIVED:  # never held: derived from torch.optim.Muon's names at each step
        assert key not in group and key not in optimizer.defaults
    # float32 weights orthogonalized in bf16, as torch.optim.Muon does: further from the float64
    # step than a float32 iteration, which ns_dtype=None gives.
    weight, grads = matrices((37, 53), 2, seed=3)
    errors = {}
    for ns_dtype in (torch.bfloat16, None):
        param = torch.nn.Parameter(weight.float())
        optimizer = st.TorchMuon([param], lr=0.02, **({} if ns_dtype else {"ns_dtype": None}))
        w, m = weight, torch.zeros_like(weight)
        for g in grads:
            param.grad = g.float()
            optimizer.step()
            w, m = reference_step(w, g, m, lr=0.02)
        errors[ns_dtype] = reference.relative_error(param.detach() - weight.float(), w - weight)
    assert errors[None] < 1e-5 < 1e-3 < errors[torch.bfloat16] < 3e-2, errors


def test_group_values_under_torch_names_are_read_at_every_step():
    """Per-group values, and values changed between steps (the steps after the first reuse
    their arguments, but not the groups')."""
    weight, grads = matrices((29, 41), 4, seed=5)
    a, b = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(weight.t().contiguous())
    optimizer = st.TorchMuon([{"params": [a]}, {"params": [b], "ns_steps": 3, "adjust_lr_fn": "match_rms_adamw"}],
                             lr=0.02, ns_dtype=None)
    full_checks = reuse.count_full_checks(optimizer)
    changes = [{}, {"ns_steps": 4}, {"ns_coefficients": (3.0, -3.2, 1.2), "adjust_lr_fn": "original"}, {}]
    expected = [(weight, torch.zeros_like(weight)), (weight.t(), torch.zeros_like(weight.t()))]
    settings = [{}, {"ns_steps": 3, "adjust_lr_fn": "match_rms_adamw"}]
    for g, change in zip(grads, changes):
        optimizer.param_groups[0].update(change)
        settings[0].update(change)
        a.grad, b.grad = g.clone(), g.t().contiguous()
        optimizer.step()
        expected = [reference_step(w, grad, m, lr=0.02, **setting)
                    for (w, m), grad, setting in zip(expected, (g, g.t()), settings)]
    for param, (w, _) in zip((a, b), expected):
        assert reference.relative_error(param.detach(), w) < 1e-11
    assert len(full_checks) == 1, full_checks


def test_bad_values_and_muons_own_names_are_refused():
    param = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="TorchMuon: adjust_lr_fn must be None, 'original' or "
                                         "'match_rms_adamw', got 'spectral'"):
        st.TorchMuon([param], adjust_lr_fn="spectral")
    with pytest.raises(ValueError, match=r"TorchMuon: ns_coefficients must be three numbers .*got \(1.0, 2.0\)"):
        st.TorchMuon([param], ns_coefficients=(1.0, 2.0))
    with pytest.raises(TypeError, match="num_ns_steps, scale_mode come from ns_coefficients"):
        st.TorchMuon([param], scale_mode="spectral", num_ns_steps=3)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: coefficient_type come from"):
        st.TorchMuon([{"params": [param], "coefficient_type": "quintic"}])
    optimizer = st.TorchMuon([param], ns_steps=numpy.int64(4))  # an integer of numpy's is one too
    assert optimizer.param_groups[0]["ns_steps"] == 4
    with pytest.raises(ValueError, match=r"Muon param_groups\[1\]: ns_steps must be an int in \[1, 1000\], got 0"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.float64))],
                                   "ns_steps": 0})
    assert len(optimizer.param_groups) == 1
    param.grad = torch.ones_like(param)
    optimizer.step()
    before = param.detach().clone()
    optimizer.param_groups[0]["ns_steps"] = 2.5  # a bad value set between steps: the step says so
    with pytest.raises(ValueError, match=r"Muon param_groups\[0\]: ns_steps must be an int in \[1, 1000\], got 2.5"):
        optimizer.step()
    assert torch.equal(param.detach(), before)


def test_a_state_dict_of_torch_optim_muons_keys_loads_and_continues_exactly():
    """A state dict whose groups hold only torch.optim.Muon's keys (as it saves them) loads:
    the rest come from the optimizer's defaults, and the steps continue bitwise as if
    uninterrupted. One saved by Muon, whose groups name the iteration otherwise, is refused."""
    weight, grads = matrices((23, 31), 4, seed=7)
    whole = torch.nn.Parameter(weight.clone())
    uninterrupted = st.TorchMuon([whole], lr=0.02, ns_steps=4)
    param = torch.nn.Parameter(weight.clone())
    first = st.TorchMuon([param], lr=0.02, ns_steps=4)
    for g in grads[:2]:
        whole.grad, param.grad = g.clone(), g.clone()
        uninterrupted.step()
        first.step()
    saved = first.state_dict()
    saved["param_groups"] = [{key: group[key] for key in TORCH_GROUP_KEYS + ("params",)}
                             for group in saved["param_groups"]]
    resumed = torch.nn.Parameter(param.detach().clone())
    second = st.TorchMuon([resumed], lr=0.5)  # its own values are replaced by the loaded ones
    second.load_state_dict(saved)
    assert second.param_groups[0]["lr"] == 0.02 and second.param_groups[0]["ns_steps"] == 4
    for g in grads[2:]:
        whole.grad, resumed.grad = g.clone(), g.clone()
        uninterrupted.step()
        second.step()
    assert torch.equal(resumed.detach(), whole.detach())
    muons = st.Muon([torch.nn.Parameter(weight.clone())]).state_dict()
    with pytest.raises(ValueError, match=r"param_groups\[0\] has coefficient_type, custom_coefficients, "
                                         r"extra_scale_factor, num_ns_steps, scale_mode: it was saved by Muon"):
        second.load_state_dict(muons)
