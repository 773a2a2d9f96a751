"""The import structure of megatron/, read from the source (nothing is imported), and its file sizes.

Two import rules (issue 25, style rules 8 and 12), and no module over ``MAX_LINES`` lines (rule 8):

(a) The module-level import graph among megatron modules has no cycle. A module's module-level
    imports are those that run when it is imported: everything outside function bodies, except
    ``if TYPE_CHECKING:`` blocks. Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and
    ``a.b`` (so a package ``__init__`` that re-exports its submodules is part of the graph), except
    the packages that enclose the importer, which are already being imported when it runs.
    ``from megatron.core import NAME`` follows megatron/core/__init__.py's lazy table to the
    module that provides NAME, since that is what runs.
(b) Imports inside functions are only of optional dependencies (``OPTIONAL`` below, each with the
    reason it is not imported at the top). A function-level import of a megatron module hides a
    cycle or a slow path, and is refused; so is one of the standard library or of torch.

Allowed dynamic imports (``importlib.import_module`` calls), each with its reason:

- megatron/core/__init__.py's ``__getattr__``: Megatron-Core's package exposes ``parallel_state``,
  ``tensor_parallel``, ``DistributedDataParallel``, ... as attributes of ``megatron.core``, and
  ``import megatron.core`` must not import torch (tools and the data preprocessor import the
  package without it). PEP 562's lazy attributes are the only way to have both; the table they
  read is the ``_LAZY`` dict, which rule (a) follows.
- megatron/core/transformer/spec_utils.py's ``import_module``: Megatron-Core's ``ModuleSpec``
  accepts a ``(module_path, name)`` pair that is imported when the spec is built; the path is the
  user's data, not an import of ours.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "megatron"

# Top-level names that may be imported inside a function, and why each is not imported at the top.
OPTIONAL: dict[str, str] = {
    "triton": "GPU kernels; absent on CPU-only installs",
    "torchao": "FP8 training helpers; optional extra",
    "transformer_engine": "--transformer-impl transformer_engine; never required",
    "apex": "Megatron-LM's fused kernels; never required",
    "wandb": "--wandb-project logging; optional extra",
    "tensorboard": "--tensorboard-dir logging; optional extra",
    "transformers": "Hugging Face tokenizers and conversion; optional extra",
    "safetensors": "Hugging Face checkpoint files; optional extra",
    "sentencepiece": "SentencePiece tokenizer; optional extra",
    "tiktoken": "TikToken tokenizer; optional extra",
    "tokenizers": "Hugging Face fast tokenizers; optional extra",
    "huggingface_hub": "Hugging Face downloads; optional extra",
    "nltk": "--split-sentences in the data preprocessor; optional extra",
    "blobfile": "tiktoken's file reader; optional extra",
}

# Dotted module prefixes, within packages that are not optional, that may be imported inside a
# function, with the reason.
OPTIONAL_MODULES: dict[str, str] = {
    "torch.utils.tensorboard": "imports the optional tensorboard package",
}

# (file relative to the repository root, function name) -> reason, for importlib.import_module.
DYNAMIC_IMPORTS: dict[tuple[str, str], str] = {
    ("megatron/core/__init__.py", "__getattr__"): "PEP 562 lazy attributes of megatron.core",
    ("megatron/core/transformer/spec_utils.py", "import_module"): "ModuleSpec's (module_path, name)",
}


@dataclass(frozen=True)
class Import:
    """One import statement's target as the importer names it."""

    importer: str  # dotted module name of the file
    path: str  # file, relative to the repository root
    line: int
    target: str  # dotted module name (relative imports resolved)
    names: tuple[str, ...]  # the names of ``from target import names``; () for ``import target``
    function: str | None  # the enclosing function's name; None at module level

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_files() -> dict[str, str]:
    """Dotted module name -> path relative to the repository root, for every module of megatron/."""
    modules: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, PACKAGE)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, filename), ROOT)
            parts = rel[: -len(".py")].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = rel.replace(os.sep, "/")
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        assert name is not None
        return name
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _walk(node: ast.AST, function: str | None) -> Iterator[tuple[ast.AST, str | None]]:
    """Every node under ``node`` with its enclosing function; ``if TYPE_CHECKING:`` bodies skipped."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:
                yield sub, function
                yield from _walk(sub, function)
            continue
        inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
        if isinstance(child, ast.Lambda):
            inner = function or "<lambda>"
        yield child, function
        yield from _walk(child, inner)


def imports_of(module: str, path: str) -> tuple[list[Import], list[tuple[int, str | None]]]:
    """The import statements of one file, and the lines of its ``importlib.import_module`` calls."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    is_package = path.endswith("__init__.py")
    found: list[Import] = []
    dynamic: list[tuple[int, str | None]] = []
    for node, function in _walk(tree, None):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, path, node.lineno, alias.name, (), function))
        elif isinstance(node, ast.ImportFrom):
            if node.module == "__future__":
                continue
            target = _resolve(module, is_package, node.level, node.module)
            names = tuple(alias.name for alias in node.names)
            found.append(Import(module, path, node.lineno, target, names, function))
        elif isinstance(node, ast.Call):
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "import_module"
                and isinstance(func.value, ast.Name)
                and func.value.id == "importlib"
            ) or (isinstance(func, ast.Name) and func.id == "__import__"):
                dynamic.append((node.lineno, function))
    return found, dynamic


def lazy_table(modules: dict[str, str]) -> dict[str, str]:
    """megatron/core/__init__.py's ``_LAZY``: attribute name -> the module that provides it."""
    with open(os.path.join(ROOT, modules["megatron.core"]), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in targets):
            value = ast.literal_eval(node.value)  # type: ignore[union-attr, arg-type]
            return {name: module for name, (module, _attr) in value.items()}
    return {}


def _enclosing_packages(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def runs_on_import(imp: Import, modules: dict[str, str], lazy: dict[str, str]) -> set[str]:
    """The megatron modules whose code an import statement runs (they may already be loaded)."""
    targets = {imp.target}
    for name in imp.names:
        sub = f"{imp.target}.{name}"
        if sub in modules:
            targets.add(sub)
        elif imp.target == "megatron.core" and name in lazy:
            targets.add(lazy[name])
    ran: set[str] = set()
    skip = _enclosing_packages(imp.importer)
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in modules and name not in skip:
                ran.add(name)
    ran.discard(imp.importer)
    return ran


def all_imports() -> tuple[dict[str, str], list[Import], list[tuple[str, int, str | None]]]:
    modules = module_files()
    found: list[Import] = []
    dynamic: list[tuple[str, int, str | None]] = []
    for module, path in modules.items():
        imps, dyn = imports_of(module, path)
        found.extend(imps)
        dynamic.extend((path, line, function) for line, function in dyn)
    return modules, found, dynamic


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def is_megatron(target: str) -> bool:
    return target == PACKAGE or target.startswith(PACKAGE + ".")


def is_optional(target: str) -> bool:
    top = target.split(".")[0]
    return top in OPTIONAL or any(target == m or target.startswith(m + ".") for m in OPTIONAL_MODULES)


def test_module_level_imports_have_no_cycle() -> None:
    modules, found, _ = all_imports()
    lazy = lazy_table(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    edges: dict[tuple[str, str], Import] = {}
    for imp in found:
        if imp.function is not None or not is_megatron(imp.target):
            continue
        for dep in runs_on_import(imp, modules, lazy):
            graph[imp.importer].add(dep)
            edges.setdefault((imp.importer, dep), imp)
    cycles = find_cycles(graph)
    lines = []
    for component in cycles:
        members = set(component)
        lines.append("cycle among: " + ", ".join(component))
        for (src, dst), imp in sorted(edges.items(), key=lambda e: e[1].where()):
            if src in members and dst in members:
                lines.append(f"  {imp.where()}: {src} -> {dst}")
    assert not cycles, "module-level import cycles in megatron/:\n" + "\n".join(lines)


def test_function_level_imports_are_only_of_optional_dependencies() -> None:
    _, found, dynamic = all_imports()
    bad = []
    for imp in found:
        if imp.function is None:
            continue
        what = f"{imp.where()}: {imp.target} in {imp.function}()"
        if is_megatron(imp.target):
            bad.append(f"{what} (a megatron module: import it at the top)")
        elif not is_optional(imp.target):
            bad.append(f"{what} (not an optional dependency)")
    for path, line, function in dynamic:
        if (path, function or "") not in DYNAMIC_IMPORTS:
            bad.append(f"{path}:{line}: importlib.import_module in {function}() (not an allowed one)")
    assert not bad, f"{len(bad)} function-level imports in megatron/:\n" + "\n".join(sorted(bad))


MAX_LINES = 500


def test_no_module_over_500_lines() -> None:
    long = []
    for path in module_files().values():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > MAX_LINES:
            long.append(f"{path}: {lines} lines")
    assert not long, f"modules over {MAX_LINES} lines (split them along cohesive lines):\n" + "\n".join(long)


# The checker's own rules, on small sources (these would fail if it missed what it is meant to see).


def _graph_of(sources: dict[str, str]) -> dict[str, set[str]]:
    modules = {name: name.replace(".", "/") + ".py" for name in sources}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, source in sources.items():
        is_package = module in {m.rsplit(".", 1)[0] for m in modules if "." in m}
        for node, function in _walk(ast.parse(source), None):
            if isinstance(node, ast.ImportFrom) and function is None:
                target = _resolve(module, is_package, node.level, node.module)
                imp = Import(module, "", 0, target, tuple(a.name for a in node.names), None)
                graph[module] |= runs_on_import(imp, modules, {})
    return graph


def test_checker_sees_a_cycle_through_a_package_init() -> None:
    graph = _graph_of(
        {
            "p": "from p.a import f\n",
            "p.a": "from q.b import g\n",
            "q": "",
            "q.b": "from p import f\n",
        }
    )
    assert find_cycles(graph) == [["p", "p.a", "q.b"]]


def test_checker_ignores_the_importers_own_package_and_type_checking() -> None:
    graph = _graph_of(
        {
            "p": "from .a import f\nfrom .b import g\n",
            "p.a": "from p.b import g\n",
            "p.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import f\n",
        }
    )
    assert graph["p.a"] == {"p.b"}
    assert graph["p.b"] == set()
    assert find_cycles(graph) == []


def test_checker_finds_function_level_imports() -> None:
    source = "import os\ndef f():\n    import triton\n    from megatron.core import utils\n"
    found = [
        (function, node.lineno)
        for node, function in _walk(ast.parse(source), None)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    assert found == [(None, 1), ("f", 3), ("f", 4)]
    assert is_optional("triton.language") and not is_optional("torch.distributed")
    assert is_optional("torch.utils.tensorboard")
