"""The ``gift`` section of a torchtitan trainer config: ``--gift.<field>`` / TOML ``[gift]``.

:class:`GiftSection` is derived from :class:`gift_compile.GiftConfig`: every field with the same
name, type, default and help text, except ``enabled`` (off unless asked for) and ``layers`` (a
list, because torchtitan's command line takes lists as one comma-separated value:
``--gift.layers w2,wo``; ``auto`` is the one-element list ``["auto"]``), plus the integration's
own keys (:data:`INTEGRATION_FIELDS`). :func:`to_gift_config` converts and validates (a
``ValueError`` naming the field).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import PurePath
from typing import Annotated, Literal

import tyro

from gift_compile.config import GiftConfig, field_docs, normalize_keys

INTEGRATION_FIELDS: dict[str, tuple[type, object, str]] = {
    "layers_file": (
        str, "gift_layers.toml",
        "(integration) Where layers = auto writes the chosen layers: a file name inside the dump folder; "
        "the file is a [gift] table that a later run can paste or pass to gift-titan.",
    ),
    "compile_codec": (
        bool, True,
        "(integration) Compile the codec's arithmetic (whiten, encode, decode, unwhiten) with Inductor, or run "
        "it eagerly: the same bits either way. graph_trainer: its regional_inductor_pass compiles the codec's "
        "regions of the joint graph, which otherwise runs as eager FX; the standard trainer: one graph per "
        "parameter shape and path. Compiling costs seconds at the first step and makes every later step faster. "
        "On graph_trainer the profile steps of layers = \"auto\" run it eagerly (their graph runs only those steps).",
    ),
}
_SECTION_OVERRIDES: dict[str, tuple[type, object]] = {
    "enabled": (bool, False),
    "layers": (list[str], list(GiftConfig.layers)),
}


def _section_fields() -> list[tuple]:
    hints = typing.get_type_hints(GiftConfig)
    docs = field_docs(GiftConfig)
    fields = []
    for f in dataclasses.fields(GiftConfig):
        kind, default = _SECTION_OVERRIDES.get(f.name, (hints[f.name], f.default))
        fields.append((f.name, kind, default, docs.get(f.name, "")))
    fields += [(name, kind, default, doc) for name, (kind, default, doc) in INTEGRATION_FIELDS.items()]
    return [
        (name, Annotated[kind, tyro.conf.arg(help=doc)],
         dataclasses.field(default_factory=lambda d=default: list(d)) if isinstance(default, list) else dataclasses.field(default=default))
        for name, kind, default, doc in fields
    ]


GiftSection = dataclasses.make_dataclass("GiftSection", _section_fields(), kw_only=True, slots=True)
GiftSection.__module__ = __name__  # pickling and tyro look the class up here
GiftSection.__doc__ = "GIFT gradient communication (``--gift.<field>``, TOML ``[gift]``); fields as GiftConfig's."


def section_field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(GiftSection)]


def to_gift_config(section) -> GiftConfig:
    """The library config a parsed section describes, validated by ``GiftConfig`` alone. The
    command line cannot spell an empty list, so ``--gift.layers ""`` (``[""]``) is ``[]``; a
    job file's table is checked before that, by :func:`section_from_dict`."""
    values = {name: getattr(section, name) for name in GiftConfig.field_names()}
    if list(values["layers"]) == [""]:
        values["layers"] = []  # how the launcher's flags spell an empty list (--gift.layers "")
    return GiftConfig(**values)


ROUTES = ("graph", "fsdp2")
"""Where GIFT reaches the gradient collectives: graph_trainer's joint graph, or FSDP2's reduce-scatter."""


def check_route(section, route: str) -> None:
    """Refuse a key that the trainer's route would ignore (a ``ValueError`` naming it)."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")


def normalize_table(values: dict) -> dict:
    """A TOML ``[gift]`` table with deprecated keys renamed (warning) and unknown ones rejected."""
    values = normalize_keys(values, "[gift]", section_field_names())
    if isinstance(values.get("layers"), str):  # "auto", "w2", "w2,wo" or "" (the command line's spelling of a list)
        values["layers"] = values["layers"].split(",") if values["layers"] else []
    return values


def section_from_dict(values: dict):
    """A section from a TOML ``[gift]`` table: unknown keys and bad values are a ``ValueError``."""
    section = GiftSection(**normalize_table(values))
    # Every GiftConfig field, validated as GiftConfig itself would (layers = [""] is an error
    # here as in Python: only the launcher's own flags may spell [] that way).
    GiftConfig(**{name: getattr(section, name) for name in GiftConfig.field_names()})
    name = section.layers_file
    if not isinstance(name, str) or PurePath(name).name != name or name in ("", ".", ".."):
        raise ValueError(f"gift.layers_file={name!r} is invalid; it must be a file name (it is written inside the dump folder)")
    for name, (kind, _, _) in INTEGRATION_FIELDS.items():
        value = getattr(section, name)
        choices = typing.get_args(kind)
        if (choices and value not in choices) or (not choices and not isinstance(value, kind)):
            allowed = f"allowed values: {list(choices)}" if choices else f"it must be a {kind.__name__}"
            raise ValueError(f"gift.{name}={value!r} is invalid; {allowed}")
    return section


__all__ = ["GiftSection", "INTEGRATION_FIELDS", "ROUTES", "check_route", "normalize_table", "section_field_names", "section_from_dict", "to_gift_config"]
