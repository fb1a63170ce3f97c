"""``gift-titan job.toml [--nproc N] [--section.field value ...]``: the TOML front-end.

A job file holds torchtitan's config sections as TOML tables, ``[gift]``, and ``[launch]``::

    dump_folder = "./outputs/debug"      # top-level Config fields (before any table)

    [launch]
    nproc = 2                            # ranks on this node (torchrun --nproc_per_node)
    config = "llama3_debug"              # one of gift_compile.titan_integration.job_configs.CONFIGS
    # nnodes = 2, node_rank = 0, master_addr = "10.0.0.1", master_port = 29500   (multi-node)

    [training]
    steps = 20

    [gift]
    enabled = true

Every key is checked against the chosen config (nested tables such as
``[validator.dataloader]`` too) and ``[gift]`` against ``GiftConfig``; an unknown key or a bad
value stops the launch with a message listing the valid keys. Flags on the command line
(``--training.steps 5``, ``--gift.enabled``, ``--gift.no-enabled``, ``--gift.layers=w2,wo``)
override the file. The result becomes torchtitan's own ``--section.field`` flags, parsed once
more by torchtitan's ``ConfigManager`` here; the model is built on the meta device to check
the ``[gift] layers`` patterns and, on a resume, that they are the layers the checkpoint holds
GIFT state for (``--dry-run`` stops after that and prints the torchrun command), then
``torchrun`` starts ``nproc`` ranks of ``gift_compile.titan_integration.entry`` on this node.
One node: ``torchrun --standalone`` (a free port). Several: every node runs the same job file
with its own ``--node-rank`` (``[launch] nnodes``, ``master_addr``, ``master_port`` shared).

Only this project's config registry may be named in ``[launch]`` (``module``), and only one of
its registered configs (``config``): a job file never imports or calls other code.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODULE = "gift_compile.titan_integration.job_configs"
ALLOWED_MODULES = (DEFAULT_MODULE,)
DEFAULT_CONFIG = "llama3_debug"
LAUNCH_KEYS = {"nproc": int, "config": str, "module": str, "nnodes": int, "node_rank": int, "master_addr": str, "master_port": int}
LAUNCH_DEFAULTS = {"nproc": 1, "config": DEFAULT_CONFIG, "module": DEFAULT_MODULE, "nnodes": 1, "node_rank": 0,
                   "master_addr": "127.0.0.1", "master_port": 0}


class JobError(ValueError):
    """A job file or flag that cannot be run; the message says which key and why."""

    def refusal(self) -> str:
        """What ``gift-titan`` prints (on stderr) when it refuses the job."""
        return f"gift-titan: error: {self}"


# -- reading ----------------------------------------------------------------------------------
def _parse_value(text: str) -> Any:
    if text == "None":  # torchtitan's spelling of an unset optional value
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set(document: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = document
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise JobError(f"--{dotted}: {part!r} is a value, not a section")
    node[leaf] = value


def parse_overrides(argv: list[str]) -> dict[str, Any]:
    """``--a.b v``, ``--a.b=v``, ``--a.b`` (true), ``--a.no-b`` (false) -> nested dict."""
    document: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise JobError(f"unexpected argument {token!r}; overrides look like --section.field value")
        key, eq, value = token[2:].partition("=")
        key = key.replace("-", "_")
        leaf = key.rsplit(".", 1)[-1]
        if eq:
            parsed = _parse_value(value)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            i += 1
            parsed = _parse_value(argv[i])
        elif leaf.startswith("no_"):
            key, parsed = key[: len(key) - len(leaf)] + leaf[3:], False
        else:
            parsed = True
        _set(document, key, parsed)
        i += 1
    return document


def merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_job(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    document: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                document = tomllib.load(f)
        except FileNotFoundError:
            raise JobError(f"job file {str(path)!r} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise JobError(f"{path}: not valid TOML: {e}") from None
    return merge(document, parse_overrides(overrides or []))


# -- checking ---------------------------------------------------------------------------------
def launch_settings(document: dict) -> dict[str, Any]:
    launch = document.get("launch", {})
    if not isinstance(launch, dict):
        raise JobError("[launch] must be a table")
    unknown = sorted(set(launch) - set(LAUNCH_KEYS))
    if unknown:
        raise JobError(f"unknown [launch] key(s) {unknown}; valid keys: {sorted(LAUNCH_KEYS)}")
    settings = LAUNCH_DEFAULTS | launch
    for key, kind in LAUNCH_KEYS.items():
        if not isinstance(settings[key], kind) or isinstance(settings[key], bool):
            raise JobError(f"[launch] {key} = {settings[key]!r} is invalid; it must be a {kind.__name__}")
    for key in ("nproc", "nnodes"):
        if settings[key] < 1:
            raise JobError(f"[launch] {key} = {settings[key]} is invalid; it must be >= 1")
    if not 0 <= settings["node_rank"] < settings["nnodes"]:
        raise JobError(f"[launch] node_rank = {settings['node_rank']} is invalid; it must be in [0, nnodes = {settings['nnodes']})")
    if not 0 <= settings["master_port"] < 65536:
        raise JobError(f"[launch] master_port = {settings['master_port']} is invalid; it must be a TCP port (0: pick a free one)")
    if settings["nnodes"] > 1 and settings["master_port"] == 0:
        raise JobError("[launch] master_port is needed with nnodes > 1: every node must reach the same rendezvous port")
    if settings["module"] not in ALLOWED_MODULES:
        raise JobError(f"[launch] module = {settings['module']!r} is not allowed; job files may only name {list(ALLOWED_MODULES)}")
    return settings


def base_config(module: str, name: str):
    registry = importlib.import_module(module)
    if name not in registry.CONFIGS:
        raise JobError(f"[launch] config = {name!r} is not a config of {module}; available: {list(registry.CONFIGS)}")
    return getattr(registry, name)()


def check_section(obj: Any, values: dict, path: str) -> None:
    """Every key of ``values`` must name a field of the dataclass ``obj`` (recursively)."""
    names = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            section = f"[{path}]" if path else "top level"
            raise JobError(f"unknown key {where!r} ({section}); valid keys: {sorted(names)}")
        current = getattr(obj, key)
        if isinstance(value, dict):
            if current is None or not dataclasses.is_dataclass(current):
                raise JobError(f"{where!r} is a value, not a section; write {where} = <value>")
            check_section(current, value, where)
        elif dataclasses.is_dataclass(current):
            raise JobError(f"{where!r} is a section; write it as a [{where}] table")


def check_job(document: dict) -> tuple[dict[str, Any], Any, dict]:
    """Validate the whole job; returns the launch settings, the base config and the document
    with its ``[gift]`` table normalized (deprecated keys renamed)."""
    from gift_compile.titan_integration.config import normalize_table, section_from_dict

    settings = launch_settings(document)
    config = base_config(settings["module"], settings["config"])
    body = {k: v for k, v in document.items() if k != "launch"}
    gift = body.pop("gift", None)
    if gift is not None:
        if not isinstance(gift, dict):
            raise JobError("[gift] must be a table")
        if not hasattr(config, "gift"):
            raise JobError(f"config {settings['config']!r} has no gift section; use a config of {DEFAULT_MODULE}")
        try:
            section_from_dict(gift)
            document = {**document, "gift": normalize_table(gift)}
        except (ValueError, TypeError) as e:
            raise JobError(str(e)) from None
    check_section(config, body, "")
    return settings, config, document


# -- flags ------------------------------------------------------------------------------------
def _flag_value(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)):
        return ",".join(_flag_value(v) for v in value)
    return str(value)


def to_flags(values: dict, prefix: str = "") -> list[str]:
    """Nested dict -> torchtitan (tyro) flags: ``--a.b v``, ``--a.b`` / ``--a.no-b``."""
    flags: list[str] = []
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flags += to_flags(value, dotted + ".")
        elif isinstance(value, bool):
            flags.append(f"--{dotted}" if value else f"--{prefix}no-{key}")
        else:
            flags += [f"--{dotted}", _flag_value(value)]
    return flags


def titan_args(document: dict, settings: dict) -> list[str]:
    body = {k: v for k, v in document.items() if k != "launch"}
    return ["--module", settings["module"], "--config", settings["config"], *to_flags(body)]


def check_model(config) -> None:
    """Check the ``[gift]`` keys against the trainer's route, and build the job's model on the meta
    device (no memory, no ranks) to check the layer patterns against its Linear layers, so a
    typo stops the launch, not every rank later; then :func:`check_resume`."""
    gift = getattr(config, "gift", None)
    if gift is None or not gift.enabled:
        return
    from gift_compile.titan_integration.config import check_route, to_gift_config

    try:
        check_route(gift, config.gift_route)
        layers = to_gift_config(gift).layers  # the rank's own reading of the flags ("" is no layer)
    except ValueError as error:
        raise JobError(str(error)) from None
    # "auto" whitens nothing until its profile has run (the session's rule)
    check_resume(config, [] if layers == "auto" else _whitened_layers(config, layers))


def _whitened_layers(config, layers: tuple[str, ...]) -> list[str]:
    from torch import nn

    from gift_compile.selection import select_layers

    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    try:
        return select_layers([name for name, module in model.named_modules() if isinstance(module, nn.Linear)], layers)
    except ValueError as error:
        raise JobError(f"[gift] layers: {error}") from None


def check_resume(config, whitened: list[str]) -> None:
    """A resume must whiten the layers its checkpoint holds GIFT state for. Every rank would
    find a mismatch only after start-up, when DCP loads (``checkpoint.explain_failed_loads``);
    where the checkpoint torchtitan will load is on this machine, refuse the job here instead."""
    from gift_compile.titan_integration.checkpoint import mismatch_message, saved_layers

    checkpoint = checkpoint_to_resume(config)
    if checkpoint is not None and (saved := saved_layers(str(checkpoint))) != sorted(whitened):
        raise JobError(mismatch_message(saved, sorted(whitened)))


def checkpoint_to_resume(config) -> Path | None:
    """The DCP checkpoint with GIFT state that torchtitan's checkpointer will load, by its rule:
    ``--checkpoint.load_step``, else the latest ``step-N`` holding a ``.metadata`` file in the
    checkpoint folder (step 0 is model-only, an ``initial_load_path`` too, by default)."""
    if not config.checkpoint.enable:
        return None
    folder = Path(config.dump_folder) / config.checkpoint.folder
    steps = [int(p.name[5:]) for p in folder.glob("step-*") if p.name[5:].isdigit() and (p / ".metadata").is_file()]
    step = config.checkpoint.load_step if config.checkpoint.load_step != -1 else max(steps, default=0)
    return folder / f"step-{step}" if step > 0 and step in steps else None


def parse_with_torchtitan(args: list[str]):
    """torchtitan's own parse of the final flags (type errors surface here, before torchrun)."""
    from torchtitan.config import ConfigManager

    try:
        return ConfigManager().parse_args(args)
    except SystemExit as e:
        raise JobError(f"torchtitan rejected the flags {shlex.join(args)} (exit {e.code}); see the message above") from None


def torchrun_command(settings: dict, args: list[str]) -> list[str]:
    """This node's torchrun command (``--standalone`` for one node on a free port)."""
    if settings["nnodes"] == 1 and settings["master_port"] == 0:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [f"--nnodes={settings['nnodes']}", f"--node_rank={settings['node_rank']}",
                      f"--master_addr={settings['master_addr']}", f"--master_port={settings['master_port']}"]
    return [
        sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc_per_node={settings['nproc']}",
        "-m", "gift_compile.titan_integration.entry", *args,
    ]


@dataclasses.dataclass(frozen=True)
class Launch:
    """What ``gift-titan`` runs on this node once the job passed every check."""

    command: list[str]
    """This node's torchrun command."""
    env: dict[str, str]
    """Its environment."""
    dry_run: bool

    def describe(self) -> str:
        """The line ``gift-titan`` prints before it starts torchrun."""
        return f"gift-titan: {shlex.join(self.command)}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gift-titan", description="Run a torchtitan job described by a TOML file, with GIFT ([gift] enabled = true).",
        epilog="Any --section.field value flag overrides the job file.",
    )
    parser.add_argument("job", nargs="?", help="TOML job file (torchtitan sections, [gift], [launch])")
    parser.add_argument("--nproc", type=int, help="ranks on this node (overrides [launch] nproc)")
    parser.add_argument("--nnodes", type=int, help="nodes of the job (overrides [launch] nnodes)")
    parser.add_argument("--node-rank", type=int, help="this node's index, 0..nnodes-1 (overrides [launch] node_rank)")
    parser.add_argument("--master-addr", help="address of node 0 (overrides [launch] master_addr)")
    parser.add_argument("--master-port", type=int, help="rendezvous port on node 0 (overrides [launch] master_port)")
    parser.add_argument("--dry-run", action="store_true", help="check the job and print this node's torchrun command; do not run")
    return parser


class _ConfigDefaultsNotice(logging.Filter):
    """torchtitan's checkpoint config warns, every time one is built, that its own default
    ``initial_load_model_only=True`` has no effect without an ``initial_load_path``. The launcher
    builds configs only to check the job, so here that line says nothing about the job."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "initial_load_model_only=True has no effect" not in record.getMessage()


def plan(argv: list[str] | None = None) -> Launch:
    """Read and check the job ``gift-titan argv`` describes, without starting anything: the
    torchrun command and environment :func:`main` runs, or a :class:`JobError` saying why not."""
    notice = _ConfigDefaultsNotice()
    logging.getLogger().addFilter(notice)  # torchtitan logs through the root logger
    try:
        return _plan(argv)
    finally:
        logging.getLogger().removeFilter(notice)


def _plan(argv: list[str] | None) -> Launch:
    ns, rest = _parser().parse_known_args(argv)
    document = load_job(ns.job, rest)
    flags = {"nproc": ns.nproc, "nnodes": ns.nnodes, "node_rank": ns.node_rank, "master_addr": ns.master_addr, "master_port": ns.master_port}
    document = merge(document, {"launch": {k: v for k, v in flags.items() if v is not None}})
    settings, _, document = check_job(document)
    args = titan_args(document, settings)
    check_model(parse_with_torchtitan(args))
    env = dict(os.environ)
    if not torch.cuda.is_available():  # few CPU cores: a compile-worker pool only adds start-up time
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    return Launch(torchrun_command(settings, args), env, ns.dry_run)


def main(argv: list[str] | None = None) -> int:
    try:
        launch = plan(argv)
    except JobError as e:
        print(e.refusal(), file=sys.stderr)
        return 2
    print(launch.describe(), flush=True)
    if launch.dry_run:
        return 0
    return subprocess.call(launch.command, env=launch.env)


def cli() -> None:
    """The ``gift-titan`` command: :func:`main`, then exit without finalizing the interpreter
    (``entry.exit_now``): the job is over."""
    from gift_compile.titan_integration.entry import exit_now

    exit_now(main())


if __name__ == "__main__":
    cli()
