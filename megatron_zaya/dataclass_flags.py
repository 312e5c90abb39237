"""Command-line flags declared on dataclass fields: a field holds its default, its flag and its help.

``setting(default, flag=..., help=...)`` declares a field. ``add_flags(parser, cls, prefix)`` adds the flag of
every such field of a dataclass, with the field's default, and ``values_from_args(cls, args, prefix)`` reads the
parsed values back as field values; an argument's ``dest`` is ``prefix + field name``. Booleans become
``store_true`` flags, ``store_false`` ones when the flag says ``-no-``, or ``--x / --no-x`` pairs with
``negatable=True``. A field whose command-line values are words maps them with ``choices={word: value}``.

``megatron_field(value, flag)`` declares a field of Megatron's ``TransformerConfig`` with ZAYA1's value, and
Megatron's flag for it if it has one: ``megatron_flags`` gives Megatron's parser those flags, and
``fixed_megatron_values`` the values of the fields without one.
"""

from __future__ import annotations

import argparse
import dataclasses

_UNSET = object()


def setting(default, *, flag: str, help: str = "", choices: dict | None = None, negatable: bool = False,
            cli_default=_UNSET, **argparse_kwargs):
    """A dataclass field with a command-line flag. ``cli_default``: the flag's default where it differs from the
    field's (e.g. None for "derived at run time"); such a value is not read back. Other keyword arguments (``type``,
    ``nargs``, ``metavar``) go to ``add_argument``."""
    metadata = dict(flag=flag, help=help, choices=choices, negatable=negatable, cli_default=cli_default,
                    argparse=argparse_kwargs)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flagged_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]


def _default(field: dataclasses.Field):
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()


def add_flags(parser, cls, prefix: str) -> None:
    """Add the flag of every ``setting`` field of ``cls`` to ``parser`` (a parser or an argument group)."""
    for field in flagged_fields(cls):
        meta, default = field.metadata, _default(field)
        kwargs = dict(dest=prefix + field.name, help=meta["help"], **meta["argparse"])
        if meta["choices"] is not None:
            words = {value: word for word, value in meta["choices"].items()}
            kwargs.update(choices=list(meta["choices"]), default=words[default])
        elif isinstance(default, bool):
            action = "store_false" if "-no-" in meta["flag"] else "store_true"
            kwargs.update(action=argparse.BooleanOptionalAction if meta["negatable"] else action, default=default)
        else:
            kwargs.setdefault("type", type(default) if isinstance(default, (int, float, str)) else None)
            kwargs.update(default=list(default) if isinstance(default, tuple) else default)
        if meta["cli_default"] is not _UNSET:
            kwargs["default"] = meta["cli_default"]
        if kwargs.get("type") is None:
            kwargs.pop("type", None)
        parser.add_argument(meta["flag"], **kwargs)


def values_from_args(cls, args: argparse.Namespace, prefix: str) -> dict:
    """``{field: value}`` of the ``setting`` fields of ``cls`` from parsed ``args``, skipping run-time defaults."""
    values = {}
    for field in flagged_fields(cls):
        meta, value = field.metadata, getattr(args, prefix + field.name)
        if meta["cli_default"] is not _UNSET and value == meta["cli_default"]:
            continue
        if meta["choices"] is not None:
            value = meta["choices"][value]
        elif isinstance(_default(field), tuple):
            value = tuple(value)
        values[field.name] = value
    return values


def megatron_field(default, flag: str | None = None):
    """A field of Megatron's ``TransformerConfig`` with ZAYA1's value. With ``flag``, Megatron's flag for it:
    zaya-pretrain passes it before the user's flags (an explicit one wins). Without, the field is no command-line
    choice: zaya-pretrain sets it over the value Megatron parsed."""
    return dataclasses.field(default=default, metadata=dict(megatron_flag=flag))


def megatron_flags(cls) -> list[str]:
    """The Megatron flags of the ``megatron_field`` fields of ``cls`` that have one, with their values."""
    flags = []
    for field in dataclasses.fields(cls):
        flag = field.metadata.get("megatron_flag")
        if flag:  # a boolean's flag stores the field's value
            flags += [flag] if isinstance(field.default, bool) else [flag, str(field.default)]
    return flags


def fixed_megatron_values(cls) -> dict:
    """``{field: value}`` of the ``megatron_field`` fields of ``cls`` without a flag."""
    return {f.name: f.default for f in dataclasses.fields(cls)
            if "megatron_flag" in f.metadata and f.metadata["megatron_flag"] is None}
