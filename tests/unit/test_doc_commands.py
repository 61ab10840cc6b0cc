"""Every command the README and docs/ show names an entry point that exists, and its flags parse (#35).

A command is a ``python -m <module> ...``, ``python scripts/<x>.py ...``, ``scripts/<x>.sh ...`` or
``launch/torchrun.sh ...`` line of a fenced block (continuations joined, ``;``/``&&``/``|``/``do``
split, redirections, ``&`` and comments dropped, ``NAME=value`` assignments of the same block
substituted), or an inline code span that starts with ``python``. "Parses" means: the entry point's
own ``argparse`` parser accepts the arguments - checked by running the module as ``__main__`` with
``ArgumentParser.parse_known_args`` patched to stop right after a successful parse, so nothing but
imports and the parse runs. ``megatron_snip.train`` commands also load their config with the
``--set`` overrides (a typo in a field name fails there). The shell launchers map onto the entry
point they call (``torchrun.sh [N] CONFIG ARGS`` -> ``megatron_snip.train --config CONFIG ARGS``,
``gpu_check.sh ARGS`` -> ``scripts/gpu_check.py ARGS``).

Records under ``docs/results/`` quote what was run at the time: a retired script there is allowed
only if ``RETIRED`` names its successor, and the successor must exist.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "launch/slurm/README.md", REPO / "experiments/README.md",
         *sorted((REPO / "docs").rglob("*.md"))]
# Scripts retired since a record was written -> the entry point that does that job now.
RETIRED = {"scripts/bench_overheads.py": "experiments.bench.overheads",
           "scripts/validate_metrics.py": "experiments.validate_metrics",
           "scripts/compare_policies.py": "experiments.compare_policies"}
# Files a page's earlier command creates (the quick starts chain them); their configs are not loaded.
GENERATED = {"tiny_hf_snip.toml"}
# Module entry points a page shows that are not argparse CLIs of this repository.
FOREIGN = {"pytest"}


class _Parsed(Exception):
    """Raised by the patched parser once the arguments parsed: stop before the command runs."""

    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


def _split_commands(line: str) -> list[list[str]]:
    """One shell line -> the words of each simple command in it, quotes respected (``;``, ``&&``,
    ``|``, ``&``, ``do``/``done`` separate commands; redirections and comments are dropped). A
    parenthesis is a word: ``entry point (python -m x)`` in a layout listing is prose, not a command."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, words, redirect = [], [], False
    for token in lexer:
        if redirect:
            redirect = False
        elif token and set(token) <= set("><"):
            redirect = True
        elif token and set(token) <= set(";&|") or token in ("do", "done", "then", "fi"):
            commands.append(words)
            words = []
        else:
            words.append(token)
    return [w for w in [*commands, words] if w]


def _assignments(block: str) -> dict[str, str]:
    """What ``$name`` stands for in a block: its ``name=value`` assignments, and the first value of
    each ``for name in v1 v2 ...`` loop (the command is checked as its first iteration runs it)."""
    found = {}
    for m in re.finditer(r"(?:^|[;\s])([A-Za-z_][A-Za-z0-9_]*)=(\"[^\"]*\"|'[^']*'|[^\s;]+)", block):
        found[m.group(1)] = m.group(2).strip("\"'")
    for m in re.finditer(r"\bfor ([A-Za-z_][A-Za-z0-9_]*) in ([^\s;]+)", block):
        found[m.group(1)] = m.group(2)
    return found


def _page_commands(page: Path) -> list[tuple[str, list[str]]]:
    """(where, argv) of every command shown on ``page`` (a page of this repository)."""
    return _page_commands_at(page, str(page.relative_to(REPO)))


def _page_commands_at(page: Path, where: str = "test") -> list[tuple[str, list[str]]]:
    """(where, argv) of every command shown on ``page``; argv starts at the entry point."""
    text = page.read_text(encoding="utf-8")
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL):
        block = re.sub(r"\\\n\s*", " ", block)
        env = _assignments(block)
        for line in block.splitlines():
            for name, value in sorted(env.items(), key=lambda kv: -len(kv[0])):  # $seeds before $s
                line = line.replace("${" + name + "}", value).replace("$" + name, value)
            lines.append(line)
    # Inline spans: a command with arguments; a bare ``python -m x`` names the entry point only.
    mentions = re.findall(r"`(python3? [^`\n]+)`", text)
    lines += [m for m in mentions if len(m.split()) > (3 if " -m " in m else 2)]
    commands = []
    for line in lines:
        line = re.sub(r"\[(--[^\]]+)\]", r"\1", line)  # "[--metric val_loss]": an optional flag shown
        try:
            split = _split_commands(line)
        except ValueError:  # unbalanced quotes: prose in a code block, not a command
            continue
        for words in split:
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words = words[1:]  # environment assignments before the command
            if "..." in words:
                words = words[:words.index("...")]  # "and the rest": only what is shown is checked
            if len(words) >= 3 and words[0] in ("python", "python3") and words[1] == "-m":
                commands.append((where, ["-m", *words[2:]]))
            elif len(words) >= 2 and words[0] in ("python", "python3") and words[1].startswith("scripts/"):
                commands.append((where, words[1:]))
            elif words and (words[0].startswith("scripts/") and words[0].endswith(".sh")
                            or words[0] == "launch/torchrun.sh"):
                commands.append((where, words))
    return commands


def all_commands() -> list[tuple[str, list[str]]]:
    return [c for page in PAGES for c in _page_commands(page)]


def _resolve(where: str, argv: list[str]) -> tuple[str, str, list[str]]:
    """(kind, target, args): kind "module" or "script" and the arguments its parser sees."""
    head, args = argv[0], argv[1:]
    if head == "-m":
        return "module", args[0], args[1:]
    if head == "launch/torchrun.sh":
        if args and args[0].isdigit():
            args = args[1:]
        return "module", "megatron_snip.train", ["--config", *args[:1], *args[1:]]
    if head == "scripts/gpu_check.sh":
        return "script", "scripts/gpu_check.py", args
    if head in RETIRED and where.startswith("docs/results/"):
        return "retired", RETIRED[head], args
    return "script", head, args


def _parse_only(kind: str, target: str, args: list[str], monkeypatch) -> argparse.Namespace | None:
    """Run the entry point as ``__main__`` until its arguments parsed; the namespace, or None when
    it parsed none (an entry point without argparse)."""
    original = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self, a=None, namespace=None):
        ns, extra = original(self, a, namespace)
        if extra:  # no entry point here passes arguments through: parse_args would refuse them
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        raise _Parsed(ns)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    monkeypatch.setattr(sys, "argv", [target, *args])
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=False)
        else:  # as `python <script>` runs it: the script's folder first on sys.path (its sibling modules)
            monkeypatch.syspath_prepend(str((REPO / target).parent))
            runpy.run_path(str(REPO / target), run_name="__main__")
    except _Parsed as done:
        return done.namespace
    return None


COMMANDS = all_commands()


def test_the_pages_show_commands():
    # The extractor finds the README's two commands and the guide's; an empty list would pass vacuously.
    shown = {" ".join(argv[:2]) for _, argv in COMMANDS}
    assert "-m megatron_snip.train" in shown and "-m pytest" in shown
    assert len(COMMANDS) > 100


def test_a_wrong_flag_or_field_fails(monkeypatch, tmp_path):
    # The check itself can fail: an unknown flag, a bad value and a misspelled config field.
    page = tmp_path / "page.md"
    page.write_text("```bash\nA=launch/configs; python -m megatron_snip.train --config $A/tiny.toml --sett x=1\n"
                    "python scripts/solve_plan.py --fp4-target nine\n```\n")
    (bad_flag, argv1), (bad_value, argv2) = [(w, a) for w, a in _page_commands_at(page)]
    with pytest.raises(SystemExit):
        _parse_only(*_resolve(bad_flag, argv1), monkeypatch)
    with pytest.raises(SystemExit):
        _parse_only(*_resolve(bad_value, argv2), monkeypatch)
    ns = _parse_only("module", "megatron_snip.train", ["--config", "launch/configs/tiny.toml", "--set",
                                                       "training.max_stepz=3"], monkeypatch)
    from megatron_snip.config import load_config

    with pytest.raises(ValueError, match="max_stepz"):
        load_config(REPO / ns.config, ns.overrides)


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("where,argv", COMMANDS, ids=[f"{w}:{' '.join(a)[:60]}" for w, a in COMMANDS])
def test_command_names_an_entry_point_whose_flags_parse(where, argv, monkeypatch):
    kind, target, args = _resolve(where, argv)
    if argv[0].endswith(".sh"):
        assert (REPO / argv[0]).is_file() and (REPO / argv[0]).stat().st_mode & 0o111, f"{where}: {argv[0]}"
    if kind == "retired":
        assert argv[0] not in {str(p.relative_to(REPO)) for p in (REPO / "scripts").iterdir()}, \
            f"{argv[0]} is listed as retired but exists"
        assert importlib.util.find_spec(target), f"{where}: successor {target} of {argv[0]}"
        return  # a record's flags are those of its time
    if kind == "module":
        if target in FOREIGN:
            return
        assert importlib.util.find_spec(target), f"{where}: no module {target}"
    else:
        assert (REPO / target).is_file(), f"{where}: no script {target}"
    try:
        ns = _parse_only(kind, target, args, monkeypatch)
    except SystemExit as e:
        pytest.fail(f"{where}: `{' '.join(argv)}` does not parse (exit {e.code})")
    assert ns is not None, f"{where}: {target} parsed no arguments (not an argparse entry point?)"
    if target == "megatron_snip.train" and Path(ns.config).name not in GENERATED:
        from megatron_snip.config import load_config

        load_config(REPO / ns.config, ns.overrides)  # ValueError naming the field on a typo
