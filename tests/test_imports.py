"""The package's imports run one way: each module draws only on modules in its own layer or below (the layers of
../shared/DESIGN.md, "Data flows one way"), and no modules import each other in a circle, counting imports made
inside functions too (a deferred import is still a dependency)."""

import ast
from pathlib import Path

from tests.helpers import REPO

# Lowest first. A module belongs to the longest prefix that names it.
LAYERS = (
    ("floor", ("qkvjax.axes", "qkvjax.checks", "qkvjax.parse", "qkvjax.perf")),
    ("attention", ("qkvjax.attention",)),
    ("models", ("qkvjax.models",)),
    ("data", ("qkvjax.data",)),
    ("config", ("qkvjax.config",)),
    ("workdir", ("qkvjax.workdir",)),
    ("train", ("qkvjax.train", "qkvjax.plan", "qkvjax.analyze")),  # analyze: the weight statistics the loop logs
    ("tools", ("qkvjax.evaluate", "qkvjax.sample", "qkvjax.sources", "qkvjax.convert", "qkvjax.compare",
               "qkvjax.info", "qkvjax.complete", "qkvjax.chat", "qkvjax.hf", "qkvjax.nnx")),
    ("entry", ("qkvjax.cli", "qkvjax")),  # the CLI, and the package's facade of public names
)  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for f in (REPO / "qkvjax").rglob("*.py"):
        parts = f.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the qkvjax modules it imports anywhere in its file (``from pkg import mod`` names the module)."""

    def known(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    edges = {}
    for name, file in modules.items():
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names if a.name.split(".")[0] == "qkvjax"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                if base.split(".")[0] == "qkvjax":
                    deps |= {known(f"{base}.{a.name}") for a in node.names}
        edges[name] = deps - {name}
    return edges


def _layer(module: str) -> int:
    matches = [(len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
               if module == p or module.startswith(p + ".")]  # fmt: skip
    assert matches, f"{module} is in no layer of tests/test_imports.py: add it where it belongs"
    return max(matches)[1]


def test_no_module_imports_one_above_it():
    edges = _edges(_modules())
    upward = [f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})"
              for a, deps in sorted(edges.items()) for b in sorted(deps) if _layer(b) > _layer(a)]  # fmt: skip
    assert upward == [], "\n".join(upward)


def test_no_modules_import_each_other_in_a_circle():
    edges = _edges(_modules())
    circles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(edges[node]):
            if state.get(dep) == "open":
                circles.append(" -> ".join(path[path.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert circles == [], "\n".join(circles)


def test_the_checker_sees_an_upward_import_and_a_circle(tmp_path, monkeypatch):
    """The checks above could fail: a function-level import back up, and a circle, in a copy of two modules."""
    modules = {"qkvjax.axes": tmp_path / "axes.py", "qkvjax.cli": tmp_path / "cli.py"}
    modules["qkvjax.axes"].write_text("def f():\n    from qkvjax import cli\n")
    modules["qkvjax.cli"].write_text("from qkvjax.axes import f\n")
    edges = _edges(modules)
    assert edges == {"qkvjax.axes": {"qkvjax.cli"}, "qkvjax.cli": {"qkvjax.axes"}}
    assert _layer("qkvjax.cli") > _layer("qkvjax.axes")


def test_no_function_in_the_package_is_over_90_lines():
    """Functions that read in one sitting (issue 100): the longest in qkvjax/ is at most 90 lines, docstring in."""
    long = []
    for file in sorted((REPO / "qkvjax").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 90:
                    long.append(f"{file.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines")
    assert long == [], "\n".join(long)
