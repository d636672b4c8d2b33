"""The house rules that can be read from the source: state lives on objects, not module globals (what must be
process-wide is an entry of ``PROCESS_STATE``, with why); tests read others' objects through public views; a
class over 300 lines is named as a warning (it may be doing several jobs, or be one concern that needs them).

Each is counted with ``ast``, so a new module dict or a new ``obj._private`` read in a test fails here, named.
"""

from __future__ import annotations

import ast
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

from harness.pack import REPO

#: Calls that make a mutable container or counter.
MUTABLE_MAKERS = frozenset(
    {
        "dict",
        "list",
        "set",
        "bytearray",
        "defaultdict",
        "OrderedDict",
        "Counter",
        "deque",
        "WeakKeyDictionary",
        "WeakValueDictionary",
        "WeakSet",
        "count",
    }
)
MAX_MODULE_STATE = 5
MAX_PRIVATE_READS = 5
MAX_CLASS_LINES = 300
#: Where the pack's own classes are (its engine, its nodes, what tests, benchmarks and scripts share).
CODE = ("offload", "nodes", "harness", "bench")


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _is_mutable(value: ast.expr, classes: set[str]) -> bool:
    """Whether a module-level value is state: a mutable display, a container or counter, an instance of one of
    the package's own classes, or an entry of the process's registry."""
    if isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp):
        return True
    if not isinstance(value, ast.Call):
        return False
    name = _called_name(value)
    return name in MUTABLE_MAKERS or name in classes or name == "entry"


def module_state(package: Path) -> Iterator[str]:
    """``module.NAME`` for each module-level mutable object of ``package``, and ``module: global NAME`` for each
    name a function rebinds (``__all__`` is the import convention's list, not state)."""
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in sorted(package.glob("*.py"))}
    classes = {node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    for path, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [ast.unparse(target) for target in targets if ast.unparse(target) != "__all__"]
                if names and _is_mutable(node.value, classes):
                    yield from (f"{package.name}/{path.stem}.{name}" for name in names)
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                yield from (f"{package.name}/{path.stem}: global {name}" for name in node.names)


def private_reads(path: Path) -> Iterator[str]:
    """Each ``obj._name`` (not a dunder) that ``path`` reads of an object other than its own ``self``/``cls``."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        yield f"{path.name}:{node.lineno}: {ast.unparse(node)}"


def long_classes(paths: list[Path], limit: int = MAX_CLASS_LINES) -> Iterator[str]:
    """``file:line: Class (N lines)`` for each class of ``paths`` longer than ``limit`` lines, docstrings included."""
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    yield f"{path.name}:{node.lineno}: {node.name} ({lines} lines)"


def test_the_counters_see_what_they_count(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        "import weakref\nfrom types import MappingProxyType\n\nclass Registry: ...\n\n"
        "CACHE = {}\nSEEN: set[int] = set()\nLIVE = weakref.WeakSet()\nREG = Registry()\n"
        "FIXED = MappingProxyType({'x': 1})\nNAMES = ('a', 'b')\n__all__ = ['CACHE']\n"
        "_count = 0\n\ndef bump():\n    global _count\n    _count += 1\n"
    )
    assert sorted(module_state(package)) == sorted(
        ["pkg/a.CACHE", "pkg/a.SEEN", "pkg/a.LIVE", "pkg/a.REG", "pkg/a: global _count"]
    )
    test = tmp_path / "test_x.py"
    test.write_text("def test(self, other):\n    self._mine\n    other._theirs\n    other.__class__\n")
    assert list(private_reads(test)) == ["test_x.py:3: other._theirs"]
    body = "".join(f"    def m{index}(self) -> None: ...\n" for index in range(4))
    (package / "b.py").write_text(f"class Short:\n{body}\n\nclass Long:\n{body}{body}")
    assert list(long_classes([package / "b.py"], limit=6)) == ["b.py:8: Long (9 lines)"]


def test_process_wide_state_is_a_few_named_objects() -> None:
    state = [entry for package in ("offload", "nodes") for entry in module_state(REPO / package)]
    assert len(state) <= MAX_MODULE_STATE, "module-level state (keep it on objects or in PROCESS_STATE):\n" + "\n".join(
        state
    )


def test_tests_read_others_objects_through_public_views() -> None:
    reads = [read for path in sorted((REPO / "tests").rglob("*.py")) for read in private_reads(path)]
    assert len(reads) <= MAX_PRIVATE_READS, (
        "private reads in tests (give the object a public view, or read ComfyUI's or torch's private parts "
        "through harness/private_views.py):\n" + "\n".join(reads)
    )


def test_classes_over_300_lines_are_reported() -> None:
    """A long class may be one concern that needs the lines: it is named as a warning, to look at, never refused
    (a hard cap split single concerns to fit it)."""
    paths = [path for folder in CODE for path in sorted((REPO / folder).glob("*.py"))]
    assert len(paths) > 40
    long = list(long_classes(paths))
    if long:
        warnings.warn("classes over 300 lines (one concern, or several?):\n" + "\n".join(long), stacklevel=1)


def test_a_process_entry_is_made_once_whoever_asks_first() -> None:
    from block_offload.offload.device import ProcessState

    state = ProcessState()
    assert state.made("counts") is None
    made: list[dict[str, int]] = []

    def make() -> dict[str, int]:
        made.append({})
        return made[-1]

    seen: list[dict[str, int]] = []
    threads = [
        threading.Thread(target=lambda: seen.append(state.entry("counts", make, "shared by every engine")))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and all(value is made[0] for value in seen)
    assert state.made("counts") is made[0]
    assert state.reasons() == {"counts": "shared by every engine"}
