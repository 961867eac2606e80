"""DDP against DiLoCo against NoLoCo: validation loss, communication and utilisation.

Each method trains the same model (``--preset``, seed 0) on the same text with N replicas and
the same number of inner steps, batch size and sequence length, so every replica sees the
same number of tokens; DiLoCo and NoLoCo synchronise every H inner steps (one H for both).
Every run goes through the real command line (``python -m noloco train ...``) into its own run
directory, and this script reads back summary.json and metrics.jsonl:

- final validation loss (mean over replicas) and the curve of validation loss against tokens;
- bytes sent per replica, seconds blocked in communication, wall seconds of the run;
- compute utilisation (inner-step compute ÷ training-loop seconds, evaluations excluded).

Two more runs are reference lines: ``single`` (one replica, the same per-replica batch, steps
and learning rate: what the other replicas' tokens buy each method) and ``averaging`` (DiLoCo
with outer lr 1 and no momentum, i.e. the replicas' weights plainly averaged every H steps:
what DiLoCo's outer optimizer adds to averaging).

Targets: DiLoCo and NoLoCo within 10% of DDP's validation loss; bytes per replica
NoLoCo < DiLoCo < DDP; compute utilisation >= 0.9 for DiLoCo and NoLoCo.

    python benchmarks/methods.py                     # the recorded run (8 replicas)
    python benchmarks/methods.py --replicas 4        # when 8 processes take too long
    python benchmarks/methods.py --quick             # smoke run (2 replicas, a few steps)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

METHODS = ("ddp", "diloco", "noloco")
REFERENCE = "single"  # one replica with the same per-replica settings: what averaging adds
AVERAGING = "averaging"  # DiLoCo with outer lr 1, no momentum: plain model averaging every H
TARGET_LOSS_GAP = 0.10
TARGET_UTILISATION = 0.9
COLORS = {"ddp": "tab:gray", "diloco": "tab:red", "noloco": "tab:blue", "single": "k",
          "averaging": "tab:orange"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_run_flags(p, data=str(common.DEFAULT_DATA), preset="tiny", replicas=8,
                         steps=300, batch_size=8, seq_len=128, lr=3e-3, warmup=30,
                         sync_every=50, eval_every=25, eval_batches=4)
    p.add_argument("--methods", nargs="+", default=[*METHODS, REFERENCE, AVERAGING],
                   choices=[*METHODS, REFERENCE, AVERAGING],
                   help="methods to run, in this order. References: 'single' (one replica "
                   "with the same per-replica settings) and 'averaging' (DiLoCo with outer lr "
                   "1 and no momentum: the replicas' weights averaged every H steps)")
    common.add_run_flags(p, seed=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 replicas, 20 steps, H 10")
    common.add_output_flags(p)
    a = p.parse_args(argv)
    if a.quick:
        a.replicas, a.steps, a.sync_every, a.eval_every = 2, 20, 10, 10
        a.batch_size, a.eval_batches, a.warmup = 4, 1, 5
    common.check_at_least_one(p, a, "replicas", "steps", "batch_size", "seq_len", "sync_every",
                              "eval_every", "eval_batches")
    common.check_pairs(p, a.replicas)
    common.check_data(p, a.data)
    return a


def train_cmd(a: argparse.Namespace, method: str, out: Path) -> list[str]:
    rest = []
    if method in ("diloco", "noloco", AVERAGING):
        rest += ["--sync-every", str(a.sync_every)]
    if method == AVERAGING:
        rest += ["--outer-lr", "1.0", "--outer-momentum", "0", "--no-nesterov"]
    return common.train_command(
        a, out, ["--method", "diloco" if method == AVERAGING else method,
                 "--replicas", str(1 if method == REFERENCE else a.replicas)], rest)


def run_method(a: argparse.Namespace, method: str, runs: Path) -> dict[str, Any]:
    out = runs / method
    keep = ("method", "replicas", "steps", "outer_steps", "sync_every", "group_size", "params",
            "param_bytes", "tokens_per_replica", "final_val_loss", "final_val_loss_per_replica",
            "bytes_sent_per_replica", "sync_seconds", "compute_seconds", "train_seconds",
            "compute_utilisation", "wall_seconds", "weight_spread", "tokens_per_second",
            "threads_per_worker")
    return common.run_and_read(train_cmd(a, method, out), out, method, keep, a.wait_quiet)


def judge(res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each target, with the numbers it was judged on (None where a method did not run)."""
    s = {m: r["summary"] for m, r in res.items()}
    out: dict[str, Any] = {}
    if "ddp" in s:
        base = s["ddp"]["final_val_loss"]
        for m in ("diloco", "noloco"):
            if m in s:
                gap = s[m]["final_val_loss"] / base - 1
                out[f"{m}_loss_gap_vs_ddp"] = gap
                out[f"{m}_loss_within_10pct"] = gap <= TARGET_LOSS_GAP
        for m in (REFERENCE, AVERAGING):  # no targets: the reference lines
            if m in s:
                out[f"{m}_loss_gap_vs_ddp"] = s[m]["final_val_loss"] / base - 1
    if all(m in s for m in METHODS):
        b = {m: s[m]["bytes_sent_per_replica"] for m in METHODS}
        out["bytes_order_noloco_lt_diloco_lt_ddp"] = b["noloco"] < b["diloco"] < b["ddp"]
    for m in ("diloco", "noloco"):
        if m in s:
            u = s[m]["compute_utilisation"]
            out[f"{m}_utilisation_ge_0.9"] = u is not None and u >= TARGET_UTILISATION
    return out


def plot(res: dict[str, dict[str, Any]], a: argparse.Namespace, path: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for m, r in res.items():
        pts = [(c["tokens_per_replica"], c["val_loss"]) for c in r["curve"]
               if c["val_loss"] is not None]
        s = r["summary"]
        label = (f"{m}: {s['final_val_loss']:.3f}, "
                 f"{s['bytes_sent_per_replica'] / 2**20:,.0f} MiB/replica")
        if m == REFERENCE:
            label = f"single replica (reference): {s['final_val_loss']:.3f}"
        elif m == AVERAGING:
            label = f"plain averaging every H (reference): {s['final_val_loss']:.3f}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label,
                color=COLORS.get(m))
    if any(m != "ddp" for m in res):
        for k in range(a.sync_every, a.steps + 1, a.sync_every):
            ax.axvline(k * a.batch_size * a.seq_len, color="0.85", lw=0.8, zorder=0)
    ax.set_xlabel(f"tokens per replica (x {a.replicas} replicas; grey lines: outer steps, "
                  f"H = {a.sync_every})")
    ax.set_ylabel("validation loss (mean over replicas)")
    ax.set_title(f"{a.preset} preset, {a.replicas} replicas, {a.steps} steps x "
                 f"{a.batch_size}x{a.seq_len} tokens")
    lo = min((c["val_loss"] for r in res.values() for c in r["curve"][1:]
              if c["val_loss"] is not None), default=None)
    if lo is not None:
        first = max(r["curve"][1]["val_loss"] for m, r in res.items()
                    if len(r["curve"]) > 1 and m in METHODS)
        ax.set_ylim(lo - 0.05, first + 0.1)
    ax.legend(fontsize=8)
    return common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    json_path, png_path = common.out_paths("methods", a.out_dir, a.quick, a.record)
    config = common.config_of(a)
    config["tokens_per_replica"] = a.steps * a.batch_size * a.seq_len
    rec = common.start_record("methods", config)
    t0 = time.perf_counter()
    res: dict[str, dict[str, Any]] = {}
    with common.run_dirs(a.runs_dir, "noloco-methods-") as runs:
        for m in a.methods:
            res[m] = r = run_method(a, m, runs)
            s = r["summary"]
            print(f"{m:>7}: val {s['final_val_loss']:.4f} | "
                  f"{s['bytes_sent_per_replica'] / 2**20:9.1f} MiB/replica | blocked "
                  f"{s['sync_seconds']:6.1f} s | utilisation {s['compute_utilisation']:.3f} | "
                  f"wall {s['wall_seconds']:6.1f} s", flush=True)
    verdict = judge(res)
    results = {"methods": res, "targets": {"loss_gap_max": TARGET_LOSS_GAP,
                                           "utilisation_min": TARGET_UTILISATION},
               "verdict": verdict}
    common.write_record(json_path, rec, results, t0)
    plot(res, a, png_path)
    common.print_verdict(verdict)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
