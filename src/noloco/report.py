"""``noloco report RUN_DIR... [--out DIR]``: compare finished runs.

Writes ``report.md`` (in ``report/`` beside the runs, or ``-o DIR``) — one row per run:
method, replicas, stages, H, the inner optimizer, what is exchanged (fp32, a quantised format,
a sparse top-k message), how far it got (steps, tokens per replica), final validation loss ±
its spread over replicas (standard deviation of the replicas' own losses), MB sent per
replica, seconds blocked in communication, wall seconds, the share of the training loop
spent computing (``compute_utilisation``; not MFU) — and, with the ``plot`` extra
(matplotlib), PNG plots: validation loss against tokens per replica, against bytes sent per
replica and against wall seconds, and weight spread against steps.

Static and elastic runs alike; a run that did not complete (running, interrupted, failed) is
shown with its status and the numbers of its last evaluation, — where it has none.

Floor 6 of docs/architecture.md: launching and watching runs, and what reads a run directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from noloco.config import ConfigError
from noloco.rundir import upgrade_summary

COLUMNS = ("run", "method", "replicas", "stages", "H", "inner", "exchange", "precision",
           "steps", "tokens / replica", "final val loss",
           "± over replicas", "MB sent / replica", "MB activations", "blocked s", "wall s",
           "computing")


def load(run_dir: str | Path) -> dict[str, Any]:
    """A run directory's summary and metrics. A run that did not complete (still running,
    interrupted, failed) is read too: its settings come from config.json, its numbers from
    its last evaluation."""
    p = Path(run_dir)
    try:
        summary = upgrade_summary(json.loads((p / "summary.json").read_text()))
        # an elastic run writes metrics.jsonl at its end only
        lines = ((p / "metrics.jsonl").read_text().splitlines()
                 if (p / "metrics.jsonl").is_file() else [])
        metrics = [json.loads(x) for x in lines if x.strip()]
        config = (json.loads((p / "config.json").read_text())
                  if (p / "config.json").is_file() else {})
    except FileNotFoundError as e:
        raise ConfigError(f"{p} is not a run directory ({Path(e.filename).name} is "
                          f"missing)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: cannot read its summary, metrics or config ({e})") from None
    if not isinstance(summary, dict) or not isinstance(config, dict):
        raise ConfigError(f"{p}: summary.json or config.json does not hold a JSON object")
    name = p.name or str(p)
    status = summary.get("status")
    if status != "completed":
        at = summary.get("last_step")
        name += f" ({status or 'no status'}" + (f" at step {at}" if at is not None else "") + ")"
    return {"name": name, "path": str(p), "summary": {**_settings(config), **summary},
            "metrics": metrics}


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """The summary's names of what config.json set: what a run that did not complete (its
    summary.json holds its status alone) still shows."""
    sec = {k: v for k, v in config.items() if isinstance(v, dict)}
    m, o, t = sec.get("method", {}), sec.get("optim", {}), sec.get("train", {})
    out = {"method": m.get("method"), "replicas": m.get("replicas"), "stages": m.get("stages"),
           "sync_every": m.get("sync_every"), "quantize": m.get("quantize"),
           "compress": m.get("compress"), "ef_decay": m.get("ef_decay"),
           "inner_optimizer": o.get("inner_optimizer"), "grad_accum": o.get("grad_accum"),
           "precision": t.get("precision")}
    return {k: v for k, v in out.items() if v is not None}


def _mean(x: Any) -> float | None:
    """A number of a summary: static runs write one per run or a list over replicas, elastic
    runs a dict keyed by replica; None where it is missing (a run that did not complete)."""
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, list):
        x = [v for v in x if isinstance(v, int | float)]
        return sum(x) / len(x) if x else None
    return float(x) if isinstance(x, int | float) else None


def _cell(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def row(run: dict[str, Any]) -> list[str]:
    s = run["summary"]
    # a run that did not complete: the numbers of its last evaluation
    last = next((m for m in reversed(run["metrics"]) if m.get("val_loss") is not None), {})
    done = s.get("status") == "completed"
    per = s.get("final_val_loss_per_replica") if done else last.get("val_loss_per_replica")
    per = [x for x in (per.values() if isinstance(per, dict) else per or [])
           if isinstance(x, int | float)]
    spread = statistics.stdev(per) if len(per) > 1 else None
    loss = s.get("final_val_loss") if done else last.get("val_loss")
    sent = s.get("bytes_sent")  # one replica's, the mean
    if not done and last.get("bytes_sent") is not None:
        # an elastic run's metrics line sums its reporting replicas' bytes
        sent = last["bytes_sent"] / (last.get("replicas_reporting") or 1)
    blocked = s.get("sync_seconds") if done else last.get("sync_seconds")
    wall = s.get("wall_seconds") if done else last.get("wall_seconds")
    # fp32 (and no accumulation) for runs from before the switches existed
    precision = (s.get("precision") or "fp32") + (
        f" × {s['grad_accum']} microbatches" if (s.get("grad_accum") or 1) > 1 else "")
    # runs of different lengths side by side: how far each got, in steps and in tokens
    steps = s.get("steps") if done else last.get("step", s.get("last_step"))
    tokens = s.get("tokens_per_replica") if done else last.get("tokens_per_replica")
    return [run["name"], str(s.get("method") or "—"), str(s.get("replicas") or "—"),
            str(s.get("stages") or 1), str(s.get("sync_every") or "—"),
            s.get("inner_optimizer") or "adamw", exchange(s), precision,
            "—" if steps is None else str(steps), _cell(_mean(tokens), ",.0f"),
            _cell(_mean(loss), ".4f") + (f" (step {last['step']})" if not done and last
                                         else ""), _cell(spread, ".4f"),
            _cell(None if sent is None else sent / 1e6, ",.1f"),
            f"{(s.get('activation_bytes') or 0) / 1e6:,.1f}",
            _cell(_mean(blocked), ".2f"), _cell(_mean(wall), ".1f"),
            _cell(_mean(s.get("compute_utilisation")), ".3f")]


def exchange(s: dict[str, Any]) -> str:
    """What replicas send each other: fp32, a quantised format, or a sparse message with
    its error feedback's decay (— for one replica alone)."""
    if s.get("method") == "single" or (s.get("replicas") or 1) <= 1:
        return "—"
    if s.get("compress"):
        return f"{s['compress']}, EF {s.get('ef_decay', 1.0):g}"
    q = s.get("quantize") or "none"
    return "fp32" if q == "none" else q


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in runs]
    return "\n".join(lines)


class MissingExtra(Exception):
    """An optional part of the report that needs an extra; the table is written without it."""


PLOT_EXTRA = "no plots: they need the 'plot' extra: pip install 'noloco[plot]'"


def plots(runs: list[dict[str, Any]], out: Path) -> list[Path]:
    """The plots as PNG files in ``out``; :class:`MissingExtra` without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtra(PLOT_EXTRA) from None
    written = []
    axes_spec = (("tokens_per_replica", "tokens per replica", "val_loss", "val_loss_tokens"),
                 ("bytes_sent", "bytes sent per replica", "val_loss", "val_loss_bytes"),
                 ("wall_seconds", "wall seconds", "val_loss", "val_loss_wall"),
                 ("step", "inner step", "weight_spread", "weight_spread"))
    for x_key, x_label, y_key, name in axes_spec:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in runs:
            # an elastic run's metrics line sums the bytes of the replicas reporting
            pts = [(m[x_key] / (m.get("replicas_reporting") or 1) if x_key == "bytes_sent"
                    else m[x_key], m[y_key]) for m in r["metrics"]
                   if m.get(x_key) is not None and m.get(y_key) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=".", label=r["name"])
        ax.set_xlabel(x_label)
        ax.set_ylabel("validation loss" if y_key == "val_loss" else "weight spread")
        if x_key == "bytes_sent":
            ax.set_xscale("symlog")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def report(run_dirs: list[str], out: str | Path) -> tuple[Path, list[Path]]:
    runs = [load(d) for d in run_dirs]
    names = [r["name"] for r in runs]
    for i, r in enumerate(runs):  # same last path component: tell them apart
        if names.count(r["name"]) > 1:
            r["name"] = f"{r['name']} ({i + 1})"
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    try:
        pngs = plots(runs, o)
    except MissingExtra:
        pngs = []
    md = ["# Runs compared", "", table(runs), ""]
    md += [f"![{p.stem}]({p.name})" for p in pngs] or [
        f"({PLOT_EXTRA})"]
    md += ["", "Runs: " + ", ".join(f"`{r['path']}`" for r in runs), ""]
    path = o / "report.md"
    path.write_text("\n".join(md))
    return path, pngs


def add_subparser(sub: Any) -> None:
    p = sub.add_parser("report", help="compare runs: a markdown table, and plots with the "
                       "'plot' extra", description=__doc__.split("\n\n")[1])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("-o", "--out", default=None,
                   help="output directory (default: report/ beside the runs, in the directory "
                        "that holds them all)")
    p.set_defaults(func=_main)


def default_out(run_dirs: list[str]) -> Path:
    """``report/`` in the directory that holds every run (runs/a runs/b → runs/report)."""
    import os

    parents = [str(Path(d).resolve().parent) for d in run_dirs]
    return Path(os.path.commonpath(parents)) / "report"


def _main(ns: argparse.Namespace) -> int:
    path, pngs = report(ns.runs, ns.out if ns.out is not None else default_out(ns.runs))
    print(path.read_text().split("\n\n")[1])
    print(f"wrote {path}" + (f" and {len(pngs)} plots" if pngs else f" ({PLOT_EXTRA})"))
    return 0
