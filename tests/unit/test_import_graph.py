"""The import graph of megatron_snip/ and snip_kernels/, read from the source with ``ast`` (module-level
and function-level imports alike, ``TYPE_CHECKING`` ones too), against the house's direction of
imports (docs: ARCHITECTURE.md): rooms form no cycle and point down the layers, snip_kernels/ imports
nothing of megatron_snip, interop/ nothing of training/, and the package root holds only the
entry points and atomic_io.py.

An edge goes to the module named (``from a.b import c`` -> ``a.b.c`` when that is a module, else
``a.b``); the parent packages Python runs on the way are not edges (else every package whose
``__init__`` re-exports would be a circle with its own modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOT_MODULES = {"__init__", "train", "evaluate", "launcher", "atomic_io"}
# Bottom to top; a room may import rooms of its own layer or below (and the room graph has no cycle).
LAYERS = (
    ("snip_kernels", "atomic_io", "megatron_snip"),  # megatron_snip: the root __init__ (empty)
    ("precision",),
    ("config", "parallel"),
    ("model", "data", "telemetry"),
    ("snip", "sizing", "interop"),
    ("training",),
    ("train", "evaluate", "launcher"),
)
# Module circles allowed inside a room: none (issue #35 removed the last, precision's capability <->
# backends: the pure rules now sit in capability.py / scaled_mm_rules.py below the backends, the
# device verdicts in backends/support.py above them, the Backend base in backends/base.py).
KNOWN_CIRCLES: list[set[str]] = []


def modules(repo: Path) -> dict[str, Path]:
    out = {}
    for pkg in ("megatron_snip", "snip_kernels"):
        for path in (repo / pkg).rglob("*.py"):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def import_graph(repo: Path) -> dict[str, set[str]]:
    """module -> the modules of megatron_snip/snip_kernels it imports anywhere in its source."""
    mods = modules(repo)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = package
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name)
                if target is not None and target != mod:
                    graph[mod].add(target)
    return graph


def room(mod: str) -> str:
    """``megatron_snip.sizing.dry_run`` -> ``sizing``; ``megatron_snip.train`` -> ``train``; ``snip_kernels.x`` -> ``snip_kernels``."""
    parts = mod.split(".")
    return parts[1] if parts[0] == "megatron_snip" and len(parts) > 1 else parts[0]


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.add(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        rooms.setdefault(room(mod), set()).update(room(t) for t in targets if room(t) != room(mod))
    return rooms


GRAPH = import_graph(REPO)


def test_circles_finds_a_circle_and_passes_a_chain():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_rooms_form_no_cycle_and_point_down_the_layers():
    rooms = room_graph(GRAPH)
    assert circles(rooms) == []
    layer = {r: i for i, names in enumerate(LAYERS) for r in names}
    assert set(rooms) <= set(layer), f"rooms missing from LAYERS: {sorted(set(rooms) - set(layer))}"
    upward = sorted((a, b) for a, targets in rooms.items() for b in targets if layer[b] > layer[a])
    assert upward == [], f"imports pointing up the layers (room -> room): {upward}"


def test_modules_form_no_cycle():
    assert sorted(map(sorted, circles(GRAPH))) == sorted(map(sorted, KNOWN_CIRCLES)) == []


def test_sizing_modules_import_one_way():
    sizing = {m: {t for t in ts if room(t) == "sizing"} for m, ts in GRAPH.items() if room(m) == "sizing"}
    assert "megatron_snip.sizing.dry_run" not in sizing["megatron_snip.sizing.gemm_time"]
    assert circles(sizing) == []


def test_kernels_import_nothing_of_megatron_snip():
    bad = sorted((m, t) for m, ts in GRAPH.items() if room(m) == "snip_kernels" for t in ts if room(t) != "snip_kernels")
    assert bad == []


def test_interop_imports_nothing_of_training():
    bad = sorted((m, t) for m, ts in GRAPH.items() if room(m) == "interop" for t in ts if room(t) == "training")
    assert bad == []


def test_package_root_holds_only_the_entry_points_and_atomic_io():
    root = {p.stem for p in (REPO / "megatron_snip").glob("*.py")}
    assert root <= ROOT_MODULES, f"modules at the package root: {sorted(root - ROOT_MODULES)}"


def test_top_level_packages_shadow_no_installed_distribution():
    """The repository root is on sys.path in every test and script run, and setup.py installs its
    top-level packages: a name another installed distribution also provides would shadow that one.
    It happened: the Triton kernels' package was called ``kernels``, which is also Hugging Face's
    ``kernels`` (a dependency of transformers >= 5), and ``import transformers``'s hub-kernels
    integration then imported ours and failed."""
    from importlib.metadata import packages_distributions

    root = Path(__file__).resolve().parents[2]
    ours = sorted(p.parent.name for p in root.glob("*/__init__.py"))
    assert "snip_kernels" in ours and "megatron_snip" in ours, ours
    providers = packages_distributions()
    clashes = {name: sorted(set(providers[name]) - {"megatron_snip", "megatron-snip"})
               for name in ours if set(providers.get(name, ())) - {"megatron_snip", "megatron-snip"}}
    assert clashes == {}, f"top-level packages also provided by installed distributions: {clashes}"
