"""Per-layer state and the eager reference of Algorithm 1, on real gloo ranks."""

import pytest
import torch
from torch import nn

from gift_compile.config import GiftConfig
from gift_compile.launch import run_on_ranks
from gift_compile.reference import GiftReducer, GiftReference
from gift_compile.state import GiftState

D_OUT, D_IN, TOKENS, STEPS = 16, 32, 64, 60


def layer_inputs(rank, step):
    """Anisotropic, correlated layer inputs (like real activations) and a gradient with a
    persistent per-rank component, so FP8 rounding errors are systematic from step to step."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    mixing = torch.linspace(3, 0.05, D_IN)[:, None] * torch.randn(D_IN, D_IN, generator=torch.Generator().manual_seed(99))
    x = torch.randn(TOKENS, D_IN, generator=g) @ mixing
    grad_out = torch.randn(D_OUT, TOKENS, generator=torch.Generator().manual_seed(rank)) + 0.05 * torch.randn(D_OUT, TOKENS, generator=g)
    return grad_out @ x, x


def exact_avg(step, world):
    return sum(layer_inputs(r, step)[0].double() for r in range(world)) / world


def run_steps(rank, world, config, collective):
    reducer = GiftReducer(config)
    outputs, checksums = [], []
    for step in range(STEPS):
        grad, x = layer_inputs(rank, step)
        outputs.append(reducer.reduce_layer("fc", grad, x, collective=collective))
        checksums.append(reducer.state.checksum())
    layer = reducer.state.layer("fc")
    restored = GiftState(config)
    restored.layer("fc", D_OUT, D_IN)
    restored.load_state_dict(reducer.state.state_dict())
    return {
        "outputs": outputs,
        "checksums": checksums,
        "refreshes": int(layer.refreshes),
        "state": reducer.state.state_dict(),
        "restored": restored.state_dict(),
    }


CONFIG = GiftConfig(layers=("fc",), rank=8, refresh_interval=10)


@pytest.fixture(scope="module")
def all_reduce_run():
    return run_on_ranks(run_steps, 2, CONFIG, "all_reduce")


def test_reduced_gradients_are_identical_on_all_ranks(all_reduce_run):
    first, second = all_reduce_run
    assert first["refreshes"] == STEPS // 10  # steps 0, 10, ..., 50
    for a, b in zip(first["outputs"], second["outputs"]):
        assert torch.equal(a, b)


def test_factors_are_identical_across_ranks(all_reduce_run):
    first, second = all_reduce_run
    assert first["checksums"] == second["checksums"]
    assert len(set(c.item() for c in first["checksums"])) == STEPS // 10  # each refresh changed them


def test_state_dict_round_trip_is_exact(all_reduce_run):
    for rank_result in all_reduce_run:
        state, restored = rank_result["state"], rank_result["restored"]
        assert state.keys() == restored.keys() and any("residual" in k for k in state)
        for key in state:
            assert torch.equal(state[key], restored[key]), key


def test_gift_error_is_fp8_sized(all_reduce_run):
    # Each step quantizes twice (sender, then the reduced shard); with the whitened residual
    # carried over, a single step's error stays of the order of the e4m3 half-ulp 2^-4.
    for step, out in enumerate(all_reduce_run[0]["outputs"]):
        exact = exact_avg(step, 2)
        assert (out.double() - exact).norm() / exact.norm() < 2 * 2.0**-4, step


def running_sum_errors(result, world):
    total, exact_total, errors = 0, 0, []
    for step, out in enumerate(result["outputs"]):
        total = total + out.double()
        exact_total = exact_total + exact_avg(step, world)[: out.shape[0]]
        errors.append((total - exact_total).norm().item())
    return errors


def test_error_feedback_bounds_the_accumulated_error():
    # Reduce-scatter quantizes once, on the sender: with error feedback the sum of what was
    # sent telescopes to the sum of the true gradients minus the last residual, so the running
    # error stays O(one step). Without it the systematic rounding error adds up every step.
    with_ef = run_on_ranks(run_steps, 2, CONFIG, "reduce_scatter")[0]
    without_ef = run_on_ranks(run_steps, 2, CONFIG.replace(error_feedback=False), "reduce_scatter")[0]
    ef_errors, plain_errors = running_sum_errors(with_ef, 2), running_sum_errors(without_ef, 2)
    print(f"accumulated error after {STEPS} steps: with EF {ef_errors[-1]:.3g}, without {plain_errors[-1]:.3g}")
    assert max(ef_errors[STEPS // 2 :]) < 2 * max(ef_errors[: STEPS // 2])  # bounded, not growing
    # Grows with the number of steps (sub-linearly: each refresh re-draws the rounding pattern).
    assert plain_errors[-1] > 1.5 * plain_errors[STEPS // 6]
    assert plain_errors[-1] > 4 * ef_errors[-1]  # measured: 160 vs 27.5


def mismatched_shapes(rank, world):
    reducer = GiftReducer(CONFIG.replace(rank=2))
    grad = torch.randn(8, 4 + rank)
    with pytest.raises(RuntimeError, match="different gradient shapes across ranks"):
        reducer.reduce_layer("fc", grad, torch.randn(10, 4 + rank))
    return True


def test_mismatched_shapes_across_ranks_raise():
    assert run_on_ranks(mismatched_shapes, 2) == [True, True]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(16, 32), nn.Linear(32, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.fc2(torch.relu(self.fc1(x))))


def model_step(rank, world, config):
    torch.manual_seed(0)
    model = MLP()
    reference = GiftReference(model, config)
    x = torch.randn(4, 24, 16, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    reference.reduce_gradients()
    return local, {n: p.grad for n, p in model.named_parameters()}, reference.selected


def test_reference_reduces_every_parameter_of_a_model():
    results = run_on_ranks(model_step, 2, GiftConfig(layers=("fc2",), rank=4))
    (local0, reduced0, selected), (local1, reduced1, _) = results
    assert selected == ["fc2"]
    for name in local0:
        exact = (local0[name].double() + local1[name].double()) / 2
        err = (reduced0[name].double() - exact).norm() / exact.norm()
        # fp32 path (biases, norm): exact to rounding; FP8 paths: two e4m3 roundings.
        limit = 2 * 2.0**-4 if name.endswith("weight") and name.startswith("fc") else 1e-6
        assert err < limit, (name, err)
        assert torch.equal(reduced0[name], reduced1[name])


def test_patterns_matching_nothing_list_the_linear_layers():
    with pytest.raises(ValueError, match=r"\['w9'\] match no Linear layer.*\['fc1', 'fc2'\]"):
        GiftReference(MLP(), GiftConfig(layers=("w9",)))


def test_state_lives_on_the_gradients_device_and_bookkeeping_on_the_host():
    # "meta" stands in for an accelerator here: which buffers move must not depend on which
    # device it is. Step and refresh counts stay on the host, so the per-step "is a refresh
    # due?" check never waits for a GPU.
    state = GiftState(CONFIG)
    layer = state.layer("fc", D_OUT, D_IN)  # created before any gradient, as a checkpoint load does
    assert state.layer("fc", D_OUT, D_IN, torch.device("meta")) is layer
    devices = {name: buffer.device.type for name, buffer in layer.named_buffers()}
    assert {name for name, device in devices.items() if device == "cpu"} == {"shape", "step", "refreshes"}
    assert devices["residual"] == devices["input_basis"] == devices["input_moment"] == "meta"
    assert layer.is_refresh_step()
    fresh = GiftState(CONFIG).layer("fc", D_OUT, D_IN, torch.device("meta"))
    assert fresh.residual.device.type == "meta" and fresh.step.device.type == "cpu"
    moved = GiftState(CONFIG)
    moved.layer("fc", D_OUT, D_IN)
    moved.to("meta")  # Module.to moves the state too, but not the host bookkeeping
    assert moved.layer("fc").residual.device.type == "meta" and moved.layer("fc").step.device.type == "cpu"
    assert moved.layer("fc").device.type == "meta"
