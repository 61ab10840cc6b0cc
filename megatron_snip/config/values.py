"""How config values are read and checked: the error every field's check raises, the value rules
several sections share, and TOML values in (``coerce``, ``parse_override``) and out (``toml_value``).

``sections.py`` declares the sections and their cross-field rules on top of these; nothing here knows
a section's fields.
"""

from __future__ import annotations

import math
import tomllib
import types
from dataclasses import fields
from typing import Any, Union, get_args, get_origin


def field_error(field_name: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"config {field_name}={value!r}: {fix}")


def check_seed(field_name: str, value: Any) -> None:
    """Seeds feed torch (< 2**64, after offsets are added) and numpy generators: [0, 2**32)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise field_error(field_name, value, "must be an integer in [0, 2**32), e.g. 1234")


def check_positive(section: str, obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not v > 0:  # also catches NaN, which fails every comparison
            raise field_error(f"{section}.{n}", v, "must be > 0")


def check_finite(section: str, obj: Any) -> None:
    """Every float field of a section must be a finite number (NaN and inf pass ``<= 0`` style
    checks and then fail hours into a run)."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise field_error(f"{section}.{f.name}", v, "must be a finite number")


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def coerce(section: str, key: str, value: Any, typ: Any) -> Any:
    """Convert a TOML/override value to the field's type, or raise naming the field."""
    name = f"{section}.{key}"
    origin = get_origin(typ)
    if origin in (Union, types.UnionType):  # bool | str: true/false as booleans, anything else a string
        seq = next((a for a in get_args(typ) if get_origin(a) is tuple), None)
        if seq is not None and isinstance(value, (list, tuple, dict)):  # str | tuple[str, ...]: a blend
            if isinstance(value, dict):  # a table {path = weight} -> Megatron's [weight, path, ...]
                value = [x for path, weight in value.items() for x in (weight, path)]
            return coerce(section, key, value, seq)
        if bool in get_args(typ) and (isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("true", "false"))):
            return coerce(section, key, value, bool)
        return coerce(section, key, value, str)
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise field_error(name, value, "must be a list, e.g. [\"fp8\", \"nvfp4\"]")
        (elem,) = {a for a in get_args(typ) if a is not Ellipsis}
        return tuple(coerce(section, key, v, elem) for v in value)
    if typ is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise field_error(name, value, "must be true or false")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise field_error(name, value, "must be an integer")
        try:
            return int(value)
        except ValueError:
            raise field_error(name, value, "must be an integer") from None
    if typ is float:
        if isinstance(value, bool):
            raise field_error(name, value, "must be a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise field_error(name, value, "must be a number") from None
    if typ is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise field_error(name, value, "must be a string")
        return str(value)
    return value


def parse_override(text: str) -> tuple[str, str, Any]:
    """'section.field=value' -> (section, field, value); the value is parsed as TOML if it can be."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ValueError(f"override {text!r} is not 'section.field=value' (e.g. training.max_steps=60)")
    path, raw = text.split("=", 1)
    section, key = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare strings: --set precision.initial_plan=uniform:nvfp4
    return section, key, value


def parse_time_costs(entries: tuple[str, ...]) -> dict[str, float]:
    """``snip.time_costs`` (``["bf16=1", "fp8=0.5"]``) as {format: relative GEMM time per FLOP}; {} if empty.
    ValueError naming the field unless each entry is ``<known format>=<positive number>``, bf16 among them."""
    from megatron_snip.precision.formats import FORMATS

    out: dict[str, float] = {}
    for e in entries:
        fmt, sep, val = str(e).partition("=")
        fmt = fmt.strip()
        try:
            t = float(val)
        except ValueError:
            t = math.nan
        if not sep or fmt not in FORMATS or not (0 < t < math.inf) or fmt in out:
            raise field_error("snip.time_costs", list(entries), f"entry {e!r} must be '<format>=<positive number>' with a "
                       f"distinct format from {sorted(FORMATS)}, e.g. [\"bf16=1\", \"fp8=0.5\"]")
        out[fmt] = t
    if out and "bf16" not in out:
        raise field_error("snip.time_costs", list(entries), "must include 'bf16=<ratio>', the reference of time_budget")
    return out
