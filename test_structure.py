"""The shape of the code base, read from the source with `ast`: imports between the project's files
go one way (no cycle), and no file reaches into another's private (underscored) names, so that a
file can be read, changed and replaced by its public names alone.

Tests (test_*.py, conftest.py) may use any name; they are not part of the graph.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent
MODULES = {p.stem: p for p in ROOT.glob("*.py") if not p.stem.startswith("test_") and p.stem != "conftest"}


def parsed(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))


def project_imports(tree: ast.Module) -> dict[str, set[str]]:
    """{project module imported anywhere in the file (top level or inside a function): the names taken from it}"""
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    found.setdefault(alias.name, set())
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
            found.setdefault(node.module, set()).update(alias.name for alias in node.names)
    return found


def module_aliases(tree: ast.Module) -> dict[str, str]:
    """{local name: project module} for `import m` and `import m as alias`"""
    return {alias.asname or alias.name: alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
            for alias in node.names if alias.name in MODULES}


def graph() -> dict[str, set[str]]:
    return {name: set(project_imports(parsed(name))) - {name} for name in MODULES}


def test_the_graph_is_read():
    """The reader finds what a file plainly imports (guards the two tests below against reading nothing)."""
    g = graph()
    assert {"config", "rundir", "step"} <= g["train"]
    assert "errors" in g["config"]
    assert g["errors"] == set()


def test_no_import_cycle():
    g = graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        for other in sorted(g[name]):
            visit(other, path + [name])
        done.add(name)

    for name in sorted(g):
        visit(name, [])


def private_crossings(name: str, tree: ast.Module) -> list[str]:
    """`from m import _x` and `m._x` in file `name` for another project file m (dunders such as __file__ aside)."""
    crossings = []
    for module, names in project_imports(tree).items():
        crossings += [f"{name}.py: from {module} import {n}" for n in names if n.startswith("_") and module != name]
    aliases = module_aliases(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__") and aliases[node.value.id] != name):
            crossings.append(f"{name}.py:{node.lineno}: {node.value.id}.{node.attr}")
    return crossings


def test_a_private_crossing_is_found():
    source = "import model as m\nimport config\nfrom step import _x, y\n\ndef f():\n    return m._y, config.__file__\n"
    assert private_crossings("sample", ast.parse(source)) == ["sample.py: from step import _x", "sample.py:6: m._y"]


def test_no_private_name_crosses_files():
    crossings = [c for name in sorted(MODULES) for c in private_crossings(name, parsed(name))]
    assert not crossings, "\n".join(crossings)
