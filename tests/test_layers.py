"""The floors of noloco's code (docs/architecture.md): every import — at the top of a module
or inside a function — points to the same floor or one below, never up. A new module must be
given its floor here, and its docstring's last line names it (:func:`floor_line`)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

FLOORS: list[set[str]] = [
    # 0 foundations: tensors, bytes, text and errors; nothing of a run
    {"errors", "exiting", "stop", "addresses", "quant", "sparse", "split", "integrity",
     "guard", "model", "hf", "data", "faults", "elastic.keys", "elastic.auth", "elastic.etcd"},
    # 1 a run's description: the config, a worker's spec, the run directory
    {"config", "spec", "rundir", "token_cache", "footprint", "optim"},
    # 2 communication and the methods; the elastic transport beneath them
    {"comm", "staging", "methods", "methods.*", "pipeline", "checkpoint", "distributed",
     "watchdog", "elastic", "elastic.deadline", "elastic.membership", "elastic.communicator",
     "elastic.host"},
    # 3 one worker's training, and the models of runs
    {"train", "metrics", "netsim", "netsim.blocking", "netsim.churn", "netsim.latency",
     "netsim.predict", "netsim.utilisation", "simulate", "simulate.fabric",
     "simulate.replicas", "simulate.run", "simulate.link", "simulate.churn"},
    # 4 what an elastic run adds to the trainer (a component it is handed)
    {"elastic.files", "elastic.join", "elastic.worker", "library"},
    # 5 a worker process from start to exit code
    {"worker", "warm", "integrations", "integrations.lightning", "integrations.hf"},
    # 6 launching and watching runs; what reads a run directory
    {"launch", "elastic.launcher", "elastic.status", "elastic.coordinator", "report",
     "generate", "export"},
    # 7 the command line
    {"cli", "__main__", "netsim.cli"},
]

# what each floor is, as the last line of every module's docstring says it (floor_line)
NAMES = ["foundations", "a run's description", "communication and the methods",
         "one worker's training, and the models of runs",
         "what an elastic run adds to the trainer", "a worker process",
         "launching and watching runs, and what reads a run directory", "the command line"]


def floor_of(module: str) -> int:
    for i, names in enumerate(FLOORS):
        if module in names or any(n.endswith(".*") and module.startswith(n[:-1])
                                  for n in names):
            return i
    raise AssertionError(f"noloco.{module} has no floor: give it one in tests/test_layers.py "
                         f"and docs/architecture.md")


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "noloco").rglob("*.py")):
        parts = path.relative_to(SRC / "noloco").with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The noloco modules ``path`` imports (``from noloco.x import y``: ``x.y`` where that is
    a module, else ``x``; a package imported only to reach its submodules does not count)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "noloco":
            base = node.module.removeprefix("noloco").lstrip(".")
            subs = {f"{base}.{a.name}".lstrip(".") for a in node.names}
            named = subs & known
            out |= named
            if len(named) < len(subs) and base:
                out.add(base)
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("noloco.") for a in node.names
                    if a.name.startswith("noloco.")}
    return out & known


def test_every_import_points_down_or_across():
    mods = modules()
    up = []
    for name, path in mods.items():
        mine = floor_of(name)
        for dep in sorted(imports(path, set(mods)) - {name}):
            if floor_of(dep) > mine:
                up.append(f"noloco.{name} (floor {mine}) imports noloco.{dep} "
                          f"(floor {floor_of(dep)})")
    assert not up, "\n".join(up)


def test_the_check_finds_an_import_up(tmp_path):
    """A module on the lowest floor importing the trainer is caught."""
    pkg = tmp_path / "noloco"
    pkg.mkdir()
    (pkg / "errors.py").write_text("def f():\n    from noloco.train import Trainer\n")
    (pkg / "train.py").write_text("")
    got = imports(pkg / "errors.py", {"errors", "train"})
    assert got == {"train"} and floor_of("train") > floor_of("errors")


def test_the_floors_name_only_modules_that_exist():
    mods = set(modules())
    named = {n for names in FLOORS for n in names if not n.endswith(".*")}
    assert named <= mods, sorted(named - mods)


def floor_line(floor: int) -> str:
    """The last line of the docstring of every module on ``floor``."""
    return f"Floor {floor} of docs/architecture.md: {NAMES[floor]}."


def docstring_problem(module: str, path: Path) -> str | None:
    """What is wrong with the floor line of ``module``'s docstring, or None."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    want = floor_line(floor_of(module))
    if doc is None:
        return f"noloco.{module} has no docstring; its last line should be {want!r}"
    last = doc.splitlines()[-1]
    if last != want:
        return f"noloco.{module}'s docstring ends {last!r}, not {want!r}"
    return None


def test_every_docstring_names_its_floor():
    """The floor a module's docstring names is the one FLOORS gives it."""
    assert len(NAMES) == len(FLOORS)
    wrong = [p for name, path in modules().items() if (p := docstring_problem(name, path))]
    assert not wrong, "\n".join(wrong)


def test_the_check_finds_a_wrong_floor_line(tmp_path):
    """A docstring naming another floor, one without the line and a module without a
    docstring are each caught."""
    (tmp_path / "a.py").write_text(f'"""The loop.\n\n{floor_line(0)}\n"""\n')
    (tmp_path / "b.py").write_text('"""The loop."""\n')
    (tmp_path / "c.py").write_text("x = 1\n")
    (tmp_path / "d.py").write_text(f'"""The loop.\n\n{floor_line(3)}"""\n')
    assert all(docstring_problem("train", tmp_path / f) for f in ("a.py", "b.py", "c.py"))
    assert docstring_problem("train", tmp_path / "d.py") is None
