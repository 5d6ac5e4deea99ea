"""One settings struct per process, filled from CLI flags, then MLXD_* environment
variables, then the struct's defaults. The same name everywhere: field
`worker_endpoint` is flag `--worker-endpoint` and variable `MLXD_WORKER_ENDPOINT`.

Each field documents itself with `Annotated[T, msgspec.Meta(description=...)]`;
that text is its `--help`.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from protocol.units import parse_size

S = TypeVar("S", bound=msgspec.Struct)


# Cached: msgspec builds a struct's whole type info on every call (some ms for a
# large settings struct), and every field's variable name is looked up here.
@functools.cache
def _fields(settings_type: type[msgspec.Struct]) -> tuple[mi.Field, ...]:
    info = mi.type_info(settings_type)
    assert isinstance(info, mi.StructType)
    return info.fields


def _unwrap(t: mi.Type) -> tuple[mi.Type, str]:
    if isinstance(t, mi.Metadata):
        return t.type, (t.extra_json_schema or {}).get("description", "")
    return t, ""


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str, settings_type: type[msgspec.Struct]) -> str:
    """MLXD_<FIELD>, unless the field's Meta(extra={"env": ...}) names another
    (a repeatable --api-key is read from MLXD_API_KEYS)."""
    for f in _fields(settings_type):
        if f.name == field and isinstance(f.type, mi.Metadata) and f.type.extra:
            return str(f.type.extra.get("env", "MLXD_" + field.upper()))
    return "MLXD_" + field.upper()


def add_arguments(
    parser: argparse.ArgumentParser, settings_type: type[msgspec.Struct], exclude: frozenset[str] = frozenset(),
    variables: bool = True,
) -> None:
    """Add one flag per settings field; unset flags stay None so env and defaults apply.
    variables: whether the command reads the MLXD_* variables too (its help names them)."""
    for f in _fields(settings_type):
        if f.name in exclude:
            continue
        t, description = _unwrap(f.type)
        default = "" if f.default is mi.NODEFAULT else f" (default: {f.default!r})"
        variable = f" [env {env_name(f.name, settings_type)}]" if variables else ""
        help_text = f"{description}{variable}{default}"
        if isinstance(t, mi.BoolType):
            parser.add_argument(
                flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                default=None, help=help_text,
            )
        elif isinstance(t, mi.ListType):
            parser.add_argument(
                flag_name(f.name), dest=f.name, action="append", default=None,
                help=help_text + " (repeatable, or comma-separated)",
            )
        else:
            parser.add_argument(flag_name(f.name), dest=f.name, default=None, help=help_text)


def resolve(
    settings_type: type[S],
    args: argparse.Namespace,
    environ: Mapping[str, str] = os.environ,
) -> S:
    """Flags win over MLXD_* variables, which win over defaults.

    Raises ValueError naming the flag and variable of a bad value.
    """
    raw: dict[str, Any] = {}
    for f in _fields(settings_type):
        value = getattr(args, f.name, None)
        variable = env_name(f.name, settings_type)
        if value is None and variable in environ:
            value = environ[variable]
        if value is not None and isinstance(_unwrap(f.type)[0], mi.ListType):
            items = [value] if isinstance(value, str) else value
            value = [v.strip() for item in items for v in item.split(",") if v.strip()]
        elif isinstance(value, str) and f.name.endswith("_bytes"):  # a size: 1G, 512M, or bytes
            try:
                value = parse_size(value)
            except ValueError as e:
                raise ValueError(f"{flag_name(f.name)} / {variable}: {e}") from None
        if value is not None:
            raw[f.name] = value
    try:
        return msgspec.convert(raw, settings_type, strict=False)
    except msgspec.ValidationError as e:
        message = str(e)
        missing = re.match(r"Object missing required field `(\w+)`", message)
        if missing:
            field = missing.group(1)
            raise ValueError(f"{flag_name(field)} (or {env_name(field, settings_type)}) is required") from None
        at = re.search(r"\$\.(\w+)", message)  # msgspec's "... - at `$.port`"
        field = at.group(1) if at else ""
        if field in raw:
            message = f"{flag_name(field)} / {env_name(field, settings_type)}: {message}"
        raise ValueError(message) from None


def parse_settings(parser: argparse.ArgumentParser, settings_type: type[S], argv: list[str]) -> S:
    """A command's settings from its flags and MLXD_* variables; a bad value
    ends the program with the parser's usage error."""
    add_arguments(parser, settings_type)
    try:
        return resolve(settings_type, parser.parse_args(argv))
    except ValueError as e:
        parser.error(str(e))


def _default(f: mi.Field) -> Any:
    # msgspec keeps a mutable default (a list) as a factory.
    return f.default_factory() if f.default_factory is not mi.NODEFAULT else f.default


def explicit_values(settings: msgspec.Struct) -> list[tuple[str, Any]]:
    """(field, value) for every setting that is not at its default."""
    return [
        (f.name, getattr(settings, f.name))
        for f in _fields(type(settings))
        if getattr(settings, f.name) != _default(f) and getattr(settings, f.name) is not None
    ]


def to_arguments(settings: msgspec.Struct) -> list[str]:
    """The flags that reproduce `settings` in another process's `resolve`."""
    argv: list[str] = []
    for name, value in explicit_values(settings):
        if isinstance(value, bool):
            argv.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
        elif isinstance(value, list):
            for item in value:
                argv += [flag_name(name), str(item)]
        else:
            argv += [flag_name(name), str(value)]
    return argv


def without_variables(environ: Mapping[str, str], settings_type: type[msgspec.Struct]) -> dict[str, str]:
    """`environ` less the settings' MLXD_* variables: for a process given its
    settings as flags, which must not read an inherited variable for a flag
    left out because its value is the default."""
    names = {env_name(f.name, settings_type) for f in _fields(settings_type)}
    return {k: v for k, v in environ.items() if k not in names}


def to_environment(settings: msgspec.Struct) -> dict[str, str]:
    """The MLXD_* variables that reproduce `settings` in another process's `resolve`."""
    return {
        env_name(name, type(settings)): ",".join(map(str, value)) if isinstance(value, list) else str(value)
        for name, value in explicit_values(settings)
    }
