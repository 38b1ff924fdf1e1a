"""The layers hold: imports only run down, no file imports itself round a circle, and every import of our
own code inside a function says why it is there. Static (ast): nothing is imported, so it takes a second.

The layer order is README's ("Layout of the code"), bottom-up; a module imports its own layer or below.
A failure prints one line per violation, `file:line imports X (layer A -> layer B)`, naming what to mend.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Bottom-up. Each name is a top-level module or package of hybridrl, or the megatron_patches package.
# A new module goes into the lowest layer whose imports it needs; a new package is added here (and to README).
LAYERS: list[tuple[str, ...]] = [
    ("bundled", "registry", "versions", "protocol", "decode_memory", "config", "data", "algorithms", "parallel",
     "megatron_patches"),                                                                        # L0
    ("models", "controller", "envs", "launch"),                                                 # L1
    ("rollout", "hybrid_engine"),                                                               # L2
    ("workers",),                                                                               # L3
    ("roles", "api"),                                                                           # L4
    ("automap",),                                                                               # L5
    ("trainer",),                                                                               # L6
    ("cli",),                                                                                   # L7
]
LAYER_OF = {name: index for index, names in enumerate(LAYERS) for name in names}
# the lazy public face: it only hands names on (importlib), so it is in no layer and is not checked
EXCLUDED = {"hybridrl/__init__.py"}
PACKAGES = ("hybridrl", "megatron_patches")


@dataclass(frozen=True)
class Import:
    file: str         # path relative to the repository root
    line: int
    target: str       # dotted module name, resolved (relative imports made absolute)
    in_function: bool
    commented: bool   # a comment on its line(s), or just above it or above its block of imports


def _module_name(rel: str) -> str:
    parts = list(Path(rel).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _all_files() -> list[str]:
    return [f.relative_to(ROOT).as_posix() for package in PACKAGES for f in sorted((ROOT / package).rglob("*.py"))]


def _source_files() -> list[str]:
    return [f for f in _all_files() if f not in EXCLUDED]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(rel: str, text: str, known: set[str]) -> list[Import]:
    """The imports of hybridrl / megatron_patches modules in one file (`rel`, its source `text`); those under
    `if TYPE_CHECKING:` are left out (never executed). `known`: every module name of the packages."""
    lines = text.splitlines()
    module = _module_name(rel)
    package = module if rel.endswith("__init__.py") else module.rpartition(".")[0]
    tree = ast.parse(text, filename=rel)
    import_lines = {line for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                    for line in range(node.lineno, node.end_lineno + 1)}
    found: list[Import] = []

    def commented(node: ast.stmt) -> bool:
        if any("#" in line for line in lines[node.lineno - 1:node.end_lineno]):
            return True
        above = node.lineno - 1
        while above in import_lines:
            above -= 1
        return above >= 1 and lines[above - 1].strip().startswith("#")

    def add(node: ast.stmt, target: str, in_function: bool) -> None:
        if target.split(".")[0] in PACKAGES:
            found.append(Import(rel, node.lineno, target, in_function, commented(node)))

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt, in_function)
            else:
                visit_one(child, in_function)

    def visit_one(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node, alias.name, in_function)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                # `from package import submodule` imports the submodule; `from module import name` the module
                candidate = f"{source}.{alias.name}"
                add(node, candidate if candidate in known else source, in_function)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            visit(node, True)
        else:
            visit(node, in_function)

    visit(tree, False)
    return list(dict.fromkeys(found))  # `from m import a, b` is one import of m


def _all_imports() -> list[Import]:
    known = {_module_name(f) for f in _all_files()}
    return [imp for rel in _source_files() for imp in imports_of(rel, (ROOT / rel).read_text(), known)]


def _layer_name(module: str) -> str:
    """hybridrl.trainer.loop -> trainer, hybridrl.config -> config, megatron_patches.rng -> megatron_patches."""
    parts = module.split(".")
    if parts[0] == "megatron_patches":
        return "megatron_patches"
    return parts[1] if len(parts) > 1 else "hybridrl"


def _describe(layer: str) -> str:
    return f"L{LAYER_OF[layer]} {layer}" if layer in LAYER_OF else f"{layer}, in no layer"


def _file_of(module: str) -> str | None:
    base = Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if (ROOT / candidate).is_file():
            return candidate.as_posix()
    return None


def layer_violations(imports: list[Import], files: list[str]) -> list[str]:
    problems = [f"{rel}:1 is in no layer ({_layer_name(_module_name(rel))}: add it to LAYERS in "
                f"tests/test_layers.py and to README)" for rel in files
                if _layer_name(_module_name(rel)) not in LAYER_OF]
    for imp in imports:
        source, target = _layer_name(_module_name(imp.file)), _layer_name(imp.target)
        if target == "hybridrl":  # the lazy public face hands on names of every layer
            problems.append(f"{imp.file}:{imp.line} imports {imp.target} (the public face, above every layer: "
                            "import the module that defines the name)")
        elif source in LAYER_OF and (target not in LAYER_OF or LAYER_OF[target] > LAYER_OF[source]):
            problems.append(f"{imp.file}:{imp.line} imports {imp.target} "
                            f"(layer {_describe(source)} -> layer {_describe(target)})")
    return problems


def circles(imports: list[Import]) -> list[str]:
    """Strongly connected components (Tarjan) of the file-level import graph, function-level imports included;
    each circle as the imports that tie it."""
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], int] = {}
    for imp in imports:
        target = _file_of(imp.target)
        if target and target != imp.file and target not in EXCLUDED:
            graph.setdefault(imp.file, set()).add(target)
            where.setdefault((imp.file, target), imp.line)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return ["circle: " + "; ".join(f"{a}:{where[a, b]} imports {b}" for a in members
                                   for b in sorted(graph[a] & set(members)))
            for members in components]


def unexplained_function_imports(imports: list[Import]) -> list[str]:
    return [f"{imp.file}:{imp.line} imports {imp.target} inside a function without its reason beside it "
            "(a comment: heavy dependency, start-up time; else import it at the top)"
            for imp in imports if imp.in_function and not imp.commented]


def _report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what}:\n" + "\n".join(problems)


def test_imports_run_down_the_layers():
    problems = layer_violations(_all_imports(), _source_files())
    assert not problems, _report(problems, "imports that run up the layers (README, 'Layout of the code')")


def test_no_import_circle_between_files():
    problems = circles(_all_imports())
    assert not problems, _report(problems, "import circles between files")


def test_imports_inside_functions_say_why():
    problems = unexplained_function_imports(_all_imports())
    assert not problems, _report(problems, "function-level imports of hybridrl / megatron_patches without a reason")


def test_the_checker_sees_what_it_checks():
    """On a made-up module the three checks find what they should; on the tree they read real imports."""
    known = {"hybridrl.parallel", "hybridrl.parallel.x", "hybridrl.models", "hybridrl.models.builder",
             "hybridrl.trainer", "hybridrl.trainer.loop", "hybridrl.api"}
    text = ("from typing import TYPE_CHECKING\n"
            "from hybridrl.trainer import loop\n"
            "from . import x\n"
            "if TYPE_CHECKING:\n"
            "    from hybridrl.api import Actor\n"
            "def f():\n"
            "    import os\n"
            "    from hybridrl.models import builder\n"
            "def g():\n"
            "    # start-up time: a reason for the block below\n"
            "    import megatron_patches\n"
            "    from hybridrl.models.builder import unwrap, build_gpt_model\n")
    found = imports_of("hybridrl/parallel/y.py", text, known)
    assert [(i.line, i.target, i.in_function, i.commented) for i in found] == [
        (2, "hybridrl.trainer.loop", False, False), (3, "hybridrl.parallel.x", False, False),
        (8, "hybridrl.models.builder", True, False), (11, "megatron_patches", True, True),
        (12, "hybridrl.models.builder", True, True)]
    assert layer_violations(found, []) == [
        "hybridrl/parallel/y.py:2 imports hybridrl.trainer.loop (layer L0 parallel -> layer L6 trainer)",
        "hybridrl/parallel/y.py:8 imports hybridrl.models.builder (layer L0 parallel -> layer L1 models)",
        "hybridrl/parallel/y.py:12 imports hybridrl.models.builder (layer L0 parallel -> layer L1 models)"]
    assert [p.split(" inside")[0] for p in unexplained_function_imports(found)] == [
        "hybridrl/parallel/y.py:8 imports hybridrl.models.builder"]
    real = _all_imports()
    assert len(real) > 300 and any(i.in_function for i in real)
    assert {_layer_name(_module_name(f)) for f in _source_files()} >= {"trainer", "controller", "cli", "workers"}
