"""Every third-party module that ``src/noloco`` imports is a declared dependency, or belongs to
an extra and is imported only inside ``try: … except ImportError`` whose handler names that
extra (``noloco[EXTRA]``): a bare ``pip install torch==2.13.0 -e .`` then either works or
says in one line what to install. ``.ci/bare_install.sh`` proves the same by running the
commands in a fresh virtual environment."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "noloco"

# import name → distribution, where they differ (or where a submodule of a dependency needs
# an extra of its own: torch's TensorBoard writer imports the tensorboard package).
DISTRIBUTION = {"torch.utils.tensorboard": "tensorboard"}


def _dist_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].strip().lower()


def declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {_dist_name(r) for r in project["dependencies"]}
    extras = {name: {_dist_name(r) for r in reqs}
              for name, reqs in project["optional-dependencies"].items()}
    return deps, extras


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = []
    t = handler.type
    for node in (t.elts if isinstance(t, ast.Tuple) else [t]):
        if isinstance(node, ast.Name):
            names.append(node.id)
    return bool({"ImportError", "ModuleNotFoundError"} & set(names))


def third_party_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, distribution, the text of the ImportError handlers around it or None)."""
    tree = ast.parse(path.read_text(), str(path))
    source = path.read_text()
    found: list[tuple[int, str, str | None]] = []
    # module-level string constants, so that a handler may raise a message kept in one
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}

    def handler_text(h: ast.ExceptHandler) -> str:
        names = [n.id for n in ast.walk(h) if isinstance(n, ast.Name) and n.id in constants]
        return "\n".join([ast.get_source_segment(source, h) or ""]
                         + [constants[n] for n in names])

    def visit(node: ast.AST, guard: str | None) -> None:
        if isinstance(node, ast.Try):
            handlers = [h for h in node.handlers if _catches_import_error(h)]
            text = "\n".join(handler_text(h) for h in handlers)
            for child in node.body:
                visit(child, text if handlers else guard)
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child, guard)
            return
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        for mod in modules:
            top = mod.split(".")[0]
            if top == "noloco" or top in sys.stdlib_module_names:
                continue
            dist = next((d for prefix, d in DISTRIBUTION.items()
                         if mod == prefix or mod.startswith(prefix + ".")), top)
            found.append((node.lineno, dist.lower(), guard))
        for child in ast.iter_child_nodes(node):
            visit(child, guard)

    visit(tree, None)
    return found


def problems() -> list[str]:
    deps, extras = declared()
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(ROOT)
        for line, dist, guard in third_party_imports(path):
            if dist in deps:
                continue
            owners = sorted(e for e, reqs in extras.items() if dist in reqs)
            if not owners:
                out.append(f"{rel}:{line}: {dist} is neither a dependency nor in an extra")
            elif guard is None:
                out.append(f"{rel}:{line}: {dist} (extra {'/'.join(owners)}) is imported "
                           "outside try/except ImportError")
            elif not any(f"noloco[{e}]" in guard for e in owners):
                out.append(f"{rel}:{line}: the ImportError handler around {dist} does not "
                           f"name its extra (noloco[{owners[0]}])")
    return out


def test_every_import_is_declared_or_guarded():
    assert problems() == []


def test_the_check_catches_an_undeclared_and_an_unguarded_import(tmp_path, monkeypatch):
    # the checker itself: break it on purpose in a copy of the tree
    fake = tmp_path / "src" / "noloco"
    fake.mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (fake / "a.py").write_text("import json\nimport torch\nimport leftpad\n")
    (fake / "b.py").write_text("def f():\n    import transformers\n")
    (fake / "c.py").write_text("try:\n    import wandb\nexcept ImportError:\n"
                               "    raise SystemExit('pip install noloco[hf]')\n")
    (fake / "d.py").write_text("try:\n    import matplotlib\nexcept ImportError:\n"
                               "    raise SystemExit(\"pip install 'noloco[plot]'\")\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    found = problems()
    assert len(found) == 3, found
    assert "leftpad is neither" in found[0]
    assert "transformers (extra hf) is imported outside" in found[1]
    assert "does not name its extra (noloco[wandb])" in found[2]


# The newest torch APIs the code uses and the release each first appeared in (read from the
# release wheels' sources: torch/distributed/distributed_c10d.py, torch/nn/utils/__init__.py;
# everything else the code calls is in 2.3 already). The declared lower bound must admit none
# older.
NEWEST_TORCH_APIS = {
    "torch.distributed.P2POp(group_peer=)": (2, 6),
    "torch.nn.utils.get_total_norm": (2, 6),
    "torch.nn.utils.clip_grads_with_norm_": (2, 6),
}


def _torch_floor() -> tuple[int, int]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    spec = next(r for r in project["dependencies"] if _dist_name(r) == "torch")
    m = re.search(r">=\s*(\d+)\.(\d+)", spec)
    assert m, f"torch has no lower bound: {spec}"
    return int(m.group(1)), int(m.group(2))


def test_the_torch_lower_bound_has_every_api_the_code_uses():
    import inspect

    import torch
    import torch.distributed as dist

    assert "group_peer" in inspect.signature(dist.P2POp.__init__).parameters
    assert callable(torch.nn.utils.get_total_norm)
    assert callable(torch.nn.utils.clip_grads_with_norm_)
    assert _torch_floor() >= max(NEWEST_TORCH_APIS.values())
    # and the code does use them (else the table is stale and the floor may be too high)
    code = "\n".join(p.read_text() for p in SRC.rglob("*.py"))
    for api in NEWEST_TORCH_APIS:
        name = api.split("(")[0].rsplit(".", 1)[1]
        needle = "group_peer=" if "group_peer" in api else name
        assert needle in code, api


# Modules below the elastic machinery (issue 33: layers point one way). Each may import only
# modules of this floor or of the standard library and third parties, never noloco.elastic.
BELOW_ELASTIC = ("addresses", "errors", "config", "model", "data", "quant", "sparse", "optim",
                 "checkpoint", "rundir", "split", "faults", "guard")


def _noloco_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "noloco" or m.startswith("noloco.")}


def test_the_floors_below_the_elastic_machinery_never_import_it():
    up = {f"{name}.py": sorted(m for m in _noloco_imports(SRC / f"{name}.py")
                               if m.startswith("noloco.elastic"))
          for name in BELOW_ELASTIC}
    assert {f: ms for f, ms in up.items() if ms} == {}
