"""The layout rules a maintainer relies on: no import cycle inside cleanrlhf_utils (function-local imports count), every
module importable first, on its own; bench/ and toolbox/ import the project as installed code, never by editing
sys.path."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "framework" / "cleanrlhf_utils"
MODULES = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__")


def package_imports(path: Path) -> set[str]:
    """The cleanrlhf_utils modules a module imports, anywhere in it (a function-local import is still an edge)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y / from . import x
                found |= {node.module} if node.module else {alias.name for alias in node.names}
            elif node.module == "cleanrlhf_utils":
                found |= {alias.name for alias in node.names}
            elif node.module and node.module.startswith("cleanrlhf_utils."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("cleanrlhf_utils.")}
    return {name.split(".")[0] for name in found} & set(MODULES)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for successor in sorted(graph[node]):
            if state.get(successor) == "open":
                return path[path.index(successor) :] + [successor] if successor in path else [node, successor]
            if successor not in state and (cycle := visit(successor, [*path, successor])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_inside_the_package():
    graph = {module: package_imports(PACKAGE / f"{module}.py") for module in MODULES}
    assert all(graph[module] <= set(MODULES) for module in graph)
    assert graph["cli"] >= {"arguments", "feedback"}, "the scanner sees the package's imports"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_every_module_imports_first_and_alone():
    """Each module as the first thing a fresh interpreter imports (what `python -c 'import cleanrlhf_utils.x'` does):
    an order-dependent import would fail for one of them."""
    processes = {
        module: subprocess.Popen([sys.executable, "-c", f"import cleanrlhf_utils.{module}"], stderr=subprocess.PIPE, text=True)
        for module in MODULES
    }
    failures = {module: process.communicate(timeout=120)[1].strip().splitlines()[-1:] for module, process in processes.items()}
    assert {module: error for module, error in failures.items() if processes[module].returncode} == {}


@pytest.mark.parametrize("folder", ["bench", "toolbox"])
def test_bench_and_toolbox_do_not_edit_sys_path(folder):
    for path in sorted((REPO / folder).glob("*.py")):
        assert "sys.path" not in path.read_text(), f"{path.relative_to(REPO)} edits sys.path; import the installed project"


def test_the_training_loop_never_asks_which_teacher_it_has():
    """One Teacher interface: only the teachers' own module names HumanTeacher and reads the feedback mode (make_teacher
    there picks the teacher); main asks the teacher what it needs (people_answer, labels_are_free)."""
    import inspect

    import pref_ppo
    import sac_rlhf
    from cleanrlhf_utils import feedback

    for path in [*sorted((REPO / "framework").rglob("*.py")), *sorted((REPO / "bench").glob("*.py"))]:
        if path.name != "feedback.py":
            assert "isinstance(teacher" not in path.read_text(), path
    for script in (sac_rlhf, pref_ppo):
        assert "HumanTeacher" not in inspect.getsource(script), script.__name__
        own = [value for value in vars(script).values() if inspect.isfunction(value) and value.__module__ == script.__name__]
        code = [inspect.getsource(function) for function in own]
        assert not [text for text in code if "teacher_feedback_mode" in text], script.__name__
    assert "teacher_feedback_mode" in inspect.getsource(feedback.make_teacher)


# ----------------------------------------------------------------------------------------
# An algorithm script reads top to bottom: reading rules, not line budgets
# ----------------------------------------------------------------------------------------
COMPOUND = (ast.If, ast.For, ast.While, ast.With, ast.Try)
ALGORITHM_SCRIPTS = ["sac_rlhf", "pref_ppo", "sac_rlhf_rime", "sac_rlhf_mistake_aware", "sac_rlhf_agent_reset", "sac", "ppo"]
MAIN_LINES, MAIN_DEPTH, FIRST_NETWORK, LINE_LENGTH, MAIN_MODULES = 130, 5, 300, 120, 6
"""`main` on about two screens (130 lines) nested at most 5 deep, reaching into at most 6 modules of cleanrlhf_utils;
the first network within 300 lines; no line over 120 characters (CleanRL's SAC: a 171-line loop nested 6 deep)"""


def nesting_depth(node: ast.AST) -> int:
    """The deepest nesting of compound statements (if, for, while, with, try; an elif is an if inside the else) below
    `node`."""
    children = [child for child in ast.iter_child_nodes(node) if not isinstance(child, ast.FunctionDef | ast.ClassDef | ast.Lambda)]
    deepest = max((nesting_depth(child) for child in children), default=0)
    return deepest + 1 if isinstance(node, COMPOUND) else deepest


def script_shape(path: Path) -> dict:
    """The lines of main, main's nesting depth, and the line of the first network (an nn.Module)."""
    tree = ast.parse(path.read_text())
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    networks = [node.lineno for node in tree.body if isinstance(node, ast.ClassDef) and "nn.Module" in map(ast.unparse, node.bases)]
    return {"main_lines": main.end_lineno - main.lineno + 1, "main_depth": nesting_depth(main), "first_network": min(networks, default=0)}


def used_before_defined(source: str) -> list[str]:
    """`name (line n) used on line m` for every module-level function, class or constant of `source` used inside a
    top-level definition or statement that comes before the line that defines it: a reader meets helpers before their
    use. A definition's own name (recursion) does not count."""
    tree = ast.parse(source)
    defined = {}
    for node in tree.body:
        names = [node.name] if isinstance(node, ast.FunctionDef | ast.ClassDef) else []
        names += [target.id for target in getattr(node, "targets", []) if isinstance(target, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
        for name in names:
            defined.setdefault(name, node.lineno)
    found = []
    for node in tree.body:
        own = getattr(node, "name", None)
        for inner in ast.walk(node):
            used = isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Load) and inner.id in defined
            if used and inner.id != own and defined[inner.id] > node.lineno:
                found.append(f"{inner.id} (line {defined[inner.id]}) used on line {inner.lineno}")
    return sorted(set(found))


def utility_modules(path: Path, function: str = "main") -> set[str]:
    """The cleanrlhf_utils modules whose names `function` of the script uses: the files its reader jumps to."""
    tree = ast.parse(path.read_text())
    origin = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cleanrlhf_utils"):
            for alias in node.names:
                origin[alias.asname or alias.name] = node.module.split(".")[-1] if "." in node.module else alias.name
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function)
    return {origin[node.id] for node in ast.walk(main) if isinstance(node, ast.Name) and node.id in origin}


def test_the_rules_see_a_planted_nesting_a_use_before_definition_and_a_jump(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import torch.nn as nn\nfrom cleanrlhf_utils.run import Run\nfrom cleanrlhf_utils import envs\n\n\n"
        "def main():\n    with a:\n        while b:\n            if c:\n                helper(Run, envs)\n"
        "            elif d:\n                pass\n\n\nclass Net(nn.Module):\n    pass\n\n\n"
        "def helper(x, y):\n    return helper(x, y)\n"
    )
    assert script_shape(planted) == {"main_lines": 7, "main_depth": 4, "first_network": 15}
    assert used_before_defined(planted.read_text()) == ["helper (line 19) used on line 10"]
    assert utility_modules(planted) == {"run", "envs"}


@pytest.mark.parametrize("script", ALGORITHM_SCRIPTS)
def test_each_algorithm_script_keeps_the_reading_rules(script):
    """No line over 120 characters, no `fmt: skip` (a block the formatter may not touch), every helper defined before
    its first use, and `main` on about two screens, nested at most 5 deep, the first network within 300 lines."""
    path = REPO / "framework" / f"{script}.py"
    text = path.read_text()
    long = [f"line {number}: {len(line)}" for number, line in enumerate(text.splitlines(), 1) if len(line) > LINE_LENGTH]
    assert not long, f"{script}.py has lines over {LINE_LENGTH} characters: {long}"
    assert "fmt: skip" not in text and "fmt: off" not in text
    assert used_before_defined(text) == [], f"{script}.py uses helpers before it defines them"
    shape = script_shape(path)
    assert shape["main_lines"] <= MAIN_LINES and shape["main_depth"] <= MAIN_DEPTH, shape
    assert shape["first_network"] <= FIRST_NETWORK, shape


@pytest.mark.parametrize("script", ["sac_rlhf", "pref_ppo"])
def test_a_reader_of_main_jumps_into_few_utility_modules(script):
    modules = utility_modules(REPO / "framework" / f"{script}.py")
    assert len(modules) <= MAIN_MODULES, sorted(modules)
