"""benchmarks/projection.py's cost model for GIFT's extra passes, against a hand count.

One whitened 1024 x 1024 layer (an attention output projection), rank 32, gradient statistics.
Per step and element GIFT adds 6 rank-32 GEMMs (6 x 2 x 32 flops) and the sketch (4 x 32):
512 flops; and it moves the codec's extra bytes
(GIFT's all-reduce codec against the Euclidean one's, per element) plus the sketch's two reads
of G (8 B per element). The model takes the slower of the two (a roofline)."""

from projection import CODEC_BYTES, Cluster, Model, project

ELEMENTS = 1024 * 1024
MODEL = Model("one layer", ELEMENTS, {"wo": (1024, 1024, 1)}, ("wo",))
CLUSTER = Cluster("2 GPUs", 2, 100, 1024)
CODEC = {"fp8": 1e3, "fp4": 1e3}


def gift_extra(gemm_tflops: float, memory_gbps: float) -> float:
    gift = project(MODEL, CLUSTER, "GIFT", CODEC, gemm_tflops, memory_gbps=memory_gbps)
    fp8 = project(MODEL, CLUSTER, "FP8", CODEC, gemm_tflops, memory_gbps=memory_gbps)
    return gift["codec"] - fp8["codec"]


def test_gift_costs_the_slower_of_its_flops_and_its_memory_traffic():
    flops = 512 * ELEMENTS
    moved = (CODEC_BYTES["GIFT"] - CODEC_BYTES["FP8"] + 8) * ELEMENTS
    # memory-bound (a GPU's balance: 100 TFLOP/s against 1,000 GB/s)
    assert abs(gift_extra(100, 1000) - moved / 1e12) < 1e-12
    # compute-bound (a slow core with fast memory)
    assert abs(gift_extra(1e-3, 1e6) - flops / 1e9) < 1e-12
