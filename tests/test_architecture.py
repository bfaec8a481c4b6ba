"""The package's shape: subpackages in layers, every import pointing down, no cycle, modules of readable size, and a
model family in one module.

Imports are read from the source (``ast``), those inside functions included: a lazy import that dodges a cycle at
import time is still a cycle in the design. Subpackage ``__init__`` files hold a docstring only; the package root
re-exports the public names and sits above everything.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import ulysses_jax

PACKAGE = pathlib.Path(ulysses_jax.__file__).parent
# bottom to top: a module may import from its own layer or any layer below it, never from one above
LAYERS = ("kernels", "parallel", "model", "data", "interop", "train", "evaluation", "plan", "cli")
MAX_LINES = 450


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    return module.split(".")[1] if module != "ulysses_jax" else "<root>"


def imports(module: str, source: str | None = None) -> set[str]:
    """The package modules ``module`` imports anywhere in its source (``from pkg import sub`` names ``pkg.sub``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    source = path.read_text(encoding="utf-8") if source is None else source
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "ulysses_jax"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if base.split(".")[0] != "ulysses_jax":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in MODULES else base)
    out.discard(module)
    return {m for m in out if m in MODULES}


def upward(module: str, targets: set[str]) -> list[str]:
    rank = LAYERS.index(layer(module))
    return sorted(t for t in targets if t == "ulysses_jax" or LAYERS.index(layer(t)) > rank)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_is_in_a_layer():
    stray = [m for m in MODULES if m not in ("ulysses_jax", "ulysses_jax.__main__") and layer(m) not in LAYERS]
    assert not stray, f"modules outside the layers {LAYERS}: {stray}"


def test_subpackage_inits_hold_a_docstring_and_no_import():
    for m, path in MODULES.items():
        if path.name != "__init__.py" or m == "ulysses_jax":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        doc = ast.get_docstring(tree)
        assert doc and 3 <= len(doc.splitlines()) <= 8, f"{m}: the docstring says in 3-6 lines what lives there"
        assert "May import" in doc and "Must not import" in doc, m
        assert len(tree.body) == 1, f"{m}/__init__.py must hold its docstring only (imports name the module itself)"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m not in ("ulysses_jax", "ulysses_jax.__main__")))
def test_imports_point_down(module):
    assert not (up := upward(module, GRAPH[module])), f"{module} ({layer(module)}) imports from a higher layer: {up}"


def test_no_import_cycle():
    assert (cycle := find_cycle(GRAPH)) is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_see_a_lazy_upward_import_and_a_cycle():
    """The walker itself: an import inside a function counts, a relative one resolves, a cycle is named."""
    src = "def f():\n    from ulysses_jax.train import trainer\n    from . import ulysses\n"
    found = imports("ulysses_jax.parallel.ring", src)
    assert found == {"ulysses_jax.train.trainer", "ulysses_jax.parallel.ulysses"}
    assert upward("ulysses_jax.parallel.ring", found) == ["ulysses_jax.train.trainer"]
    graph = {**GRAPH, "ulysses_jax.parallel.exchange": GRAPH["ulysses_jax.parallel.exchange"] | {
        "ulysses_jax.parallel.ring"}}
    assert find_cycle(graph) == ["ulysses_jax.parallel.exchange", "ulysses_jax.parallel.ring",
                                 "ulysses_jax.parallel.exchange"]


def test_modules_are_readable_in_one_sitting():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (a second concern hiding inside?): {long}"


def test_public_names_stay_importable():
    for name in ulysses_jax.__all__:
        assert getattr(ulysses_jax, name) is not None, name
    assert ulysses_jax.ModelConfig.from_hf.__qualname__ == "ModelConfig.from_hf"


# the modules of model/families/ that are not a family
FAMILY_HELPERS = ("fields", "tensors", "registry")
FAMILY_INTERFACE = ("ARCHITECTURE", "MODEL_TYPE", "fields", "claims", "hf_config", "ENTRIES", "PRESETS")


def architectures_named_outside(sources: dict[str, str]) -> dict[str, list[str]]:
    """Each registered architecture string (``LlamaForCausalLM``, ...) -> the modules other than its family's that
    name it."""
    from ulysses_jax.model.families import registry

    out = {}
    for family in registry.FAMILIES:
        word = re.compile(rf"\b{re.escape(family.ARCHITECTURE)}\b")
        if named := sorted(m for m, src in sources.items() if m != family.__name__ and word.search(src)):
            out[family.ARCHITECTURE] = named
    return out


def test_a_family_is_named_in_its_module_only():
    """Adding a family is one module (and its registry line): the generic reader and writer, the weights' table and
    every other module name no architecture."""
    sources = {m: p.read_text(encoding="utf-8") for m, p in MODULES.items()}
    assert not (named := architectures_named_outside(sources)), f"architectures named outside their family: {named}"
    caught = architectures_named_outside({**sources, "ulysses_jax.model.hf_config": 'if arch == "LlamaForCausalLM":'})
    assert caught == {"LlamaForCausalLM": ["ulysses_jax.model.hf_config"]}


def test_every_family_is_registered_with_its_interface_and_presets():
    from ulysses_jax.model.config import PRESETS
    from ulysses_jax.model.families import registry

    prefix = "ulysses_jax.model.families."
    modules = {m for m in MODULES if m.startswith(prefix) and m.removeprefix(prefix) not in FAMILY_HELPERS}
    assert {f.__name__ for f in registry.FAMILIES} == modules, "a family module missing from registry.FAMILIES"
    assert sorted(f.__name__ for f in registry.EXPORT_ORDER) == sorted(modules), "EXPORT_ORDER lists each once"
    for family in registry.FAMILIES:
        assert not (missing := [a for a in FAMILY_INTERFACE if not hasattr(family, a)]), (family.__name__, missing)
        assert all(PRESETS[name].name == name for name in family.PRESETS), family.__name__
