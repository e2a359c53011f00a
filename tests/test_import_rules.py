"""The rooms' import rules, read from docs/architecture.md's table and checked on every import of
the package, lazy ones inside functions included: a room imports only itself and the rooms its
row names (all of them lower in the flow), and the rooms marked "never" import neither torch nor
Megatron. And no two modules import each other, directly or around a cycle: an import inside a
function hides a cycle, it does not remove it (only `if TYPE_CHECKING:` imports stay aside)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_omnibal"
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Rooms and what they may import"
HEAVY = ("torch", "megatron")


@dataclass(frozen=True, kw_only=True)
class Room:
    paths: tuple[str, ...]
    may_import: tuple[str, ...]
    never_heavy: bool

    @property
    def name(self) -> str:
        return self.paths[0]


def read_rooms() -> list[Room]:
    """The table's rows, bottom room first."""
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    rooms = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rooms.append(Room(paths=tuple(re.findall(r"`([^`]+)`", cells[0])),
                          may_import=tuple(re.findall(r"`([^`]+)`", cells[2])),
                          never_heavy=cells[3] == "never"))
    return rooms


def named(entry: str, rooms: list[Room]) -> set[str]:
    """The rooms one "may import" entry names: `x/` itself, `x/*` the room x/ and those inside."""
    if entry.endswith("*"):
        return {room.name for room in rooms if room.name.startswith(entry[:-1])}
    return {room.name for room in rooms if room.name == entry}


def room_of(relative: str, rooms: list[Room]) -> Room | None:
    """The most specific room holding a module path relative to the package."""
    best: tuple[int, Room] | None = None
    for room in rooms:
        for path in room.paths:
            holds = relative.startswith(path) if path.endswith("/") else relative == path
            if holds and (best is None or len(path) > best[0]):
                best = (len(path), room)
    return None if best is None else best[1]


def package_path(dotted: str) -> str | None:
    """megatron_omnibal.a.b -> 'a/b.py' or 'a/b/__init__.py' (or '_balance_core'), if it exists."""
    parts = dotted.split(".")[1:]
    if not parts:
        return "__init__.py"
    base = "/".join(parts)
    if base == "_balance_core":
        return base
    if (PACKAGE / f"{base}.py").is_file():
        return f"{base}.py"
    if (PACKAGE / base / "__init__.py").is_file():
        return f"{base}/__init__.py"
    return None


def imported_names(relative: str, source: str, typing_only: bool = True
                   ) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in a module: statements anywhere, and
    importlib.import_module / __import__ of a string literal; `typing_only=False` leaves out
    the imports under `if TYPE_CHECKING:` (never run, so they make no cycle)."""
    package = ["megatron_omnibal", *relative.split("/")[:-1]]
    found = []
    tree = ast.parse(source)
    if not typing_only:
        tree = _WithoutTypeChecking().visit(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                inside = base.startswith("megatron_omnibal") and package_path(child)
                found.append((node.lineno, child if inside else base))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "__import__"))):
            found.append((node.lineno, node.args[0].value))
    return found


class _WithoutTypeChecking(ast.NodeTransformer):
    """Drops the body of every `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`), keeping its
    else branch."""

    def visit_If(self, node: ast.If) -> ast.AST | list[ast.stmt]:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            return [self.visit(stmt) for stmt in node.orelse]
        return self.generic_visit(node)


def import_cycles(sources: dict[str, str]) -> list[list[str]]:
    """The import cycles among modules {path relative to the package: source}, each as the
    modules around it (the strongly connected components of the import graph, Tarjan)."""
    edges = {relative: sorted({path for _, name in imported_names(relative, source, False)
                               if name.startswith("megatron_omnibal")
                               and (path := package_path(name)) in sources and path != relative})
             for relative, source in sources.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in edges[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(edges):
        if module not in order:
            visit(module)
    return cycles


def violations(relative: str, source: str, rooms: list[Room]) -> list[str]:
    """What one module imports against its room's row."""
    own = room_of(relative, rooms)
    if own is None:
        return [f"{relative}: in no room of docs/architecture.md (add a row)"]
    allowed = {own.name}.union(*(named(entry, rooms) for entry in own.may_import))
    found = []
    for line, name in imported_names(relative, source):
        where = f"megatron_omnibal/{relative}:{line} imports {name}"
        if own.never_heavy and (name.split(".")[0] in HEAVY
                                or name.startswith("megatron_omnibal.megatron")):
            found.append(f"{where}: room {own.name} never imports torch or Megatron")
        if not name.startswith("megatron_omnibal"):
            continue
        path = package_path(name)
        target = None if path is None else room_of(path, rooms)
        if target is None:
            found.append(f"{where}: not a module in any room")
        elif target.name not in allowed:
            found.append(f"{where} of room {target.name}: room {own.name} may import only "
                         f"{', '.join(own.may_import) or 'itself'}")
    return found


def package_modules() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                  if "__pycache__" not in p.parts)


def test_the_table_names_known_rooms_each_below_the_row_that_names_it() -> None:
    rooms = read_rooms()
    assert len(rooms) > 20
    seen: set[str] = set()
    for room in rooms:
        for entry in room.may_import:
            names = named(entry, rooms)
            assert names, f"row {room.name} names {entry}, which is no row"
            above = seen | {room.name}
            assert names <= above, f"row {room.name} names {entry}: {names - above} not above it"
        seen.add(room.name)


def test_every_import_of_the_package_keeps_to_its_rooms_row() -> None:
    rooms = read_rooms()
    found = [problem for relative in package_modules()
             for problem in violations(relative, (PACKAGE / relative).read_text(), rooms)]
    assert not found, "\n".join(found)


def test_no_module_imports_itself_around_a_cycle() -> None:
    sources = {relative: (PACKAGE / relative).read_text() for relative in package_modules()}
    cycles = import_cycles(sources)
    assert not cycles, "import cycles (imports inside functions count):\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_sees_lazy_imports_and_leaves_type_checking_aside() -> None:
    """A cycle closed by an import inside a function is refused; one closed only under
    `if TYPE_CHECKING:` is not."""
    lengths = "from megatron_omnibal.data.frames import FrameSettings\n"
    lazy = "def f():\n    from megatron_omnibal.data import video_lengths\n"
    back = "from megatron_omnibal.data.lengths import LengthStats\n"
    typing_only = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from megatron_omnibal.data import video_lengths\nelse:\n    x = 1\n")
    around = {"data/lengths.py": lengths, "data/frames.py": lazy, "data/video_lengths.py": back}
    assert import_cycles(around) == [["data/frames.py", "data/lengths.py",
                                      "data/video_lengths.py"]]
    assert not import_cycles({**around, "data/frames.py": typing_only})


def test_balancing_planning_and_length_code_never_import_torch_or_megatron() -> None:
    rooms = read_rooms()
    pure = [r for r in package_modules() if (room := room_of(r, rooms)) and room.never_heavy]
    assert {"balance/balancer.py", "planner/make.py", "planner/search/partition.py",
            "data/lengths.py", "data/video_lengths.py"} <= set(pure)
    heavy = ("data/stats/compute.py", "megatron/stages/model.py")
    assert not any(room_of(r, rooms).never_heavy for r in heavy)


def test_the_check_sees_lazy_relative_and_dynamic_imports() -> None:
    """Each of these must be refused: the checker itself can fail."""
    rooms = read_rooms()
    cases = {
        "planner/search/x.py": "def f():\n    import torch.nn\n",
        "balance/x.py": "def f():\n    from megatron.core import parallel_state\n",
        "data/lengths.py": "import importlib\nimportlib.import_module('torch')\n",
        "megatron/stream/x.py": "from ..stages import model\n",
        "planner/cost_model/x.py": "from megatron_omnibal.planner.search import setting\n",
        "megatron/runtime/x.py": "__import__('megatron_omnibal.megatron.training.handover')\n",
    }
    for relative, source in cases.items():
        assert violations(relative, source, rooms), relative
    allowed = "from megatron_omnibal.megatron.stream import batch\nimport torch\n"
    assert not violations("megatron/stages/x.py", allowed, rooms)
