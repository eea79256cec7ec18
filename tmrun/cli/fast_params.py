"""Plain coercion of tmrun-ctl's parameters, so that a call does not import pydantic.

typer (0.29) coerces every parameter's value through a pydantic ``TypeAdapter`` that it builds
on first use: importing pydantic and building the adapters is about a third of tmrun-ctl's
start-up (``python -X importtime``), more than its request to the job. tmrun-ctl's parameters
are all ``str``, ``int``, ``float`` or ``bool`` (each maybe ``None``): :func:`plain_coercion`
gives each parameter of a typer command a coercion of typer's own kind for those
(``RuntimeParam``) before it runs, with the same "Invalid value for ..." usage errors. A
parameter of any other type, or a typer without these internals, keeps typer's own coercion
(correct, only slower).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any

_NAMES = {int: "integer", float: "number", bool: "boolean"}
_TRUE = {"1", "true", "t", "yes", "y", "on"}
_FALSE = {"0", "false", "f", "no", "n", "off"}


def coerce_plain(annotation: type, value: Any) -> Any:
    """``value`` (a command-line string, or a default) as ``annotation``; ValueError if it is not one."""
    if annotation is str:
        return value if isinstance(value, str) else str(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ValueError(f"{value!r} is not a valid boolean")
    if annotation is int:
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a valid integer")
        if isinstance(value, int):
            return value
        try:
            return int(str(value).strip())
        except ValueError:
            raise ValueError(f"{value!r} is not a valid integer") from None
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            number = float(str(value).strip())
        except ValueError:
            raise ValueError(f"{value!r} is not a valid number") from None
        if math.isnan(number):
            raise ValueError(f"{value!r} is not a valid number")
        return number
    raise TypeError(f"no plain coercion for {annotation!r}")


@functools.cache
def _plain_param_class() -> Any:
    """typer's ``RuntimeParam`` with the plain coercion (None: not the typer this knows)."""
    try:
        from typer._click.exceptions import BadParameter
        from typer._coercion import RuntimeParam
    except ImportError:
        return None

    @dataclass(frozen=True)
    class PlainParam(RuntimeParam):  # type: ignore[misc, valid-type]
        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            try:
                return coerce_plain(self.annotation, value)
            except ValueError as exc:
                raise BadParameter(f"{exc}.", ctx=ctx, param=param) from None

    return PlainParam


def plain_coercion(command: Any) -> int:
    """Give every str/int/float/bool parameter of ``command`` (a typer click command or group,
    recursively, its ``--help`` included) the plain coercion. Returns how many parameters got it
    (0: typer's internals are not what this knows; typer's own coercion stays)."""
    plain_param = _plain_param_class()
    if plain_param is None:
        return 0
    from typer._click import Context

    count = 0
    for sub in getattr(command, "commands", {}).values():
        count += plain_coercion(sub)
    params = list(getattr(command, "params", []))
    with contextlib.suppress(Exception):  # not the typer this knows: --help keeps typer's coercion
        params.append(command.get_help_option(Context(command)))  # made on first use, then kept
    for param in params:
        descriptor = getattr(param, "type_descriptor", None)
        if descriptor is None or not hasattr(param, "_runtime_param") or getattr(param, "multiple", False):
            continue
        if descriptor.annotation in _NAMES or descriptor.annotation is str:
            info = descriptor.parameter_info
            plain = all(getattr(info, name, None) is None for name in ("parser", "min", "max", "callback"))
            if descriptor.file_annotation is None and plain:
                param._runtime_param = plain_param(info, descriptor.annotation)
                count += 1
    return count
