"""Fidelity of GIFT's FP8 round trip on real weight gradients (the paper's Tables I-II and more).

A Llama-3-style model (torchtitan's Llama-3 definition, SDPA attention, separate wq/wk/wv)
is trained single-process on WikiText-2 ``test.txt`` with the local tokenizer (AdamW). At an
early, a middle and a late checkpoint, every Linear layer's weight gradient is captured for
per-rank token counts of about 2k, 8k and 32k, together with the second moments of that
layer's inputs (``A``) and output-gradients (``B``) over the same tokens. Each method's round
trip (whiten -> FP8 per-tensor quantize/dequantize -> unwhiten) is scored against the exact
gradient with the paper's Eq. 15 metrics.

Which statistics build the factors (stated in every table):

* ``same``: ``A`` from the very tokens whose gradient is sent. This is GIFT at a refresh
  step: the layer inputs exist after the forward pass, before the gradient is sent.
* ``heldout``: ``A`` from an independent batch of the same size at the same checkpoint:
  what a reused factor looks like without any model drift.
* ``stale``: ``A`` from a refresh ``lag`` optimizer steps earlier (the staleness section).

Also measured: factor staleness (0..200 steps), the stability of the boundary-hit layer
ranking (paper's Figure 3 profiling), error feedback over the whole run (single-process
emulation: the reduction is the identity, the round trip is the codec), and emulated FP4
E2M1 with per-block scales.

Run ``python benchmarks/fidelity.py --quick`` (< 5 min on 2 cores) or without flags (full).
Writes ``benchmarks/results/fidelity.md``, ``fidelity_per_layer.md`` and PNG plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tabulate import tabulate
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gift_compile.testing.text import TokenBatcher, load_token_ids, vocab_size  # noqa: E402
from fidelity_harness import (  # noqa: E402
    EUCLIDEAN,
    FeedbackChannel,
    Method,
    build_transform,
    capture_layers,
    measure,
    spearman,
)
from gift_compile.numerics import boundary_hits, quantize  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
TEXT = DATA / "wikitext-2" / "test.txt"
TOKENIZER = DATA / "tokenizer" / "tokenizer.json"
RESULTS = ROOT / "benchmarks" / "results"

# The paper's figures (one-step round trip, averaged over layers). Only the numbers the
# paper states are quoted; its qualitative claims are quoted as text.
PAPER_RELL2 = {"euclidean": "5.28e-2", "input": "1.77e-2"}
PAPER_TABLE1 = {
    "euclidean": "5.28e-2",
    "output": "output side adds ~nothing",
    "input": "1.77e-2",
    "both": "~ input side",
}
PAPER_TABLE2 = {"diag": "~ no gain (~ Euclidean)", "r8": "", "r16": "", "r32": "~ full", "full": "1.77e-2 (Cholesky)"}

PAPER_DAMPING = 1e-3  # the table methods' damping (the paper's setting) unless a method says otherwise

LAYER_TYPES = {"wq": "q", "wk": "k", "wv": "v", "wo": "o", "w1": "w1", "w2": "w2", "w3": "w3", "lm_head": "output"}
TYPE_ORDER = ["q", "k", "v", "o", "w1", "w2", "w3", "output"]


@dataclass(frozen=True)
class Settings:
    dim: int
    n_layers: int
    n_heads: int
    seq_len: int
    train_seqs: int  # sequences per optimizer step (tokens/step = train_seqs * seq_len)
    micro_seqs: int  # sequences per forward/backward when accumulating a large gradient
    steps: int
    checkpoints: dict[str, int]
    token_counts: tuple[int, ...]
    ranks: tuple[int, ...] = (8, 16, 32)
    stale_refresh: int = 40
    stale_lags: tuple[int, ...] = (0, 10, 25, 50, 100, 200)
    stale_tokens: int = 8192
    ef_refresh: int = 50  # K for the error-feedback run's whitened channel
    ef_types: tuple[str, ...] = ("w2", "output")  # layer types in the error-feedback run (cost)
    profile_window: int = 100  # boundary-hit profiling window (paper: first 100 steps)
    lr: float = 1e-3
    max_chars: int | None = None
    formats: tuple[str, ...] = ("e4m3", "e5m2")
    fp4_formats: tuple[str, ...] = ("fp4_b16", "fp4_b32")
    seed: int = 0


FULL = Settings(
    dim=256, n_layers=3, n_heads=8, seq_len=256, train_seqs=4, micro_seqs=8, steps=250,
    checkpoints={"early": 20, "middle": 80, "late": 150}, token_counts=(2048, 8192, 32768),
    stale_refresh=50, stale_lags=(0, 10, 25, 50, 100, 200),
)
QUICK = Settings(
    dim=128, n_layers=2, n_heads=4, seq_len=128, train_seqs=8, micro_seqs=16, steps=120,
    checkpoints={"early": 10, "middle": 60, "late": 120}, token_counts=(2048, 8192, 32768),
    stale_refresh=20, stale_lags=(0, 10, 25, 50, 100), stale_tokens=8192, ef_refresh=50, profile_window=50,
)
TINY = Settings(  # the test's configuration: seconds, not minutes
    dim=32, n_layers=1, n_heads=2, seq_len=32, train_seqs=2, micro_seqs=4, steps=4,
    checkpoints={"late": 4}, token_counts=(128,), ranks=(8,), stale_refresh=1, stale_lags=(0, 2),
    stale_tokens=128, ef_refresh=2, profile_window=2, max_chars=50_000,
)


# ----------------------------------------------------------------------------- model


def build_model(s: Settings, vocab: int) -> nn.Module:
    """torchtitan's Llama-3 (``Llama3Model``) at a CPU-trainable size, SDPA, separate wq/wk/wv."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        _NORM_INIT,
        Llama3Model,
        Llama3TransformerBlock,
        _depth_init,
        _output_linear_init,
    )

    dim = s.dim
    blocks = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
            attention=make_gqa_config(
                dim=dim, n_heads=s.n_heads, wqkv_param_init=_LINEAR_INIT, wo_param_init=_depth_init(i),
                inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=False,
                rope=ComplexRoPE.Config(dim=dim // s.n_heads, max_seq_len=s.seq_len, theta=500000, scaling="llama"),
            ),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
                w1_param_init=_LINEAR_INIT, w2w3_param_init=_depth_init(i),
            ),
        )
        for i in range(s.n_layers)
    ]
    config = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=blocks,
    )
    torch.manual_seed(s.seed)
    model = config.build()
    model.init_states()
    return model


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def layer_type(fqn: str) -> str:
    return LAYER_TYPES.get(fqn.rsplit(".", 1)[-1], fqn.rsplit(".", 1)[-1])


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ----------------------------------------------------------------------------- methods


def table_methods(ranks: tuple[int, ...]) -> list[Method]:
    """Every method of Tables I and II (names are unique; Euclidean first)."""
    methods = [EUCLIDEAN]
    for fact in ("cholesky", "symmetric"):
        methods += [
            Method(name=f"output-{fact}", side="output", factorization=fact, damping=PAPER_DAMPING),
            Method(name=f"input-{fact}", side="input", factorization=fact, damping=PAPER_DAMPING),
            Method(name=f"both-{fact}", side="both", factorization=fact, damping=PAPER_DAMPING),
        ]
        methods += [Method(name=f"input-{fact}-r{r}", side="input", factorization=fact, rank=r, damping=PAPER_DAMPING) for r in ranks]
    methods.append(Method(name="input-diag", side="input", diagonal=True, damping=PAPER_DAMPING))
    return methods


HEADLINE = ("euclidean", "input-cholesky", "input-symmetric", "input-symmetric-r32", "input-cholesky-r32")


class EighCache:
    """Memoize ``torch.linalg.eigh`` by the exact bytes of its input while active.

    ``geometry.factorize`` runs one full ``eigh`` of the damped ``A`` for the symmetric
    transform and again for every low-rank variant (``top_eigenpairs``); for the same ``A``
    those inputs are bit-identical, so one decomposition serves all of them. Results are
    unchanged (same input, same LAPACK call); only repeated work is skipped. Benchmark-only.
    """

    def __init__(self) -> None:
        self.store: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.original = torch.linalg.eigh

    def __enter__(self) -> "EighCache":
        def eigh(a: torch.Tensor, *args, **kwargs):
            if args or kwargs or a.dim() != 2:
                return self.original(a, *args, **kwargs)
            key = (a.dtype, tuple(a.shape), hashlib.sha1(a.detach().contiguous().cpu().numpy().tobytes()).hexdigest())
            if key not in self.store:
                self.store[key] = tuple(self.original(a))
            return tuple(t.clone() for t in self.store[key])

        torch.linalg.eigh = eigh
        return self

    def __exit__(self, *exc) -> None:
        torch.linalg.eigh = self.original
        self.store.clear()


class TransformCache:
    """Factorize each (side, factorization, rank, diagonal) once per sample; compose for ``both``."""

    def __init__(self, input_moment, output_moment) -> None:
        self.moments = {"input": input_moment, "output": output_moment}
        self.cache: dict[tuple, object] = {}

    def get(self, method: Method) -> dict:
        transform = {}
        for side in method.sides:
            key = (side, method.factorization, method.rank, method.diagonal, method.damping)
            if key not in self.cache:
                single = dataclasses.replace(method, side=side)
                self.cache[key] = build_transform(single, self.moments["input"], self.moments["output"])[side]
            transform[side] = self.cache[key]
        return transform


# ----------------------------------------------------------------------------- measurements


@dataclass
class Run:
    settings: Settings
    rows: list[dict] = field(default_factory=list)  # one-step round-trip metrics
    stale_rows: list[dict] = field(default_factory=list)
    hits: list[dict[str, float]] = field(default_factory=list)  # per step: layer -> boundary-hit rate
    ef_curve: list[dict[str, float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def evaluate_checkpoint(run: Run, model, layers, probe: TokenBatcher, heldout: TokenBatcher, phase: str, step: int, log, *, tables: bool = True) -> None:
    """Round-trip metrics at one checkpoint; ``tables=False``: headline methods only, no FP4."""
    s = run.settings
    methods = [m for m in table_methods(s.ranks) if m.rank is None or m.rank < s.dim]
    headline = [m for m in methods if m.name in HEADLINE]
    if not tables:
        methods = headline
    # Early and middle checkpoints: the headline methods at the middle token count only (time).
    for tokens in s.token_counts if tables else s.token_counts[len(s.token_counts) // 2 :][:1]:
        t0 = time.time()
        samples = capture_layers(model, layers, probe.batches(tokens, s.micro_seqs), loss_fn)
        other = capture_layers(model, layers, heldout.batches(tokens, s.micro_seqs), loss_fn, backward=False)
        for name, sample in samples.items():
            base = {"phase": phase, "step": step, "tokens": sample.tokens, "layer": name, "type": layer_type(name)}
            same = TransformCache(sample.input_moment, sample.output_moment)
            with EighCache():
                transforms = {method.name: same.get(method) for method in methods}
                held = TransformCache(other[name].input_moment, None)
                held_transforms = {method.name: held.get(method) for method in headline[1:]}
            for method in methods:
                transform = transforms[method.name]
                fmts = s.formats + (s.fp4_formats if tables and method in headline else ())
                for fmt in fmts:
                    run.rows.append({**base, "method": method.name, "a": "same", "fmt": fmt, **measure(sample.grad, transform, fmt)})
            for method in headline[1:]:
                for fmt in s.formats:
                    run.rows.append({**base, "method": method.name, "a": "heldout", "fmt": fmt, **measure(sample.grad, held_transforms[method.name], fmt)})
        log(f"checkpoint {phase} (step {step}): {tokens} tokens/rank evaluated in {time.time() - t0:.0f}s")


STALE_METHODS = (
    Method(name="input-symmetric", side="input", factorization="symmetric", damping=PAPER_DAMPING),
    Method(name="input-cholesky", side="input", factorization="cholesky", damping=PAPER_DAMPING),
    Method(name="input-symmetric-r32", side="input", factorization="symmetric", rank=32, damping=PAPER_DAMPING),
    Method(name="input-symmetric-damp1e-2", side="input", factorization="symmetric", damping=1e-2),
    Method(name="input-symmetric-damp1e-1", side="input", factorization="symmetric", damping=1e-1),
)


def stale_probe(run: Run, model, layers, probe: TokenBatcher, lag: int, refresh: dict | None) -> dict:
    """Round trips of a fresh gradient with factors from ``lag`` steps ago (and fresh ones)."""
    s = run.settings
    samples = capture_layers(model, layers, probe.batches(s.stale_tokens, s.micro_seqs), loss_fn, output_side=False)
    methods = [m for m in STALE_METHODS if m.rank is None or m.rank < s.dim]
    fresh = {}
    for name, sample in samples.items():
        fresh[name] = TransformCache(sample.input_moment, None)
        with EighCache():
            for method in methods:
                fresh[name].get(method)
    refresh = refresh if refresh is not None else fresh
    for name, sample in samples.items():
        base = {"lag": lag, "layer": name, "type": layer_type(name)}
        for fmt in s.formats:
            run.stale_rows.append({**base, "method": "euclidean", "a": "-", "fmt": fmt, **measure(sample.grad, {}, fmt)})
            for method in methods:
                for a, cache in (("stale", refresh[name]), ("fresh", fresh[name])):
                    run.stale_rows.append({**base, "method": method.name, "a": a, "fmt": fmt, **measure(sample.grad, cache.get(method), fmt)})
    return fresh


def run_benchmark(s: Settings, *, log=print, text: Path = TEXT, tokenizer: Path = TOKENIZER) -> Run:
    torch.manual_seed(s.seed)
    ids = load_token_ids(text, tokenizer, max_chars=s.max_chars)
    model = build_model(s, vocab_size(tokenizer))
    layers = linear_layers(model)
    train = TokenBatcher(ids, s.seq_len, seed=s.seed)
    probe = TokenBatcher(ids, s.seq_len, seed=s.seed + 1)
    heldout = TokenBatcher(ids, s.seq_len, seed=s.seed + 2)
    stale_batches = TokenBatcher(ids, s.seq_len, seed=s.seed + 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1)
    run = Run(s)
    start = time.time()
    # Error feedback: per layer, (Euclidean | whitened) x (no EF | EF), e4m3, over every step.
    variants = {(coords, ef): None for coords in ("euclidean", "whitened") for ef in (False, True)}
    ef_layers = [name for name in layers if layer_type(name) in s.ef_types]
    channels = {name: {v: FeedbackChannel("e4m3", error_feedback=v[1]) for v in variants} for name in ef_layers}
    sums = {name: {"exact": None, **{v: None for v in variants}} for name in ef_layers}
    ef_method = Method(name="input-symmetric", side="input", factorization="symmetric", damping=PAPER_DAMPING)
    refresh = None
    stale_steps = {s.stale_refresh + lag: lag for lag in s.stale_lags}
    checkpoint_steps = {step: phase for phase, step in s.checkpoints.items()}
    for step in range(s.steps + 1):
        if step in checkpoint_steps:
            phase = checkpoint_steps[step]
            evaluate_checkpoint(run, model, layers, probe, heldout, phase, step, log, tables=phase == list(s.checkpoints)[-1])
        if step in stale_steps:
            fresh = stale_probe(run, model, layers, stale_batches, stale_steps[step], refresh)
            if stale_steps[step] == 0:
                refresh = fresh
        if step == s.steps:
            break
        ef_refresh = step % s.ef_refresh == 0
        batch = [train.batch(s.train_seqs)]
        samples = capture_layers(model, layers, batch, loss_fn, input_side=ef_refresh, output_side=False)
        with torch.no_grad():
            rates, curve = {}, defaultdict(list)
            for name, sample in samples.items():
                g = sample.grad
                payload, _ = quantize(g, "e4m3")
                hit = boundary_hits(g, payload, "e4m3")
                rates[name] = (hit.saturated + hit.flushed).item() / g.numel()
                if name not in channels:
                    continue
                if ef_refresh:
                    transform = build_transform(ef_method, sample.input_moment)
                    for v in variants:
                        if v[0] == "whitened":
                            channels[name][v].set_transform(transform)
                acc = sums[name]
                acc["exact"] = g.clone() if acc["exact"] is None else acc["exact"] + g
                for v in variants:
                    sent = channels[name][v].send(g)
                    acc[v] = sent if acc[v] is None else acc[v] + sent
                    curve[v].append(((acc[v] - acc["exact"]).norm() / acc["exact"].norm()).item())
            run.hits.append(rates)
            run.ef_curve.append({f"{c}{'+EF' if ef else ''}": sum(vals) / len(vals) for (c, ef), vals in curve.items()})
        optimizer.step()
        with torch.no_grad():
            run.losses.append(loss_fn(model(batch[0][0]), batch[0][1]).item() if step % 10 == 0 else float("nan"))
        if step % 10 == 0 or step == s.steps - 1:
            log(f"step {step + 1}/{s.steps}  loss {run.losses[-1] if step % 10 == 0 else float('nan'):.3f}  elapsed {time.time() - start:.0f}s")
    run.seconds = time.time() - start
    return run


# ----------------------------------------------------------------------------- aggregation


def mean_metric(rows, metric="rel_l2", **where) -> float:
    vals = [r[metric] for r in rows if all(r[k] == v for k, v in where.items())]
    return sum(vals) / len(vals) if vals else float("nan")


def fmt_num(x: float) -> str:
    return "-" if x != x else f"{x:.3e}"


def tokens_label(n: int) -> str:
    return f"{n / 1024:.0f}k" if n >= 1024 else str(n)


def plot_curve(ax, xs, ys, style: str, label: str) -> None:
    """One curve, skipped when every point is missing (NaN: the method was not measured)."""
    if not all(y != y for y in ys):
        ax.plot(xs, ys, style, marker="o", label=label)


def headline_table(run: Run, phase: str) -> tuple[list[str], list[list]]:
    rows = [r for r in run.rows if r["phase"] == phase]
    tokens = sorted({r["tokens"] for r in rows})
    headers = ["method", "A from"] + [f"{f} {tokens_label(t)}" for f in run.settings.formats for t in tokens] + ["paper"]
    out = []
    for method in HEADLINE:
        for a in ("same", "heldout"):
            if method == "euclidean" and a == "heldout":
                continue
            vals = [mean_metric(rows, method=method, a=a, fmt=f, tokens=t) for f in run.settings.formats for t in tokens]
            if all(v != v for v in vals):
                continue
            eu = [mean_metric(rows, method="euclidean", fmt=f, tokens=t) for f in run.settings.formats for t in tokens]
            cells = [fmt_num(v) if method == "euclidean" else f"{fmt_num(v)} ({v / e:.2f}x)" for v, e in zip(vals, eu)]
            paper = PAPER_RELL2["euclidean"] if method == "euclidean" else (PAPER_RELL2["input"] if method == "input-cholesky" and a == "same" else "")
            out.append([method, "-" if method == "euclidean" else a, *cells, paper])
    return headers, out


def type_table(run: Run, phase: str, tokens: int, fmt: str, methods: list[str], paper: dict[str, str], key) -> tuple[list[str], list[list]]:
    """Per-layer-type mean RelL2 (and all-layer means of the four Eq. 15 metrics)."""
    rows = [r for r in run.rows if r["phase"] == phase and r["tokens"] == tokens and r["fmt"] == fmt and r["a"] == "same"]
    types = [t for t in TYPE_ORDER if any(r["type"] == t for r in rows)]
    headers = ["method", *[f"RelL2 {t}" for t in types], "RelL2 all", "cosine", "MaxErr", "MSE", "paper RelL2"]
    out = []
    for method in methods:
        sel = [r for r in rows if r["method"] == method]
        if not sel:
            continue
        out.append([
            method,
            *[fmt_num(mean_metric(sel, type=t)) for t in types],
            fmt_num(mean_metric(sel)),
            f"{mean_metric(sel, 'cosine'):.5f}",
            fmt_num(mean_metric(sel, "max_err")),
            fmt_num(mean_metric(sel, "mse")),
            paper.get(key(method), ""),
        ])
    return headers, out


def table1_key(method: str) -> str:
    return method.split("-")[0]


def table2_key(method: str) -> str:
    if method == "input-diag":
        return "diag"
    if method == "euclidean":
        return ""
    last = method.split("-")[-1]
    return last if last.startswith("r") else "full"


def per_layer_table(run: Run, phase: str, tokens: int) -> tuple[list[str], list[list]]:
    rows = [r for r in run.rows if r["phase"] == phase and r["tokens"] == tokens and r["a"] == "same"]
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    cols = [(m, f) for f in run.settings.formats for m in ("euclidean", "input-cholesky", "input-symmetric", "input-symmetric-r32", "input-diag")]
    headers = ["layer", *[f"{m} {f}" for m, f in cols]]
    out = []
    for layer in layers:
        out.append([layer, *[fmt_num(mean_metric(rows, layer=layer, method=m, fmt=f)) for m, f in cols]])
    return headers, out


def phase_table(run: Run) -> tuple[list[str], list[list]]:
    tokens = run.settings.token_counts[len(run.settings.token_counts) // 2]
    rows = [r for r in run.rows if r["tokens"] == tokens and r["a"] == "same"]
    phases = list(run.settings.checkpoints)
    headers = ["method", *[f"{f} {p} (step {run.settings.checkpoints[p]})" for f in run.settings.formats for p in phases]]
    out = []
    for method in HEADLINE:
        vals = [mean_metric(rows, method=method, fmt=f, phase=p) for f in run.settings.formats for p in phases]
        if all(v != v for v in vals):
            continue
        out.append([method, *map(fmt_num, vals)])
    return headers, out


def fp4_table(run: Run, phase: str) -> tuple[list[str], list[list]]:
    rows = [r for r in run.rows if r["phase"] == phase and r["a"] == "same"]
    tokens = sorted({r["tokens"] for r in rows})
    headers = ["method", *[f"{f} {tokens_label(t)}" for f in run.settings.fp4_formats for t in tokens]]
    out = []
    for method in HEADLINE:
        vals = [mean_metric(rows, method=method, fmt=f, tokens=t) for f in run.settings.fp4_formats for t in tokens]
        eu = [mean_metric(rows, method="euclidean", fmt=f, tokens=t) for f in run.settings.fp4_formats for t in tokens]
        if all(v != v for v in vals):
            continue
        out.append([method, *[fmt_num(v) if method == "euclidean" else f"{fmt_num(v)} ({v / e:.2f}x)" for v, e in zip(vals, eu)]])
    return headers, out


def stale_table(run: Run) -> tuple[list[str], list[list]]:
    s = run.settings
    headers = ["fmt", "method", "A", *[f"lag {lag}" for lag in s.stale_lags]]
    out = []
    for fmt in s.formats:
        out.append([fmt, "euclidean", "-", *[fmt_num(mean_metric(run.stale_rows, lag=lag, method="euclidean", fmt=fmt)) for lag in s.stale_lags]])
        for method in STALE_METHODS:
            for a in ("stale", "fresh"):
                vals = [mean_metric(run.stale_rows, lag=lag, method=method.name, a=a, fmt=fmt) for lag in s.stale_lags]
                if all(v != v for v in vals):
                    continue
                out.append([fmt, method.name, a, *map(fmt_num, vals)])
    return headers, out


def selection_analysis(run: Run) -> dict:
    """Boundary-hit ranking in the profiling window vs the last window; vs measured gain."""
    s = run.settings
    window = min(s.profile_window, len(run.hits) // 2)
    early, late = run.hits[:window], run.hits[-window:]
    layers = list(run.hits[0])
    mean_early = {n: sum(h[n] for h in early) / len(early) for n in layers}
    mean_late = {n: sum(h[n] for h in late) / len(late) for n in layers}
    rank_early = sorted(layers, key=lambda n: -mean_early[n])
    rank_late = sorted(layers, key=lambda n: -mean_late[n])
    last = list(s.checkpoints)[-1]
    tokens = max(s.token_counts)
    gain = {}
    for n in layers:
        eu = mean_metric(run.rows, phase=last, tokens=tokens, layer=n, method="euclidean", fmt="e4m3", a="same")
        gi = mean_metric(run.rows, phase=last, tokens=tokens, layer=n, method="input-symmetric", fmt="e4m3", a="same")
        if eu != eu:  # token count is the rounded actual count
            rows = [r for r in run.rows if r["phase"] == last and r["layer"] == n and r["fmt"] == "e4m3" and r["a"] == "same"]
            big = max(r["tokens"] for r in rows)
            eu = mean_metric(rows, tokens=big, method="euclidean")
            gi = mean_metric(rows, tokens=big, method="input-symmetric")
        gain[n] = eu / gi
    ks = sorted({k for k in (4, 8, len(layers) // 4) if 0 < k <= len(layers)})
    return {
        "window": window,
        "steps": len(run.hits),
        "layers": layers,
        "early": mean_early,
        "late": mean_late,
        "gain": gain,
        "overlap": {k: len(set(rank_early[:k]) & set(rank_late[:k])) for k in ks},
        "spearman_early_late": spearman([mean_early[n] for n in layers], [mean_late[n] for n in layers]),
        "spearman_hits_gain": spearman([mean_early[n] for n in layers], [gain[n] for n in layers]),
        "top_early": rank_early[:max(ks)],
        "top_gain": sorted(layers, key=lambda n: -gain[n])[:max(ks)],
    }


def ef_table(run: Run) -> tuple[list[str], list[list]]:
    n = len(run.ef_curve)
    marks = sorted({m for m in (1, 10, 50, 100, 200, n) if m <= n})
    names = list(run.ef_curve[0])
    headers = ["coordinates", *[f"step {m}" for m in marks]]
    return headers, [[name, *[fmt_num(run.ef_curve[m - 1][name]) for m in marks]] for name in names]


# ----------------------------------------------------------------------------- output


def plots(run: Run, sel: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = run.settings
    files = []
    last = list(s.checkpoints)[-1]
    fig, axes = plt.subplots(1, len(s.formats), figsize=(5 * len(s.formats), 4), squeeze=False)
    for ax, fmt in zip(axes[0], s.formats):
        rows = [r for r in run.rows if r["phase"] == last and r["fmt"] == fmt]
        tokens = sorted({r["tokens"] for r in rows})
        for method in HEADLINE + ("input-diag",):
            for a, style in (("same", "-"), ("heldout", "--")):
                if method == "euclidean" and a == "heldout":
                    continue
                ys = [mean_metric(rows, method=method, a=a, tokens=t) for t in tokens]
                plot_curve(ax, tokens, ys, style, f"{method}" + (" (held-out A)" if a == "heldout" else ""))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank behind the gradient")
        ax.set_ylabel("RelL2 (mean over layers)")
        ax.set_title(f"{fmt}, {last} checkpoint")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "fidelity_tokens.png", dpi=110)
    plt.close(fig)
    files.append("fidelity_tokens.png")

    fig, axes = plt.subplots(1, len(s.formats), figsize=(5 * len(s.formats), 4), squeeze=False)
    for ax, fmt in zip(axes[0], s.formats):
        ax.plot(s.stale_lags, [mean_metric(run.stale_rows, lag=l, method="euclidean", fmt=fmt) for l in s.stale_lags], "k-o", label="euclidean")
        for method in STALE_METHODS:
            for a, style in (("stale", "-"), ("fresh", ":")):
                ys = [mean_metric(run.stale_rows, lag=l, method=method.name, a=a, fmt=fmt) for l in s.stale_lags]
                plot_curve(ax, s.stale_lags, ys, style, f"{method.name} ({a} A)")
        ax.axvline(50, color="grey", lw=0.5)
        ax.set_xlabel("steps since the factors were refreshed")
        ax.set_ylabel("RelL2 (mean over layers)")
        ax.set_title(f"factor staleness, {fmt}, {tokens_label(s.stale_tokens)} tokens")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "fidelity_staleness.png", dpi=110)
    plt.close(fig)
    files.append("fidelity_staleness.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    xs = [sel["early"][n] for n in sel["layers"]]
    axes[0].scatter(xs, [sel["late"][n] for n in sel["layers"]], s=12)
    axes[0].set_xlabel(f"boundary-hit rate, steps 0-{sel['window']}")
    axes[0].set_ylabel("boundary-hit rate, last window")
    axes[0].set_title(f"ranking stability (Spearman {sel['spearman_early_late']:.2f})")
    for t in TYPE_ORDER:
        names = [n for n in sel["layers"] if layer_type(n) == t]
        axes[1].scatter([sel["early"][n] for n in names], [sel["gain"][n] for n in names], s=14, label=t)
    axes[1].axhline(1.0, color="grey", lw=0.5)
    axes[1].set_xlabel(f"boundary-hit rate, steps 0-{sel['window']}")
    axes[1].set_ylabel("RelL2 gain (Euclidean / input-symmetric), e4m3")
    axes[1].set_title(f"hits vs gain (Spearman {sel['spearman_hits_gain']:.2f})")
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "fidelity_selection.png", dpi=110)
    plt.close(fig)
    files.append("fidelity_selection.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    steps = range(1, len(run.ef_curve) + 1)
    for name in run.ef_curve[0]:
        ax.plot(steps, [c[name] for c in run.ef_curve], label=name)
    ax.set_yscale("log")
    ax.set_xlabel("steps")
    ax.set_ylabel("RelL2 of the accumulated gradient")
    ax.set_title("error feedback (e4m3, single-process emulation)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "fidelity_error_feedback.png", dpi=110)
    plt.close(fig)
    files.append("fidelity_error_feedback.png")
    return files


def report(run: Run, mode: str, out: Path | None, *, make_plots: bool = True) -> str:
    s = run.settings
    last = list(s.checkpoints)[-1]
    big = max(r["tokens"] for r in run.rows if r["phase"] == last)
    sections: list[tuple[str, str, tuple]] = []
    sections.append(("Headline: mean RelL2 over all Linear layers, " + f"{last} checkpoint (step {s.checkpoints[last]})",
                     "Ratio to Euclidean in parentheses (< 1 = GIFT helps). `same`: A from the same tokens as the gradient (a refresh step); `heldout`: A from an independent batch of the same size (a reused factor without model drift). Paper: Table I (its Euclidean number equals our e5m2 floor).",
                     headline_table(run, last)))
    sections.append((f"Across training ({tokens_label(s.token_counts[len(s.token_counts) // 2])} tokens/rank, A from the same tokens)", "", phase_table(run)))
    t1 = ["euclidean", "output-cholesky", "input-cholesky", "both-cholesky", "output-symmetric", "input-symmetric", "both-symmetric"]
    t2 = ["euclidean", "input-diag", *[f"input-cholesky-r{r}" for r in s.ranks], "input-cholesky", *[f"input-symmetric-r{r}" for r in s.ranks], "input-symmetric"]
    for fmt in s.formats:
        sections.append((f"Table I ({fmt}, {tokens_label(big)} tokens/rank, {last}, A and B from the same tokens)",
                         "RelL2 per layer type (mean over layers of that type), then all-layer means of the Eq. 15 metrics.",
                         type_table(run, last, big, fmt, t1, PAPER_TABLE1, table1_key)))
    for fmt in s.formats:
        sections.append((f"Table II ({fmt}, {tokens_label(big)} tokens/rank, {last}, A from the same tokens)", "",
                         type_table(run, last, big, fmt, t2, PAPER_TABLE2, table2_key)))
    sections.append((f"Factor staleness ({tokens_label(s.stale_tokens)} tokens/rank, refresh at step {s.stale_refresh})",
                     "Mean RelL2 over layers of a gradient `lag` optimizer steps after the refresh; `stale`: factors from the refresh step's inputs (GIFT between refreshes); `fresh`: from the gradient's own tokens.",
                     stale_table(run)))
    sections.append((f"FP4 E2M1 emulation (per-block scales, {last})", "Ratio to Euclidean FP4 of the same block size in parentheses; A from the same tokens.", fp4_table(run, last)))
    sections.append((f"Error feedback (e4m3, single-process emulation, layer types {', '.join(s.ef_types)})",
                     f"Mean over those layers of ||sum of sent gradients - sum of exact gradients|| / ||sum of exact gradients|| after n training steps ({s.train_seqs * s.seq_len} tokens/step; fp32 sums). Whitened = input-symmetric refreshed every {s.ef_refresh} steps from that step's inputs; the residual is moved into the new coordinates at each refresh.",
                     ef_table(run)))
    sel = selection_analysis(run)
    sel_table = (["measure", "value"], [
        ["profiling window", f"steps 0-{sel['window']} vs steps {sel['steps'] - sel['window']}-{sel['steps']} (e4m3 boundary hits = saturations + flushes, per element)"],
        *[[f"top-{k} overlap", f"{v}/{k}"] for k, v in sel["overlap"].items()],
        ["Spearman(hits early, hits late)", f"{sel['spearman_early_late']:.2f}"],
        ["Spearman(hits early, gain)", f"{sel['spearman_hits_gain']:.2f} (gain = Euclidean/input-symmetric RelL2, e4m3, {last}, {tokens_label(big)})"],
        ["top layers by hits", ", ".join(sel["top_early"])],
        ["top layers by gain", ", ".join(sel["top_gain"])],
        ["mean hit rate early / late", f"{sum(sel['early'].values()) / len(sel['layers']):.2e} / {sum(sel['late'].values()) / len(sel['layers']):.2e}"],
    ])
    sections.append(("Selection stability (paper Figure 3 profiling)", "", sel_table))

    lines = [f"# Fidelity benchmark ({mode})", "",
             f"Model: torchtitan Llama-3, dim {s.dim}, {s.n_layers} layers, {s.n_heads} heads, seq {s.seq_len}; AdamW lr {s.lr}, "
             f"{s.train_seqs * s.seq_len} tokens/step, {s.steps} steps on WikiText-2 test.txt; loss {run.losses[0]:.2f} -> "
             f"{[l for l in run.losses if l == l][-1]:.2f}. Wall time {run.seconds / 60:.1f} min. Generated by `python benchmarks/fidelity.py{' --quick' if mode == 'quick' else ''}`.",
             "Round trip: whiten -> per-tensor-scaled FP8 quantize/dequantize (or FP4 per block) -> unwhiten; damping 1e-3 x mean eigenvalue.", ""]
    console = []
    for title, note, (headers, rows) in sections:
        lines += [f"## {title}", ""] + ([note, ""] if note else []) + [tabulate(rows, headers, tablefmt="github", disable_numparse=True), ""]
        console += [title, tabulate(rows, headers, tablefmt="simple", disable_numparse=True), ""]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if make_plots:
            files = plots(run, sel, out)
            lines += ["## Plots", ""] + [f"![{f}]({f})" for f in files] + [""]
        (out / "fidelity.md").write_text("\n".join(lines))
        per_layer = ["# Per-layer RelL2", ""]
        for phase in s.checkpoints:
            toks = sorted({r["tokens"] for r in run.rows if r["phase"] == phase})
            for t in toks:
                headers, rows = per_layer_table(run, phase, t)
                per_layer += [f"## {phase} (step {s.checkpoints[phase]}), {tokens_label(t)} tokens/rank, A from the same tokens", "",
                              tabulate(rows, headers, tablefmt="github", disable_numparse=True), ""]
        (out / "fidelity_per_layer.md").write_text("\n".join(per_layer))
    return "\n".join(console)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, 2k/8k tokens, < 5 min on 2 cores")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for markdown and PNG results")
    parser.add_argument("--steps", type=int, default=None, help="override the number of training steps")
    parser.add_argument("--replay", type=Path, default=None, help="re-render a saved fidelity_*.pt (same --quick flag)")
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    if args.steps is not None:
        s = dataclasses.replace(s, steps=args.steps)
    if args.replay is not None:
        run = Run(**{**torch.load(args.replay, weights_only=True), "settings": s})  # plain data: lists, dicts, numbers
    else:
        run = run_benchmark(s, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        args.out.mkdir(parents=True, exist_ok=True)
        # Raw measurements (git-ignored): --replay re-renders the report without re-running.
        torch.save({k: v for k, v in vars(run).items() if k != "settings"}, args.out / f"fidelity_{'quick' if args.quick else 'full'}.pt")
    print(report(run, "quick" if args.quick else "full", args.out))


if __name__ == "__main__":
    main()
