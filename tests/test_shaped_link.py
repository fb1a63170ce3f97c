"""The shaped-link benchmark's network namespaces: set up, shaped, removed; and its preflight."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import warnings
from pathlib import Path

import pytest

from shaped_link import (LOCAL_BATCH, WARMUP, DelayedLink, ShapedLink, launcher, missing_requirements, reading_step_excess, round_trip_ms,
                         table_to_merge)

ROOT = Path(__file__).resolve().parents[1]
needs_root = pytest.mark.skipif(os.geteuid() != 0 or bool(missing_requirements()), reason="network namespaces need root and iproute2")


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def links() -> str:
    return subprocess.run(["ip", "link"], capture_output=True, text=True, check=True).stdout


def bytes_received(link: ShapedLink, port: int, size: int) -> int:
    """Send ``size`` bytes over TCP from node a to node b; what b counted."""
    server = subprocess.Popen(link.command(1, [sys.executable, "-c", (
        "import socket; s = socket.socket(); s.bind(('%s', %d)); s.listen(1); c, _ = s.accept(); "
        "n = 0\nwhile (d := c.recv(65536)): n += len(d)\nprint(n)") % (link.addresses[1], port)]), stdout=subprocess.PIPE, text=True)
    sent = subprocess.run(link.command(0, [sys.executable, "-c", (
        "import socket, time\nfor _ in range(50):\n    try: s = socket.create_connection(('%s', %d)); break\n"
        "    except OSError: time.sleep(0.1)\ns.sendall(b'x' * %d); s.close()") % (link.addresses[1], port, size)]), timeout=60)
    received = server.communicate(timeout=60)[0].strip()
    assert sent.returncode == 0, "the sender failed"
    return int(received)


@needs_root
def test_namespaces_are_joined_shaped_and_removed():
    with ShapedLink("901") as link:
        a, b = link.namespaces
        assert a in namespaces() and b in namespaces()
        link.shape(100)
        qdisc = subprocess.run(["ip", "netns", "exec", a, "tc", "qdisc", "show", "dev", link.devices[0]], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "rate 100Mbit" in qdisc
        # the two "nodes" reach each other over the veth (and only through it)
        assert bytes_received(link, 5901, 300000) == 300000
        assert link.tx_bytes(0) > 300000
        link.shape(None)
    assert a not in namespaces() and b not in namespaces()
    assert link.devices[0] not in links() and link.devices[1] not in links()


@needs_root
def test_namespaces_are_removed_when_the_run_is_interrupted():
    script = ("import os, signal, sys, time; sys.path.insert(0, %r); from shaped_link import ShapedLink\n"
              "with ShapedLink('902') as link:\n    print(link.namespaces[0], flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(30)") % str(ROOT / "benchmarks")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0  # the interrupt still ends the run
    assert run.stdout.strip() == "gift902a"
    assert "gift902" not in namespaces()


# uid/gid 65534 (nobody/nogroup): a user with no capabilities and no access to root's files.
UNPRIVILEGED = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def unprivileged(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*UNPRIVILEGED, *argv], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "HOME": str(cwd)})


def top_level_imports_outside_the_standard_library(script: Path) -> list[str]:
    tree = ast.parse(script.read_text())
    names = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
    names += ["." * node.level + (node.module or "") for node in tree.body if isinstance(node, ast.ImportFrom)]
    return [name for name in names if name.startswith(".") or name.split(".")[0] not in sys.stdlib_module_names]


def world_readable_dir() -> Path:
    """A fresh directory that uid 65534 can reach: not under the checkout or pytest's base temp
    directory, either of which may sit in a mode-700 directory (``mktemp -d``, /tmp/pytest-of-root)."""
    path = Path(tempfile.mkdtemp(prefix="gift-shaped-link-", dir="/tmp" if os.path.isdir("/tmp") else None)).resolve()
    path.chmod(0o755)
    closed = [str(p) for p in path.parents if not p.stat().st_mode & 0o001]
    if closed:
        shutil.rmtree(path)
        pytest.fail(f"no directory uid 65534 can reach to copy the benchmark into: {', '.join(closed)} not searchable by others")
    return path


def interpreter_for_nobody(cwd: Path) -> str:
    """Our interpreter if uid 65534 can run it from its own installation, else a system python3 it can.

    Ours may live where others cannot reach (pyenv under /root, mode 700): setpriv still execs it
    (its capabilities are dropped only at the exec), but it then cannot read its own libpython
    and standard library and silently picks up whatever the system has, or fails to start; so
    the probe checks it reports our version and prefix. The benchmark needs only the standard
    library up to its preflight (checked in the test), so a system python3 runs it just as well."""
    probe = ["-c", "import sys; print(sys.version); print(sys.prefix)"]
    ours = unprivileged([sys.executable, *probe], cwd)
    if ours.returncode == 0 and ours.stdout == f"{sys.version}\n{sys.prefix}\n":
        return sys.executable
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if system is not None and unprivileged([system, *probe], cwd).returncode == 0:
        warnings.warn(f"uid 65534 cannot run {sys.executable} from its own installation (a directory above it is not "
                      f"searchable by others?); the benchmark runs under {system} instead", stacklevel=2)
        return system
    pytest.fail(f"uid 65534 can run neither {sys.executable} from its own installation (it reported "
                f"{(ours.stdout + ours.stderr).strip()!r}, not {sys.version!r} from {sys.prefix}) nor a system python3: "
                "make the directories above the interpreter searchable by others (chmod o+x) or install python3")


def test_without_root_the_benchmark_explains_itself(tmp_path):
    script = ROOT / "benchmarks" / "shaped_link.py"
    if os.geteuid() != 0:
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                             env={**os.environ, "HOME": str(tmp_path)})
    else:  # drop to an unprivileged user, as a newcomer without sudo would run it
        if shutil.which("setpriv") is None:
            pytest.fail("setpriv (util-linux) is needed to run the benchmark as an unprivileged user")
        # That user may not reach the checkout (a clone under `mktemp -d`, mode 700), so it runs
        # a copy of the script; up to the preflight the script needs nothing else.
        foreign = top_level_imports_outside_the_standard_library(script)
        assert not foreign, f"shaped_link.py imports {foreign} before its preflight: copy them here too, or import them later"
        workdir = world_readable_dir()
        try:
            copy = workdir / "benchmarks" / "shaped_link.py"
            copy.parent.mkdir()
            copy.parent.chmod(0o755)
            shutil.copyfile(script, copy)
            copy.chmod(0o644)
            python = interpreter_for_nobody(workdir)
            run = unprivileged([python, str(copy)], workdir)
        finally:
            shutil.rmtree(workdir)
    detail = f"{run.args}: rc {run.returncode}\n{run.stderr}"
    assert run.returncode == 2, detail
    assert "needs:" in run.stderr and "root: network namespaces and tc need CAP_NET_ADMIN (run it with sudo)" in run.stderr, detail
    assert "Traceback" not in run.stderr, detail


@needs_root
def test_the_delay_line_adds_its_round_trip_carries_shaped_traffic_and_is_removed():
    """The delay cells' link: each packet is held 5 ms each way, so a TCP ping takes at least
    10 ms (and the forwarder's own cost is well under the 10 ms bound above that); the veth,
    with no delay line, answers in well under a millisecond."""
    with ShapedLink("904") as veth:
        assert round_trip_ms(veth, 5904) < 1.0
    with DelayedLink("905", one_way_ms=5.0) as link:
        a, b = link.namespaces
        forwarder = link._forwarder.pid
        link.shape(100)
        qdisc = subprocess.run(["ip", "netns", "exec", a, "tc", "qdisc", "show", "dev", link.devices[0]], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "rate 100Mbit" in qdisc
        assert 10.0 <= round_trip_ms(link, 5905) < 20.0
        before = link.tx_bytes(0)
        assert bytes_received(link, 5906, 3000000) == 3000000
        assert link.tx_bytes(0) - before > 3000000  # the payload went through the TUN device
    assert a not in namespaces() and b not in namespaces()
    assert not os.path.exists(f"/proc/{forwarder}")


def test_every_run_trains_on_the_asked_batch_and_a_table_merges_only_its_own_batch(tmp_path):
    # Every job (the pairs and the compute-only run) is launched with the batch asked for, so a
    # table's limits and tokens/s hold for one batch; --merge refuses to mix two.
    command = launcher(Path("job.toml"), tmp_path, 12, ["--nproc", "1"], 8)
    assert command[command.index("--training.local_batch_size") + 1] == "8"
    default = launcher(Path("job.toml"), tmp_path, 12, [])
    job = tomllib.loads((ROOT / "examples" / "llama3_debug_cpu.toml").read_text())
    assert default[default.index("--training.local_batch_size") + 1] == str(job["training"]["local_batch_size"])

    saved = tmp_path / "table.json"
    assert table_to_merge(saved, 8) is None  # nothing saved yet: a new table
    saved.write_text(json.dumps({"compute_s": 1.0, "local_batch_size": 8, "results": []}))
    assert table_to_merge(saved, 8)["compute_s"] == 1.0
    with pytest.raises(ValueError, match="measured with --local-batch-size 8, this run asks for 2"):
        table_to_merge(saved, 2)
    saved.write_text(json.dumps({"compute_s": 1.0, "results": []}))  # saved before the flag: the job's batch
    assert table_to_merge(saved, LOCAL_BATCH)["compute_s"] == 1.0
    with pytest.raises(ValueError, match="measured with --local-batch-size 2, this run asks for 8"):
        table_to_merge(saved, 8)


PROBE = """
import json, os, sys
import torch.distributed as dist
from gift_compile.collectives import parameter_piece_kib_for
rank, address, port, device = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ["GLOO_SOCKET_IFNAME"] = device
dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=2)
print(json.dumps(parameter_piece_kib_for(dist.group.WORLD)))
dist.destroy_process_group()
"""


def probe(link: ShapedLink, port: int) -> list:
    procs = [subprocess.Popen(link.command(side, [sys.executable, "-c", PROBE, str(side), link.addresses[0], str(port), link.devices[side]]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for side in (0, 1)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


@needs_root
def test_auto_parameter_pieces_on_a_slow_link():
    # parameter_piece_kib = "auto" times one 1 MiB all_to_all. At 50 Mbit/s gloo moves it at
    # ~25 Mbit/s (half the link: gloo_link.md), far below SLOW_LINK_MBIT (300): 128 KiB pieces,
    # chosen alike on both ranks (the slowest rank's time, all-reduced). The fast branch (one
    # call each) is checked on loopback in tests/test_pieces.py.
    with ShapedLink("903") as link:
        link.shape(50)
        results = probe(link, 5903)
    assert results[0] == results[1]
    kib, rate = results[0]
    assert kib == 128 and 5 < rate < 60, rate


def test_the_steps_with_a_meter_reading_are_told_apart():
    """``reading_step_excess`` takes the job's steps 11, 21, ... (1-based; GIFT's default
    ``meter_interval`` of 10, its readings at the layers' steps 10, 20, ...) from a loss curve
    that starts at the first timed step: 1 s steps, those 1.25 s, read as +0.25 s."""
    first_timed = WARMUP + 1
    durations = {step: 1.25 if step % 10 == 1 else 1.0 for step in range(first_timed + 1, 40)}
    curve, t = [[0.0, 7.0]], 0.0
    for step in sorted(durations):
        t += durations[step]
        curve.append([t, 7.0])
    assert reading_step_excess(curve) == pytest.approx(0.25)
    assert reading_step_excess(curve[:5]) is None  # no reading step timed yet
