"""The shape of the code base, read from the source with `ast`: the top level holds what a user runs
beside model.py and sharding.py, the other modules live in folders by layer, imports go down the layers
(no cycle), and no file reaches into another's private (underscored) names, so that a file can be read,
changed and replaced by its public names alone.

Tests (test_*.py, conftest.py) may use any name; they are not part of the graph.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent

# The layers, lowest first: a module imports its own folder's modules and those of lower layers only.
# model.py and sharding.py are units of their own; the entry scripts are the top and may import each
# other, except train.py, which nothing imports.
LAYERS = {"core": 0, "layers": 1, "sharding": 1, "tokendata": 1, "model": 2, "training": 3, "inference": 3,
          "store": 4, "interop": 4, "benchmarks": 5}
ENTRY = {"data", "train", "eval", "sample", "serve", "convert_torch", "bench", "gcs_emulator", "plot"}
TOP = 6


def project_modules() -> dict[str, pathlib.Path]:
    """{dotted module name: file} for the top-level modules and those of each package folder."""
    found = {p.stem: p for p in ROOT.glob("*.py") if not p.stem.startswith("test_") and p.stem != "conftest"}
    for init in ROOT.glob("*/__init__.py"):
        package = init.parent.name
        found.update({f"{package}.{p.stem}": p for p in init.parent.glob("*.py") if p.stem != "__init__"})
    return found


MODULES = project_modules()
PACKAGES = {name.split(".")[0] for name in MODULES if "." in name}


def unit(module: str) -> str:
    """The layer a module belongs to: its folder, or itself at the top level."""
    return module.split(".")[0]


def rank(module: str) -> int:
    return TOP if unit(module) in ENTRY else LAYERS[unit(module)]


def parsed(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))


def project_imports(tree: ast.Module) -> dict[str, set[str]]:
    """{project module imported anywhere in the file (top level or inside a function): the names taken from it}
    `from PACKAGE import m` imports module PACKAGE.m; `from PACKAGE.m import x` takes x from it."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    found.setdefault(alias.name, set())
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in PACKAGES:
            for alias in node.names:
                found.setdefault(f"{node.module}.{alias.name}", set())
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
            found.setdefault(node.module, set()).update(alias.name for alias in node.names)
    return found


def module_aliases(tree: ast.Module) -> dict[str, str]:
    """{local name: project module} for `import m [as a]` and `from PACKAGE import m [as a]`"""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in MODULES})
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in PACKAGES:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return aliases


def graph() -> dict[str, set[str]]:
    return {name: set(project_imports(parsed(name))) - {name} for name in MODULES}


def test_the_graph_is_read():
    """The reader finds what a file plainly imports, in both forms (guards the tests below against reading
    nothing)."""
    g = graph()
    assert {"training.config", "store.rundir", "training.step", "model"} <= g["train"]
    assert "core.errors" in g["training.config"]
    assert "core.storage" in g["tokendata.shards"]
    assert g["core.errors"] == set()
    assert module_aliases(ast.parse("from training import config as config_lib\nimport model\n")) == {
        "config_lib": "training.config", "model": "model"}


def test_the_top_level_is_what_a_user_runs():
    """At the top level: the entry scripts, model.py and sharding.py, the tests; every other module in a
    package folder whose __init__.py says what lives there, and no folder named as a module or a folder
    the tools write."""
    top = {p.stem for p in ROOT.glob("*.py") if not p.stem.startswith("test_") and p.stem != "conftest"}
    assert top == ENTRY | {"model", "sharding"}
    assert PACKAGES == set(LAYERS) - {"model", "sharding"}
    for package in PACKAGES:
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        assert doc and len(doc.split()) > 20, f"{package}/__init__.py says what lives there"
        assert not (ROOT / f"{package}.py").exists() and package not in {"data", "runs", "bench"}
    assert not (ROOT / "bench" / "__init__.py").exists()  # bench/ holds records, not code


def test_imports_go_down_the_layers():
    g = graph()
    wrong = [f"{name} imports {other}" for name, others in sorted(g.items()) for other in sorted(others)
             if other == "train" or not (unit(other) == unit(name) or rank(other) < rank(name)
                                          or rank(name) == TOP)]
    assert not wrong, "\n".join(wrong)


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
    """`from m import _x` and `m._x` in module `name` for another project module m (dunders such as
    __file__ aside)."""
    crossings = []
    for module, names in project_imports(tree).items():
        crossings += [f"{name}: from {module} import {n}" for n in names if n.startswith("_") and module != name]
        if module.split(".")[-1].startswith("_"):
            crossings.append(f"{name}: imports {module}")
    aliases = module_aliases(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__") and aliases[node.value.id] != name):
            crossings.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr}")
    return crossings


def test_a_private_crossing_is_found():
    source = ("import model as m\nfrom training import config\nfrom training.step import _x, y\n\n"
              "def f():\n    return m._y, config.__file__, config._z\n")
    assert private_crossings("sample", ast.parse(source)) == [
        "sample: from training.step import _x", "sample:6: m._y", "sample:6: config._z"]


def test_no_private_name_crosses_files():
    crossings = [c for name in sorted(MODULES) for c in private_crossings(name, parsed(name))]
    assert not crossings, "\n".join(crossings)
