"""The house's structure, checked on the files (docs/design.md, "Rules of the house"): no import circle, no private
name imported across modules, no scoring-mode name outside its registry, the wings' forbidden imports, a small top
floor, nothing edits `sys.path`, and a README that is an introduction.

Run: pytest tests/test_layout.py
"""

import ast
import re
from pathlib import Path

from grpo_ratio.modes import MODES


ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "grpo_ratio"
MODULES = sorted(PACKAGE.rglob("*.py"))
CODE = sorted(p for folder in ("grpo_ratio", "benchmarks", "scripts", "trainers") for p in (ROOT / folder).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[str, list[str], int]]:
    """(absolute module, imported names, line) of every `from ... import` and `import` of grpo_ratio in `path`,
    function-level imports included."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "grpo_ratio":
                found.append((module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "grpo_ratio"]
    return found


def resolve(module: str, name: str) -> str:
    """The module an imported name stands for: `from grpo_ratio.x import y` is module x.y when y is one."""
    candidate = f"{module}.{name}"
    as_path = PACKAGE.parent / candidate.replace(".", "/")
    return candidate if as_path.with_suffix(".py").exists() or (as_path / "__init__.py").exists() else module


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (a package's `__init__` counts as the package itself)."""
    graph = {}
    for path in MODULES:
        edges = set()
        for module, names, _ in imports_of(path):
            edges |= {resolve(module, n) for n in names} if names else {module}
        graph[module_name(path)] = edges - {module_name(path)}
    return graph


def test_no_import_circle():
    graph = import_graph()
    state, circles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(nxt_ := node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[nxt_] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # a package's face (`__init__` handing names on) importing its own modules is no circle
    real = [c for c in circles if not any(c[i + 1].startswith(c[i] + ".") for i in range(len(c) - 1))]
    assert real == []
    assert len(graph) > 60  # the walk found the package


def test_no_private_name_imported_across_modules():
    private = [f"{p.relative_to(ROOT)}:{line} {module}.{name}"
               for p in CODE for module, names, line in imports_of(p)
               for name in names if name.startswith("_") and not name.startswith("__")]
    assert private == []


def _mode_literals(path: Path) -> list[str]:
    """Scoring-mode names as string literals: any of them, except `bf16`, which is also TRL's `bf16` field and a dtype
    name; `bf16` counts where it is compared with, or passed as, a mode."""
    tree = ast.parse(path.read_text())
    names = set(MODES) - {"bf16"}
    hits = [f"{path.relative_to(ROOT)}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in names]

    def mentions_mode(node) -> bool:
        return any("mode" in (getattr(x, "id", "") or getattr(x, "attr", "") or "").lower() for x in ast.walk(node))

    for n in ast.walk(tree):
        operands = []
        if isinstance(n, ast.Compare) and (mentions_mode(n.left) or any(mentions_mode(c) for c in n.comparators)):
            operands = [n.left, *n.comparators]
        elif isinstance(n, ast.keyword) and n.arg and "mode" in n.arg:
            operands = [n.value]
        hits += [f"{path.relative_to(ROOT)}:{n.lineno} 'bf16'" for op in operands for c in ast.walk(op)
                 if isinstance(c, ast.Constant) and c.value == "bf16"]
    return hits


def test_no_mode_name_outside_its_registry():
    homes = {PACKAGE / "modes.py", PACKAGE / "config.py"}
    hits = [h for p in MODULES if p not in homes for h in _mode_literals(p)]
    assert hits == []
    assert _mode_literals(PACKAGE / "modes.py")  # the check sees literals where they are


# The wings (docs/design.md, "Modules"): which imports must never be. A wing is a folder of grpo_ratio, or a module.
CORE = ("config", "checks", "plan", "records", "trainer", "rloo")
NEVER = {  # wing -> wings it must not import, and why
    "corrections": (CORE + ("sampler", "old_pass"), "the correction math knows no trainer, recorder or model pass"),
    "diagnostics": (CORE, "statistics know no trainer"),
    "old_pass": (CORE + ("sampler",), "scoring modes are usable without a trainer; settings are a value"),
    "probes": (CORE, "probes run on any model without a trainer"),
    "analysis": (CORE + ("old_pass", "sampler", "corrections", "trainer"), "the report reads files only"),
    "ladder": (CORE + ("async_grpo", "old_pass", "sampler", "corrections", "probes", "testing", "cli", "tasks"),
               "the ladder reads files only: its cells are run by benchmarks/ladder.py"),
    "integer": (CORE + ("analysis", "cli", "probes", "sampler", "testing"),
                "the integer forward is a model of its own: usable without a trainer, a probe or a script"),
    **{core: (("probes", "analysis", "testing", "cli", "tasks"), "no probe, report, test helper or script in the loop")
       for core in CORE},
}


def wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_the_wings_never_import_what_they_must_not():
    broken = []
    for path in MODULES:
        source = wing(module_name(path))
        forbidden, why = NEVER.get(source, ((), ""))
        for module, names, line in imports_of(path):
            targets = {resolve(module, n) for n in names} if names else {module}
            broken += [f"{path.relative_to(ROOT)}:{line} -> {t} ({why})" for t in targets if wing(t) in forbidden]
    assert broken == []


def test_a_small_top_floor():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 12, top
    assert {"config.py", "modes.py", "checks.py", "plan.py", "records.py", "trainer.py"} <= set(top)


def test_nothing_edits_sys_path():
    edits = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*=|sys\.path\s*\+=")
    assert [str(p.relative_to(ROOT)) for p in CODE + sorted((ROOT / "tests").rglob("*.py"))
            if edits.search(p.read_text())] == []


def test_readme_is_an_introduction_that_links_the_design():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 200
    assert any("docs/design.md" in line for line in readme[:40])  # on its first screen
