"""Misuse that used to give silently wrong results: each case now stops with a message that
names the problem, or gives the bit-identical result of the correct use.

Real gloo ranks, the public API (``replicate`` + ``gift_backend``, FSDP2 ``fully_shard``).
Configuration bounds and ``layers = [""]`` from TOML are in test_config.py / test_titan_config.py,
the cache key in test_cache_key.py, huge inputs' factors in test_geometry.py.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from gift_compile import GiftConfig, gift_backend, replicate
from gift_compile.agreement import GiftConfigMismatch
from gift_compile.backend import default_backend

CONFIG = GiftConfig(layers=("fc2",), low_rank=4)


class ThreeLayers(nn.Module):
    """Linear layers named like neither Llama's attention nor anything the defaults know."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def batch(step: int, rank: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1000 * step + rank)) * scale


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return replicate(ThreeLayers())


def grad_of(m: nn.Module, layer: str) -> torch.Tensor:
    return m.get_submodule(layer).parametrizations.weight.original.grad.clone()


def step(compiled, m, x, loss=lambda y: y.square().mean()) -> None:
    m.zero_grad()
    loss(compiled(x)).backward()


# -- 1. two models, one state ------------------------------------------------------------------
def two_models_two_backends(rank, world):
    """Model A beside model B (same layer names), each with gift_backend(CONFIG) of its own,
    against model A alone: A's gradients must not change by a bit."""
    solo_model, a_model, b_model = model(0), model(0), model(1)
    solo = torch.compile(solo_model, backend=gift_backend(CONFIG), fullgraph=True)
    a = torch.compile(a_model, backend=gift_backend(CONFIG), fullgraph=True)
    b = torch.compile(b_model, backend=gift_backend(CONFIG), fullgraph=True)
    same = []
    for s in range(4):
        step(solo, solo_model, batch(s, rank))
        step(a, a_model, batch(s, rank))
        step(b, b_model, batch(s + 100, rank, scale=3.0))  # another model's residual, basis and step
        same.append(torch.equal(grad_of(solo_model, "fc2"), grad_of(a_model, "fc2")))
    return same


def test_two_backends_keep_two_states(ranks):
    # Before: both backends shared the runtime "default", and model A's fc2 gradient came out
    # tens of percent off its solo run.
    for same in ranks(2).run(two_models_two_backends):
        assert same == [True] * 4


def one_backend_two_models(rank, world, by_name):
    first, second = model(0), model(1)
    backend = "gift" if by_name else gift_backend(CONFIG)
    step(torch.compile(first, backend=backend), first, batch(0, rank))
    with pytest.raises(ValueError) as info:
        step(torch.compile(second, backend=backend), second, batch(0, rank))
    # the first model's state was not touched by the refused call
    owner = default_backend() if by_name else backend
    return str(info.value), owner.runtime.counters["fc2"].steps


@pytest.mark.parametrize("by_name", [False, True], ids=["gift_backend", "backend='gift'"])
def test_one_backend_refuses_a_second_model(ranks, by_name):
    for message, steps in ranks(2).run(one_backend_two_models, by_name):
        assert "two models with a layer named 'fc1' are compiled with the same GIFT backend" in message
        assert "backend=gift_backend(config)) per model" in message
        assert steps == 1


def shared_on_purpose(rank, world):
    """A train step and an eval-mode forward of one model, each compiled with a backend that
    shares the first's state: one state, no error."""
    m = model(0)
    train = gift_backend(CONFIG)
    evaluate = gift_backend(share_state_with=train)
    step(torch.compile(m, backend=train), m, batch(0, rank))
    with torch.no_grad():
        torch.compile(m, backend=evaluate)(batch(1, rank))
    return evaluate.state is train.state and evaluate.runtime.counters["fc2"].steps == 1


def test_sharing_a_state_is_explicit(ranks):
    assert ranks(2).run(shared_on_purpose) == [True, True]


# -- 2. ranks that disagree --------------------------------------------------------------------
def disagreeing(rank, world, configs):
    m = model(0)
    compiled = torch.compile(m, backend=gift_backend(configs[rank]), fullgraph=True)
    try:
        step(compiled, m, batch(0, rank))
    except GiftConfigMismatch as error:
        return str(error)
    return None


@pytest.mark.parametrize("configs, expected", [
    # other layers whitened on each rank (of other shapes: fc2 is 32x32, fc3 8x32)
    ((CONFIG.replace(layers=("fc2",)), CONFIG.replace(layers=("fc3",))),
     ["layer 'fc2': rank 0: gift fp8 all_reduce(avg) [32, 32] x2; rank 1: euclidean fp8 all_reduce(avg) [32, 32] x2",
      "layer 'fc3': rank 0: euclidean fp8 all_reduce(avg) [8, 32] x2; rank 1: gift fp8 all_reduce(avg) [8, 32] x2",
      "layers: rank 0: ('fc2',); rank 1: ('fc3',)"]),
    ((CONFIG, CONFIG.replace(low_rank=8)), ["low_rank: rank 0: 4; rank 1: 8"]),
    ((CONFIG, CONFIG.replace(euclidean_dtype="bf16")),
     ["euclidean_dtype: rank 0: 'fp8'; rank 1: 'bf16'", "layer 'fc1': rank 0: euclidean fp8"]),
], ids=["other-layers", "low_rank", "euclidean_dtype"])
def test_ranks_that_disagree_stop_with_the_difference(ranks, configs, expected):
    # Before: other layers ran and gave each rank a different "average"; another low_rank
    # aborted the process inside gloo (collective size mismatch).
    messages = ranks(2).run(disagreeing, configs)
    assert messages[0] is not None and messages[0] == messages[1]  # every rank stops, saying the same
    for line in expected:
        assert line in messages[0], messages[0]


def same_shape_other_layer(rank, world):
    """Two 32x32 layers, one whitened per rank: the very case whose sums were silently wrong."""

    class Twins(nn.Module):
        def __init__(self):
            super().__init__()
            self.fa, self.fb = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            return self.fb(self.fa(x))

    torch.manual_seed(0)
    m = replicate(Twins())
    compiled = torch.compile(m, backend=gift_backend(CONFIG.replace(layers=(("fa",), ("fb",))[rank])), fullgraph=True)
    with pytest.raises(GiftConfigMismatch) as info:
        compiled(torch.randn(8, 32)).sum().backward()
    return str(info.value)


def test_same_shaped_layers_whitened_on_different_ranks_stop(ranks):
    message = ranks(2).run(same_shape_other_layer)[0]
    assert "layer 'fa': rank 0: gift fp8 all_reduce(avg) [32, 32] x2; rank 1: euclidean fp8" in message


# -- 5. finite inputs never make NaN -----------------------------------------------------------
def huge_inputs(rank, world, magnitude):
    m = model(0)
    exact_model = model(0)  # the same weights, reduced by replicate's exact fp32 all_reduce
    compiled = torch.compile(m, backend=gift_backend(GiftConfig(layers=("fc1", "fc2", "fc3"), low_rank=4)), fullgraph=True)
    errors = []
    for s in range(6):
        x = batch(s, rank, magnitude)
        step(compiled, m, x, loss=torch.mean)  # linear in the output: no square of 1e30 to overflow
        step(exact_model, exact_model, x, loss=torch.mean)
        want, got = grad_of(exact_model, "fc1"), grad_of(m, "fc1")
        got, want = got.double(), want.double()  # their squares overflow fp32
        errors.append(float((got - want).norm() / want.norm()) if bool(torch.isfinite(got).all()) else float("nan"))
    return errors


@pytest.mark.parametrize("magnitude", [1e18, 1e30])
def test_huge_finite_inputs_give_finite_gradients(ranks, magnitude):
    # Before: the fp32 input sketch overflowed from ~1e17 and every rank's reduced gradient was
    # all NaN, where fp32 and plain FP8 stay finite. Now the first steps send with T = I while
    # the sketch's scale adapts. Bound: two e4m3 roundings on the all-reduce route (the sender's,
    # then the shard owner's), each at most 2^-4 relative per element, so the Frobenius error is
    # below 2 * 2^-4 plus error feedback's carried residual; 0.15 leaves room for that.
    for errors in ranks(2).run(huge_inputs, magnitude):
        assert all(e == e and e < 0.15 for e in errors), errors


# -- 8. the first run of a newcomer ------------------------------------------------------------
def by_name_on_any_model(rank, world):
    m = model(0)
    compiled = torch.compile(m, backend="gift")
    for s in range(3):
        step(compiled, m, batch(s, rank))
    counters = default_backend().runtime.counters
    return {fqn: (c.path, c.steps) for fqn, c in counters.items()}


def test_backend_by_name_works_on_a_model_with_any_linear_names(ranks):
    # Before: the default layers ("w[qkvo]*") matched nothing in an fc1/fc2/fc3 model and the
    # first backward failed with an Inductor traceback.
    for counters in ranks(2).run(by_name_on_any_model):
        assert counters == {"fc1": ("gift", 3), "fc2": ("gift", 3), "fc3": ("gift", 3)}


# -- 4. corrupt or mismatched GIFT state -------------------------------------------------------
def trained_state(rank, world, config=CONFIG, steps=2):
    m = model(0)
    backend = gift_backend(config)
    compiled = torch.compile(m, backend=backend, fullgraph=True)
    for s in range(steps):
        step(compiled, m, batch(s, rank))
    return backend, m, compiled


def refusals(rank, world, tmp):
    """Every way a saved state can be unusable, each refused by load_state_dict with its reason."""
    backend, m, _ = trained_state(rank, world)
    saved = backend.state.state_dict()
    torch.save(saved, f"{tmp}/gift_rank{rank}.pt")
    messages = {}

    def refused(name, state_dict, config=CONFIG, shapes_of=None):
        fresh = gift_backend(config)
        with pytest.raises(ValueError) as info:
            fresh.load_state_dict(state_dict, model=shapes_of)
        assert fresh.state.fqns() == []  # refused before anything was created or loaded
        messages[name] = str(info.value)

    for buffer in ("residual", "basis"):
        corrupt = dict(saved)
        corrupt[f"layers.fc2.{buffer}"] = saved[f"layers.fc2.{buffer}"].clone()
        corrupt[f"layers.fc2.{buffer}"][0, 0] = float("nan")
        refused(buffer, corrupt)
    refused("low_rank", saved, CONFIG.replace(low_rank=8))
    refused("damping_exponent", {**saved, "layers.fc2.damping_exponent": torch.tensor(1000)})  # damping * 2^1000: inf
    refused("fallbacks_in_a_row", {**saved, "layers.fc2.fallbacks_in_a_row": torch.tensor(-1)})
    refused("shadow_verdict", {**saved, "layers.fc2.shadow_verdict": torch.tensor(-0.5, dtype=torch.float64)})
    before_adaptive = {k: v for k, v in saved.items()
                       if not k.endswith(("damping_exponent", "damping_direction", "last_verdict", "fallbacks_in_a_row", "shadow_verdict"))}
    older = gift_backend(CONFIG)
    older.load_state_dict(before_adaptive, model=m)  # saved before adaptive damping, retry doubling, gated retries: they start afresh
    assert older.state.layer("fc2").damping == CONFIG.damping and float(older.state.layer("fc2").last_verdict) < 0
    assert int(older.state.layer("fc2").fallbacks_in_a_row) == 0 and float(older.state.layer("fc2").shadow_verdict) < 0

    class Wider(ThreeLayers):
        def __init__(self):
            super().__init__()
            self.fc2 = nn.Linear(32, 48)

    refused("shape", saved, shapes_of=Wider())
    ok = gift_backend(CONFIG)
    ok.load_state_dict(saved, model=m)  # the right state for the right model loads
    return messages


def test_unusable_states_are_refused_when_loaded(ranks, tmp_path):
    # Before: a NaN residual gave one all-NaN gradient on every rank, a NaN basis a LAPACK
    # error ("linalg.eigh ... failed to converge") at every later backward; both loaded fine.
    for messages in ranks(2).run(refusals, str(tmp_path)):
        assert "layer 'fc2' buffer 'residual' holds 1 non-finite value(s) (NaN/Inf): the checkpoint is corrupt" in messages["residual"]
        assert "layer 'fc2' buffer 'basis' holds 1 non-finite value(s)" in messages["basis"]
        assert "saved with low_rank=4, this config has low_rank=8" in messages["low_rank"]
        assert "layer 'fc2' buffer 'damping_exponent' is 1000, outside [-7, 7]: the checkpoint is corrupt" in messages["damping_exponent"]
        assert "layer 'fc2' buffer 'fallbacks_in_a_row' is -1, outside [0, 2147483647]" in messages["fallbacks_in_a_row"]
        assert "layer 'fc2' buffer 'shadow_verdict' is -0.5, neither a ratio (>= 0) nor -1.0" in messages["shadow_verdict"]
        assert "layer 'fc2' was saved for (32, 32) gradients, this model's layer has (48, 32)" in messages["shape"]


def load_on_three(rank, world, tmp):
    backend = gift_backend(CONFIG)
    with pytest.raises(ValueError) as info:
        backend.load_state_dict(torch.load(f"{tmp}/gift_rank{rank % 2}.pt"))
    return str(info.value)


def test_a_state_saved_on_two_ranks_is_refused_on_three(ranks, tmp_path):
    ranks(2).run(refusals, str(tmp_path))  # writes gift_rank{0,1}.pt
    messages = ranks(3).run(load_on_three, str(tmp_path))
    assert "saved by rank 0 of 2 ranks, loaded on rank 0 of 3" in messages[0]
    assert "saved by rank 0 of 2 ranks, loaded on rank 2 of 3" in messages[2]
    assert "resume on 2 ranks, each loading the state it saved" in messages[1]


def restart_after_corruption(rank, world):
    """A basis that turns NaN in memory between steps (nothing a checkpoint check can see)."""
    backend, m, compiled = trained_state(rank, world)
    backend.state.layer("fc2").basis[0, 0] = float("nan")
    step(compiled, m, batch(5, rank))
    finite = bool(torch.isfinite(grad_of(m, "fc2")).all())
    step(compiled, m, batch(6, rank))
    counters = backend.runtime.counters["fc2"].as_dict()
    return finite, counters["restarts"], counters["steps"], bool(torch.isfinite(backend.state.layer("fc2").basis).all())


def test_a_non_finite_basis_restarts_fresh_instead_of_failing_lapack(ranks):
    for finite, restarts, steps, basis_finite in ranks(2).run(restart_after_corruption):
        assert finite and basis_finite and restarts == 1 and steps == 4
