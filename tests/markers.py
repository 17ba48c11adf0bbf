"""Which tests start processes, found by reading their code, and a check that nothing else does.

``python -m pytest -q`` runs every test but the heavy tier. ``-m "not slow"`` runs the fast ones
alone: no swarm, no process, no model loaded into llama.cpp. The marks (registered in pyproject.toml):

    swarm  the test, or a fixture it uses, starts processes: swarmctl nodes, a local swarm, the CLI
           in a subprocess. Found here, by reading the test's code, its fixtures' code and the
           helpers they call from tests/ and benchmarks/ (``swarmctl(...)``, ``Swarm``, ``Node``,
           ``LocalSwarm``, ``subprocess``, ...), so a new test needs no mark of its own.
    netns  the test builds network namespaces (harness/netns.py; root and iproute2). Found the same way.
    slow   seconds or more in this process (a model loaded, a long search); every swarm and netns
           test is slow too. Given by the modules (``pytestmark``) and SLOW_FIXTURES.

    heavy  a multi-process test of faults (kill -9, a revocation mid-ask, lossy links and a cut)
           whose ground the simulator now covers, seeded and replayable, in tests/test_sim.py.
           Given by hand. A run of the whole folder leaves them out; ``-m heavy``
           runs them, and so does naming their file or test.

The reading can miss a process started some other way, so the check backs it up: a test without
the slow mark that starts a process anyway fails and says to mark it.
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path
from dataclasses import dataclass, field
from functools import lru_cache

import pytest

# Names whose use means a process starts. The helpers of tests/ and benchmarks/ are read in turn,
# so Swarm, Node, swarmctl() and NetnsLab are found through the subprocess calls they make.
PROCESS_NAMES = frozenset({"subprocess", "Popen", "LocalSwarm", "create_subprocess_exec", "create_subprocess_shell",
                           "forkpty", "posix_spawn"})
NETNS_NAMES = frozenset({"NetnsLab"})
# Code of these packages is read when a test calls into it; library code (swarmctl/, kernels/...)
# is not: it starts processes only on paths (a local swarm for `ask`) that tests reach through
# the names above.
READ_PACKAGES = ("tests", "benchmarks", "harness")
# Fixtures that load a model into llama.cpp: seconds each, several per module.
SLOW_FIXTURES = frozenset({"oracle", "tiny_model"})


@lru_cache(maxsize=None)
def names_reached(obj: object) -> frozenset[str]:
    """Every name ``obj``'s source uses, and those of the tests/ and benchmarks/ functions and
    classes it refers to, recursively."""
    return frozenset(_walk(obj, set()))


@lru_cache(maxsize=None)
def _definitions(filename: str) -> tuple[ast.Module, dict[int, ast.AST]]:
    """A source file parsed once, and its functions by the line their code starts on (the first
    decorator's, as ``co_firstlineno`` counts). inspect.getsource parsed a module again for every
    class it was asked for: 11 s of a 22 s collection."""
    tree = ast.parse(Path(filename).read_text())
    by_line: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            by_line[min([node.lineno] + [d.lineno for d in node.decorator_list])] = node
    return tree, by_line


def _node_of(obj: object) -> ast.AST | None:
    """``obj``'s definition in its parsed source file: a function's by its first line, a class's
    by its qualified name."""
    obj = inspect.unwrap(obj) if callable(obj) else obj
    try:
        filename = inspect.getsourcefile(obj)
    except TypeError:
        return None
    if filename is None or not Path(filename).is_file():
        return None
    tree, by_line = _definitions(filename)
    code = getattr(obj, "__code__", None)
    if code is not None:
        return by_line.get(code.co_firstlineno)
    if not inspect.isclass(obj):
        return None
    scope: ast.AST | None = tree
    for part in obj.__qualname__.split("."):
        scope = next((n for n in getattr(scope, "body", []) if isinstance(n, ast.ClassDef) and n.name == part), None)
        if scope is None:
            return None
    return scope


def _walk(obj: object, seen: set[int]) -> set[str]:
    if id(obj) in seen:
        return set()
    seen.add(id(obj))
    names, targets = _own_names(obj)
    found = set(names)
    for target in targets:
        found |= _walk(target, seen)
    return found


@lru_cache(maxsize=None)
def _own_names(obj: object) -> tuple[frozenset[str], tuple[object, ...]]:
    """The names ``obj``'s own definition uses, and the functions and classes of READ_PACKAGES
    that they are in its module (read in turn). Kept per object: a helper many tests reach is
    read once."""
    try:
        tree = _node_of(obj)
    except (OSError, SyntaxError):
        return frozenset(), ()
    if tree is None:
        return frozenset(), ()
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
    module = sys.modules.get(getattr(obj, "__module__", ""), None)
    targets = []
    for name in sorted(names):
        target = getattr(module, name, None)
        if (inspect.isfunction(target) or inspect.isclass(target)) and \
                getattr(target, "__module__", "").split(".")[0] in READ_PACKAGES:
            targets.append(target)
    return frozenset(names), tuple(targets)


def _fixture_functions(item: pytest.Item) -> list[object]:
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}) if info is not None else {}
    return [d.func for name in item.fixturenames for d in defs.get(name, ())]


def mark(item: pytest.Item) -> None:
    function = getattr(item, "function", None)
    if function is None:
        return
    names: set[str] = set(names_reached(function))
    for fixture in _fixture_functions(item):
        names |= names_reached(fixture)
    if names & NETNS_NAMES:
        item.add_marker(pytest.mark.netns)
    if names & (PROCESS_NAMES | NETNS_NAMES):
        item.add_marker(pytest.mark.swarm)
    if SLOW_FIXTURES & set(item.fixturenames) or any(item.iter_markers("swarm")) or any(item.iter_markers("netns")):
        item.add_marker(pytest.mark.slow)


def leave_out_heavy(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ``-m``, a run of folders leaves the heavy tier out; a run that names a file or a
    test runs what it names."""
    if config.getoption("markexpr") or any(not _is_folder(arg) for arg in config.args):
        return
    heavy = [item for item in items if any(item.iter_markers("heavy"))]
    if heavy:
        config.hook.pytest_deselected(items=heavy)
        items[:] = [item for item in items if not any(item.iter_markers("heavy"))]


# The modules that take the longest (summed --durations of two-worker runs: 50-140 s each, the
# rest under 45 s), longest first. They are handed to the workers first (pyproject.toml's
# --no-loadscope-reorder keeps this order; xdist's own orders modules by their number of tests),
# so that no worker starts a two-minute module when the other is nearly done.
LONG_MODULES = ("test_pipelining", "test_audit", "test_nat_swarm", "test_prefix_reuse", "test_api", "test_sim",
                "test_swarm", "test_one_identity", "test_layer_proof", "test_moe", "test_fault_tolerance",
                "test_speculate", "test_fuzz")


def long_modules_first(items: list[pytest.Item]) -> None:
    """LONG_MODULES first, in that order; every module's own tests keep their order (some build on
    the one before)."""
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(LONG_MODULES)))


def _is_folder(arg: str) -> bool:
    return "::" not in arg and Path(arg).is_dir()


# Library calls that run a short command and wait for it: not a process a test starts.
# platform.processor() runs `uname -p` (the openai client asks it once, for its user agent).
HARMLESS_COMMANDS = frozenset({"uname -p"})


@dataclass
class ProcessWatch:
    """Records processes started while a test not marked slow sets up and runs (a Python audit
    hook: subprocess, os.fork and the like report themselves there)."""

    watching: str | None = None
    started: list[str] = field(default_factory=list)

    def audit(self, event: str, args: tuple) -> None:
        if self.watching is None:
            return
        if event == "subprocess.Popen":
            command = " ".join(map(str, args[1] if isinstance(args[1], (list, tuple)) else [args[1]]))
            if command not in HARMLESS_COMMANDS:
                self.started.append(command)
        elif event in ("os.fork", "os.forkpty", "os.posix_spawn", "os.system"):
            self.started.append(event)

    def start(self, item: pytest.Item) -> None:
        self.started = []
        self.watching = None if any(item.iter_markers("slow")) else item.nodeid

    def stop(self) -> None:
        self.watching = None

    def complaint(self) -> str | None:
        if self.watching is None or not self.started:
            return None
        return (f"{self.watching} is not marked slow but started a process ({self.started[0][:200]}): mark it "
                f"(pytestmark = pytest.mark.swarm in its module), or see tests/markers.py")
