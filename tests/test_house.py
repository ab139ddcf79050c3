"""Rules of the house that the code itself can check, over every module of ``src/padfree``: no import circle, and
no module reaching into another module's private (``_``-prefixed) names.

Both read the source with :mod:`ast`, not by importing it. Every ``import`` statement counts, at module level or
inside a function (a lazy import still ties the two modules together, it only postpones the circle to the first
call). An edge goes to the most specific module an import names: ``from padfree.model import configure`` is an
edge to ``padfree.model.configure``; ``from padfree.model import configure_packing`` is one to the package
``padfree.model``. The parent packages that Python imports on the way are not edges: every module would otherwise
sit in a circle with its package's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def module_names(root: Path, package: str = "padfree") -> dict[str, Path]:
    """Dotted name -> file of every module of ``package`` under ``root`` (a package is its ``__init__.py``)."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _resolve(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[str]:
    """The dotted names an import statement asks for (a module, or a module's attribute that may be a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importer's package, one level up per extra dot
        package = importer if is_package else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(root: Path = SRC, package: str = "padfree") -> dict[str, dict[str, int]]:
    """importer -> {imported module: line of the first import of it}, for every module of ``package``."""
    modules = module_names(root, package)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            asked = _resolve(node, name, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):
                # ``from a.b import c``: the submodule a.b.c when it exists, else the module a.b itself
                *names, base = asked
                targets = [n for n in names if n in modules] or [base]
            else:
                targets = asked
            for target in targets:
                while target and target not in modules:  # ``import a.b.c`` where c is not a module of ours
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    inside = set(component)
    edges = [f"{a} -> {b} (line {line})" for a in component for b, line in sorted(graph[a].items()) if b in inside]
    return "; ".join(edges)


def private_reaches(root: Path = SRC, package: str = "padfree") -> dict[tuple[str, str], set[str]]:
    """``(importer, module) -> the private names of module that importer uses``: ``from m import _x``, or
    ``m._x`` where ``m`` names a module of ``package`` (dunders such as ``__version__`` are public)."""
    modules = module_names(root, package)
    found: dict[tuple[str, str], set[str]] = {}

    def private(name: str) -> bool:
        return name.startswith("_") and not name.endswith("__")

    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # a local name bound to one of our modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
            elif isinstance(node, ast.ImportFrom):
                *_, base = _resolve(node, name, path.name == "__init__.py")
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
                    elif base in modules and base != name and private(alias.name):
                        found.setdefault((name, base), set()).add(alias.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and aliases[node.value.id] != name and private(node.attr)):
                found.setdefault((name, aliases[node.value.id]), set()).add(node.attr)
    return found


# ---- the graph builder itself ------------------------------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_graph_sees_lazy_relative_and_package_imports(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "from pkg import a\n",
        "a.py": "def f():\n    from pkg.sub import b\n",
        "sub/__init__.py": "X = 1\n",
        "sub/b.py": "from . import c\nfrom pkg.sub import X\nimport pkg.a\nimport numpy\n",
        "sub/c.py": "from ..a import f\n",
    })
    assert import_graph(root, "pkg") == {
        "pkg": {"pkg.a": 1},
        "pkg.a": {"pkg.sub.b": 2},
        "pkg.sub": {},
        "pkg.sub.b": {"pkg.sub.c": 1, "pkg.sub": 2, "pkg.a": 3},
        "pkg.sub.c": {"pkg.a": 1},
    }
    assert circles(import_graph(root, "pkg")) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "trainer.py": "def enable():\n    from pkg.trl import SFTTrainer\n",
        "trl.py": "from pkg.trainer import _configure\n",
        "leaf.py": "from pkg import trainer\n",
    })
    assert circles(import_graph(root, "pkg")) == [["pkg.trainer", "pkg.trl"]]


def test_private_reaches_are_found_through_from_imports_and_module_aliases(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "__version__ = '1'\n",
        "a.py": "_X = 1\nY = 2\n",
        "b.py": "from pkg.a import _X, Y\nfrom pkg import __version__\n",
        "c.py": "from pkg import a as mod\n\ndef f():\n    return mod._X + mod.Y + mod.__name__.count('_')\n",
        "d.py": "_own = 1\nfrom pkg import d\nd._own\n",
    })
    assert private_reaches(root, "pkg") == {("pkg.b", "pkg.a"): {"_X"}, ("pkg.c", "pkg.a"): {"_X"}}


# ---- the house -----------------------------------------------------------------------------------------------------


#: circles the house still owes (issue "The house"), each the sorted modules of one strongly connected component:
#: the test fails on any other circle, and on an entry here once its circle is broken (then delete the entry)
KNOWN_CIRCLES: list[list[str]] = []


def test_src_padfree_has_no_import_circle():
    graph = import_graph()
    assert "padfree.integrations.trainer" in graph and "padfree.layout" in graph  # the walk found the package
    found = circles(graph)
    new = [c for c in found if c not in KNOWN_CIRCLES]
    assert not new, "import circles in src/padfree:\n" + "\n".join(_describe(c, graph) for c in new)
    gone = [c for c in KNOWN_CIRCLES if c not in found]
    assert not gone, f"these known circles are broken now, delete them from KNOWN_CIRCLES: {gone}"


def test_no_module_takes_another_modules_private_names():
    found = private_reaches()
    listed = "; ".join(f"{importer} uses {', '.join(sorted(names))} of {module}"
                       for (importer, module), names in sorted(found.items()))
    assert not found, (f"private names taken from another module: {listed}; make them public, or give what the "
                       f"modules share a home of its own")


# ---- tests take padfree through its public names -------------------------------------------------------------------


def _private_part(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _is_private_for(dotted: str, test_file: str, modules: dict[str, Path]) -> bool:
    """Whether ``dotted`` names something private, for ``test_file`` (a private module's own test file may take it
    and everything in it)."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if _private_part(part):
            own = "test_" + "_".join(p.strip("_") for p in parts[1 : i + 1]) + ".py"
            return not (".".join(parts[: i + 1]) in modules and test_file == own)
    return False


def private_uses_in_tests(tests: Path | None = None, root: Path = SRC, package: str = "padfree") -> dict[str, set[str]]:
    """Test file -> the private things of ``package`` it takes: ``from m import _x``, a private module (``import
    m._p``, ``from m._p import x``, ``from m import _p``), ``m._x`` (``m`` bound to a module of ``package`` by an
    import, through any chain of attributes) and ``setattr``/``getattr``/``delattr``/``monkeypatch.setattr(m,
    "_x", ...)``. A private module's own test file (``test_data_arrow_writer.py`` for ``data/_arrow_writer.py``) may
    take its names. Private attributes of other objects (a model's config, a trainer) are not this check's."""
    tests = tests or Path(__file__).resolve().parent
    modules = module_names(root, package)
    found: dict[str, set[str]] = {}
    for path in sorted(tests.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        hits: set[str] = set()
        aliases: dict[str, str] = {}  # a local name bound to one of our modules

        def take(dotted: str, hits: set[str] = hits, name: str = path.name) -> None:
            if _is_private_for(dotted, name, modules):
                hits.add(dotted)

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == package:
                        take(a.name)
                        if a.asname:
                            aliases[a.asname] = a.name
                        else:
                            aliases[package] = package
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    take(full)
                    if full in modules:
                        aliases[a.asname or a.name] = full
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Attribute) and _private_part(node.attr):
                target, attr = node.value, node.attr
            elif (isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str) and _private_part(node.args[1].value)
                  and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) in {
                      "setattr", "getattr", "delattr", "hasattr"}):
                target, attr = node.args[0], node.args[1].value
            if target is None:
                continue
            chain = []
            while isinstance(target, ast.Attribute):
                chain.append(target.attr)
                target = target.value
            if isinstance(target, ast.Name) and target.id in aliases:
                dotted = ".".join([aliases[target.id], *reversed(chain)])
                if dotted in modules:
                    take(f"{dotted}.{attr}")
        if hits:
            found[path.name] = hits
    return found


#: what tests may still take, each with its reason (a dotted prefix: a module allows everything in it)
ALLOWED_PRIVATE: dict[str, dict[str, str]] = {
    # fault injection: a write that stops half-way (a killed process, a full disk) has no public route
    "test_cli_cleanup.py": {"padfree.data._arrow_writer": "the writer's batches, stopped or failing mid-write"},
    "test_data_hf.py": {"padfree.data._arrow_writer": "the writer's fill, failing mid-write"},
    # a fake CUDA kernel and accelerator on a machine without one: the kernel cache and the device probes
    "test_model_mixers.py": {"padfree.model.cuda_kernels": "fake kernels, a fake accelerator, a fresh cache"},
    # negative controls: the same comparison must catch a replay that ignores its frames, a reset that is off
    "test_model_flight.py": {"padfree.model.flight._replay": "a replay without the recorded layout",
                             "padfree.model.flight._in_backward": "the forward's layout read during backward"},
    "test_model_vlm_routes.py": {"padfree.model.flight._replay": "a replay under the latest layout, not its own"},
    "test_families_recurrent.py": {"padfree.model.families.rwkv._starts": "segment starts without the boundaries",
                                   "padfree.model.families.rwkv._LAYOUT": "the layout the installed forward sets, "
                                                                          "for time_shift called alone"},
    # a new process (only the disk cache left), and reads that cross many blocks, without a large data set
    "test_model_certify.py": {"padfree.proof.certify._MEMORY": "the in-memory verdicts, cleared"},
    "test_data_datasets.py": {"padfree.data.iterable._READ_BLOCK": "a 7-sample read block"},
}


def test_private_uses_in_tests_are_found(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "_X = 1\nY = 2\n",
        "sub/__init__.py": "",
        "sub/_p.py": "Z = 3\n_W = 4\n",
    })
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_one.py").write_text(
        "import pkg\nimport pkg.a as m\nfrom pkg import a\nfrom pkg.a import _X, Y as _Y\nfrom pkg.sub._p import Z\n"
        "def test(monkeypatch):\n    monkeypatch.setattr(a, '_X', 2)\n    assert m._X and pkg.a._X and a.Y\n"
        "    assert m.config._attn and getattr(a, '__name__') and setattr(a, 'Y', 1) is None\n")
    (tests / "test_sub_p.py").write_text("from pkg.sub import _p\nfrom pkg.sub._p import _W\nassert _p._W\n")
    (tests / "test_two.py").write_text("from pkg.sub import _p\n")
    assert private_uses_in_tests(tests, root, "pkg") == {
        "test_one.py": {"pkg.a._X", "pkg.sub._p.Z"},
        "test_two.py": {"pkg.sub._p"},
    }


def test_no_test_takes_a_private_name_of_padfree():
    found = private_uses_in_tests()
    allowed = {(f, p) for f, entries in ALLOWED_PRIVATE.items() for p in entries}
    left = {f"{f}: {name}" for f, names in found.items() for name in names
            if not any(name == p or name.startswith(f"{p}.") for g, p in allowed if g == f)}
    assert not left, (f"tests taking padfree's private names: {sorted(left)}; test through the public route, or "
                      f"make the unit public (drop the underscore) where other modules use it")
    unused = {(f, p) for f, p in allowed if not any(n == p or n.startswith(f"{p}.") for n in found.get(f, ()))}
    assert not unused, f"allowed but no longer taken, delete them from ALLOWED_PRIVATE: {sorted(unused)}"


#: the modules that run in a training step (the first part of their name under ``padfree``)
RUN_TIME = ("model", "integrations", "sequence_parallel", "data", "packing", "rows", "samples", "layout", "step_loss")
#: the arrows from run time to the proof package: configure's decision (the support table, on-the-spot
#: certification), the trainers' decision (the table for a model still to be loaded, the images check) and the
#: in-run proof (the check on the user's own model)
PROOF_ARROWS = frozenset({"model.configure", "integrations.decide", "integrations.inrun"})


def proof_imports(graph: dict[str, dict[str, int]], package: str = "padfree") -> dict[str, list[str]]:
    """Run-time module -> the modules of ``<package>.proof`` it imports (module- or function-level), for every
    run-time module outside :data:`PROOF_ARROWS`."""
    proof = f"{package}.proof"
    found = {}
    for importer, edges in graph.items():
        name = importer.removeprefix(f"{package}.")
        if importer == package or name.split(".")[0] not in RUN_TIME or name in PROOF_ARROWS:
            continue
        hits = sorted(t for t in edges if t == proof or t.startswith(f"{proof}."))
        if hits:
            found[importer] = hits
    return found


def test_a_run_time_module_importing_the_proof_package_is_found(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "def __getattr__(name):\n    from pkg.proof import check\n",
        "cli.py": "from pkg.proof.check import verify\n",
        "layout.py": "import pkg.proof.check\n",
        "model/__init__.py": "",
        "model/configure.py": "from pkg.proof import certify, versions\n",
        "model/rebind.py": "def message():\n    from pkg.proof import versions\n",
        "model/install.py": "from pkg import layout\n",
        "proof/__init__.py": "",
        "proof/certify.py": "from pkg.model import install\n",
        "proof/check.py": "", "proof/versions.py": "",
    })
    assert proof_imports(import_graph(root, "pkg"), "pkg") == {
        "pkg.layout": ["pkg.proof.check"], "pkg.model.rebind": ["pkg.proof.versions"]}


def test_run_time_modules_do_not_import_the_proof_package():
    """The proof package (sweep, certification, verify) builds on the run-time model layer, never the reverse: a
    training step reaches it only through configure's decision, the trainers' decision and the in-run proof."""
    graph = import_graph()
    assert "padfree.proof.certify" in graph and "padfree.model.install" in graph
    found = proof_imports(graph)
    listed = "; ".join(f"{importer} imports {', '.join(hits)}" for importer, hits in sorted(found.items()))
    assert not found, f"run-time modules importing the proof package: {listed}"


# ---- no test asserts nothing -------------------------------------------------------------------------------------
#
# A test that asserts nothing passes whatever the code computes. Each ``test_*`` function of ``tests/test_*.py`` (and
# ``test_*`` method of a ``Test*`` class) must, in its body or a helper it defines inside, assert, call one of
# pytest's checks (raises, warns, approx, fail, deprecated_call) or a ``*.testing.assert_*`` function (torch, numpy),
# or call a helper of its own file or of tests/zoo.py that is named as a check (``assert_*``, ``check_*``,
# ``_assert*``, ``_check*``, ``expect*``) or that does one of these itself, one or two calls deep.

TESTS = Path(__file__).resolve().parent
_PYTEST_CHECKS = frozenset({"pytest.raises", "pytest.warns", "pytest.approx", "pytest.fail", "pytest.deprecated_call"})
_CHECK_PREFIXES = ("assert_", "check_", "_assert", "_check", "expect")


def _imported_names(nodes: list[ast.stmt]) -> dict[str, str]:
    """Local name -> dotted name, for the absolute imports among ``nodes`` (and inside them)."""
    names = {}
    for stmt in nodes:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.partition(".")[0]
                    names[alias.asname or top] = alias.name if alias.asname else top
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names})
    return names


def _dotted(func: ast.expr, names: dict[str, str]) -> str | None:
    """``np.testing.assert_equal`` -> ``numpy.testing.assert_equal``; None for a call of anything but a name."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return None
    return ".".join([names.get(func.id, func.id), *reversed(parts)])


class _TestFile:
    """One test module read with :mod:`ast`: its imports, its module-level functions and its tests."""

    def __init__(self, path: Path, zoo: _TestFile | None = None) -> None:
        tree = ast.parse(path.read_text(), str(path))
        defs = (ast.FunctionDef, ast.AsyncFunctionDef)
        self.names = _imported_names([n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))])
        self.functions = {n.name: n for n in tree.body if isinstance(n, defs)}
        self.tests = {n.name: n for n in tree.body if isinstance(n, defs) and n.name.startswith("test")}
        for cls in tree.body:
            if isinstance(cls, ast.ClassDef) and cls.name.startswith("Test"):
                self.tests.update({f"{cls.name}.{n.name}": n for n in cls.body
                                   if isinstance(n, defs) and n.name.startswith("test")})
        self.zoo = zoo

    def _helper(self, dotted: str) -> tuple[_TestFile, ast.FunctionDef] | None:
        if dotted in self.functions:
            return self, self.functions[dotted]
        if self.zoo is not None and dotted.startswith("zoo.") and dotted[4:] in self.zoo.functions:
            return self.zoo, self.zoo.functions[dotted[4:]]
        return None

    def checks(self, fn: ast.FunctionDef, depth: int = 2) -> bool:
        """Whether ``fn`` asserts something, itself or through a helper at most ``depth`` calls deeper."""
        names = {**self.names, **_imported_names(fn.body)}  # a function-level ``from zoo import ...`` counts
        for stmt in fn.body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Assert):
                    return True
                dotted = _dotted(node.func, names) if isinstance(node, ast.Call) else None
                if dotted is None:
                    continue
                if dotted in _PYTEST_CHECKS or dotted.startswith("self.assert"):
                    return True
                if ".testing." in dotted and dotted.rpartition(".")[2].startswith("assert"):
                    return True
                helper = self._helper(dotted)
                if helper is not None:
                    module, function = helper
                    if function.name.startswith(_CHECK_PREFIXES):
                        return True
                    if depth and function is not fn and module.checks(function, depth - 1):
                        return True
        return False

    def silent_tests(self) -> list[str]:
        return [name for name, fn in self.tests.items() if not self.checks(fn)]


def test_the_assertion_check_finds_the_tests_that_assert_nothing(tmp_path):
    (tmp_path / "zoo.py").write_text("def compare(a, b):\n    assert a == b\n\ndef build():\n    return 1\n")
    (tmp_path / "test_x.py").write_text('''
import numpy as np
import pytest
from padfree import check_packing_support
from zoo import build

def _one(a):
    assert a

def _two(a):
    return _one(a)

def _three(a):
    return _two(a)

def check_it(a):
    return a

def test_silent():
    build()

def test_assert():
    assert build()

def test_raises():
    with pytest.raises(ValueError):
        int("x")

def test_numpy():
    np.testing.assert_array_equal(1, 1)

def test_one_deep():
    _one(1)

def test_two_deep():
    _two(1)

def test_three_deep():
    _three(1)

def test_named_helper():
    check_it(1)

def test_zoo_helper():
    from zoo import compare
    compare(1, 1)

def test_zoo_builder_only():
    import zoo
    zoo.build()

def test_a_library_check_is_no_assertion():
    check_packing_support(None)

def test_nested_helper():
    def inner():
        assert True
    inner()

class TestThings:
    def test_method(self):
        build()

    def test_unittest_style(self):
        self.assertEqual(1, 1)
''')
    zoo = _TestFile(tmp_path / "zoo.py")
    assert _TestFile(tmp_path / "test_x.py", zoo).silent_tests() == [
        "test_silent", "test_three_deep", "test_zoo_builder_only", "test_a_library_check_is_no_assertion",
        "TestThings.test_method"]


#: test files with tests that assert nothing, owned by other work in progress: the check is expected to fail there
#: (strict: it fails once they are fixed, then delete the entry); every other file is checked live
KNOWN_SILENT_TESTS: dict[str, list[str]] = {}


def _test_files() -> list:
    params = []
    for path in sorted(TESTS.rglob("test_*.py")):
        silent = KNOWN_SILENT_TESTS.get(path.name)
        marks = [pytest.mark.xfail(strict=True, reason=f"offenders: {', '.join(silent)}")] if silent else []
        params.append(pytest.param(path, marks=marks, id=path.name))
    return params


@pytest.mark.parametrize("path", _test_files())
def test_every_test_asserts_something(path):
    silent = _TestFile(path, _TestFile(TESTS / "zoo.py")).silent_tests()
    assert not silent, f"{path.name}: these tests assert nothing (so pass whatever the code does): {silent}"


def test_the_public_surface_is_at_most_50_names_and_every_one_resolves():
    """The top level is the seed-compatible names, the routes to packed rows, the model and trainer entry points
    (SFT, DPO, reward and GRPO trainers and their configs, the plain Trainer) and the errors users catch; a name that
    moved to its module says where it lives now. 50 = 47 + the packing options objects ``PackingSpec`` and
    ``RowSpec`` and ``plan_dataset`` (the plan of ``pack_dataset``, once its ``return_result`` flag)."""
    import padfree

    assert len(padfree.__all__) <= 50 and len(set(padfree.__all__)) == len(padfree.__all__)
    assert sorted(dir(padfree)) == sorted(padfree.__all__)
    for name in padfree.__all__:
        assert getattr(padfree, name) is not None, name
    with pytest.raises(AttributeError, match=r"padfree\.balance_bins is not a top-level name; use "
                                             r"padfree\.packing\.balance_bins"):
        padfree.balance_bins  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        padfree.no_such_name  # noqa: B018


def test_every_family_module_keeps_the_family_contract():
    """Adding a family is one module in padfree/model/families: found by discovery (no list to edit), it must define
    what configure_packing calls — and no two families may claim one class."""
    import inspect

    from padfree.model import install
    from padfree.model.families import Family, discover

    found = discover()
    assert {"scan_mixers", "convs", "kda", "indexers", "rwkv", "xlstm"} <= set(found)
    for name, module in found.items():
        assert isinstance(module, Family), name
        assert module.CLASSES and all(isinstance(k, str) and isinstance(v, str) and v for k, v in
                                      module.CLASSES.items()), name
        assert list(inspect.signature(module.install).parameters)[:2] == ["module", "state"], name
        assert list(inspect.signature(module.uninstall).parameters) == ["model"], name
        shards = getattr(module, "SEQUENCE_PARALLEL", frozenset())
        assert set(shards) <= set(module.CLASSES), name
    claimed = install.families()  # raises when two families claim one class
    assert len(claimed) == sum(len(m.CLASSES) for m in found.values())


# ---- a small, stated surface ---------------------------------------------------------------------------------------
#
# The public modules are the ones README.md and docs/*.md tell users to import from (one line each in
# docs/architecture.md); every name in their ``__all__`` must resolve. Every other module's ``__all__`` holds only the
# names that something else imports from it: another module of src/padfree (``from m import x``, or ``m.x`` through a
# module bound by an import), the top-level tables of ``padfree/__init__.py`` (``_LAZY``, ``_MOVED``: a module that
# a name lives in), or the code under benchmarks/, scripts/ and examples/. Tests may import any name and do not count.

#: the modules the docs tell users to import from
PUBLIC_MODULES = frozenset({
    "padfree",
    "padfree.analysis",
    "padfree.corpus",
    "padfree.errors",
    "padfree.integrations.unpadded",
    "padfree.layout",
    "padfree.packing",
    "padfree.proof.shrink",
    "padfree.rows",
    "padfree.samples",
    "padfree.sequence_parallel",
    "padfree.step_loss",
})
#: folders of the repository whose code imports from padfree like a user's (their imports count as uses)
IMPORTING_FOLDERS = ("benchmarks", "scripts", "examples")


def module_exports(path: Path) -> list[str] | None:
    """The names of a module's top-level ``__all__ = [...]`` (None: it has none)."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return [ast.literal_eval(e) for e in node.value.elts]
    return None


def _dotted_name(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def imported_names(root: Path = SRC, package: str = "padfree", extra: tuple[Path, ...] = ()) -> dict[str, set[str]]:
    """Module of ``package`` -> the names other code takes from it: the modules of ``package`` and the ``extra``
    files, by ``from m import x`` or ``m.x`` (``m`` a module bound by ``import`` or ``from ... import``), and the
    package's own tables of ``name: "module"`` (the lazy top level)."""
    modules = module_names(root, package)
    sources = [(name, path) for name, path in modules.items()] + [(f"<{path}>", path) for path in extra]
    taken: dict[str, set[str]] = {}
    for name, path in sources:
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # a local name bound to one of our modules (or to the package's top)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == package:
                        top = alias.name.split(".")[0]
                        aliases[alias.asname or top] = alias.name if alias.asname else top
            elif isinstance(node, ast.ImportFrom):
                *_, base = _resolve(node, name, path.name == "__init__.py")
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
                    elif base in modules and base != name:
                        taken.setdefault(base, set()).add(alias.name)
        for node in ast.walk(tree):
            dotted = _dotted_name(node.value) if isinstance(node, ast.Attribute) else None
            head, _, rest = (dotted or "").partition(".")
            if head in aliases:
                module = aliases[head] + (f".{rest}" if rest else "")
                if module in modules and module != name and f"{module}.{node.attr}" not in modules:
                    taken.setdefault(module, set()).add(node.attr)
        if name == package:  # the lazy tables: name -> the module it is imported from on first use
            for node in tree.body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                    for key, value in zip(node.value.keys, node.value.values, strict=True):
                        if isinstance(key, ast.Constant) and isinstance(value, ast.Constant) and value.value in modules:
                            taken.setdefault(value.value, set()).add(key.value)
    return taken


def unused_exports(root: Path = SRC, package: str = "padfree", public: frozenset[str] = PUBLIC_MODULES,
                   extra: tuple[Path, ...] = ()) -> dict[str, list[str]]:
    """Module outside ``public`` -> the names of its ``__all__`` that nothing else imports from it."""
    taken = imported_names(root, package, extra)
    found = {}
    for name, path in module_names(root, package).items():
        exports = module_exports(path)
        if name in public or exports is None:
            continue
        unused = [n for n in exports if n not in taken.get(name, set())]
        if unused:
            found[name] = unused
    return found


def test_unused_exports_are_found_and_every_kind_of_import_counts(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "_LAZY = {'Lazy': 'pkg.lazy'}\n__all__ = ['Lazy']\n",
        "lazy.py": "__all__ = ['Lazy', 'Unused']\n",
        "a.py": "__all__ = ['f', 'g', 'h', 'k', 'own']\nown = 1\nfrom pkg.a import own\n",
        "b.py": "from pkg.a import f\nfrom pkg import a as mod\nmod.g\n",
        "sub/__init__.py": "__all__ = ['Public', 'Unused']\n",
        "sub/c.py": "import pkg.a\n__all__ = ['C']\n\ndef use():\n    from . import d\n    return pkg.a.h, d.D\n",
        "sub/d.py": "__all__ = ['D']\n",
        "tool.py": "__all__ = ['tool']\n",
    })
    bench = tmp_path / "bench.py"
    bench.write_text("from pkg.a import k\nfrom pkg.sub.c import C\n")
    public = frozenset({"pkg", "pkg.sub"})
    assert unused_exports(root, "pkg", public, (bench,)) == {
        "pkg.a": ["own"], "pkg.lazy": ["Unused"], "pkg.tool": ["tool"]}
    # without the bench file, its imports are unused; with every module public, nothing is
    assert unused_exports(root, "pkg", public)["pkg.sub.c"] == ["C"]
    assert "pkg.a" in unused_exports(root, "pkg", public) and unused_exports(root, "pkg", frozenset({
        "pkg", "pkg.a", "pkg.lazy", "pkg.sub", "pkg.sub.c", "pkg.sub.d", "pkg.tool"})) == {}


def test_every_name_a_module_exports_is_imported_elsewhere_unless_the_module_is_public():
    extra = tuple(p for folder in IMPORTING_FOLDERS for p in sorted((SRC.parent / folder).glob("*.py")))
    assert extra and "padfree.integrations.trainer" in imported_names(extra=extra)
    found = unused_exports(extra=extra)
    listed = "; ".join(f"{module}: {', '.join(names)}" for module, names in sorted(found.items()))
    assert not found, (f"names in __all__ that no other module imports: {listed}; drop them from __all__ (tests may "
                       f"import any name), or add the module to PUBLIC_MODULES if the docs tell users to import it")


def test_every_public_module_exists_and_its_exports_resolve():
    import importlib

    modules = module_names(SRC)
    assert not PUBLIC_MODULES - set(modules), sorted(PUBLIC_MODULES - set(modules))
    for name in sorted(PUBLIC_MODULES):
        module = importlib.import_module(name)
        exports = module_exports(modules[name])
        assert exports, f"{name} is public but states no __all__"
        missing = [n for n in exports if not hasattr(module, n)]
        assert not missing, f"{name}.__all__ names what it does not define: {missing}"
