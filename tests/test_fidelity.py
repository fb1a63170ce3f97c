"""The fidelity harness (benchmarks/fidelity.py) and its library helpers, on a tiny model.

Checks against independent computations:

* The Euclidean method is exactly ``numerics.fp8_round_trip``: the harness's rows must equal
  ``fidelity(fp8_round_trip(G), G)`` bit for bit on gradients captured independently.
* Identity whitening must reproduce the Euclidean numbers: ``G @ I`` is exact in fp32 (every
  output element is one product by 1.0 plus exact zeros), so the codec sees the same tensor.
* A known whitening reproduces a hand computation (the paper note's 2x2 example).
* Error feedback keeps ``sum(sent) + unwhiten(R) == sum(G)`` (telescoping), also across a
  change of coordinates; without feedback the error of the sum is the sum of the errors.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from gift_compile.testing.text import TokenBatcher, load_token_ids, vocab_size
from fidelity_harness import (
    EUCLIDEAN,
    FeedbackChannel,
    Method,
    build_transform,
    capture_layers,
    codec_round_trip,
    measure,
    round_trip,
    spearman,
)
from gift_compile.geometry import identity_whitening
from gift_compile.numerics import fidelity, fp4_e2m1_round_trip, fp8_round_trip

ROOT = Path(__file__).resolve().parents[1]


def bundled_text() -> tuple[Path, Path]:
    """The corpus and tokenizer that ship with the project (the benchmark reads WikiText-2)."""
    from gift_compile.titan_integration.datasets import DEFAULT_CORPUS, default_tokenizer_dir

    return DEFAULT_CORPUS, default_tokenizer_dir() / "tokenizer.json"


def _bench():
    pytest.importorskip("torchtitan")
    pytest.importorskip("tokenizers")
    spec = importlib.util.spec_from_file_location("fidelity_bench", ROOT / "benchmarks" / "fidelity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _bench()


@pytest.fixture(scope="module")
def tiny_run(bench):
    text, tokenizer = bundled_text()
    return bench.run_benchmark(bench.TINY, log=lambda msg: None, text=text, tokenizer=tokenizer)


def _tiny_samples(bench, seed: int):
    s = bench.TINY
    ids = load_token_ids(*bundled_text(), max_chars=s.max_chars)
    model = bench.build_model(s, vocab_size(bundled_text()[1]))
    layers = bench.linear_layers(model)
    batches = TokenBatcher(ids, s.seq_len, seed=seed).batches(s.token_counts[0], s.micro_seqs)
    return model, layers, capture_layers(model, layers, batches, bench.loss_fn)


def test_token_batcher_shapes_shift_and_determinism(bench):
    ids = load_token_ids(*bundled_text(), max_chars=5000)
    assert ids.dtype == torch.int64 and int(ids.max()) < vocab_size(bundled_text()[1])
    a, b = TokenBatcher(ids, 16, seed=3), TokenBatcher(ids, 16, seed=3)
    x, y = a.batch(4)
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert torch.equal(x, b.batch(4)[0])  # same seed, same windows
    micro = TokenBatcher(ids, 16, seed=0).batches(100, 2)  # 100 tokens -> 6 sequences -> 2+2+2
    assert [m[0].shape[0] for m in micro] == [2, 2, 2]


def test_capture_accumulates_the_mean_loss_gradient(bench):
    """Micro-batch accumulation must equal one big batch, and A must be E[x x^T] of the inputs."""
    model, layers, samples = _tiny_samples(bench, seed=5)
    s = bench.TINY
    ids = load_token_ids(*bundled_text(), max_chars=s.max_chars)
    batches = TokenBatcher(ids, s.seq_len, seed=5).batches(s.token_counts[0], s.micro_seqs)
    inputs, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    seen = {}

    def keep_input(module, args, output) -> None:  # returns None: must not replace the output
        seen["x"] = args[0].detach()

    handle = layers["lm_head"].register_forward_hook(keep_input)
    model.zero_grad()
    bench.loss_fn(model(inputs), targets).backward()
    handle.remove()
    for name, layer in layers.items():
        torch.testing.assert_close(samples[name].grad, layer.weight.grad, rtol=1e-4, atol=1e-7)
    x = seen["x"].reshape(-1, seen["x"].shape[-1])
    assert samples["lm_head"].tokens == x.shape[0] == s.token_counts[0]
    torch.testing.assert_close(samples["lm_head"].input_moment, x.T @ x / x.shape[0], rtol=1e-4, atol=1e-6)
    assert samples["lm_head"].output_moment.shape == (layers["lm_head"].out_features,) * 2


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_euclidean_equals_direct_codec_and_identity_whitening(bench, fmt):
    _, layers, samples = _tiny_samples(bench, seed=1)
    for name, sample in samples.items():
        g = sample.grad
        direct = fidelity(fp8_round_trip(g, fmt), g)
        ours = measure(g, build_transform(EUCLIDEAN, sample.input_moment), fmt)
        assert ours["rel_l2"] == direct.rel_l2.item() and ours["mse"] == direct.mse.item()
        eye = {"input": identity_whitening("dense", g.shape[1], g.shape[1])}
        assert measure(g, eye, fmt) == ours
        # The floor: round-to-nearest with m mantissa bits has relative error <= 2^-(m+1)
        # per element in the normal range, so RelL2 <= 2^-(m+1) (flushes are negligible here).
        assert 0 < ours["rel_l2"] <= 2.0 ** -({"e4m3": 3, "e5m2": 2}[fmt] + 1)


def test_harness_rows_match_an_independent_computation(bench):
    """evaluate_checkpoint on a fresh model == fp8_round_trip of independently captured gradients."""
    s = bench.TINY
    ids = load_token_ids(*bundled_text(), max_chars=s.max_chars)
    model, layers, samples = _tiny_samples(bench, seed=11)
    run = bench.Run(s)
    bench.evaluate_checkpoint(run, model, layers, TokenBatcher(ids, s.seq_len, seed=11), TokenBatcher(ids, s.seq_len, seed=12), "late", 0, lambda m: None)
    methods = {m.name for m in bench.table_methods(s.ranks) if m.rank is None or m.rank < s.dim}
    assert {r["method"] for r in run.rows} == methods
    for name, sample in samples.items():
        for fmt in s.formats:
            (row,) = [r for r in run.rows if r["layer"] == name and r["method"] == "euclidean" and r["fmt"] == fmt]
            assert row["rel_l2"] == pytest.approx(fidelity(fp8_round_trip(sample.grad, fmt), sample.grad).rel_l2.item(), rel=1e-4)
            (row,) = [r for r in run.rows if r["layer"] == name and r["method"] == "input-symmetric" and r["fmt"] == fmt and r["a"] == "same"]
            method = Method(name="input-symmetric", side="input", factorization="symmetric", damping=1e-3)
            expected = measure(sample.grad, build_transform(method, sample.input_moment), fmt)["rel_l2"]
            assert row["rel_l2"] == pytest.approx(expected, rel=1e-3)
        (row,) = [r for r in run.rows if r["layer"] == name and r["method"] == "euclidean" and r["fmt"] == "fp4_b16"]
        assert row["rel_l2"] == pytest.approx(fidelity(fp4_e2m1_round_trip(sample.grad, 16), sample.grad).rel_l2.item(), rel=1e-4)


def test_known_whitening_reproduces_the_hand_computation():
    """The paper note's example: A = [[4,3],[3,4]], g = (5,1), Cholesky T = L^-T.

    Whitened: L^-1 g = (2.5, -2.0788). e4m3 with per-tensor scale 2.5/448: 2.5 -> 448 exactly;
    -2.0788 -> -372.5 units, between the e4m3 neighbours 352 and 384 (spacing 32), rounds to
    -384 -> -2.142857. Unwhitened: L u = (5, 3.75 - 1.3229 * 2.142857) = (5, 0.91521), so the
    error is (0, -1.3229 * 0.064052) and RelL2 = 0.084732 / sqrt(26) = 0.016617. Euclidean:
    scale 5/448, 1 -> 89.6 units -> 88 -> 0.982143, RelL2 = 0.017857 / sqrt(26) = 0.0035021.
    """
    a = torch.tensor([[4.0, 3.0], [3.0, 4.0]])
    g = torch.tensor([[5.0, 1.0]])
    chol = Method(name="c", side="input", factorization="cholesky", damping=1e-3)
    transform = build_transform(chol, a, damping=1e-12)
    torch.testing.assert_close(transform["input"].whiten(g), torch.tensor([[2.5, -2.0788046]]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(round_trip(g, transform, "e4m3"), torch.tensor([[5.0, 3.75 - math.sqrt(1.75) * 384 * 2.5 / 448]]), rtol=1e-5, atol=1e-5)
    w2 = 1.0 - 1.5 * 2.5  # numerator of the second whitened coordinate
    l22 = math.sqrt(4 - 1.5**2)
    hand = l22 * (384 * 2.5 / 448 - (-w2 / l22)) / math.sqrt(26)
    assert measure(g, transform, "e4m3")["rel_l2"] == pytest.approx(hand, rel=1e-5)
    assert hand == pytest.approx(0.016617, rel=1e-4)
    assert measure(g, {}, "e4m3")["rel_l2"] == pytest.approx((1 - 88 * 5 / 448) / math.sqrt(26), rel=1e-6)


def test_fp4_codec_dispatch():
    x = torch.randn(8, 64)
    assert torch.equal(codec_round_trip(x, "fp4_b16"), fp4_e2m1_round_trip(x, 16))
    assert torch.equal(codec_round_trip(x, "fp4_b32"), fp4_e2m1_round_trip(x, 32))
    with pytest.raises(ValueError, match="unknown codec"):
        codec_round_trip(x, "fp4_b8")


@pytest.mark.parametrize("whitened", [False, True])
def test_error_feedback_telescopes(whitened):
    """With EF the error of the running sum is exactly the (unwhitened) residual, which stays
    bounded by one step's quantization error; without EF it is the sum of every step's error."""
    torch.manual_seed(0)
    d_out, d_in, steps = 16, 24, 60
    mix = torch.randn(d_in, d_in) * torch.logspace(-2, 0, d_in)
    moment = lambda: (lambda x: x.T @ x / x.shape[0])(torch.randn(256, d_in) @ mix)  # noqa: E731
    method = Method(name="s", side="input", factorization="symmetric", damping=1e-3)
    ef, plain = FeedbackChannel("e5m2", error_feedback=True), FeedbackChannel("e5m2", error_feedback=False)
    total, sent_ef, sent_plain = torch.zeros(d_out, d_in, dtype=torch.float64), 0, 0
    for step in range(steps):
        if whitened and step % 20 == 0:  # refresh: the residual must move into the new coordinates
            transform = build_transform(method, moment())
            ef.set_transform(transform)
            plain.set_transform(transform)
        g = torch.randn(d_out, d_in) @ mix
        total += g.double()
        sent_ef = sent_ef + ef.send(g).double()
        sent_plain = sent_plain + plain.send(g).double()
    residual = ef.residual if not whitened else ef.transform["input"].unwhiten(ef.residual)
    torch.testing.assert_close(sent_ef + residual.double(), total, rtol=0, atol=1e-4 * total.abs().max().item())
    err_ef = (sent_ef - total).norm() / total.norm()
    err_plain = (sent_plain - total).norm() / total.norm()
    assert err_ef < 0.5 * err_plain  # independent errors add up (~sqrt(steps)); EF's does not


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1,2,3) vs (1,3,2): 1 - 6*(0+1+1)/(3*8) = 0.5
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_tiny_harness_end_to_end(bench, tiny_run, tmp_path):
    """The smallest configuration runs every section and writes the report and plots."""
    s = bench.TINY
    rows = tiny_run.rows
    layers = {r["layer"] for r in rows}
    assert len(layers) == 7 * s.n_layers + 1  # wq wk wv wo w1 w2 w3 per block + lm_head
    for r in rows:
        assert math.isfinite(r["rel_l2"]) and r["cosine"] <= 1.0 + 1e-6
        # Factors from the very tokens sent keep the round trip close; held-out factors need
        # not (on this 32-wide model they can lose to Euclidean by far: the staleness story).
        assert r["a"] != "same" or r["cosine"] > 0.9, r
    for fmt, floor in (("e4m3", 2.0**-4), ("e5m2", 2.0**-3)):
        eu = [r["rel_l2"] for r in rows if r["method"] == "euclidean" and r["fmt"] == fmt]
        assert eu and all(0 < v <= floor for v in eu)
    # lag 0: the stale factors are the fresh ones, so both columns must agree exactly
    lag0 = [r for r in tiny_run.stale_rows if r["lag"] == 0 and r["method"] != "euclidean"]
    by_key = {}
    for r in lag0:
        by_key.setdefault((r["layer"], r["method"], r["fmt"]), {})[r["a"]] = r["rel_l2"]
    assert by_key and all(v["stale"] == v["fresh"] for v in by_key.values())
    assert len(tiny_run.hits) == s.steps and len(tiny_run.ef_curve) == s.steps
    first = tiny_run.ef_curve[0]
    assert first["euclidean"] == first["euclidean+EF"]  # no residual before the first step
    text = bench.report(tiny_run, "tiny", tmp_path)
    assert "Table I" in text and "Table II" in text and "FP4" in text and "staleness" in text
    written = {p.name for p in tmp_path.iterdir()}
    assert {"fidelity.md", "fidelity_per_layer.md", "fidelity_tokens.png", "fidelity_staleness.png"} <= written
