"""Figures of the code's shape, for issue notes: lines, the largest functions, the places that
decide "elastic", the NOLOCO_* variables read below the entry points, ``: Any`` annotations and
imports that point up the layers (docs/architecture.md). Prints JSON.

    python tools/code_figures.py
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"noloco/cli.py", "noloco/__main__.py"}
"""where the command line is parsed: environment variables may be read here"""


def py_files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "egg-info" not in str(p))


def lines(folder: str) -> int:
    return sum(len(p.read_text().splitlines()) for p in py_files(folder))


def functions(folder: str, most: int = 10) -> list[str]:
    found = []
    for p in py_files(folder):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                found.append((n, f"{p.relative_to(ROOT / folder)}:{node.name} ({n})"))
    return [name for _, name in sorted(found, reverse=True)[:most]]


def grep(folder: str, pattern: str, skip: set[str] = frozenset()) -> dict[str, int]:
    rx = re.compile(pattern)
    out = {}
    for p in py_files(folder):
        rel = str(p.relative_to(ROOT / folder))
        if rel in skip:
            continue
        n = sum(len(rx.findall(line)) for line in p.read_text().splitlines())
        if n:
            out[rel] = n
    return out


def main() -> int:
    elastic = grep("src", r"method\.elastic\b|\bm\.elastic\b|NOLOCO_ELASTIC",
                   {"noloco/config.py"})
    env = grep("src", r"environ(?:\.get)?\s*[\[(]\s*\"NOLOCO_|getenv\(\s*\"NOLOCO_|"
                      r"\"NOLOCO_\w+\"\s+(?:not )?in os\.environ", ENTRY_POINTS)
    figures = {
        "lines": {"src": lines("src"), "benchmarks": lines("benchmarks")},
        "largest_functions": functions("src"),
        "decide_elastic": {"places": sum(elastic.values()), "files": elastic},
        "noloco_env_reads_below_entry": {"places": sum(env.values()), "files": env},
        "any_annotations": sum(grep("src", r":\s*Any\b|->\s*Any\b").values()),
    }
    json.dump(figures, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
