"""shardmuon.torch.Muon on one process (CPU) against the float64 reference step."""

import copy
import ctypes
import gc
import io
import itertools
import re
import weakref

import pytest
import torch

import reference
import reuse
import shardmuon
import shardmuon.torch as st

TOLERANCE = {torch.float64: 1e-11, torch.float32: 2e-5, torch.bfloat16: 3e-2}
LEARNING_RATES = [0.02, 0.05, 0.01]


def run(dtype, shape, steps=3, seed=0, **options):
    """`steps` steps of Muon and of the reference with the learning rate changed every step;
    returns the relative errors of the weight and the momentum."""
    generator = torch.Generator().manual_seed(seed)
    w0 = (0.05 * torch.randn(*shape, generator=generator, dtype=torch.float64)).to(dtype)
    grads = [torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype) for _ in range(steps)]
    weight = torch.nn.Parameter(w0.clone())
    optimizer = st.Muon([weight], **{k: v for k, v in options.items() if k != "lr"}, lr=LEARNING_RATES[0])
    w_ref, m_ref = w0.double(), torch.zeros(*shape, dtype=torch.float64)
    ref_options = dict(momentum=options.get("momentum", 0.95), nesterov=options.get("nesterov", True),
                       weight_decay=options.get("weight_decay", 0.01),
                       mode=options.get("weight_decay_mode") or
                       ("l2" if options.get("use_decoupled_weight_decay") is False else "decoupled"),
                       schedule=options.get("coefficient_type", "quintic"),
                       steps=options.get("num_ns_steps", 5), custom=options.get("custom_coefficients"),
                       scale_mode=options.get("scale_mode", "spectral"),
                       extra=options.get("extra_scale_factor", 1.0), eps=options.get("eps", 1e-7))
    for step in range(steps):
        lr = LEARNING_RATES[step % 3]
        optimizer.param_groups[0]["lr"] = lr
        weight.grad = grads[step].clone()
        optimizer.step()
        w_ref, m_ref = reference.muon_step(w_ref, grads[step], m_ref, lr=lr, **ref_options)
    momentum = optimizer.state[weight]["momentum_buffer"]
    return reference.relative_error(weight.detach(), w_ref), reference.relative_error(momentum, m_ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,nesterov,scale_mode", list(itertools.product(
    ["decoupled", "l2", "independent", "none"], [True, False], ["spectral", "shape_scaling", "unit_rms_norm", "none"])))
def test_every_mode_matches_the_reference(dtype, mode, nesterov, scale_mode):
    shape = (37, 53) if nesterov else (53, 37)
    w_error, m_error = run(dtype, shape, weight_decay=0.1, weight_decay_mode=mode, nesterov=nesterov,
                           scale_mode=scale_mode, momentum=0.9)
    assert w_error < TOLERANCE[dtype]
    assert m_error < TOLERANCE[dtype]


@pytest.mark.parametrize("schedule,steps", [("simple", 5), ("polar_express", 8), ("cans", 5), ("aol", 4)])
def test_schedules(schedule, steps):
    w_error, _ = run(torch.float64, (29, 41), coefficient_type=schedule, num_ns_steps=steps)
    assert w_error < 1e-11


@pytest.mark.parametrize("dtype,ns_dtype", [(torch.float32, torch.bfloat16), (torch.float32, "bfloat16"),
                                            (torch.float64, torch.bfloat16), (torch.bfloat16, torch.float32),
                                            (torch.float32, torch.float32)])
def test_updates_orthogonalized_in_another_dtype(dtype, ns_dtype):
    """ns_dtype rounds only the update for the iteration: the momentum keeps its own dtype's
    accuracy, the weights that of the coarser dtype. A bf16 iteration must show in float32 or
    float64 weights (further from the float64 step than a float32 iteration would leave them)."""
    w_error, m_error = run(dtype, (37, 53), ns_dtype=ns_dtype)
    ns_dtype = {"bfloat16": torch.bfloat16}.get(ns_dtype, ns_dtype)
    coarser = torch.bfloat16 if torch.bfloat16 in (dtype, ns_dtype) else dtype
    assert m_error < TOLERANCE[dtype]
    assert w_error < TOLERANCE[coarser]
    if coarser == torch.bfloat16 and dtype != torch.bfloat16:
        assert w_error > 10 * TOLERANCE[torch.float32]


def test_ns_dtype_is_checked_and_kept_in_the_state_dict():
    weight = torch.nn.Parameter(torch.randn(6, 4))
    for bad in [torch.float16, "fp8", 3]:
        with pytest.raises(ValueError, match=r"Muon: ns_dtype must be None .*, got"):
            st.Muon([weight], ns_dtype=bad)
    optimizer = st.Muon([weight], lr=0.02, ns_dtype=torch.bfloat16)
    weight.grad = torch.randn(6, 4)
    optimizer.param_groups[0]["ns_dtype"] = torch.float16
    before = weight.detach().clone()
    with pytest.raises(ValueError, match=r"Muon param_groups\[0\]: ns_dtype must be"):
        optimizer.step()
    assert torch.equal(weight.detach(), before)
    optimizer.param_groups[0]["ns_dtype"] = torch.bfloat16
    optimizer.step()
    saved = optimizer.state_dict()
    assert saved["param_groups"][0]["ns_dtype"] == torch.bfloat16
    # A state dict from before the option (no ns_dtype in its groups) loads and steps as the
    # parameter's dtype.
    del saved["param_groups"][0]["ns_dtype"]
    twin_weight = torch.nn.Parameter(weight.detach().clone())
    twin = st.Muon([twin_weight], lr=0.02)
    twin.load_state_dict(copy.deepcopy(saved))
    reference_weight = torch.nn.Parameter(weight.detach().clone())
    reference_optimizer = st.Muon([reference_weight], lr=0.02)
    reference_optimizer.load_state_dict(copy.deepcopy(saved))
    reference_optimizer.param_groups[0]["ns_dtype"] = None
    for p in (twin_weight, reference_weight):
        p.grad = weight.grad.clone()
    twin.step()
    reference_optimizer.step()
    assert torch.equal(twin_weight.detach(), reference_weight.detach())


def test_custom_coefficients_and_te_style_l2():
    custom = [(3.0, -3.2, 1.1), (2.5, -2.8, 1.0), (1.875, -1.25, 0.375)]
    w_error, _ = run(torch.float64, (23, 31), coefficient_type="custom", num_ns_steps=3,
                     custom_coefficients=custom, use_decoupled_weight_decay=False, weight_decay=0.05)
    assert w_error < 1e-11


def test_defaults_are_transformer_engines():
    weight = torch.nn.Parameter(torch.randn(4, 6))
    group = st.Muon([weight]).param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]) == (3e-4, 0.95, True, 0.01)
    assert (group["coefficient_type"], group["num_ns_steps"], group["scale_mode"]) == ("quintic", 5, "spectral")
    assert (group["extra_scale_factor"], group["eps"]) == (1.0, 1e-7)


def make_model_and_grads(seed=1):
    generator = torch.Generator().manual_seed(seed)
    a = torch.nn.Parameter(torch.randn(12, 20, generator=generator))
    b = torch.nn.Parameter(torch.randn(30, 8, generator=generator, dtype=torch.float64))
    grads = [(torch.randn(12, 20, generator=generator), torch.randn(30, 8, generator=generator, dtype=torch.float64))
             for _ in range(4)]
    return a, b, grads


def test_state_dict_round_trip_continues_exactly():
    a, b, grads = make_model_and_grads()
    optimizer = st.Muon([{"params": [a]}, {"params": [b], "lr": 0.01, "momentum": 0.8}], lr=0.02)
    for step in range(2):
        a.grad, b.grad = grads[step]
        optimizer.step()
    # As if from a file: PyTorch 2.x's load_state_dict keeps the tensors it is given.
    saved = copy.deepcopy(optimizer.state_dict())
    a2, b2 = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())
    resumed = st.Muon([{"params": [a2]}, {"params": [b2]}], lr=0.5)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[1]["lr"] == 0.01 and resumed.param_groups[1]["momentum"] == 0.8
    for step in range(2, 4):
        a.grad, b.grad = grads[step]
        a2.grad, b2.grad = grads[step]
        optimizer.step()
        resumed.step()
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert torch.equal(optimizer.state[a]["momentum_buffer"], resumed.state[a2]["momentum_buffer"])


def test_a_loaded_momentum_of_another_shape_is_refused_before_the_step():
    """The library writes the momentum through its pointer: a state saved for another shape
    (another model, another shard) must fail with the parameter's name, touching nothing."""
    weight = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    weight.grad = torch.randn(6, 4, dtype=torch.float64)
    optimizer = st.Muon([("layer.weight", weight)], lr=0.02)
    optimizer.step()
    saved = optimizer.state_dict()
    saved["state"][0]["momentum_buffer"] = torch.zeros(3, 4, dtype=torch.float64)
    optimizer.load_state_dict(saved)
    before = weight.detach().clone()
    with pytest.raises(ValueError, match=r"layer\.weight.*momentum_buffer must be a contiguous "
                                         r"\(6, 4\) torch\.float64 tensor.*got \(3, 4\)"):
        optimizer.step()
    assert torch.equal(weight.detach(), before)
    assert optimizer.state[weight]["momentum_buffer"].shape == (3, 4)


# Changes a user may make between steps, each applied alike to two optimizers (see the test).
def _swap_in_new_data(opt, a, b, c):
    a.data = a.data.clone()  # new storage at another address


def _replace_a_momentum(opt, a, b, c):
    opt.state[a]["momentum_buffer"] = opt.state[a]["momentum_buffer"].clone() * 0.5


def _reload_the_state(opt, a, b, c):
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _add_a_parameter(opt, a, b, c):
    opt.param_groups[1]["params"].append(c)
    c.grad = torch.ones_like(c)


def _drop_b_gradient(opt, a, b, c):
    b.grad = None


def _transpose_b_in_place(opt, a, b, c):  # same address and shape, no longer contiguous
    b.data = b.data.t()


def _noncontiguous_gradient(opt, a, b, c):
    a.grad = torch.ones(a.shape[1], a.shape[0], dtype=a.dtype).t()


def _sparse_gradient(opt, a, b, c):
    a.grad = a.grad.to_sparse()


def _momentum_view_of_another_shape(opt, a, b, c):  # same address, the shape of a.T
    opt.state[a]["momentum_buffer"] = opt.state[a]["momentum_buffer"].view(a.shape[1], a.shape[0])


def _momentum_view_of_its_shape(opt, a, b, c):
    opt.state[a]["momentum_buffer"] = opt.state[a]["momentum_buffer"].view(a.shape)


def _transpose_a_in_place(opt, a, b, c):  # same address, contiguous, the shape of a.T
    a.data = a.data.view(a.shape[1], a.shape[0])


def _transpose_a_gradient_in_place(opt, a, b, c):
    a.grad.data = a.grad.data.view(a.shape[1], a.shape[0])


def _a_as_float16(opt, a, b, c):  # same address and shape
    a.data = a.data.view(torch.float16)


def _a_as_bfloat16(opt, a, b, c):
    a.data = a.data.view(torch.bfloat16)


def _a_gradient_as_float16(opt, a, b, c):
    a.grad.data = a.grad.data.view(torch.float16)


def _move_a_momentum(opt, a, b, c):  # the same tensor, its storage elsewhere
    buffer = opt.state[a]["momentum_buffer"]
    buffer.data = buffer.data.clone()


def _bad_partition_dim(opt, a, b, c):
    a.partition_dim = 7


def _good_partition_dim(opt, a, b, c):
    a.partition_dim = -1


def _new_learning_rate(opt, a, b, c):
    opt.param_groups[0]["lr"] = 0.05


def _negative_learning_rate(opt, a, b, c):
    opt.param_groups[0]["lr"] = -1.0


# (change, whether the step may reuse the last one's arguments, the error it must raise, and
# what undoes the change after it): see reuse.check_reuse.
_CHANGES = [
    (None, False, None, None),  # the first step
    (None, True, None, None),
    (reuse.gradients_in_place, True, None, None),
    (_new_learning_rate, True, None, None),
    (_swap_in_new_data, False, None, None),
    (_replace_a_momentum, False, None, None),
    (_move_a_momentum, False, None, None),
    (_drop_b_gradient, False, None, None),
    (None, False, None, None),  # b has its gradient again
    (_reload_the_state, False, None, None),
    (None, True, None, None),
    (_transpose_b_in_place, False, (ValueError, "is not contiguous"), _transpose_b_in_place),
    (None, False, None, None),
    (_transpose_a_in_place, False, (ValueError, "its gradient has shape"), _transpose_a_in_place),
    (None, False, None, None),
    (_transpose_a_gradient_in_place, False, (ValueError, "its gradient has shape"), None),
    (None, False, None, None),
    (_a_as_float16, False, (TypeError, "takes float32 or bfloat16 parameters"), _a_as_bfloat16),
    (None, False, None, None),
    (_a_gradient_as_float16, False, (TypeError, "its gradient is torch.float16"), None),
    (None, False, None, None),
    (_noncontiguous_gradient, False, (ValueError, "gradient is not a contiguous dense tensor"), None),
    (None, False, None, None),
    (_sparse_gradient, False, (ValueError, "gradient is not a contiguous dense tensor"), None),
    (None, False, None, None),
    (_bad_partition_dim, False, (ValueError, "partition_dim must be 0, 1, -1"), _good_partition_dim),
    (None, False, None, None),
    (_momentum_view_of_another_shape, False, (ValueError, "momentum_buffer must be a contiguous"),
     _momentum_view_of_its_shape),
    (None, False, None, None),
    (_negative_learning_rate, False, (ValueError, "invalid learning rate: -1"), _new_learning_rate),
    (None, False, None, None),
    (_add_a_parameter, False, None, None),
    (None, True, None, None),
]


def test_a_step_reuses_the_last_steps_arguments_only_while_they_still_hold():
    """A step of the same parameters reuses the C arrays the last step built (see
    shardmuon.torch._StepCache); each change above must be seen (see reuse.check_reuse)."""
    generator = torch.Generator().manual_seed(11)
    shapes = [(6, 4), (5, 5), (3, 7)]
    start = [torch.randn(*shape, generator=generator).bfloat16() for shape in shapes]
    gradients = [[torch.randn(*shape, generator=generator).bfloat16() for shape in shapes] for _ in _CHANGES]

    def set_gradient(p, index, step, in_place):
        if in_place:
            p.grad.copy_(gradients[step][index])
        else:
            p.grad = gradients[step][index].clone()

    reuse.check_reuse(_CHANGES, lambda: [torch.nn.Parameter(w.clone()) for w in start], set_gradient,
                      torch.Tensor.detach)


def test_ns_batch_bytes_sizes_the_batches_and_is_checked():
    """Same-shaped matrices run as strided batches within ns_batch_bytes of workspace: with
    none, one at a time, the workspace smaller and the results the same."""
    generator = torch.Generator().manual_seed(12)
    start = [torch.randn(24, 16, generator=generator) for _ in range(6)]
    gradients = [[torch.randn(24, 16, generator=generator) for _ in range(6)] for _ in range(2)]
    workspace, weights = {}, {}
    for budget in (0, 256 << 20):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        optimizer = st.Muon(params, lr=0.02, ns_batch_bytes=budget)
        for step in range(2):
            for p, g in zip(params, gradients[step]):
                p.grad = g.clone()
            optimizer.step()
        context, _ = optimizer._runtimes.get(torch.device("cpu"), optimizer.process_group)
        held = ctypes.c_size_t()
        shardmuon._capi.check(shardmuon._capi.lib.shardmuon_context_workspace_bytes(context.handle,
                                                                                    ctypes.byref(held)))
        workspace[budget], weights[budget] = held.value, [p.detach() for p in params]
    assert workspace[0] < workspace[256 << 20]
    for one, batched in zip(weights[0], weights[256 << 20]):
        assert reference.relative_error(one, batched) < 1e-6
    for bad in (-1, 1.5, True, "1GiB"):
        with pytest.raises(ValueError, match="ns_batch_bytes must be a non-negative int"):
            st.Muon(start, ns_batch_bytes=bad)


def test_lr_scheduler_drives_the_learning_rate():
    a, _, grads = make_model_and_grads()
    manual = torch.nn.Parameter(a.detach().clone())
    optimizer = st.Muon([a], lr=0.04)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    reference_optimizer = st.Muon([manual], lr=0.04)
    for step in range(3):
        a.grad = grads[step][0]
        manual.grad = grads[step][0]
        optimizer.step()
        scheduler.step()
        reference_optimizer.step()
        reference_optimizer.param_groups[0]["lr"] = 0.04 * 0.5 ** (step + 1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.04 / 8)
    assert torch.equal(a, manual)


@pytest.mark.parametrize("mode", ["decoupled", "independent", "l2", "none"])
def test_a_tensor_learning_rate_is_read_when_the_step_runs(mode):
    """A float32 tensor lr (what a step captured with torch.cuda.graph needs: the kernels read
    it when they run), filled in place every step, against the same rates given as floats."""
    a, _, grads = make_model_and_grads()
    as_float = torch.nn.Parameter(a.detach().clone())
    rate = torch.tensor(0.04, dtype=torch.float32)
    optimizer = st.Muon([a], lr=rate, weight_decay=0.1, weight_decay_mode=mode)
    reference_optimizer = st.Muon([as_float], lr=0.04, weight_decay=0.1, weight_decay_mode=mode)
    for step in range(3):
        value = 0.04 * 0.5 ** step
        rate.fill_(value)
        reference_optimizer.param_groups[0]["lr"] = float(rate)  # the same float32 value
        a.grad = grads[step][0]
        as_float.grad = grads[step][0]
        optimizer.step()
        reference_optimizer.step()
    assert optimizer.param_groups[0]["lr"] is rate
    # The device path computes the decay in float32 from the float32 rate; the host path in
    # float64: a few float32 roundings apart.
    assert reference.relative_error(a.detach(), as_float.detach()) < 1e-6
    assert not torch.equal(a, grads[0][0])  # it did step


def test_a_tensor_learning_rate_must_be_one_float32_value():
    a, _, grads = make_model_and_grads()
    optimizer = st.Muon([a], lr=torch.tensor(0.02, dtype=torch.float64))
    a.grad = grads[0][0]
    with pytest.raises(ValueError, match="a tensor lr must be one float32 value"):
        optimizer.step()


def test_closure_runs_with_grad_enabled_and_its_loss_is_returned():
    weight = torch.nn.Parameter(torch.randn(8, 5))
    optimizer = st.Muon([weight], lr=0.02)

    def closure():
        assert torch.is_grad_enabled()
        optimizer.zero_grad()
        loss = (weight ** 2).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = optimizer.step(closure)
    assert loss.item() > 0 and "momentum_buffer" in optimizer.state[weight]


def test_parameters_without_grad_are_skipped():
    a, b, grads = make_model_and_grads()
    optimizer = st.Muon([a, b], lr=0.02)
    a.grad = grads[0][0]
    before = b.detach().clone()
    optimizer.step()
    assert torch.equal(b, before) and "momentum_buffer" not in optimizer.state[b]
    optimizer.zero_grad(set_to_none=True)
    optimizer.step()  # no gradients at all: a no-op


def test_bad_inputs_name_the_parameter():
    bias = torch.nn.Parameter(torch.randn(7))
    bias.grad = torch.randn(7)
    with pytest.raises(ValueError, match=r"layer\.bias \(shape \(7,\), torch\.float32, cpu\): .*2D parameters"):
        st.Muon([("layer.bias", bias)])  # at construction, as torch.optim.Muon refuses it
    weight = torch.nn.Parameter(torch.randn(6, 4))
    optimizer = st.Muon([weight])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] \(shape \(7,\).*2D parameters"):
        optimizer.add_param_group({"params": [bias]})
    assert len(optimizer.param_groups) == 1
    conv = torch.nn.Parameter(torch.randn(3, 2, 2, 2))
    with pytest.raises(ValueError, match=r"shape \(3, 2, 2, 2\).*2D parameters"):
        st.TorchMuon([conv])
    with pytest.raises(ValueError, match="2D parameters"):
        st.MuonWithAdamW([{"params": [bias], "use_muon": True}])
    st.MuonWithAdamW([{"params": [weight], "use_muon": True}, {"params": [bias, conv], "use_muon": False}])
    weight.data = torch.randn(24)  # its .data replaced after construction: refused at the step
    weight.grad = torch.randn(24)
    with pytest.raises(ValueError, match="2D parameters"):
        optimizer.step()

    # A gradient of another dtype than its parameter: PyTorch refuses the assignment itself
    # (1.13: "different type"; 2.11: "grad_dtype"), unless the tensor allows gradients of any
    # dtype (grad_dtype = None, PyTorch 2.10 and later): then Muon refuses it.
    weight = torch.nn.Parameter(torch.randn(6, 4))
    with pytest.raises(RuntimeError, match="different type|grad_dtype"):
        weight.grad = torch.randn(6, 4, dtype=torch.float64)
    if hasattr(weight, "grad_dtype"):
        weight.grad_dtype = None
        weight.grad = torch.randn(6, 4, dtype=torch.float64)
        with pytest.raises(TypeError, match=r"its gradient is torch\.float64, the parameter torch\.float32"):
            st.Muon([weight]).step()
        weight.grad = None

    strided = torch.nn.Parameter(torch.randn(4, 6).t())
    strided.grad = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(6, 4\), "
                                         r"torch\.float32, cpu\): the parameter is not contiguous"):
        st.Muon([strided]).step()

    half = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float16))
    half.grad = torch.randn(4, 4, dtype=torch.float16)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        st.Muon([half]).step()

    with pytest.raises(ValueError, match="coefficient_type"):
        st.Muon([weight], coefficient_type="quintc")
    with pytest.raises(ValueError, match="custom_coefficients"):
        st.Muon([weight], coefficient_type="custom", num_ns_steps=3, custom_coefficients=[(1, 2, 3)])
    with pytest.raises(ValueError, match="learning rate"):
        st.Muon([weight], lr=-1.0)
    with pytest.raises(ValueError, match="contradicts"):
        st.Muon([weight], use_decoupled_weight_decay=True, weight_decay_mode="l2")
    for budget in [-1, 1.5, True, "1GiB"]:
        with pytest.raises(ValueError, match=f"redistribution_bytes must be a non-negative int, got {budget!r}"):
            st.Muon([weight], redistribution_bytes=budget)

    # Flat (ZeRO-style) shards: a 1D tensor with the matrix's shape beside it.
    flat = torch.nn.Parameter(torch.randn(24))
    flat.grad = torch.randn(24)
    flat.partition_dim = "flat"
    with pytest.raises(ValueError, match=r"layer\.flat.*muon_shape = \(rows, cols\)"):
        st.Muon([("layer.flat", flat)]).step()
    flat.muon_shape = (5, 5)  # one rank holds the whole matrix: 25 elements, not 24
    with pytest.raises(ValueError, match="holds 24 elements, not the 5 x 5 of its muon_shape"):
        st.Muon([flat]).step()
    with pytest.raises(ValueError, match="partition_dim must be 0, 1, -1 \\(replicated\\) or \"flat\""):
        st.Muon([weight], partition_dim="rows")


def test_library_errors_arrive_as_exceptions_with_the_message():
    weight = torch.nn.Parameter(torch.randn(5, 7))
    weight.grad = torch.randn(5, 7)
    # A combination only the library checks (the front end checks eps, lr and the others).
    optimizer = st.Muon([weight], coefficient_type="cans", algorithm="gram_applied_twice")
    with pytest.raises(shardmuon.ShardmuonError, match=r"groups\[0\]\.ns\.algorithm GRAM_APPLIED_TWICE does "
                                                       r"not take groups\[0\]\.ns\.schedule CANS"):
        optimizer.step()
    assert "momentum_buffer" in optimizer.state[weight]
    assert torch.count_nonzero(optimizer.state[weight]["momentum_buffer"]) == 0  # untouched


def test_muon_with_adamw_matches_torch_adamw_for_the_other_parameters():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 16), torch.nn.Linear(16, 24), torch.nn.LayerNorm(24))
    twin = torch.nn.Sequential(torch.nn.Embedding(10, 16), torch.nn.Linear(16, 24), torch.nn.LayerNorm(24))
    twin.load_state_dict(model.state_dict())
    groups = st.muon_param_groups(model, muon_lr=0.02, adamw_lr=1e-3, adamw_weight_decay=0.1)
    assert [n for n, _ in groups[0]["params"]] == ["1.weight"]
    # Expert stacks and flat shards of matrices are Muon's too; 1D tensors otherwise AdamW's.
    experts = torch.nn.Module()
    experts.w = torch.nn.Parameter(torch.randn(4, 8, 6))
    experts.flat = torch.nn.Parameter(torch.randn(20))
    experts.flat.partition_dim, experts.flat.muon_shape = "flat", (4, 10)
    experts.bias = torch.nn.Parameter(torch.randn(6))
    expert_groups = st.muon_param_groups(experts, muon_lr=0.02, adamw_lr=1e-3)
    assert [n for n, _ in expert_groups[0]["params"]] == ["w", "flat"]
    assert len(expert_groups[1]["params"]) == 1
    optimizer = st.MuonWithAdamW(groups, adamw_betas=(0.9, 0.95))
    adam_params = [p for n, p in twin.named_parameters() if n != "1.weight"]
    adam = torch.optim.AdamW(adam_params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    twin_muon = st.Muon([twin[1].weight], lr=0.02)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(3):
        tokens = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(step))
        for net in (model, twin):
            net.zero_grad()
            net(tokens).pow(2).mean().backward()
        optimizer.step()
        adam.step()
        twin_muon.step()
        scheduler.step()
        for group in adam.param_groups:
            group["lr"] = 1e-3 * 0.5 ** (step + 1)
        twin_muon.param_groups[0]["lr"] = 0.02 * 0.5 ** (step + 1)
    for (name, ours), theirs in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(ours, theirs), name
    saved = optimizer.state_dict()
    assert len(saved["state"]) == 5  # Muon's momentum and AdamW's moments, in one state dict
    optimizer.load_state_dict(saved)
    optimizer.step()


def test_muon_with_adamw_without_adamw_groups_and_one_added_later():
    torch.manual_seed(6)
    weight, bias = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(6))
    optimizer = st.MuonWithAdamW([{"params": [weight], "use_muon": True}], lr=0.02)
    weight.grad = torch.randn(6, 4)
    optimizer.step()
    optimizer.add_param_group({"params": [bias], "use_muon": False, "lr": 1e-3})
    twin = torch.nn.Parameter(bias.detach().clone())
    adamw = torch.optim.AdamW([twin], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for _ in range(2):
        weight.grad, bias.grad = torch.randn(6, 4), torch.randn(6)
        twin.grad = bias.grad.clone()
        optimizer.step()
        adamw.step()
    assert torch.equal(bias.detach(), twin.detach())


def test_copies_and_pickles_are_refused_with_the_way_to_save():
    weight = torch.nn.Parameter(torch.randn(6, 4))
    for optimizer in (st.Muon([weight]), st.MuonWithAdamW([{"params": [weight], "use_muon": True}])):
        with pytest.raises(TypeError, match=r"cannot be copied or pickled.*state_dict\(\)"):
            copy.deepcopy(optimizer)
        with pytest.raises(TypeError, match="cannot be copied or pickled"):
            torch.save(optimizer, io.BytesIO())


def test_a_sparse_adamw_gradient_is_refused_before_anything_steps():
    torch.manual_seed(7)
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    weight = torch.nn.Parameter(torch.randn(6, 4))
    optimizer = st.MuonWithAdamW([{"params": [weight], "use_muon": True},
                                  {"params": list(embedding.parameters()), "use_muon": False}], lr=0.02)
    embedding(torch.tensor([1, 2])).sum().backward()
    weight.grad = torch.randn(6, 4)
    before = weight.detach().clone()
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\].*sparse gradient"):
        optimizer.step()
    assert torch.equal(weight.detach(), before) and "momentum_buffer" not in optimizer.state[weight]


def test_groups_added_or_changed_later_are_checked():
    torch.manual_seed(4)
    weight, other = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(5, 3))
    optimizer = st.Muon([weight], lr=0.02)
    with pytest.raises(ValueError, match=r"Muon param_groups\[1\]: invalid learning rate: -1"):
        optimizer.add_param_group({"params": [other], "lr": -1.0})
    # A group's weight decay settings that contradict each other (one of them inherited).
    l2 = st.Muon([torch.nn.Parameter(torch.randn(4, 6))], weight_decay_mode="l2")
    with pytest.raises(ValueError, match=r"param_groups\[1\]: use_decoupled_weight_decay=True contradicts"):
        l2.add_param_group({"params": [other], "use_decoupled_weight_decay": True})
    # Custom coefficients that are not (a, b, c) triples.
    with pytest.raises(ValueError, match="needs custom_coefficients with one"):
        st.Muon([other], coefficient_type="custom", num_ns_steps=2, custom_coefficients=[(1, 2, 3, 4), (5, 6)])
    assert len(optimizer.param_groups) == 1  # not added
    optimizer.add_param_group({"params": [other], "lr": 0.01})
    weight.grad, other.grad = torch.randn(4, 6), torch.randn(5, 3)
    optimizer.param_groups[1]["coefficient_type"] = "quintc"
    before = [weight.detach().clone(), other.detach().clone()]
    with pytest.raises(ValueError, match=r"Muon param_groups\[1\]: unknown coefficient_type 'quintc'"):
        optimizer.step()
    assert torch.equal(weight.detach(), before[0]) and torch.equal(other.detach(), before[1])
    optimizer.param_groups[1]["coefficient_type"] = "quintic"
    optimizer.step()
    twin = torch.nn.Parameter(before[1].clone())
    twin.grad = other.grad.clone()
    st.Muon([twin], lr=0.01).step()
    assert torch.equal(other.detach(), twin.detach())  # the added group's own lr


@pytest.mark.parametrize("key,value", [("lr", None), ("lr", "0.02"), ("momentum", "0.95"), ("weight_decay", [0.1]),
                                       ("num_ns_steps", 2.5), ("num_ns_steps", True), ("eps", None),
                                       ("extra_scale_factor", "2"), ("weight_decay_mode", ["l2"]),
                                       ("coefficient_type", ["quintic"]), ("scale_mode", {}),
                                       ("algorithm", None), ("use_decoupled_weight_decay", "yes"),
                                       ("partition_dim", True), ("custom_coefficients", 5)])
def test_a_hyperparameter_of_the_wrong_type_is_refused_by_name_and_its_group_not_added(key, value):
    weight, other = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(5, 3))
    extra = {"coefficient_type": "custom"} if key == "custom_coefficients" else {}
    optimizer = st.Muon([weight], lr=0.02)
    with pytest.raises(ValueError, match=rf"Muon param_groups\[1\]: .*{key}.*{re.escape(repr(value))}"):
        optimizer.add_param_group({"params": [other], key: value, **extra})
    assert len(optimizer.param_groups) == 1
    with pytest.raises(ValueError, match=rf"Muon: .*{key}"):
        st.Muon([other], **{key: value, **extra})
    optimizer.add_param_group({"params": [other]})  # the same parameter, now well given
    weight.grad, other.grad = torch.randn(4, 6), torch.randn(5, 3)
    optimizer.step()


def test_num_ns_steps_takes_numpy_ints_and_numbers_take_numpy_floats():
    numpy = pytest.importorskip("numpy")
    weight = torch.nn.Parameter(torch.randn(4, 6))
    twin = torch.nn.Parameter(weight.detach().clone())
    weight.grad, twin.grad = torch.randn(4, 6), None
    twin.grad = weight.grad.clone()
    st.Muon([weight], lr=numpy.float64(0.02), momentum=numpy.float32(0.9), num_ns_steps=numpy.int64(4)).step()
    st.Muon([twin], lr=0.02, momentum=float(numpy.float32(0.9)), num_ns_steps=4).step()
    assert torch.equal(weight.detach(), twin.detach())


def test_muon_with_adamw_groups_use_their_own_eps_and_check_their_values():
    torch.manual_seed(8)
    weight, bias = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(6))
    twin = torch.nn.Parameter(bias.detach().clone())
    optimizer = st.MuonWithAdamW([{"params": [weight], "use_muon": True},
                                  {"params": [bias], "use_muon": False, "lr": 1e-2, "eps": 0.5}], eps=1e-6)
    assert optimizer.param_groups[0]["eps"] == 1e-6 and optimizer.param_groups[1]["eps"] == 0.5
    adam = torch.optim.AdamW([twin], lr=1e-2, betas=(0.9, 0.95), eps=0.5, weight_decay=0.0)
    for step in range(2):
        weight.grad, bias.grad = torch.randn(6, 4), torch.full((6,), 1e-2 * (step + 1))
        twin.grad = bias.grad.clone()
        optimizer.step()
        adam.step()
    assert torch.equal(bias.detach(), twin.detach())
    # The default is adamw_eps; a state dict saved when the AdamW eps was kept as "adamw_eps"
    # loads with it as the group's eps.
    plain = st.MuonWithAdamW([{"params": [weight], "use_muon": True},
                              {"params": [bias], "use_muon": False}], adamw_eps=1e-5)
    assert plain.param_groups[1]["eps"] == 1e-5 and plain.param_groups[0]["eps"] == 1e-7
    saved = plain.state_dict()
    saved["param_groups"][1]["adamw_eps"] = 3e-4
    saved["param_groups"][1]["eps"] = 1e-7
    plain.load_state_dict(saved)
    assert plain.param_groups[1]["eps"] == 3e-4 and "adamw_eps" not in plain.param_groups[1]
    weight.grad, bias.grad = torch.randn(6, 4), torch.randn(6)
    plain.step()
    assert plain._adam.param_groups[0]["eps"] == 3e-4
    for key, value in [("betas", (0.9, 1.5)), ("betas", 0.9), ("eps", -1.0), ("eps", "1e-8"),
                       ("weight_decay", -0.1), ("lr", "1e-3")]:
        with pytest.raises(ValueError, match=rf"MuonWithAdamW param_groups\[2\]: {key} must be"):
            plain.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "use_muon": False, key: value})
        assert len(plain.param_groups) == 2


def test_add_param_group_takes_named_parameters_as_the_constructor_does():
    weight, late = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(5, 3))
    optimizer = st.Muon([("first.weight", weight)], lr=0.02)
    optimizer.add_param_group({"params": [("late.weight", late)], "lr": 0.01})
    assert optimizer.param_groups[1]["params"][0] is late
    weight.grad, late.grad = torch.randn(4, 6), torch.randn(5, 3)
    assert set(optimizer.plan()) == {"first.weight", "late.weight"}
    late.grad = torch.randn(3, 5).T  # its name in the error
    with pytest.raises(ValueError, match=r"late\.weight .*its gradient is not a contiguous"):
        optimizer.step()
    groups = st.muon_param_groups(torch.nn.Linear(6, 4), muon_lr=0.02, adamw_lr=1e-3)
    both = st.MuonWithAdamW([groups[1]])
    both.add_param_group(groups[0])
    assert "weight" in both.plan()


def test_muon_param_groups_gives_convolution_kernels_to_adamw():
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 8, 3), torch.nn.Conv2d(8, 8, 3), torch.nn.Linear(8, 4),
                                torch.nn.ConvTranspose1d(4, 4, 3))
    muon, adamw = st.muon_param_groups(model, muon_lr=0.02, adamw_lr=1e-3)
    assert [name for name, _ in muon["params"]] == ["2.weight"]
    assert len(adamw["params"]) == 7


@pytest.mark.parametrize("shape", [(0, 6), (6, 0), (0, 4, 6), (3, 0, 6)])
def test_a_parameter_without_elements_is_left_alone_and_the_others_step(shape):
    weight, empty = torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(*shape))
    twin = torch.nn.Parameter(weight.detach().clone())
    optimizer, alone = st.Muon([("weight", weight), ("empty", empty)], lr=0.02), st.Muon([twin], lr=0.02)
    for step in range(3):  # the second and third reuse the first's arguments
        weight.grad, empty.grad = torch.randn(5, 7), torch.randn(*shape)
        twin.grad = weight.grad.clone()
        optimizer.step()
        alone.step()
    assert torch.equal(weight.detach(), twin.detach())
    assert empty not in optimizer.state and "empty" not in optimizer.plan()
    only_empty = st.Muon([empty])
    only_empty.step()  # nothing to do
    assert only_empty.plan() == {}


def test_muon_with_adamw_steps_an_adamw_group_added_later():
    torch.manual_seed(5)
    weight, bias, late = (torch.nn.Parameter(torch.randn(*shape)) for shape in [(6, 4), (6,), (3,)])
    optimizer = st.MuonWithAdamW([{"params": [weight], "use_muon": True},
                                  {"params": [bias], "use_muon": False, "lr": 1e-3}], lr=0.02)
    with pytest.raises(ValueError, match=r"param_groups\[2\] needs use_muon=True or False"):
        optimizer.add_param_group({"params": [late]})
    assert len(optimizer.param_groups) == 2
    optimizer.add_param_group({"params": [late], "use_muon": False, "lr": 1e-2})
    twin = torch.nn.Parameter(late.detach().clone())
    adam = torch.optim.AdamW([twin], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for _ in range(2):
        for p in (weight, bias):
            p.grad = torch.randn_like(p)
        late.grad = torch.randn(3)
        twin.grad = late.grad.clone()
        optimizer.step()
        adam.step()
    assert torch.equal(late.detach(), twin.detach())


@pytest.mark.parametrize("shape", [(7, 13), (13, 7), (1, 9), (40, 40)])
@pytest.mark.parametrize("schedule,steps", [("quintic", 5), ("polar_express", 8)])
def test_newton_schulz_matches_a_float64_iteration(shape, schedule, steps):
    ns = st.NewtonSchulz(ns_steps=steps, coefficient_type=schedule)
    coefficients = ns.coefficients()
    assert len(coefficients) == steps
    matrix = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    # The same iteration written out, in whichever orientation has the smaller Gram.
    x = matrix if shape[0] <= shape[1] else matrix.T
    x = x / x.norm().clamp(min=1e-7)
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    expected = x if shape[0] <= shape[1] else x.T
    result = matrix.clone()
    assert ns(result, shape) is result
    assert torch.allclose(result, expected, rtol=0, atol=1e-12)
    assert ns.plan(shape) == "local"


def test_newton_schulz_rejects_bad_arguments():
    with pytest.raises(ValueError, match="coefficient_type"):
        st.NewtonSchulz(coefficient_type="cubic")
    with pytest.raises(ValueError, match="algorithm"):
        st.NewtonSchulz(algorithm="fastest")
    ns = st.NewtonSchulz()
    with pytest.raises(ValueError, match="contiguous"):
        ns(torch.randn(8, 6).T, (6, 8))
    with pytest.raises(ValueError, match="must be 4 x 6, got \\(4, 5\\)"):
        ns(torch.randn(4, 5), (4, 6))
    with pytest.raises(ValueError, match="partition_dim"):
        ns(torch.randn(4, 6), (4, 6), partition_dim=2)
    with pytest.raises(shardmuon.ShardmuonError, match="num_iterations"):
        st.NewtonSchulz(ns_steps=0)(torch.randn(4, 6), (4, 6))


def test_newton_schulz_takes_a_flat_shard_on_one_rank_as_on_several():
    ns = st.NewtonSchulz()
    matrix = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    whole, flat = matrix.clone(), matrix.reshape(-1).clone()
    ns(whole, (3, 4))
    assert ns(flat, (3, 4), "flat") is flat and torch.equal(flat, whole.reshape(-1))
    ns(matrix.reshape(-1).clone(), (3, 4), "flat", [12])
    with pytest.raises(ValueError, match=r"must be 12, got \(3, 4\)"):
        ns(matrix.clone(), (3, 4), "flat")
    for dim, sizes in (("flat", [6, 6]), (0, [2])):
        with pytest.raises(ValueError, match=r"shard_sizes must be \[(12|3)\] on a group of one rank"):
            ns(matrix.reshape(-1).clone() if dim == "flat" else matrix.clone(), (3, 4), dim, sizes)


def test_newton_schulz_estimate_grows_with_the_work():
    ns = st.NewtonSchulz(algorithm="duplicated")  # on one rank: the standard iteration
    small, large = ns.estimate_seconds((512, 1024)), ns.estimate_seconds((4096, 14336))
    assert 0 < small < large
    # At least the update products X <- P X (2 s^2 L flops each, not symmetric) at the
    # 760 TFLOP/s it assumes; the symmetric products make the rest cheaper than 2 s^2 L + 2 s^3.
    assert large > 5 * 2 * 4096**2 * 14336 / 760e12


def test_auto_runs_the_gram_iteration_where_it_is_cheaper():
    auto = st.NewtonSchulz()
    assert auto.uses_gram_iteration((4096, 14336)) and auto.uses_gram_iteration((14336, 4096))
    assert not auto.uses_gram_iteration((4096, 4096)) and not auto.uses_gram_iteration((40, 120))
    standard = st.NewtonSchulz(algorithm="duplicated")
    assert not standard.uses_gram_iteration((4096, 14336))
    assert st.NewtonSchulz(algorithm="gram_newton_schulz").uses_gram_iteration((40, 40))
    # It chose (e) because the model prices it lower: three updates of X instead of five.
    assert auto.estimate_seconds((4096, 14336)) < 0.9 * standard.estimate_seconds((4096, 14336))
    assert auto.plan((4096, 14336)) == standard.plan((4096, 14336)) == "local"


def test_the_gram_applied_twice_is_reported_where_it_runs():
    # One rank: (c) takes more flops than the standard iteration, so AUTO never runs it there;
    # asked for, it runs on the whole matrix ("local": nothing to communicate).
    assert not st.NewtonSchulz().uses_applied_twice((8192, 8192))
    twice = st.NewtonSchulz(algorithm="gram_applied_twice")
    assert twice.uses_applied_twice((40, 40)) and twice.plan((40, 40)) == "local"
    assert not twice.uses_gram_iteration((40, 40))
    assert not st.NewtonSchulz(algorithm="gram_newton_schulz").uses_applied_twice((40, 40))


def test_experts_and_fused_parts_are_orthogonalized_one_by_one():
    generator = torch.Generator().manual_seed(5)
    experts = torch.nn.Parameter(0.05 * torch.randn(3, 8, 12, dtype=torch.float64, generator=generator))
    fused = torch.nn.Parameter(0.05 * torch.randn(10, 6, dtype=torch.float64, generator=generator))
    fused.muon_row_blocks = 2  # gate and up halves
    optimizer = st.Muon([experts, fused], lr=0.02, weight_decay=0.0)
    experts.grad = torch.randn(3, 8, 12, dtype=torch.float64, generator=generator)
    fused.grad = torch.randn(10, 6, dtype=torch.float64, generator=generator)
    expected, initial = [], [experts[e].detach().clone() for e in range(3)]
    for w, g in [(experts[e], experts.grad[e]) for e in range(3)] + \
            [(fused[:5], fused.grad[:5]), (fused[5:], fused.grad[5:])]:
        new_w, _ = reference.muon_step(w.detach().clone(), g, torch.zeros_like(g), lr=0.02, weight_decay=0.0)
        expected.append(new_w)
    optimizer.step()
    got = [experts[e].detach() for e in range(3)] + [fused[:5].detach(), fused[5:].detach()]
    for e, (x, y) in enumerate(zip(got, expected)):
        assert reference.relative_error(x, y) < 1e-11, e
    # One matrix per expert, not one over all of them: the whole stack's step differs.
    stack, _ = reference.muon_step(torch.cat(initial), experts.grad.reshape(24, 12),
                                   torch.zeros(24, 12, dtype=torch.float64), lr=0.02, weight_decay=0.0)
    assert reference.relative_error(torch.cat(got[:3]), stack) > 1e-3


def test_plan_is_keyed_by_the_names_given_with_the_parameters():
    named = torch.nn.Parameter(torch.randn(8, 6))
    unnamed = torch.nn.Parameter(torch.randn(6, 4))
    optimizer = st.Muon([{"params": [("fc.weight", named)]}, {"params": [unnamed]}], lr=0.01)
    named.grad, unnamed.grad = torch.randn(8, 6), torch.randn(6, 4)
    plan = optimizer.plan()
    assert list(plan) == ["fc.weight", "param_groups[1]['params'][0]"]
    assert plan["fc.weight"]["algorithm"] == "local" and plan["fc.weight"]["group_size"] == 1


def test_per_tensor_caches_find_only_the_tensor_they_were_given():
    from shardmuon.torch import _PerTensor
    table = _PerTensor()
    a, b = torch.zeros(3), torch.zeros(3)
    table[a] = "a's"
    assert a in table and table[a] == "a's" and table.get(a) == "a's"
    assert b not in table and table.get(b) is None  # equal values, another tensor
    # An entry left under b's id by a tensor that held it before (ids are reused once a
    # tensor is freed; here another live tensor stands in for the dead one).
    table._entries[id(b)] = (weakref.ref(a), "stale")
    assert b not in table and table.get(b, "none") == "none"
    with pytest.raises(KeyError):
        table[b]
    # A collected tensor's entry goes with it.
    c = torch.zeros(2)
    table[c] = "c's"
    key = id(c)
    del c
    gc.collect()
    assert key not in table._entries


def test_row_blocks_on_a_3d_parameter_are_refused_unless_they_are_its_experts():
    p = torch.nn.Parameter(torch.randn(2, 4, 6))
    p.muon_row_blocks = 4  # would cut each expert in halves; the experts are the blocks
    optimizer = st.Muon([p], lr=0.01)
    p.grad = torch.randn(2, 4, 6)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"muon_row_blocks \(4\) is for 2D weights.*2 experts"):
        optimizer.step()
    assert torch.equal(p.detach(), before)
    for blocks in (1, 2):  # nothing to split, and what the experts already are
        p.muon_row_blocks = blocks
        optimizer.step()
        assert not torch.equal(p.detach(), before)
        before = p.detach().clone()


def test_3d_parameters_take_only_column_or_no_sharding():
    p = torch.nn.Parameter(torch.randn(2, 4, 6))
    p.partition_dim = 1
    optimizer = st.Muon([p], lr=0.01)
    p.grad = torch.randn(2, 4, 6)
    with pytest.raises(ValueError, match="partition_dim 2"):
        optimizer.step()


def test_nonfinite_policies_skip_raise_or_proceed_and_are_counted():
    torch.manual_seed(8)
    with pytest.raises(ValueError, match=r"nonfinite must be one of \['proceed', 'raise', 'skip'\], got 'ignore'"):
        st.Muon([torch.nn.Parameter(torch.randn(4, 6))], nonfinite="ignore")
    for poison in (float("nan"), float("inf")):
        weight = torch.nn.Parameter(torch.randn(6, 9))
        skipping, raising = st.Muon([weight], lr=0.02), st.Muon([weight], lr=0.02, nonfinite="raise")
        assert skipping.nonfinite_counts() == {"skipped_steps": 0, "skipped_params": 0}
        weight.grad = torch.randn(6, 9)
        weight.grad[2, 3] = poison
        before = weight.detach().clone()
        skipping.step()
        assert torch.equal(weight.detach(), before)
        assert skipping.nonfinite_counts() == {"skipped_steps": 1, "skipped_params": 0}
        with pytest.raises(shardmuon.torch.c.ShardmuonError, match="NON_FINITE.*skipped on every rank") as raised:
            raising.step()
        assert raised.value.status == 13 and torch.equal(weight.detach(), before)
        assert raising.nonfinite_counts()["skipped_steps"] == 1
        st.Muon([weight], lr=0.02, nonfinite="proceed").step()
        assert not torch.isfinite(weight.detach()).all()  # as documented: no check
        weight.grad = torch.randn(6, 9)  # a finite step after a skipped one runs
        weight.data.copy_(before)
        skipping.step()
        assert not torch.equal(weight.detach(), before) and torch.isfinite(weight.detach()).all()


def _muon_with_adamw_pair(seed, **options):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(6, 9, generator=generator))
    bias = torch.nn.Parameter(torch.randn(9, generator=generator))
    optimizer = st.MuonWithAdamW([{"params": [weight], "use_muon": True},
                                  {"params": [bias], "use_muon": False, "lr": 1e-3}], lr=0.02, **options)
    return weight, bias, optimizer


def _set_grads(params, seed, poison=None):
    generator = torch.Generator().manual_seed(seed)
    for index, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=generator)
        if poison == index:
            p.grad.view(-1)[1] = float("nan")


@pytest.mark.parametrize("poisoned", ["muon", "adamw"])
def test_muon_with_adamw_skips_both_on_a_nonfinite_gradient_of_either(poisoned):
    weight, bias, optimizer = _muon_with_adamw_pair(9)
    twin_weight, twin_bias, twin = _muon_with_adamw_pair(9, nonfinite="proceed")
    params = [weight, bias]
    _set_grads(params, 1)
    _set_grads([twin_weight, twin_bias], 1)
    optimizer.step()
    twin.step()
    state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in params}
    before = [p.detach().clone() for p in params]
    _set_grads(params, 2, poison=0 if poisoned == "muon" else 1)
    optimizer.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))  # neither stepped
    for p in params:
        assert all(torch.equal(v, state[id(p)][k]) for k, v in optimizer.state[p].items())
    assert optimizer.nonfinite_counts() == {"skipped_steps": 1, "skipped_params": 0}
    # The next finite step runs both, the same as an optimizer that never saw the bad one.
    for seed in (3, 4):
        _set_grads(params, seed)
        _set_grads([twin_weight, twin_bias], seed)
        optimizer.step()
        twin.step()
    assert torch.equal(weight.detach(), twin_weight.detach()) and torch.equal(bias.detach(), twin_bias.detach())


def test_the_nonfinite_check_finds_nan_and_inf_and_no_overflow_of_finite_gradients():
    # Finite gradients whose 1-norm passes their dtype's range (float16's 65504, or float32's
    # 3.4e38 for a float64 norm) are finite; a NaN or Inf in any tensor of any dtype is not.
    cpu = torch.device("cpu")
    big_half = torch.full((3,), 30000.0, dtype=torch.float16)
    big_double = torch.full((3,), 1e39, dtype=torch.float64)
    finite = [big_half, big_double, torch.ones(4, dtype=torch.bfloat16), torch.ones(5)]
    assert st._any_nonfinite(finite, cpu).item() == 0.0
    assert st._any_nonfinite([], cpu).item() == 0.0
    for index, bad in itertools.product(range(len(finite)), (float("nan"), float("inf"), -float("inf"))):
        tensors = [t.clone() for t in finite]
        tensors[index][-1] = bad
        flag = st._any_nonfinite(tensors, cpu)
        assert flag.dtype == torch.float32 and flag.item() == 1.0, (index, bad)


def _adamw_steps(dtype):
    probe = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
    probe.grad = torch.ones(2, dtype=dtype)
    try:
        torch.optim.AdamW([probe]).step()
    except RuntimeError:  # PyTorch 1.13's AdamW on the CPU has no float16 kernels
        return False
    return True


# 100 float16 elements of 1000 sum to 1e5 (past 65504) while AdamW's float16 second moment,
# 0.05 * 1000^2, stays in range; 1e39 passes float32's range, where a float64 norm was put.
@pytest.mark.parametrize("dtype,value,size", [(torch.float64, 1e39, 3), (torch.float16, 1000.0, 100)])
def test_muon_with_adamw_steps_on_a_finite_adamw_gradient_whose_norm_passes_its_dtypes_range(dtype, value, size):
    if not _adamw_steps(dtype):
        pytest.skip(f"torch.optim.AdamW {torch.__version__} cannot step a {dtype} parameter on the CPU")
    weight = torch.nn.Parameter(torch.randn(6, 9, dtype=torch.float64))
    bias = torch.nn.Parameter(torch.zeros(size, dtype=dtype))
    optimizer = st.MuonWithAdamW([{"params": [weight], "use_muon": True},
                                  {"params": [bias], "use_muon": False, "lr": 1e-3}], lr=0.02)
    weight.grad = torch.randn(6, 9, dtype=torch.float64)
    bias.grad = torch.full((size,), value, dtype=dtype)
    before = weight.detach().clone()
    optimizer.step()
    assert optimizer.nonfinite_counts() == {"skipped_steps": 0, "skipped_params": 0}
    assert not torch.equal(weight.detach(), before)
    # AdamW's first step moves each element by lr (its update is m / sqrt(v) = sign(g)).
    assert torch.allclose(bias.detach().double(), torch.full((size,), -1e-3, dtype=torch.float64), rtol=1e-2)


def test_muon_with_adamw_raises_on_an_adamw_gradient_before_writing_and_counts_adamw_alone():
    weight, bias, optimizer = _muon_with_adamw_pair(10, nonfinite="raise")
    _set_grads([weight, bias], 5, poison=1)
    before = [weight.detach().clone(), bias.detach().clone()]
    with pytest.raises(shardmuon.torch.c.ShardmuonError, match="NON_FINITE.*step flag"):
        optimizer.step()
    assert torch.equal(weight.detach(), before[0]) and torch.equal(bias.detach(), before[1])
    weight.grad = None  # no Muon gradient: the library's step still reads the flag
    with pytest.raises(shardmuon.torch.c.ShardmuonError, match="NON_FINITE.*step flag"):
        optimizer.step()
    assert torch.equal(bias.detach(), before[1])
    assert optimizer.nonfinite_counts()["skipped_steps"] == 2
    # Without Muon groups there is no library step: the AdamW groups' own check skips (or
    # raises) and counts.
    for policy in ("skip", "raise"):
        bias_alone = torch.nn.Parameter(torch.randn(9))
        adamw_only = st.MuonWithAdamW([{"params": [bias_alone], "use_muon": False, "lr": 1e-3}],
                                      nonfinite=policy)
        bias_alone.grad = torch.full((9,), float("inf"))
        kept = bias_alone.detach().clone()
        if policy == "raise":
            with pytest.raises(shardmuon.torch.c.ShardmuonError, match="AdamW groups was not finite"):
                adamw_only.step()
        else:
            adamw_only.step()
        assert torch.equal(bias_alone.detach(), kept)
        assert adamw_only.nonfinite_counts() == {"skipped_steps": 1, "skipped_params": 0}
        bias_alone.grad = torch.ones(9)
        adamw_only.step()
        assert not torch.equal(bias_alone.detach(), kept)


def _step_as_a_loss_scaler_does(optimizer, grad_scale, found_inf):
    """What torch.amp.GradScaler.step does for an optimizer with _step_supports_amp_scaling
    (PyTorch 2.1 and later): the two attributes, the step, the attributes removed."""
    optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def _scaled_pair(kind, seed, **options):
    if kind == "muon":
        generator = torch.Generator().manual_seed(seed)
        weight = torch.nn.Parameter(torch.randn(6, 9, generator=generator))
        return [weight], st.Muon([weight], lr=0.02, **options)
    weight, bias, optimizer = _muon_with_adamw_pair(seed, **options)
    return [weight, bias], optimizer


@pytest.mark.parametrize("kind", ["muon", "muon_with_adamw"])
@pytest.mark.parametrize("policy", ["skip", "raise", "proceed"])
def test_a_loss_scalers_scale_is_removed_and_its_found_inf_skips_the_step(kind, policy):
    assert st.Muon._step_supports_amp_scaling == (torch.__version__ >= (2, 1))
    params, optimizer = _scaled_pair(kind, 11, nonfinite=policy)
    twins, twin = _scaled_pair(kind, 11, nonfinite=policy)
    scale, clear, found = torch.tensor(1024.0), torch.tensor(0.0), torch.tensor(1.0)
    for seed in (1, 2):  # scaled gradients (by a power of two: unscaled exactly) step as unscaled ones
        _set_grads(params, seed)
        _set_grads(twins, seed)
        for p in params:
            p.grad.mul_(1024.0)
        _step_as_a_loss_scaler_does(optimizer, scale, clear)
        twin.step()
        for p, t in zip(params, twins):
            assert torch.equal(p.grad, t.grad)  # unscaled in place, as GradScaler.unscale_ does
            assert torch.equal(p.detach(), t.detach())
    # found_inf skips the step, finite gradients or not, under every policy (raise too: an
    # overflow is the scaler's routine signal), and counts it.
    before = [p.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in params]
    _set_grads(params, 3, poison=0)
    _step_as_a_loss_scaler_does(optimizer, scale, found)
    _set_grads(params, 3)
    _step_as_a_loss_scaler_does(optimizer, scale, found)
    for p, b, s in zip(params, before, state):
        assert torch.equal(p.detach(), b)
        assert all(torch.equal(v, s[k]) for k, v in optimizer.state[p].items())
    assert optimizer.nonfinite_counts() == {"skipped_steps": 2, "skipped_params": 0}
    # The verdict is cleared for the next step; after scaler.unscale_ (grad_scale None) the
    # gradients are taken as they are.
    _set_grads(params, 4)
    _set_grads(twins, 4)
    _step_as_a_loss_scaler_does(optimizer, None, clear)
    twin.step()
    assert all(torch.equal(p.detach(), t.detach()) for p, t in zip(params, twins))
    # Without a scaler the policy is the optimizer's own again.
    _set_grads(params, 5, poison=0)
    if policy == "raise":
        with pytest.raises(shardmuon.torch.c.ShardmuonError, match="NON_FINITE"):
            optimizer.step()
    else:
        optimizer.step()
    assert torch.isfinite(params[0].detach()).all() == (policy != "proceed")


def test_a_scaled_step_refused_for_bad_input_leaves_the_gradients_scaled():
    good = torch.nn.Parameter(torch.randn(6, 9))
    bad = torch.nn.Parameter(torch.randn(6, 9).half())
    optimizer = st.Muon([good, bad], lr=0.02)
    good.grad, bad.grad = torch.full((6, 9), 1024.0), torch.full((6, 9), 1024.0).half()
    with pytest.raises(TypeError, match="float16"):
        _step_as_a_loss_scaler_does(optimizer, torch.tensor(1024.0), torch.tensor(0.0))
    assert torch.equal(good.grad, torch.full((6, 9), 1024.0)) and torch.equal(bad.grad.float(), good.grad)


@pytest.mark.skipif(not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"),
                    reason="torch.amp.GradScaler (PyTorch 2.3+) runs on the CPU; this PyTorch has none")
def test_a_cpu_grad_scaler_steps_as_its_ordinary_path_does():
    """torch.amp.GradScaler("cpu") through the protocol against the same scaler's ordinary
    path (the optimizer's _step_supports_amp_scaling turned off): the same parameters and the
    same scale after steps that include an overflow."""
    runs = []
    for protocol in (True, False):
        params, optimizer = _scaled_pair("muon_with_adamw", 12)
        optimizer._step_supports_amp_scaling = protocol
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
        for seed in range(5):
            optimizer.zero_grad()
            generator = torch.Generator().manual_seed(seed)
            x = torch.randn(4, 6, generator=generator)
            loss = ((x @ params[0]) + params[1]).square().mean()
            scaler.scale(loss).backward()
            if seed == 2:
                params[1].grad[0] = float("inf")
            if seed == 3:  # clipped after unscale_: the step gets no grad_scale
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, 0.5)
            scaler.step(optimizer)
            scaler.update()
        runs.append(([p.detach().clone() for p in params], scaler.get_scale()))
    (ours, our_scale), (theirs, their_scale) = runs
    assert our_scale == their_scale
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_a_step_moves_the_versions_of_the_parameters_it_writes():
    # The library writes through pointers autograd does not see: without the versions moved,
    # a backward pass through a graph that saved a weight before the step used the new one.
    torch.manual_seed(11)
    weight, frozen = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5, 3))
    optimizer = st.Muon([weight, frozen], lr=0.02)
    x = torch.randn(4, 2, requires_grad=True)
    loss = (weight @ x).pow(2).sum()  # saves weight for x's gradient
    weight.grad = torch.randn(6, 4)
    versions = weight._version, frozen._version
    optimizer.step()
    assert weight._version > versions[0]
    assert frozen._version == versions[1]  # no gradient: not written
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_parameter_collections_are_taken_as_torch_optim_takes_them():
    weight = torch.nn.Parameter(torch.randn(6, 4))
    # A set's order differs between processes, whose shards are paired by position.
    with pytest.raises(TypeError, match="ordered collections"):
        st.Muon({weight})
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\].*ordered collections"):
        st.Muon([{"params": {weight}}])
    with pytest.raises(TypeError, match="ordered collections"):
        st.Muon([torch.nn.Parameter(torch.randn(3, 3))]).add_param_group({"params": {weight}})
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        st.Muon(weight)
    # A group's lone tensor is a list of one (it was iterated into its rows).
    twin = torch.nn.Parameter(weight.detach().clone())
    grad = torch.randn(6, 4)
    ours, theirs = st.Muon([{"params": weight}], lr=0.02), st.Muon([twin], lr=0.02)
    assert ours.param_groups[0]["params"] == [weight]
    weight.grad, twin.grad = grad.clone(), grad.clone()
    ours.step()
    theirs.step()
    assert torch.equal(weight, twin)
    both = st.MuonWithAdamW([{"params": weight, "use_muon": True}])
    assert both.param_groups[0]["params"] == [weight]


@pytest.mark.parametrize("options,message", [
    ({"lr": float("inf")}, "invalid learning rate: inf"),
    ({"lr": torch.tensor([0.1, 0.2])}, "lr must be a number or a one-element tensor"),
    ({"weight_decay": float("inf")}, "invalid weight_decay value: inf"),
    ({"eps": -1.0}, "eps must be finite and >= 0, got -1.0"),
    ({"eps": float("nan")}, "eps must be finite and >= 0, got nan"),
    ({"extra_scale_factor": float("inf")}, "extra_scale_factor must be finite, got inf"),
])
def test_values_the_library_refuses_are_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=re.escape(f"Muon: {message}")):
        st.Muon([torch.nn.Parameter(torch.randn(6, 4))], **options)


@pytest.mark.parametrize("group", [5, "world"])
def test_a_process_group_that_is_not_one_is_refused_by_name(group):
    with pytest.raises(TypeError, match=f"Muon: process_group must be None .* got {group!r}"):
        st.Muon([torch.nn.Parameter(torch.randn(6, 4))], process_group=group)
    with pytest.raises(TypeError, match="NewtonSchulz: process_group must be"):
        st.NewtonSchulz(group)


@pytest.mark.parametrize("switch", ["amsgrad", "maximize"])
def test_muon_with_adamw_passes_adamws_switches_on(switch):
    torch.manual_seed(12)
    weight, bias = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(7))
    twin = torch.nn.Parameter(bias.detach().clone())
    optimizer = st.MuonWithAdamW([{"params": [weight], "use_muon": True},
                                  {"params": [bias], "use_muon": False, "lr": 1e-2, switch: True}], lr=0.02)
    adamw = torch.optim.AdamW([twin], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, **{switch: True})
    for step in range(3):
        weight.grad, bias.grad = torch.randn(6, 4), torch.randn(7) * (3.0 if step == 0 else 0.1)
        twin.grad = bias.grad.clone()
        optimizer.step()
        adamw.step()
    assert torch.equal(bias.detach(), twin.detach())
    assert sorted(optimizer.state[bias]) == sorted(adamw.state[twin])
    with pytest.raises(ValueError, match=rf"param_groups\[1\]: {switch} must be True or False, got 'yes'"):
        st.MuonWithAdamW([{"params": [weight], "use_muon": True},
                          {"params": [bias], "use_muon": False, switch: "yes"}])


def test_muon_with_adamw_refuses_a_use_muon_that_is_not_a_bool_and_a_save_of_other_groups():
    weight, bias = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(6, 2))
    with pytest.raises(ValueError, match=r"param_groups\[0\] needs use_muon=True or False, got 'no'"):
        st.MuonWithAdamW([{"params": [weight], "use_muon": "no"}])
    saved_as = st.MuonWithAdamW([{"params": [weight], "use_muon": True}, {"params": [bias], "use_muon": False}])
    weight.grad, bias.grad = torch.randn(6, 4), torch.randn(6, 2)
    saved_as.step()
    loaded_into = st.MuonWithAdamW([{"params": [weight], "use_muon": False}, {"params": [bias], "use_muon": True}])
    before = copy.deepcopy(loaded_into.state_dict())
    with pytest.raises(ValueError, match=r"param_groups\[0\] was saved with use_muon=True, but here it has "
                                         r"use_muon=False"):
        loaded_into.load_state_dict(saved_as.state_dict())
    assert loaded_into.state_dict() == before


def test_a_state_dict_of_torch_optim_muons_form_is_refused_by_muon_at_load():
    weight = torch.nn.Parameter(torch.randn(6, 4))
    torch_form = st.TorchMuon([weight])
    weight.grad = torch.randn(6, 4)
    torch_form.step()
    muon = st.Muon([weight])
    with pytest.raises(ValueError, match=r"param_groups\[0\] has adjust_lr_fn, ns_coefficients, ns_steps: "
                                         r"it was saved by TorchMuon or torch.optim.Muon"):
        muon.load_state_dict(torch_form.state_dict())
    assert not muon.state


def test_num_ns_steps_is_bounded_as_the_library_bounds_it():
    weight = torch.nn.Parameter(torch.randn(4, 6))
    for steps in [0, -3, 1001]:
        with pytest.raises(ValueError, match=rf"Muon: num_ns_steps must be in \[1, 1000\], got {steps}"):
            st.Muon([weight], num_ns_steps=steps)
    st.Muon([weight], num_ns_steps=1000)  # the largest the library takes
