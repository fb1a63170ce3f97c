"""benchmarks/gloo_link.py: both ranks measure every row, and the table reads them right.

The measurement runs as the benchmark runs it, two worker processes, here on loopback (the shaped
link needs root and namespaces: ``tests/test_shaped_link.py`` covers those)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gloo_link import table

from gift_compile.testing.ranks import free_port

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gloo_link.py"


def test_both_ranks_measure_every_row_and_the_table_compares_with_raw_tcp():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "--sizes", "0.25", "--piece-kib", "64", "--port", str(port),
                               "--worker", str(rank), "127.0.0.1", "lo"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    rows = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert [r["op"] for r in rows] == ["raw TCP, both directions at once", "gloo all-reduce", "gloo all-gather, one call",
                                       "gloo all-to-all, one call",
                                       "gloo all-gather, 64 KiB pieces one by one", "gloo all-gather, 64 KiB pieces two in flight (FSDP's prefetch)",
                                       "gloo all-gather, 64 KiB pieces all issued, then waited",
                                       "gloo all-to-all, 64 KiB pieces one by one", "gloo all-to-all, 64 KiB pieces all issued, then waited"]
    assert all(r["mib"] == 0.25 and r["mbit_s"] > 0 for r in rows)
    text = table(rows, 200.0)
    raw = rows[0]["mbit_s"]
    for row in rows:  # each row's share of raw TCP is its rate over the TCP row's
        assert f"| 0.25 | {row['op']} | {row['mbit_s']:.0f} | {row['mbit_s'] / raw:.2f} |" in text
