"""The package's layers: each row of ARCHITECTURE.md's table imports only the rows below
it, the bottom row imports nothing of gpufleet, and neither packages nor modules import
each other in a circle. Inside ``gpufleet.train`` a second table orders its subpackages
and top-level modules (the engine above checkpoints, recovery and the guard) the same way.

The graph is built from the source with ``ast``, not by importing it. A node is a
subpackage (``gpufleet.train``) or a top-level module (``gpufleet.cli``); an edge is any
import of one node from another, at module level or inside a function (both run, sooner
or later), or under ``if TYPE_CHECKING:`` (it never runs, but ties the two modules just
the same: one cannot move or change its types without the other).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import gpufleet

PACKAGE = Path(gpufleet.__file__).parent
BOTTOM = "gpufleet.core"
TRAIN = "gpufleet.train"
ARCHITECTURE = PACKAGE.parent.parent / "ARCHITECTURE.md"
# The package itself: its __init__ imports its public names lazily, on first use.
ROOT = "gpufleet"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _node(module: str) -> str:
    """The graph node of a module: its subpackage, or itself for a top-level module."""
    parts = module.split(".")
    if len(parts) == 1:
        return module
    return ".".join(parts[:2])


def _imports(path: Path) -> set[str]:
    """The gpufleet modules ``path`` imports anywhere (TYPE_CHECKING blocks included)."""
    module = _module_name(path)
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # `from gpufleet import train` imports the subpackage itself, and
            # `from gpufleet.train import loop` the module.
            folder = PACKAGE.parent / target.replace(".", "/")
            found.update(f"{target}.{a.name}" for a in node.names
                         if (folder / a.name).is_dir() or (folder / f"{a.name}.py").is_file())
    return {m for m in found if m == "gpufleet" or m.startswith("gpufleet.")}


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        source = _node(_module_name(path))
        for target in _imports(path):
            node = _node(target)
            if node != source:
                edges[source].add(node)
    return edges


def _reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(edges.get(node, ()))
    return False


def test_bottom_layer_imports_nothing_from_the_package() -> None:
    imported = {m for path in (PACKAGE / "core").rglob("*.py") for m in _imports(path)}
    outside = sorted(m for m in imported if not m.startswith(BOTTOM))
    assert outside == [], f"{BOTTOM} must import nothing else of gpufleet: {outside}"


def test_no_import_cycles_between_packages() -> None:
    edges = _graph()
    in_cycles = sorted((a, b) for a, targets in edges.items() for b in targets
                       if _reaches(edges, b, a))
    assert in_cycles == [], f"imports that close a cycle between packages: {in_cycles}"


def _module_graph() -> dict[str, set[str]]:
    """Module -> the gpufleet modules it imports (``from pkg import name`` counts as
    importing ``pkg``, or ``pkg.name`` when that is a module)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for target in _imports(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                edges[module].add(target)
    return edges


def test_no_import_cycles_between_modules() -> None:
    """Also inside a package (train.checkpoint and train.sharded, since moved to
    train.checkpoint.format and .sharded, serve.export and serve.model once imported each
    other from inside functions)."""
    edges = _module_graph()
    in_cycles = sorted((a, b) for a, targets in edges.items() for b in targets
                       if _reaches(edges, b, a))
    assert in_cycles == [], f"imports that close a cycle between modules: {in_cycles}"


def test_the_graph_sees_known_imports() -> None:
    """The walker itself: it finds a module-level and a function-level import."""
    edges = _graph()
    assert "gpufleet.core" in edges["gpufleet.monitor"]  # module level (the callbacks)
    assert "gpufleet.monitor" in edges["gpufleet.entry"]  # inside entry.run_rank (Progress)
    # The pairs named in issue 18, one way round only.
    for low, high in (("config", "data"), ("config", "parallel"), ("config", "train"),
                      ("parallel", "train"), ("monitor", "train"), ("fault", "train"),
                      ("data", "train"), ("launch", "parallel"), ("fault", "launch")):
        assert f"gpufleet.{high}" not in edges.get(f"gpufleet.{low}", set()), (low, high)


def test_the_config_names_the_registered_strategies() -> None:
    """The config checks strategy names without importing gpufleet.parallel."""
    from gpufleet.config.schema import STRATEGY_NAMES
    from gpufleet.parallel import strategy_names

    assert strategy_names() == list(STRATEGY_NAMES)


def _rows(heading: str = "## Layers", package: str = ROOT) -> list[list[str]]:
    """The rows of the layer table that follows ``heading`` in ARCHITECTURE.md, top first,
    as names under ``package``: a row is a line whose names start at the left edge (a
    description's continuation lines are indented further)."""
    folder = PACKAGE.parent / package.replace(".", "/")
    text = ARCHITECTURE.read_text(encoding="utf-8").split(heading, 1)[1]
    table = text.split("```", 2)[1]
    rows = []
    for line in table.splitlines()[1:]:
        if not line.strip() or len(line) - len(line.lstrip()) > 2:
            continue
        # The names come first; the description starts at the first word that is not one.
        names = []
        for word in line.split():
            if not (folder / word).is_dir() and not (folder / f"{word}.py").is_file():
                break
            names.append(f"{package}.{word}")
        rows.append(names)
    return rows


def test_the_architecture_names_every_package_in_one_row() -> None:
    rows = _rows()
    placed = [name for row in rows for name in row]
    assert len(rows) >= 8 and all(rows), rows
    assert len(placed) == len(set(placed)), f"a name in two rows: {placed}"
    nodes = {_node(_module_name(path)) for path in PACKAGE.rglob("*.py")} - {ROOT}
    assert sorted(nodes - set(placed)) == [], "packages ARCHITECTURE.md's layers leave out"
    assert sorted(set(placed) - nodes) == [], "rows that name no package"


def test_each_row_imports_only_the_rows_below_it() -> None:
    """Not above, not beside: ``bench`` and ``monitor`` share a row, so neither imports
    the other."""
    height = {name: len(_rows()) - i for i, row in enumerate(_rows()) for name in row}
    edges = _graph()
    wrong = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                   if a in height and b in height and height[b] >= height[a])
    assert wrong == [], f"imports of a row above or beside (see ARCHITECTURE.md): {wrong}"
    assert all(a in height for a in edges if a != ROOT), sorted(set(edges) - set(height))


# Inside gpufleet.train: a node is a subpackage (``gpufleet.train.engine``) or a module
# at train/ level (``gpufleet.train.loop``); the table is ARCHITECTURE.md's "Inside train/".
TRAIN_HEADING = "### Inside `train/`"


def _train_node(module: str) -> str:
    return ".".join(module.split(".")[:3])


def _train_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in (PACKAGE / "train").rglob("*.py"):
        source = _train_node(_module_name(path))
        for target in _imports(path):
            if target.startswith(f"{TRAIN}."):
                node = _train_node(target)
                if node != source:
                    edges[source].add(node)
    return edges


def test_the_train_graph_sees_known_imports() -> None:
    """The walker inside train/: the loop runs the engine, the engine builds the
    checkpointer, the guard and the recovery, and a regrouping moves a scheduler onto a
    rebuilt optimizer (the recovery reads no checkpoint of its own: a loop's state)."""
    edges = _train_graph()
    assert f"{TRAIN}.engine" in edges[f"{TRAIN}.loop"]
    for part in ("checkpoint", "guard", "recovery"):
        assert f"{TRAIN}.{part}" in edges[f"{TRAIN}.engine"], part
    assert f"{TRAIN}.recipe" in edges[f"{TRAIN}.recovery"]  # place_scheduler
    assert f"{TRAIN}.seed" in edges[f"{TRAIN}.checkpoint"]  # the checkpointer: RNG states


def test_the_architecture_places_every_part_of_train_in_one_row() -> None:
    rows = _rows(TRAIN_HEADING, TRAIN)
    placed = [name for row in rows for name in row]
    assert len(rows) >= 5 and all(rows), rows
    assert len(placed) == len(set(placed)), f"a name in two rows: {placed}"
    nodes = {_train_node(_module_name(path)) for path in (PACKAGE / "train").rglob("*.py")}
    nodes -= {TRAIN}
    assert sorted(nodes - set(placed)) == [], "parts of train/ ARCHITECTURE.md leaves out"
    assert sorted(set(placed) - nodes) == [], "rows that name no part of train/"


def test_each_row_inside_train_imports_only_the_rows_below_it() -> None:
    """The engine above recovery, checkpoints and the guard; nothing below imports it."""
    rows = _rows(TRAIN_HEADING, TRAIN)
    height = {name: len(rows) - i for i, row in enumerate(rows) for name in row}
    edges = _train_graph()
    wrong = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                   if height.get(b, 0) >= height.get(a, 0))
    assert wrong == [], f"imports of a row above or beside in train/ (ARCHITECTURE.md): {wrong}"
    assert TRAIN not in edges, "gpufleet.train's __init__ imports nothing"
