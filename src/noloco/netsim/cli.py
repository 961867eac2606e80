"""``noloco netsim latency|blocking|churn|utilisation|predict``: the network model, on the
command line.

Every subcommand prints an aligned table, or one JSON object with ``--json``, and can draw a
figure with ``--plot FILE.png`` (matplotlib, an optional extra, is imported only then). Bad
input is one line on stderr, ``noloco: error: ...``, and exit code 2.

Standalone: ``python -m noloco.netsim.cli latency --workers 1024 --cv 0 0.5 1``.

Floor 7 of docs/architecture.md: the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from noloco.errors import plural
from noloco.netsim.blocking import BlockingResult, blocking_sweep
from noloco.netsim.latency import LatencyPoint, NetsimError, latency_sweep
from noloco.netsim.predict import METHODS, Prediction, predict_run
from noloco.netsim.utilisation import (
    PAPER_MODELS,
    PAPER_TABLE,
    TARGETS,
    ModelSpec,
    UtilisationCurve,
    grid_steps_between,
    paper_schemes,
    simulate_utilisation,
)

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error and exit code 2 (argparse itself prints the usage too),
    and no abbreviated flags (``--band`` is refused, not taken as ``--bandwidth``)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw["allow_abbrev"] = False
        super().__init__(*args, **kw)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"noloco: error: {message}\n")


# ---------------------------------------------------------------------------------------------
# Plain-text tables
# ---------------------------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns aligned on their widest cell; text left-aligned, numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [
        all(_is_number(row[i]) for row in rows) if rows else False for i in range(len(headers))
    ]

    def line(r: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric, strict=True)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def _is_number(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def _emit(ns: argparse.Namespace, payload: dict[str, Any], text: str) -> None:
    print(json.dumps(payload, indent=None) if ns.json else text)


# ---------------------------------------------------------------------------------------------
# latency
# ---------------------------------------------------------------------------------------------


def _run_latency(ns: argparse.Namespace) -> int:
    points = latency_sweep(ns.workers, ns.cv, samples=ns.samples, seed=ns.seed)
    rows = [
        (
            p.workers,
            p.cv,
            p.sigma,
            p.tree_over_pair,
            p.ring_over_pair,
            p.tree_seconds,
            p.ring_seconds,
            p.pair_seconds,
            p.pair_seconds_mc,
        )
        for p in points
    ]
    text = format_table(
        ["workers", "cv", "sigma", "tree/pair", "ring/pair", "tree", "ring", "pair", "pair (MC)"],
        rows,
    )
    text += (
        "\n\ntimes in mean message times t_c; tree = binary-tree reduce + broadcast, ring = "
        "2(n-1) steps each waiting for the slowest of n, pair = 2 E[max(t1, t2)] "
        "(closed form)"
    )
    _emit(
        ns,
        {
            "command": "latency",
            "samples": ns.samples,
            "seed": ns.seed,
            "points": [p.to_dict() for p in points],
        },
        text,
    )
    if ns.plot:
        plot_latency(points, ns.plot)
    return 0


def plot_latency(points: list[LatencyPoint], path: str) -> None:
    """Fig. 5A: tree (and ring) all-reduce time over pair-exchange time against cv."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for n in sorted({p.workers for p in points}):
        ps = [p for p in points if p.workers == n]
        axes[0].plot([p.cv for p in ps], [p.tree_over_pair for p in ps], "o-", label=f"n={n}")
        axes[1].plot([p.cv for p in ps], [p.ring_over_pair for p in ps], "o-", label=f"n={n}")
    for ax, name in zip(axes, ("tree", "ring"), strict=True):
        ax.set_xlabel("std / mean of message time")
        ax.set_ylabel(f"{name} all-reduce / pair exchange")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("All-reduce versus NoLoCo pair exchange (log-normal message times)")
    _save(plt, fig, path)


# ---------------------------------------------------------------------------------------------
# blocking
# ---------------------------------------------------------------------------------------------


def _run_blocking(ns: argparse.Namespace) -> int:
    results = blocking_sweep(
        ns.workers,
        ns.sync_every,
        ns.outer_steps,
        mu=ns.mu,
        sigma2=ns.sigma2,
        group_size=ns.group_size,
        seed=ns.seed,
    )
    rows = [
        (
            r.workers,
            r.sync_every,
            r.outer_steps,
            r.diloco_seconds,
            r.noloco_seconds,
            r.ratio,
            r.compute_seconds,
        )
        for r in results
    ]
    text = format_table(
        ["workers", "H", "outer steps", "T_DiLoCo", "T_NoLoCo", "DiLoCo/NoLoCo", "compute"], rows
    )
    text += (
        f"\n\ninner-step times LogNormal(mu={ns.mu}, sigma^2={ns.sigma2}); DiLoCo waits at a "
        f"global barrier, NoLoCo for its group of {ns.group_size}; no transfer time"
    )
    _emit(ns, {"command": "blocking", "results": [r.to_dict() for r in results]}, text)
    if ns.plot:
        plot_blocking(results, ns.plot)
    return 0


def plot_blocking(results: list[BlockingResult], path: str) -> None:
    """Fig. 5B: T_DiLoCo / T_NoLoCo against H, one line per worker count."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in sorted({r.workers for r in results}):
        rs = sorted((r for r in results if r.workers == n), key=lambda r: r.sync_every)
        ax.plot([r.sync_every for r in rs], [r.ratio for r in rs], "o-", label=f"n={n}")
    ax.set_xscale("log")
    ax.set_xlabel("inner steps per outer step H")
    ax.set_ylabel("T_DiLoCo / T_NoLoCo")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Straggler waiting: global barrier versus pairwise")
    _save(plt, fig, path)


# ---------------------------------------------------------------------------------------------
# churn
# ---------------------------------------------------------------------------------------------


def _run_churn(ns: argparse.Namespace) -> int:
    from noloco.netsim.churn import simulate_churn

    results = [simulate_churn(ns.workers, ns.sync_every, ns.outer_steps, mtbf=m,
                              timeout=ns.timeout, rejoin_delay=ns.rejoin_delay, mu=ns.mu,
                              sigma2=ns.sigma2, group_size=ns.group_size, seed=ns.seed)
               for m in ns.mtbf]
    rows = [(f"{r.mtbf:g}", r.failures, r.noloco_steps_per_second, r.diloco_steps_per_second,
             r.noloco_utilisation, r.diloco_utilisation,
             r.noloco_steps_per_second / r.diloco_steps_per_second) for r in results]
    text = format_table(["MTBF", "failures", "NoLoCo steps/s", "DiLoCo steps/s",
                         "NoLoCo util", "DiLoCo util", "NoLoCo/DiLoCo"], rows)
    text += (f"\n\n{plural(ns.workers, 'replica')}, H = {ns.sync_every}, "
             f"{ns.outer_steps} outer steps; "
             f"inner steps LogNormal(mu={ns.mu}, sigma^2={ns.sigma2}); peer timeout "
             f"{ns.timeout:g}, back {ns.rejoin_delay:g} after a failure (time unit: the step "
             f"times'); steps/s: inner steps kept, all replicas, per unit of time")
    _emit(ns, {"command": "churn", "results": [r.to_dict() for r in results]}, text)
    if ns.plot:
        plot_churn(results, ns.plot)
    return 0


def plot_churn(results: list[Any], path: str) -> None:
    """Compute utilisation of NoLoCo's groups and DiLoCo's quorum against failure rate."""
    plt = _pyplot()
    rs = sorted(results, key=lambda r: 1 / r.mtbf)
    rate = [r.workers / r.mtbf for r in rs]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rate, [r.noloco_utilisation for r in rs], "o-", label="NoLoCo (groups)")
    ax.plot(rate, [r.diloco_utilisation for r in rs], "s-", label="DiLoCo (quorum)")
    if rate and rate[0] == 0 and len(rate) > 1:
        ax.set_xscale("symlog", linthresh=min(x for x in rate if x > 0))
    else:
        ax.set_xscale("log")
    ax.set_xlabel("failures per unit of time (all replicas)")
    ax.set_ylabel("compute utilisation")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    r0 = rs[0]
    ax.set_title(f"Churn: {plural(r0.workers, 'replica')}, H={r0.sync_every}, "
                 f"timeout {r0.timeout:g}")
    _save(plt, fig, path)


# ---------------------------------------------------------------------------------------------
# utilisation
# ---------------------------------------------------------------------------------------------


def _models_from_args(ns: argparse.Namespace) -> list[ModelSpec]:
    custom = (ns.params, ns.layers, ns.step_time)
    if any(v is not None for v in custom):
        if any(v is None for v in custom):
            raise NetsimError("a custom model needs all of --params, --layers and --step-time")
        return [
            ModelSpec(name="custom", params=ns.params, layers=ns.layers, step_seconds=ns.step_time)
        ]
    unknown = [m for m in ns.model if m not in PAPER_MODELS]
    if unknown:
        raise NetsimError(
            f"unknown model {unknown[0]!r} (choose from "
            f"{', '.join(PAPER_MODELS)}, or give --params --layers --step-time)"
        )
    return [PAPER_MODELS[m] for m in ns.model]


def _run_utilisation(ns: argparse.Namespace) -> int:
    models = _models_from_args(ns)
    schemes = paper_schemes(ns.sync_every, ns.fragment_layers, ns.overlap_steps)
    targets = tuple(ns.targets)
    curves = [
        simulate_utilisation(
            m, s, datacenters=ns.datacenters, payload_scale=ns.payload_scale, targets=targets
        )
        for m in models
        for s in schemes
    ]
    rows, compared, exact, within = [], 0, 0, 0
    for c in curves:
        paper = PAPER_TABLE.get((c.model.name, c.scheme.name)) if targets == TARGETS else None
        row: list[Any] = [c.model.name, c.scheme.name]
        for i, ours in enumerate(c.required_gbps()):
            ref = paper[i] if paper else None
            if ours is not None and ref is not None:
                steps = grid_steps_between(ours, ref)
                compared += 1
                exact += steps == 0
                within += abs(steps) <= 1
                row.append(f"{_gbps(ours)} ({ref:g})")
            else:
                row.append("-" if ours is None else _gbps(ours))
        rows.append(row)
    headers = ["model", "method"] + [f"{t:.0%}" for t in targets]
    text = format_table(headers, rows)
    text += (
        "\n\nGbit/s needed for each compute utilisation, smallest value of "
        "numpy.logspace(-1, 3, 50) that reaches it; (paper's value in brackets). "
        f"H={ns.sync_every}, {ns.fragment_layers}-layer fragments, tau={ns.overlap_steps}, "
        f"M={ns.datacenters} datacenters"
    )
    if not compared:
        text = text.replace("; (paper's value in brackets)", "")
    if compared:
        text += (
            f"\n{compared} cells compared with the paper: {exact} on the same grid value, "
            f"{within} within one grid step (x1.207)"
        )
    payload = {
        "command": "utilisation",
        "targets": list(targets),
        "curves": [c.to_dict() for c in curves],
        "paper_cells_compared": compared,
        "paper_cells_exact": exact,
        "paper_cells_within_one_grid_step": within,
    }
    _emit(ns, payload, text)
    if ns.plot:
        plot_utilisation(curves, ns.plot)
    return 0


def _gbps(x: float) -> str:
    """A grid bandwidth with enough digits to tell neighbouring grid values apart."""
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def plot_utilisation(curves: list[UtilisationCurve], path: str) -> None:
    """Utilisation against bandwidth (Streaming DiLoCo Fig. 4 style), one panel per model."""
    plt = _pyplot()
    names = list(dict.fromkeys(c.model.name for c in curves))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for c in (c for c in curves if c.model.name == name):
            ax.plot(c.bandwidth_gbps, c.utilisation, label=c.scheme.name)
        ax.set_xscale("log")
        ax.set_xlabel("bandwidth between datacenters (Gbit/s)")
        ax.set_ylabel("compute utilisation")
        ax.set_ylim(0, 1.02)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(plt, fig, path)


# ---------------------------------------------------------------------------------------------
# predict
# ---------------------------------------------------------------------------------------------


def _run_predict(ns: argparse.Namespace) -> int:
    pred = _predict(ns, ns.bandwidth)
    rows = [
        (
            m.method,
            m.replicas,
            m.sync_every,
            m.fragments,
            m.overlap_steps,
            m.wire_bits,
            m.sync_events,
            m.seconds_per_sync,
            m.exposed_sync_seconds,
            m.wall_seconds,
            f"{m.compute_utilisation:.1%}",
            m.bytes_sent_per_replica / 1e6,
        )
        for m in pred.methods
    ]
    text = format_table(
        [
            "method",
            "N",
            "H",
            "P",
            "tau",
            "bits",
            "syncs",
            "s/sync",
            "exposed s",
            "wall s",
            "utilisation",
            "MB sent",
        ],
        rows,
    )
    if pred.note:
        text = f"note: {pred.note}\n\n{text}"
    meas = pred.measured
    util = meas["compute_utilisation"]
    text += (
        f"\n\nnetwork: {pred.bandwidth_bps / 1e9:g} Gbit/s, {pred.latency_s * 1e3:g} ms per "
        f"message; compute {pred.run.compute_seconds:.4g} s "
        f"({pred.run.step_seconds * 1e3:.4g} ms/step) measured in {pred.run.path}\n"
        f"measured ({meas['method']}): wall {_cell(meas['wall_seconds'])} s, training loop "
        f"{_cell(meas['train_seconds'])} s, blocked in sync {_cell(meas['sync_seconds'])} s,"
        f" utilisation {'-' if util is None else f'{util:.1%}'}, sent "
        f"{_cell(_mb(meas['bytes_sent_per_replica']))} MB per replica"
    )
    _emit(ns, {"command": "predict", **pred.to_dict()}, text)
    if ns.plot:
        plot_predict(ns, pred, ns.plot)
    return 0


def _mb(x: float | None) -> float | None:
    return None if x is None else x / 1e6


def _predict(ns: argparse.Namespace, bandwidth: Any) -> Prediction:
    return predict_run(
        ns.run_dir,
        bandwidth,
        ns.latency,
        methods=tuple(ns.methods),
        replicas=ns.replicas,
        sync_every=ns.sync_every,
        fragments=ns.fragments,
        overlap_steps=ns.overlap_steps,
        wire_bits=ns.wire_bits,
        pair_latency_terms=ns.pair_latency_terms,
    )


def plot_predict(ns: argparse.Namespace, pred: Prediction, path: str) -> None:
    """Predicted utilisation of each method against bandwidth, the chosen one marked."""
    plt = _pyplot()
    grid = np.logspace(6, 12, 61)  # 1 Mbit/s .. 1 Tbit/s
    sweep = [_predict(ns, float(b)) for b in grid]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, m in enumerate(pred.methods):
        line = ax.plot(
            grid / 1e9, [p.methods[i].compute_utilisation for p in sweep], label=m.method
        )
        ax.plot([pred.bandwidth_bps / 1e9], [m.compute_utilisation], "o", color=line[0].get_color())
    ax.set_xscale("log")
    ax.set_xlabel("bandwidth (Gbit/s)")
    ax.set_ylabel("predicted compute utilisation")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"latency {pred.latency_s * 1e3:g} ms, N={pred.methods[0].replicas}")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(plt, fig, path)


# ---------------------------------------------------------------------------------------------
# plotting helpers (matplotlib is optional and imported only here)
# ---------------------------------------------------------------------------------------------


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise NetsimError("--plot needs matplotlib (pip install 'noloco[plot]')") from None
    return plt


def _save(plt: Any, fig: Any, path: str) -> None:
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise NetsimError(f"cannot write {path}: {e}") from None
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------------


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn a NetsimError into the one-line error and exit code 2."""

    def run(ns: argparse.Namespace) -> int:
        try:
            if getattr(ns, "plot", None):
                # no matplotlib, nowhere to write: say so before computing or printing anything
                folder = Path(ns.plot).parent
                if not folder.is_dir():
                    raise NetsimError(f"cannot write {ns.plot}: {folder} is not a directory")
                _pyplot()
            return fn(ns)
        except NetsimError as e:
            print(f"noloco: error: {e}", file=sys.stderr)
            return EXIT_USAGE

    return run


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also draw a figure (needs matplotlib)")


def _add_latency(sub: Any) -> None:
    """``noloco netsim latency``."""
    p = sub.add_parser(
        "latency",
        help="tree/ring all-reduce versus pair exchange (Fig. 5A)",
        description="Expected all-reduce time over a NoLoCo pair exchange with "
        "log-normal message times (NoLoCo Fig. 5A).",
    )
    p.add_argument(
        "--workers",
        "-n",
        type=int,
        nargs="+",
        default=[4, 16, 64, 256, 1024],
        help="number of workers n (one or more; default 4 16 64 256 1024)",
    )
    p.add_argument(
        "--cv",
        type=float,
        nargs="+",
        default=[0.0, 0.5, 1.0, 1.5, 2.0, 2.5],
        help="std/mean of the message time (one or more; default 0 .. 2.5)",
    )
    p.add_argument("--samples", type=int, default=2000, help="Monte Carlo samples (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    _common(p)
    p.set_defaults(func=_guarded(_run_latency))


def _add_blocking(sub: Any) -> None:
    """``noloco netsim blocking``."""
    p = sub.add_parser(
        "blocking",
        help="DiLoCo barrier versus NoLoCo pairwise waits (Fig. 5B)",
        description="Total time of DiLoCo (global barrier per outer step) and "
        "NoLoCo (pairwise waits) with log-normal inner-step times (Fig. 5B).",
    )
    p.add_argument(
        "--workers",
        "-n",
        type=int,
        nargs="+",
        default=[1024],
        help="number of workers (default 1024)",
    )
    p.add_argument(
        "--sync-every",
        "-H",
        type=int,
        nargs="+",
        default=[1, 5, 10, 20, 50, 100],
        help="inner steps per outer step H (default 1 5 10 20 50 100)",
    )
    p.add_argument("--outer-steps", type=int, default=250, help="outer steps (default 250)")
    p.add_argument("--mu", type=float, default=1.0, help="log-normal mu of a step (default 1)")
    p.add_argument(
        "--sigma2", type=float, default=0.5, help="log-normal sigma^2 of a step (default 0.5)"
    )
    p.add_argument("--group-size", type=int, default=2, help="NoLoCo group size (default 2)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    _common(p)
    p.set_defaults(func=_guarded(_run_blocking))


def _add_churn(sub: Any) -> None:
    """``noloco netsim churn``."""
    p = sub.add_parser(
        "churn",
        help="NoLoCo's groups versus DiLoCo's quorum when replicas fail and rejoin",
        description="Tokens per second and compute utilisation of elastic NoLoCo and elastic "
        "DiLoCo with log-normal inner-step times, failures as a Poisson process per replica, "
        "a peer timeout and a rejoin delay (docs/elastic.md).",
    )
    p.add_argument("--workers", "-n", type=int, default=1024, help="replicas (default 1024)")
    p.add_argument("--sync-every", "-H", type=int, default=100, help="H (default 100)")
    p.add_argument("--outer-steps", type=int, default=100, help="outer steps (default 100)")
    p.add_argument("--mtbf", type=float, nargs="+",
                   default=[float("inf"), 1e7, 3e6, 1e6, 3e5, 1e5, 3e4, 1e4],
                   help="mean time between failures of one replica, in step-time units "
                   "(one or more; inf: none; default inf 1e7 .. 1e4)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="peer timeout (default 600)")
    p.add_argument("--rejoin-delay", type=float, default=1800.0,
                   help="time from a failure until the replica is back (default 1800)")
    p.add_argument("--mu", type=float, default=1.0, help="log-normal mu of a step (default 1)")
    p.add_argument("--sigma2", type=float, default=0.5,
                   help="log-normal sigma^2 of a step (default 0.5)")
    p.add_argument("--group-size", type=int, default=2, help="NoLoCo group size (default 2)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    _common(p)
    p.set_defaults(func=_guarded(_run_churn))


def _add_utilisation(sub: Any) -> None:
    """``noloco netsim utilisation``."""
    p = sub.add_parser(
        "utilisation",
        aliases=["utilization"],
        help="compute utilisation versus bandwidth (Streaming DiLoCo Table 4)",
        description="Bandwidth between two datacenters needed for a compute "
        "utilisation, for data parallel, DiLoCo and Streaming DiLoCo variants "
        "(per-layer DAG simulation, Streaming DiLoCo Table 4).",
    )
    p.add_argument(
        "--model",
        nargs="+",
        default=list(PAPER_MODELS),
        help="paper models to simulate (default 1B 10B 100B)",
    )
    p.add_argument("--params", type=float, help="custom model: total parameters, e.g. 7e9")
    p.add_argument("--layers", type=int, help="custom model: transformer layers")
    p.add_argument("--step-time", type=float, help="custom model: seconds per inner step")
    p.add_argument(
        "--sync-every", "-H", type=int, default=100, help="H for DiLoCo and Streaming (default 100)"
    )
    p.add_argument(
        "--fragment-layers", type=int, default=3, help="layers per streaming fragment (default 3)"
    )
    p.add_argument(
        "--overlap-steps", type=int, default=1, help="tau of the overlap rows (default 1)"
    )
    p.add_argument(
        "--datacenters", "-M", type=int, default=2, help="number of datacenters M (default 2)"
    )
    p.add_argument(
        "--targets",
        type=float,
        nargs="+",
        default=list(TARGETS),
        help="utilisation targets (default 0.5 0.8 0.9 0.95 0.99)",
    )
    p.add_argument(
        "--payload-scale",
        type=float,
        default=1.0,
        help="analysis only: multiply every payload (see docs/netsim.md; default 1)",
    )
    _common(p)
    p.set_defaults(func=_guarded(_run_utilisation))


def _add_predict(sub: Any) -> None:
    """``noloco netsim predict``."""
    p = sub.add_parser(
        "predict",
        help="predict a run's wall-clock on another network",
        description="Predict wall-clock and compute utilisation of ddp, diloco, "
        "noloco and streaming for a finished run's model and measured step time "
        "on a network of the given bandwidth and latency.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory with summary.json")
    p.add_argument(
        "--bandwidth",
        "-b",
        required=True,
        help="per-worker bandwidth: 100Mbit, 1Gbit, 10Gbit, 125MB/s or bits/s",
    )
    p.add_argument(
        "--latency",
        "-l",
        default="0",
        help="per-message latency: 50ms, 0.05 (seconds), 200us (default 0)",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=METHODS,
        help="methods to predict (default all)",
    )
    p.add_argument("--replicas", "-N", type=int, help="predict for N replicas instead")
    p.add_argument("--sync-every", "-H", type=int, help="H instead of the run's")
    p.add_argument("--fragments", "-P", type=int, help="streaming fragments P instead")
    p.add_argument("--overlap-steps", type=int, help="streaming tau instead of the run's")
    p.add_argument(
        "--wire-bits",
        type=float,
        help="bits per value of the outer-step methods' messages (default: as run)",
    )
    p.add_argument(
        "--pair-latency-terms",
        type=int,
        default=1,
        choices=(1, 2),
        help="latency terms of a NoLoCo exchange (1: simultaneous send, default; "
        "2: the paper's count)",
    )
    _common(p)
    p.set_defaults(func=_guarded(_run_predict))


def _fill(netsim: argparse.ArgumentParser) -> None:
    sub = netsim.add_subparsers(
        dest="netsim_command",
        required=True,
        parser_class=_Parser,
        metavar="{latency,blocking,churn,utilisation,predict}",
    )
    _add_latency(sub)
    _add_blocking(sub)
    _add_churn(sub)
    _add_utilisation(sub)
    _add_predict(sub)


def add_subparsers(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``netsim`` (with latency|blocking|utilisation|predict) on a subparsers object."""
    netsim = subparsers.add_parser(
        "netsim",
        help="network model: latency, blocking, utilisation, predict",
        description="Network model of the papers' simulations and of real runs.",
    )
    _fill(netsim)
    return netsim


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="noloco netsim",
        description="Network model of the papers' simulations and of real runs.",
    )
    _fill(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
