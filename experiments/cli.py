"""Command-line pieces the experiment scripts share: ``NAME=PATH`` options and writing a page."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def named_path(option: str, text: str, example: str) -> tuple[str, Path]:
    """``NAME=PATH`` of a repeated option (``--size``, ``--plan``) as (name, path); ValueError
    naming the option, the value and an ``example`` when either side is missing."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"{option} {text!r}: write NAME=PATH, e.g. {example!r}")
    return name, Path(path)


def write_or_print(text: str, out: Path | None) -> None:
    """Write a generated page to ``out`` (creating its folder), or print it when ``out`` is None."""
    if out is None:
        print(text, end="")
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def emit_page(make: Callable[[], str], out: Path | None) -> int:
    """A script's exit status: build the page with ``make`` and write or print it (0), or print a
    bad input's one-line error (a ValueError, or a missing file) to stderr and write nothing (2)."""
    try:
        text = make()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_or_print(text, out)
    return 0
