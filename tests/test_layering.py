"""The project's structure rules (docs/DESIGN.md, "Layering"), checked on the source with ``ast``:
every module sits in one layer and imports only from its own layer and the ones below, no import
cycle, no private name crosses a module, no ``sys.path`` edits or scripts loaded by path, short
functions and modules, a config that names no model type, and every autograd Function's ``apply``
called with what its forward requires."""
import ast
import os

import pytest

import hf_division
from hf_division.registry import family

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("hf_division", "model_patches")
CHECKED = PACKAGES + ("scripts", "tests")


def _files(folders):
    for folder in folders:
        for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in sorted(names):
                if name.endswith(".py"):
                    yield os.path.join(dirpath, name)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


MODULES = {_module_name(p): p for p in _files(PACKAGES)}


def _is_package(name: str) -> bool:
    return MODULES.get(name, "").endswith("__init__.py")


def _imports(name: str, tree: ast.Module):
    """``(imported module, imported names)`` for every import statement, at any depth."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            yield base, tuple(a.name for a in node.names)


def _edges(name: str, tree: ast.Module) -> set:
    """Project modules ``name`` imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    out = set()
    for module, names in _imports(name, tree):
        subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
        if subs:
            out.update(subs)
        elif module in MODULES:
            out.add(module)
    out.discard(name)
    return out


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


#: the layers, lowest first (docs/DESIGN.md, "Layering"): a module imports from its own layer and the
#: layers before it, never from a later one. A module belongs to the layer of its longest prefix here.
LAYERS = (
    ("hf_division.config", "hf_division.registry"),  # the policy
    ("hf_division.quant",),  # the math
    ("hf_division.kernels",),  # how it runs
    ("hf_division.compress",),  # the pipeline
    ("hf_division.autograd",),  # what a step keeps for backward
    ("hf_division.patching",),  # wiring into module instances
    ("model_patches",),  # one module per family
    ("hf_division.api",),  # apply_division / remove_division
    ("hf_division.integrations",),  # Trainer, TRL, Accelerate, launcher, CLI
    ("hf_division.analysis",),  # measuring what division does
    ("hf_division.bench",),  # the measurement harness
    ("hf_division",),  # the package's public names, each loaded on first use
)


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of ``module``'s longest matching prefix; None if it has none."""
    best, found = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), i
    return found


def upward_imports(graph: dict) -> list[str]:
    """``"a -> b"`` for every import of a module ``b`` in a later layer than ``a``'s."""
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if layer_of(b) > layer_of(a))


def _graph() -> dict:
    return {name: _edges(name, _parse(path)) for name, path in MODULES.items()}


def test_imports_flow_down_the_layers():
    assert upward_imports(_graph()) == []


def test_the_direction_check_can_fail():
    graph = {"hf_division.quant.codecs": {"hf_division.autograd.store", "hf_division.config"},
             "hf_division.bench.zoo": {"hf_division.api"}, "model_patches.llama": {"hf_division.integrations.trl"}}
    assert upward_imports(graph) == ["hf_division.quant.codecs -> hf_division.autograd.store",
                                     "model_patches.llama -> hf_division.integrations.trl"]


def test_every_module_is_in_a_layer_and_the_top_folder_holds_only_layers():
    assert [m for m in MODULES if layer_of(m) is None] == []
    top = sorted(n for n in os.listdir(os.path.join(ROOT, "hf_division")) if not n.startswith(("_", ".")))
    assert top == ["analysis", "api.py", "autograd", "bench", "compress", "config.py", "integrations", "kernels",
                   "patching", "quant", "registry.py"]


def test_no_import_cycle():
    graph = {name: _edges(name, _parse(path)) for name, path in MODULES.items()}
    assert _cycles(graph) == []


def test_the_cycle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _project_aliases(name: str, tree: ast.Module) -> set:
    """Local names bound to project modules (``import hf_division as hd``, ``from x import store``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in PACKAGES)
        elif isinstance(node, ast.ImportFrom):
            for module, names in _imports(name, ast.Module(body=[node], type_ignores=[])):
                out.update(a.asname or a.name for a in node.names if f"{module}.{a.name}" in MODULES)
    return out


def test_no_private_name_crosses_a_module():
    bad = []
    for path in _files(CHECKED):
        name, tree = _module_name(path), _parse(path)
        for module, names in _imports(name, tree):
            if module.split(".")[0] in PACKAGES and module != name:
                bad += [f"{path}: from {module} import {n}" for n in names if _private(n)]
        aliases = _project_aliases(name, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in aliases:
                    bad.append(f"{path}:{node.lineno}: .{node.attr}")
    assert bad == []


#: the one place that sets sys.path: ``hf-division run SCRIPT`` runs a user's script as
#: ``python SCRIPT`` would, with the script's folder first on the path (docs/GUIDE.md, "Fine-tuning scripts")
SYS_PATH_ALLOWED = {os.path.join("hf_division", "integrations", "launcher.py")}


def test_no_sys_path_edits_and_no_script_loaded_by_path():
    bad = []
    for path in _files(CHECKED):
        rel = os.path.relpath(path, ROOT)
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                if rel not in SYS_PATH_ALLOWED:
                    bad.append(f"{rel}:{node.lineno}: sys.path")
            if isinstance(node, ast.Attribute) and node.attr in ("spec_from_file_location", "SourceFileLoader"):
                bad.append(f"{rel}:{node.lineno}: {node.attr}")
            if isinstance(node, ast.Attribute) and node.attr == "run_path" and not rel.startswith("hf_division"):
                bad.append(f"{rel}:{node.lineno}: runpy.run_path")
    assert bad == []


def test_functions_and_modules_are_short():
    long = []
    for path in _files(PACKAGES):
        rel = os.path.relpath(path, ROOT)
        tree = _parse(path)
        with open(path, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > 450:
            long.append(f"{rel}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - first + 1 > 80:
                    long.append(f"{rel}:{node.lineno}: {node.name} {node.end_lineno - first + 1} lines")
    assert long == []


def test_config_names_no_model_type():
    with open(os.path.join(ROOT, "hf_division", "config.py"), encoding="utf-8") as f:
        source = f.read()
    named = [t for t in hf_division.supported_model_types() if f'"{t}"' in source or f"'{t}'" in source]
    assert named == []


@pytest.mark.parametrize("model_type", hf_division.supported_model_types())
def test_every_family_module_registers_itself(model_type):
    apply = family(model_type).apply
    assert apply.__module__.startswith("model_patches.")


def _required_arity(trees: dict) -> dict:
    """Per autograd Function class name (``class X(...Function)`` with a ``forward``), the positional
    parameters its forward requires besides ``ctx``; a name defined twice is left out."""
    found = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Function") for b in node.bases):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "forward":
                        params = item.args.posonlyargs + item.args.args
                        found.setdefault(node.name, []).append(len(params) - 1 - len(item.args.defaults))
    return {name: arity[0] for name, arity in found.items() if len(arity) == 1}


def short_apply_calls(trees: dict) -> list[str]:
    """``X.apply(...)`` calls that pass fewer positional arguments than ``X.forward`` requires,
    counted up to the first ``*args`` (after which the count is unknown)."""
    arity, short = _required_arity(trees), []
    for where, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "apply"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in arity):
                given = 0
                for arg in node.args:
                    if isinstance(arg, ast.Starred):
                        given = None
                        break
                    given += 1
                if given is not None and given < arity[node.func.value.id]:
                    short.append(f"{where}:{node.lineno}: {node.func.value.id}.apply with {given} of "
                                 f"{arity[node.func.value.id]} arguments")
    return short


def test_every_function_is_applied_with_what_its_forward_requires():
    """Checked on the source because some call sites run only under another Transformers than CI's
    (``model_patches/falcon_inline.py``, before 5.25): one passed AttentionFn five of its six."""
    trees = {os.path.relpath(p, ROOT): _parse(p) for p in _files(PACKAGES)}
    assert short_apply_calls(trees) == []


def test_the_apply_check_can_fail():
    tree = ast.parse("class F(torch.autograd.Function):\n    def forward(ctx, a, b, c=1, *rest): ...\n"
                     "F.apply(x)\nF.apply(x, y)\nF.apply(*xs)\n")
    assert short_apply_calls({"m.py": tree}) == ["m.py:3: F.apply with 1 of 2 arguments"]
