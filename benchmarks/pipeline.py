"""Pipeline stages and random routing: N replicas × P stages (NoLoCo §3.1).

All runs train the same model (``--preset``, seed 0) on the same text through the real command
line (``python -m noloco train ...``), each into its own run directory; this script reads back
summary.json and metrics.jsonl.

- N × P grid (default 4 × 2, 8 worker processes) for DDP, DiLoCo and NoLoCo with random
  routing, and NoLoCo with fixed routing: validation loss, synchronisation bytes against
  activation bytes per replica, weight spread.
- No outer synchronisation at all — ``--method diloco --sync-every`` larger than the steps,
  so DiLoCo never takes an outer step and the replicas are independent — with random and with
  fixed routing: how much random routing alone lowers the weight spread (the NoLoCo paper saw
  10–15%).
- Throughput at the same number of workers: NoLoCo on N × P (pipelined) against N·P × 1
  (data parallel only), same per-replica batch, measured side by side in this run.

    python benchmarks/pipeline.py                 # the recorded run
    python benchmarks/pipeline.py --quick         # smoke run (2 x 2, a few steps)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# name → (method, routing, stages factor): "grid" runs use N × P; "flat" uses N·P × 1.
RUNS: dict[str, tuple[str, str, str]] = {
    "ddp": ("ddp", "random", "grid"),
    "diloco": ("diloco", "random", "grid"),
    "noloco": ("noloco", "random", "grid"),
    "noloco_fixed": ("noloco", "fixed", "grid"),
    "independent_random": ("independent", "random", "grid"),
    "independent_fixed": ("independent", "fixed", "grid"),
    "noloco_one_stage": ("noloco", "fixed", "flat"),
}
COLORS = {"ddp": "tab:gray", "diloco": "tab:red", "noloco": "tab:blue",
          "noloco_fixed": "tab:cyan", "independent_random": "tab:green",
          "independent_fixed": "tab:olive", "noloco_one_stage": "tab:purple"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_run_flags(p, {"replicas": "replicas N per stage"},
                         data=str(common.DEFAULT_DATA), preset="tiny", replicas=4, stages=2,
                         steps=80, batch_size=8, seq_len=64, microbatches=0, lr=3e-3,
                         warmup=10, sync_every=20, eval_every=20, eval_batches=4)
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS),
                   help="runs to make, in this order")
    common.add_run_flags(p, seed=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 x 2, 6 steps")
    common.add_output_flags(p)
    a = p.parse_args(argv)
    if a.quick:
        a.replicas, a.stages, a.steps, a.sync_every, a.eval_every = 2, 2, 6, 3, 3
        a.batch_size, a.seq_len, a.eval_batches, a.warmup = 4, 32, 1, 2
    common.check_at_least_one(p, a, "replicas", "stages", "steps", "batch_size", "seq_len",
                              "sync_every", "eval_every", "eval_batches")
    if a.stages < 2:
        p.error("--stages must be >= 2 (this benchmark is about pipelines)")
    common.check_pairs(p, a.replicas)
    common.check_data(p, a.data)
    return a


def train_cmd(a: argparse.Namespace, name: str, out: Path) -> list[str]:
    method, routing, shape = RUNS[name]
    replicas, stages = ((a.replicas, a.stages) if shape == "grid"
                        else (a.replicas * a.stages, 1))
    sync_every = a.sync_every
    if method == "independent":
        # DiLoCo whose first outer step would come after the last step: no synchronisation.
        method, sync_every = "diloco", a.steps + 1
    return common.train_command(
        a, out, ["--method", method, "--replicas", str(replicas), "--stages", str(stages),
                 "--routing", routing, "--microbatches", str(a.microbatches)],
        ["--sync-every", str(sync_every)] if method != "ddp" else [])


def run_one(a: argparse.Namespace, name: str, runs: Path) -> dict[str, Any]:
    out = runs / name
    keep = ("method", "replicas", "stages", "steps", "outer_steps", "sync_every", "params",
            "param_bytes", "tokens_per_replica", "final_val_loss", "final_val_loss_per_replica",
            "bytes_sent_per_replica", "activation_bytes", "sync_seconds", "compute_seconds",
            "train_seconds", "compute_utilisation", "wall_seconds", "weight_spread",
            "tokens_per_second", "threads_per_worker", "schedule", "routing", "microbatches",
            "bubble_fraction", "pipeline_wait_fraction_per_stage")
    return common.run_and_read(train_cmd(a, name, out), out, name, keep, a.wait_quiet,
                               curve=("step", "tokens", "val_loss", "train_loss",
                                      "weight_spread", "bytes_sent", "activation_bytes",
                                      "wall_seconds"))


def _spread_ratio(res: dict[str, Any], random: str, fixed: str) -> dict[str, Any] | None:
    """1 − spread(random)/spread(fixed) at every evaluation after step 0, and at the end."""
    if random not in res or fixed not in res:
        return None
    cr, cf = res[random]["curve"], res[fixed]["curve"]
    per_eval = [{"step": r["step"], "random": r["weight_spread"], "fixed": f["weight_spread"],
                 "reduction": 1 - r["weight_spread"] / f["weight_spread"]}
                for r, f in zip(cr, cf, strict=True) if r["step"] > 0 and f["weight_spread"]]
    return {"per_eval": per_eval,
            "final_reduction": per_eval[-1]["reduction"] if per_eval else None,
            "mean_reduction": (sum(e["reduction"] for e in per_eval) / len(per_eval)
                               if per_eval else None)}


def derive(res: dict[str, Any]) -> dict[str, Any]:
    s = {k: r["summary"] for k, r in res.items()}
    out: dict[str, Any] = {
        "spread_random_vs_fixed_noloco": _spread_ratio(res, "noloco", "noloco_fixed"),
        "spread_random_vs_fixed_no_sync": _spread_ratio(res, "independent_random",
                                                        "independent_fixed"),
    }
    if "noloco" in s and "noloco_one_stage" in s:
        out["tokens_per_second_pipelined"] = s["noloco"]["tokens_per_second"]
        out["tokens_per_second_one_stage"] = s["noloco_one_stage"]["tokens_per_second"]
        out["throughput_ratio_pipelined_vs_one_stage"] = (
            s["noloco"]["tokens_per_second"] / s["noloco_one_stage"]["tokens_per_second"])
    out["bytes_per_replica"] = {k: {"sync": v["bytes_sent_per_replica"],
                                    "activation": v["activation_bytes"]} for k, v in s.items()}
    return out


def plot(res: dict[str, Any], a: argparse.Namespace, path: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    ax = axes[0]
    for k in ("noloco", "noloco_fixed", "independent_random", "independent_fixed"):
        if k in res:
            pts = [(c["step"], c["weight_spread"]) for c in res[k]["curve"] if c["step"] > 0]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=k,
                    color=COLORS[k], ls="-" if "fixed" not in k else "--")
    ax.set_yscale("log")
    ax.set_xlabel("inner step")
    ax.set_ylabel("weight spread (all stages)")
    ax.set_title(f"spread, {a.replicas} x {a.stages}: random vs fixed routing")
    ax.legend(fontsize=8)
    ax = axes[1]
    for k, r in res.items():
        pts = [(c["tokens"], c["val_loss"]) for c in r["curve"] if c["val_loss"] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=COLORS[k],
                label=f"{k}: {r['summary']['final_val_loss']:.3f}")
    ax.set_xlabel("tokens (all replicas)")
    ax.set_ylabel("validation loss (mean over replicas)")
    ax.set_title(f"{a.preset}, {a.steps} steps x {a.batch_size}x{a.seq_len} per replica")
    ax.legend(fontsize=7)
    ax = axes[2]
    names = list(res)
    tps = [res[k]["summary"]["tokens_per_second"] for k in names]
    ax.barh(names, tps, color=[COLORS[k] for k in names])
    for i, v in enumerate(tps):
        ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    ax.set_xlabel(f"tokens / s, whole job ({a.replicas * a.stages} workers, "
                  f"{common.cores()} cores)")
    ax.set_title("throughput")
    return common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    json_path, png_path = common.out_paths("pipeline", a.out_dir, a.quick, a.record)
    config = common.config_of(a)
    config["tokens_per_replica"] = a.steps * a.batch_size * a.seq_len
    rec = common.start_record("pipeline", config)
    t0 = time.perf_counter()
    res: dict[str, Any] = {}
    with common.run_dirs(a.runs_dir, "noloco-pipeline-") as runs:
        for k in a.runs:
            res[k] = r = run_one(a, k, runs)
            s = r["summary"]
            print(f"{k:>19}: {s['replicas']}x{s['stages']} val {s['final_val_loss']:.4f} | "
                  f"spread {s['weight_spread']:.3e} | sync "
                  f"{s['bytes_sent_per_replica'] / 2**20:8.1f} MiB | act "
                  f"{s['activation_bytes'] / 2**20:8.1f} MiB | {s['tokens_per_second']:7,.0f} "
                  f"tok/s | process {r['process_seconds']:5.1f} s", flush=True)
    derived = derive(res)
    common.write_record(json_path, rec, {"runs": res, "derived": derived}, t0)
    plot(res, a, png_path)
    for key in ("spread_random_vs_fixed_noloco", "spread_random_vs_fixed_no_sync"):
        d = derived[key]
        if d and d["final_reduction"] is not None:
            print(f"{key}: final {d['final_reduction']:+.1%}, mean over evals "
                  f"{d['mean_reduction']:+.1%}")
    if "throughput_ratio_pipelined_vs_one_stage" in derived:
        print(f"tokens/s {a.replicas}x{a.stages} / {a.replicas * a.stages}x1: "
              f"{derived['throughput_ratio_pipelined_vs_one_stage']:.3f}")
    print(f"wrote {json_path} and {png_path}  ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
