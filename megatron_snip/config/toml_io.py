"""Configs in and out of TOML: ``load_config`` (a file plus dotted ``--set`` overrides) and
``config_from_dict`` (nested tables -> the ``Config`` tree, an unknown section or key an error).
Writing is ``Config.to_toml`` (sections.py); the value rules both directions use are values.py.
"""

from __future__ import annotations

import tomllib
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

from megatron_snip.config.sections import Config
from megatron_snip.config.values import coerce, field_error, parse_override

_SECTIONS = {f.name: f for f in fields(Config)}


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from nested dicts (as TOML gives); unknown sections/keys raise ValueError."""
    sections: dict[str, Any] = {}
    hints = get_type_hints(Config)
    for section, values in raw.items():
        if section not in _SECTIONS:
            raise field_error(section, "...", f"unknown config section; sections are {sorted(_SECTIONS)}")
        if not isinstance(values, dict):
            raise field_error(section, values, "must be a table of key = value")
        cls = hints[section]
        assert is_dataclass(cls)
        field_types = get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in field_types:
                raise field_error(f"{section}.{key}", value, f"unknown key; {section} has {sorted(field_types)}")
            kwargs[key] = coerce(section, key, value, field_types[key])
        sections[section] = cls(**kwargs)
    return Config(**sections)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML config (or the defaults when path is None) and apply dotted overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"config file {str(path)!r} is a directory; give a TOML file in it (e.g. "
                             f"{path / 'config.toml'}) or one of launch/configs/*.toml")
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist; see launch/configs/ for examples")
        try:
            raw = tomllib.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}); "
                             f"give a TOML file such as launch/configs/tiny.toml") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    for ov in overrides:
        section, key, value = parse_override(ov)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise field_error(section, raw[section], "must be a table")
        raw[section][key] = value
    return config_from_dict(raw)
