"""``noloco report RUN_DIR... [--out DIR]``: compare finished runs.

Writes ``report.md`` — one row per run: method, replicas, stages, H, the inner optimizer,
what is exchanged (fp32, a quantised format, a sparse top-k message), final validation loss ±
its spread over replicas (standard deviation of the replicas' own losses), MB sent per
replica, seconds blocked in communication, wall seconds, compute utilisation — and PNG plots
(with matplotlib): validation loss against tokens per replica, against bytes sent per
replica and against wall seconds, and weight spread against steps.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from noloco.config import ConfigError

COLUMNS = ("run", "method", "replicas", "stages", "H", "inner", "exchange", "precision",
           "final val loss",
           "± over replicas", "MB sent / replica", "MB activations", "blocked s", "wall s",
           "utilisation")


def load(run_dir: str | Path) -> dict[str, Any]:
    p = Path(run_dir)
    try:
        summary = json.loads((p / "summary.json").read_text())
        metrics = [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()
                   if x.strip()]
    except FileNotFoundError as e:
        raise ConfigError(f"{p} is not a run directory ({Path(e.filename).name} is "
                          f"missing)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: cannot read its summary or metrics ({e})") from None
    if summary.get("status") != "completed":
        raise ConfigError(f"{p} did not complete (status {summary.get('status')!r})")
    return {"name": p.name or str(p), "path": str(p), "summary": summary, "metrics": metrics}


def row(run: dict[str, Any]) -> list[str]:
    s = run["summary"]
    per = [x for x in s.get("final_val_loss_per_replica") or [] if x is not None]
    spread = statistics.stdev(per) if len(per) > 1 else 0.0
    # fp32 (and no accumulation) for runs from before the switches existed
    precision = s.get("precision", "fp32") + (
        f" × {s['grad_accum']} microbatches" if (s.get("grad_accum") or 1) > 1 else "")
    return [run["name"], s["method"], str(s["replicas"]), str(s.get("stages", 1)),
            str(s.get("sync_every") or "—"), s.get("inner_optimizer", "adamw"), exchange(s),
            precision, f"{s['final_val_loss']:.4f}",
            f"{spread:.4f}", f"{s['bytes_sent_per_replica'] / 1e6:,.1f}",
            f"{(s.get('activation_bytes') or 0) / 1e6:,.1f}", f"{s['sync_seconds']:.2f}",
            f"{s['wall_seconds']:.1f}", f"{s['compute_utilisation']:.3f}"]


def exchange(s: dict[str, Any]) -> str:
    """What replicas send each other: fp32, a quantised format, or a sparse message with
    its error feedback's decay (— for one replica alone)."""
    if s["method"] == "single" or s.get("replicas", 1) <= 1:
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
            pts = [(m[x_key], m[y_key]) for m in r["metrics"]
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
    p = sub.add_parser("report", help="compare finished runs: a markdown table and plots",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default="report", help="output directory (default: report/)")
    p.set_defaults(func=_main)


def _main(ns: Any) -> int:
    path, pngs = report(ns.runs, ns.out)
    print(path.read_text().split("\n\n")[1])
    print(f"wrote {path}" + (f" and {len(pngs)} plots" if pngs else f" ({PLOT_EXTRA})"))
    return 0
