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
        source = inspect.getsource(script)
        assert "HumanTeacher" not in source and "teacher_feedback_mode" not in source.split("class FeedbackArgs")[0], script.__name__
    assert "teacher_feedback_mode" in inspect.getsource(feedback.make_teacher)


# ----------------------------------------------------------------------------------------
# An algorithm script is read in one sitting
# ----------------------------------------------------------------------------------------
COMPOUND = (ast.If, ast.For, ast.While, ast.With, ast.Try)
SCRIPT_LINES = {"sac_rlhf": 1000, "pref_ppo": 1100}


def nesting_depth(node: ast.AST) -> int:
    """The deepest nesting of compound statements (if, for, while, with, try; an elif is an if inside the else) below
    `node`."""
    children = [child for child in ast.iter_child_nodes(node) if not isinstance(child, ast.FunctionDef | ast.ClassDef | ast.Lambda)]
    deepest = max((nesting_depth(child) for child in children), default=0)
    return deepest + 1 if isinstance(node, COMPOUND) else deepest


def script_shape(path: Path) -> dict:
    """Lines of the file and of its main, main's nesting depth, and the line of the first network (an nn.Module)."""
    tree = ast.parse(path.read_text())
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    networks = [node.lineno for node in tree.body if isinstance(node, ast.ClassDef) and "nn.Module" in map(ast.unparse, node.bases)]
    return {
        "lines": len(path.read_text().splitlines()),
        "main_lines": main.end_lineno - main.lineno + 1,
        "main_depth": nesting_depth(main),
        "first_network": min(networks),
    }


def test_the_shape_measure_sees_a_planted_nesting_and_an_elif(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import torch.nn as nn\n\n\nclass Net(nn.Module):\n    pass\n\n\n"
        "def main():\n    with a:\n        while b:\n            if c:\n                pass\n            elif d:\n                pass\n"
    )
    assert script_shape(planted) == {"lines": 14, "main_lines": 7, "main_depth": 4, "first_network": 4}


@pytest.mark.parametrize("script", sorted(SCRIPT_LINES))
def test_each_algorithm_script_reads_in_one_sitting(script):
    """The script at most SCRIPT_LINES long, its main at most 150 lines nested at most 5 deep, its first network
    within the first 300 lines (CleanRL's SAC: 324 lines, a 171-line loop nested 6 deep)."""
    shape = script_shape(REPO / "framework" / f"{script}.py")
    assert shape["lines"] <= SCRIPT_LINES[script], shape
    assert shape["main_lines"] <= 150 and shape["main_depth"] <= 5, shape
    assert shape["first_network"] <= 300, shape
