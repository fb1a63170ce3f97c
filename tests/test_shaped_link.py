"""The shaped-link benchmark's network namespaces: set up, shaped, removed; and its preflight."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shaped_link import ShapedLink, missing_requirements

ROOT = Path(__file__).resolve().parents[1]
needs_root = pytest.mark.skipif(os.geteuid() != 0 or bool(missing_requirements()), reason="network namespaces need root and iproute2")


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def links() -> str:
    return subprocess.run(["ip", "link"], capture_output=True, text=True, check=True).stdout


@needs_root
def test_namespaces_are_joined_shaped_and_removed():
    with ShapedLink("901") as link:
        a, b = link.namespaces
        assert a in namespaces() and b in namespaces()
        link.shape(100)
        qdisc = subprocess.run(["ip", "netns", "exec", a, "tc", "qdisc", "show", "dev", link.devices[0]], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "rate 100Mbit" in qdisc
        # the two "nodes" reach each other over the veth (and only through it)
        server = subprocess.Popen(link.command(1, [sys.executable, "-c", (
            "import socket; s = socket.socket(); s.bind(('%s', 5901)); s.listen(1); c, _ = s.accept(); "
            "n = 0\nwhile (d := c.recv(65536)): n += len(d)\nprint(n)") % link.addresses[1]]), stdout=subprocess.PIPE, text=True)
        sent = subprocess.run(link.command(0, [sys.executable, "-c", (
            "import socket, time\nfor _ in range(50):\n    try: s = socket.create_connection(('%s', 5901)); break\n"
            "    except OSError: time.sleep(0.1)\ns.sendall(b'x' * 300000); s.close()") % link.addresses[1]]), timeout=60)
        assert sent.returncode == 0 and server.communicate(timeout=60)[0].strip() == "300000"
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


def test_without_root_the_benchmark_explains_itself(tmp_path):
    if os.geteuid() == 0:  # drop to an unprivileged user, as a newcomer without sudo would run it
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, str(ROOT / "benchmarks" / "shaped_link.py")]
    else:
        command = [sys.executable, str(ROOT / "benchmarks" / "shaped_link.py")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)})
    assert run.returncode == 2
    assert "needs:" in run.stderr and "root: network namespaces and tc need CAP_NET_ADMIN (run it with sudo)" in run.stderr
    assert "Traceback" not in run.stderr
