"""torchtitan Llama-3 debug model on CPU ranks: FP32 vs bf16 vs Euclidean FP8 vs GIFT gradients,
on both trainers.

    python benchmarks/titan_train.py [--steps 300] [--variants fp32,bf16,fp8,gift] [--trainers graph,standard]
                                     [--results titan_train]

Each row is the same gift-titan job (examples/llama3_debug_cpu.toml, seed 0) trained on
WikiText-2 test.txt and validated on valid.txt (../shared/data), on one of two trainers:

- graph:    torchtitan's graph_trainer (SimpleFSDP, joint graph, the ``gift`` pass pipeline)
- standard: torchtitan's standard trainer (FSDP2 fully_shard per block; GIFT owns each block's
            reduce-scatter, gift_compile.fsdp)
- standard_hsdp: the same on 4 ranks as HSDP, 2 replicas x 2 shards (GIFT also owns the
            replicas' all-reduce); not in the default set

and differing only in how gradients travel:

- fp32:  [gift] enabled with every path fp32 (the pass changes nothing, it only counts bytes)
- bf16:  every weight gradient reduced in bf16
- fp8:   Euclidean FP8 (per-tensor scale) for every weight gradient, no whitening
- gift:  GIFT: attention projections whitened (current-step factors, rank 32, error
         feedback), the rest Euclidean FP8
- gift_w2: GIFT with the paper's choice, the `w2` layers whitened
- fp4:   Euclidean FP4 (NVFP4: E2M1, an E4M3 scale per 16 values) for every weight gradient
- gift_fp4: GIFT on FP4: attention projections whitened, every wire FP4

Prints a table (final train loss = mean of the last 10 steps, validation loss / perplexity at
the end, tokens/s, gradient bytes per step per rank and the statistics' bytes, peak RSS of
rank 0) and writes benchmarks/results/<results>.md and <results>_loss.png.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gift_compile.testing.titan_jobs import JobResult, run_job  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
JOB = ROOT / "examples" / "llama3_debug_cpu.toml"

VARIANTS = {
    "fp32": ["--gift.layers", "", "--gift.euclidean_dtype", "fp32", "--gift.embedding_dtype", "fp32"],
    "bf16": ["--gift.layers", "", "--gift.euclidean_dtype", "bf16", "--gift.embedding_dtype", "bf16"],
    "fp8": ["--gift.layers", "", "--gift.euclidean_dtype", "fp8", "--gift.embedding_dtype", "fp8"],
    "gift": ["--gift.layers", "wqkv,wo"],
    "gift_w2": ["--gift.layers", "w2"],
    "fp4": ["--gift.layers", "", "--gift.euclidean_dtype", "fp4", "--gift.embedding_dtype", "fp4"],
    "gift_fp4": ["--gift.layers", "wqkv,wo", "--gift.gift_dtype", "fp4", "--gift.euclidean_dtype", "fp4", "--gift.embedding_dtype", "fp4"],
}
DEFAULT_VARIANTS = "fp32,bf16,fp8,gift,gift_w2"
# name -> (config, ranks, extra flags)
TRAINERS = {
    "graph": ("llama3_debug", 2, []),
    "standard": ("llama3_debug_standard", 2, []),
    "standard_hsdp": ("llama3_debug_standard", 4, ["--nproc", "4", "--parallelism.data_parallel_replicate_degree", "2"]),
}


def common_flags(steps: int, val_steps: int) -> list[str]:
    return [
        "--gift.enabled", "--training.steps", str(steps), "--metrics.log_freq", "1", "--debug.seed", "0",
        "--hf_assets_path", str(DATA / "tokenizer"),
        "--dataloader.dataset", "text_lines", "--dataloader.dataset_path", str(DATA / "wikitext-2" / "test.txt"),
        "--validator.enable", "--validator.freq", str(steps), "--validator.steps", str(val_steps),
        "--validator.dataloader.dataset", "text_lines_valid",
        "--validator.dataloader.dataset_path", str(DATA / "wikitext-2" / "valid.txt"),
    ]


def tokens_per_second(run: JobResult, tokens_per_step: int) -> float:
    times = [r["time"] for r in sorted(run.records, key=lambda r: r["step"]) if "loss" in r]
    deltas = [b - a for a, b in zip(times, times[1:])][2:]  # skip the trace / first steps
    return tokens_per_step / statistics.median(deltas) if deltas else float("nan")


def summarize(name: str, run: JobResult, tokens_per_step: int, fp32: JobResult | None) -> list:
    losses = run.losses()
    # the same seed and data in every run: step by step, the difference is the codec's alone
    gap = statistics.fmean(a - b for a, b in zip(losses, fp32.losses())) if fp32 is not None else None
    val = run.last("validation_loss")
    fp32_bytes = run.last("gift/bytes_per_step_fp32")
    sent = run.last("gift/bytes_per_step")
    stats = run.last("gift/stats_bytes_per_step") or 0.0
    return [
        *name,
        len(losses),
        f"{statistics.fmean(losses[-10:]):.4f}",
        None if gap is None else f"{gap:+.5f}",
        None if val is None else f"{val:.4f}",
        None if val is None else f"{math.exp(val):.1f}",
        f"{tokens_per_second(run, tokens_per_step):.0f}",
        f"{sent / 2**20:.3f}",
        f"{sent / fp32_bytes:.3f}",
        f"{run.last('gift/linear_bytes_ratio_vs_fp32'):.4f}",
        f"{stats / 2**20:.3f}",
        f"{run.last('max_rss_mib'):.0f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--val-steps", type=int, default=20)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"of {','.join(VARIANTS)}")
    parser.add_argument("--trainers", default="graph,standard")
    parser.add_argument("--results", default="titan_train", help="file stem under benchmarks/results/")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "titan_bench"))
    args = parser.parse_args()
    if not (DATA / "wikitext-2" / "test.txt").is_file():
        sys.exit(f"needs WikiText-2 and the tokenizer under {DATA}")
    rows, curves, world = [], {}, set()
    for trainer in args.trainers.split(","):
        config, ranks, extra = TRAINERS[trainer]
        tokens_per_step = ranks * 2 * 256  # ranks x local batch x seq_len (the job's defaults)
        world.add(ranks)
        fp32 = None
        for name in args.variants.split(","):
            print(f"== {trainer} / {name}: {args.steps} steps", flush=True)
            flags = ["--launch.config", config, *extra, *common_flags(args.steps, args.val_steps), *VARIANTS[name]]
            run = run_job(JOB, Path(args.out) / f"{trainer}-{name}", *flags).check()
            rows.append(summarize((trainer, name), run, tokens_per_step, fp32))
            fp32 = run if name == "fp32" else fp32
            curves[f"{trainer}/{name}"] = run.series("loss")
            print(f"   {run.wall_s:.0f} s", flush=True)
    headers = ["trainer", "gradients", "steps", "train loss (last 10)", "paired loss gap vs fp32 (mean over steps)", "val loss",
               "val ppl", "tokens/s", "grad MiB/step/rank", "bytes vs fp32", "Linear weights' bytes vs fp32",
               "statistics MiB/step/rank", "peak RSS MiB (rank 0)"]
    table = tabulate(rows, headers=headers)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    note = (f"Llama-3 debug model (6.2M), torchtitan 0.3.0, graph_trainer (SimpleFSDP) and the standard trainer "
            f"(FSDP2), {' / '.join(map(str, sorted(world)))} CPU ranks (gloo), WikiText-2, {args.steps} steps, "
            f"batch 2x256 tokens per rank, seed 0.\n\n")
    md, png = RESULTS / f"{args.results}.md", RESULTS / f"{args.results}_loss.png"
    md.write_text(note + tabulate(rows, headers=headers, tablefmt="github") + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, series in curves.items():
        steps = sorted(series)
        ax.plot(steps, [series[s] for s in steps], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_title("Llama-3 debug, WikiText-2: gradient communication")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {md} and {png}")


if __name__ == "__main__":
    main()
