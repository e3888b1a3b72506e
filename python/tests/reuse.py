"""The harness of the tests of a step's reused arguments (shardmuon.torch._StepCache), for
plain tensors (test_muon.py) and DTensors (test_dtensor.py).

Two optimizers take the same steps and the same changes between steps. One may reuse the C
arrays its last step built; the other is made to go the full way every time. They must raise
the same errors and end bitwise equal, and the first must have skipped the full checks
exactly where the table says it may."""

import pytest
import torch

import shardmuon.torch as st


def gradients_in_place(optimizer, *params):
    """A change of the tables: the step's gradients are written into the last step's."""


def count_full_checks(optimizer) -> list:
    """A list that grows by one each time the optimizer's step goes the full way (builds and
    checks every argument) instead of reusing the last step's."""
    full_checks = []
    collect = optimizer._collect

    def counted():
        full_checks.append(True)
        return collect()

    optimizer._collect = counted
    return full_checks


def check_reuse(changes, make_parameters, set_gradient, local, context=()):
    """Takes the steps of `changes`, each (change, reused, error, undo):
    - change(optimizer, a, b, c, *context) is made before the step (None: nothing else changes
      but the gradients, which are new tensors unless the change is gradients_in_place);
    - reused: whether the step may reuse the last one's arguments;
    - error: None, or (type, pattern) the step must raise, leaving the parameters as they were;
    - undo(optimizer, a, b, c, *context), made after the error, or None.
    A step that raised leaves no arguments to reuse, so each error should follow a step that
    succeeded: the reuse is then what must see the change.

    make_parameters() -> (a, b, c), the same values each call: a in the first group, b in the
    second (another learning rate), c in none until a change adds it.
    set_gradient(p, index, step, in_place) gives parameter `index` its gradient of `step`.
    local(t) is the piece of a parameter or momentum that the library reads and writes."""
    runs = []
    for reuse in (True, False):
        params = make_parameters()
        optimizer = st.Muon([{"params": [params[0]]}, {"params": [params[1]], "lr": 0.03}], lr=0.02,
                            momentum=0.9)
        full_checks = count_full_checks(optimizer)
        if not reuse:
            optimizer._last_calls_again = lambda: None
        runs.append((optimizer, params, full_checks))
    start_of_c = local(runs[0][1][2]).clone()
    for step, (change, reused, error, undo) in enumerate(changes):
        for optimizer, params, full_checks in runs:
            for index, p in enumerate(params):
                set_gradient(p, index, step, change is gradients_in_place)
            if change is not None:
                change(optimizer, *params, *context)
            before = [local(p).clone() for p in params]
            checked = len(full_checks)
            if error is None:
                optimizer.step()
            else:
                with pytest.raises(error[0], match=error[1]):
                    optimizer.step()
                assert all(torch.equal(local(p), w) for p, w in zip(params, before)), (step, change)
                if undo is not None:
                    undo(optimizer, *params, *context)
            if full_checks is runs[0][2]:
                assert (len(full_checks) == checked) == reused, (step, change)
    (first, mine, _), (second, theirs, _) = runs
    for p, q in zip(mine, theirs):
        assert torch.equal(local(p), local(q))
        assert torch.equal(local(first.state[p]["momentum_buffer"]), local(second.state[q]["momentum_buffer"]))
    assert not torch.equal(local(mine[2]), start_of_c)  # c, added late, was stepped
