"""The layout of the code, read from its import statements (tasks/__init__.py states the rule).

python -m pytest tests/test_layout.py -v
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tasks"
WRAPPERS = sorted(p for p in TASKS.glob("*.py") if p.name != "__init__.py")
LIBRARY = sorted(p for p in TASKS.glob("*/**/*.py"))
LIBRARY_NAMES = sorted(
    {p.stem for p in LIBRARY if p.stem != "__init__"}
    | {p.name for p in TASKS.iterdir() if p.is_dir() and p.name != "__pycache__"}
)


def imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (`from a.b import c`: a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from tasks.rl import batch`
    return names


def importers(package: str, among: list[Path]) -> list[str]:
    return [
        str(p.relative_to(ROOT))
        for p in among
        if any(name == package or name.startswith(package + ".") for name in imports(p))
    ]


ALL = sorted(TASKS.rglob("*.py")) + sorted((ROOT / "flows").glob("*.py"))


# The layers, bottom first. A module imports from its own area or from a layer below; never from
# a layer above, nor sideways from another area of its own layer.
LAYERS = [
    ["records"],  # plain record types: problem, trajectory, sample, rollout spec, run context
    ["config"],
    ["sandbox", "store"],
    ["rollout"],
    ["data", "reward", "rl"],
    ["train", "summary", "tracking"],
    ["cluster"],
    ["runtime"],
    ["tasks"],  # the Prefect task files directly in tasks/
    ["flows"],  # the flows, the CLI and the preflight checks they call
]
LEVEL = {area: level for level, areas in enumerate(LAYERS) for area in areas}


def area(module: str) -> str | None:
    """The area a module of the project belongs to (None: not the project's)."""
    parts = module.split(".")
    if parts[0] == "flows":
        return "flows"
    if parts[0] != "tasks":
        return None
    return parts[1] if len(parts) > 1 and (TASKS / parts[1]).is_dir() else "tasks"


def test_every_area_has_a_layer():
    areas = {p.name for p in TASKS.iterdir() if p.is_dir() and p.name != "__pycache__"} | {"tasks", "flows"}
    assert areas == set(LEVEL)


def test_imports_only_flow_down_the_layers():
    against = []
    for path in ALL:
        here = area(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for name in imports(path):
            there = area(name)
            if there is not None and there != here and LEVEL[there] >= LEVEL[here]:
                against.append(f"{path.relative_to(ROOT)} ({here}) imports {name} ({there})")
    assert sorted(set(against)) == []


def test_the_library_stays_usable_without_prefect():
    assert importers("prefect", LIBRARY) == []


@pytest.mark.parametrize(
    "package, home",
    [
        ("mlflow", "tasks/tracking/"),
        ("deepspeed", "tasks/train/"),
        ("vllm", "tasks/rollout/engine.py"),
        ("ray", "tasks/cluster/"),
    ],
)
def test_a_heavy_dependency_has_one_home(package, home):
    assert [p for p in importers(package, ALL) if not p.startswith(home)] == []


def test_algorithms_never_reach_the_rollout_loop_or_the_services():
    banned = ["tasks.rollout.agent", "tasks.rollout.engine", "tasks.cluster", "tasks.sandbox", "tasks.runtime"]
    pure = [p for p in LIBRARY if p.parent.name in ("rl", "reward")]
    assert {
        str(p.relative_to(ROOT)): sorted(n for n in imports(p) for b in banned if n.startswith(b)) for p in pure
    } == {str(p.relative_to(ROOT)): [] for p in pure}


def test_the_library_never_imports_the_task_files_or_flows():
    wrappers = [f"tasks.{p.stem}" for p in WRAPPERS]
    assert [p for w in wrappers for p in importers(w, LIBRARY)] == []
    assert importers("flows", LIBRARY + WRAPPERS) == []


def test_a_file_directly_in_tasks_holds_prefect_tasks_only():
    for path in WRAPPERS:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # the docstring
                continue
            assert isinstance(node, ast.FunctionDef), f"{path.name}:{node.lineno}: only @task functions belong here"
            decorators = [ast.unparse(d) for d in node.decorator_list]
            assert any(d.startswith("task") for d in decorators), f"{path.name}: {node.name} is not a @task"


def _near(a: str, b: str) -> bool:
    """Names a reader could take for one another: one starts with the other, or they share a
    stem of five letters (curate / curation, rollouts / rollout, rl_update / rl)."""
    return a.startswith(b) or b.startswith(a) or (len(a) >= 5 and len(b) >= 5 and a[:5] == b[:5])


def test_no_task_file_is_named_like_a_library_module():
    clashes = [(w.stem, name) for w in WRAPPERS for name in LIBRARY_NAMES if _near(w.stem, name)]
    assert clashes == []


def test_pure_modules_load_no_heavy_dependency():
    code = (
        "import sys, tasks.rl.batch, tasks.rl.roc, tasks.rollout.metrics, tasks.records, "
        "tasks.store.run_folder, tasks.config.cluster; "
        "print(sorted({'torch', 'aiohttp', 'transformers', 'vllm', 'mlflow', 'prefect', 'ray'} "
        "& set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tests_call_library_functions_not_prefect_task_internals():
    offenders = [
        p.name for p in (ROOT / "tests").glob("*.py") if ".fn(" in p.read_text() and p.name != Path(__file__).name
    ]
    assert offenders == []


def test_no_module_of_the_library_runs_past_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in TASKS.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}
