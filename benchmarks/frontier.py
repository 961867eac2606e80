"""The study: do the methods pay off? Multi-seed H sweeps, the loss–communication frontier, the
outer optimizer at small scale, and long runs (docs/science.md).

Every run is ``python -m noloco train`` on the tiny preset, ``--replicas 4`` (one thread per
worker), the same tokens per replica for every method, a fixed validation set
(``--eval-sequences``). Parts:

- ``sweep``: H ∈ {5, 10, 20, 50, 100} for DiLoCo and NoLoCo, Streaming DiLoCo (P = 4,
  τ = 1, fp4) at two H, DDP and one replica alone as reference lines; 3 seeds each.
- ``grid``: DiLoCo's outer (lr, momentum) and NoLoCo's (α, β) on a small grid at H = 20,
  2 seeds each (the paper defaults are points of the grid).
- ``why``: the outer step replaced by plain averaging at H = 5 and 20 (3 seeds): what the
  paper defaults' outer momentum costs or buys at small scale.
- ``sparse``: the loss–bytes frontier of the sparse exchanges (issue 25) at H = 4 and 20:
  SparseLoCo at 1% and 2% (2 bits), DiLoCo with top-k and error feedback, Streaming DiLoCo
  (fp4, τ = 1, P = 2 at H = 4 and 4 at H = 20), NoLoCo dense and with sparse gossip, DiLoCo
  fp32, and DDP, each with AdamW and with Muon inner steps, 3 seeds each.
- ``long``: 2,000 steps of NoLoCo, DiLoCo and independent replicas (weight spread over time,
  NoLoCo paper Fig. 3B), and NoLoCo with 2 pipeline stages, random against fixed routing
  (paper Fig. 4).

The study is resumable: each run keeps its directory under ``--runs-dir``; a completed run is
read back, not re-run, and an interrupted long run resumes from its newest checkpoint
(``noloco train --resume``). Run it alone: parallel runs on 2 cores measure the load.

    python benchmarks/frontier.py                       # every part (~1.5 h on 2 cores)
    python benchmarks/frontier.py --parts sweep         # one part
    python benchmarks/frontier.py --parts sparse        # its own record: frontier_sparse
    python benchmarks/frontier.py --quick               # smoke run, temp directory
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PARTS = ("sweep", "grid", "long", "why", "sparse")
SPARSE_H = (4, 20)
SPARSE_CONFIGS: dict[str, tuple[str, tuple[str, ...]]] = {
    # name → (method, flags), at each of SPARSE_H (streaming: P = H/5 rounded to 2 or 4)
    "diloco": ("diloco", ()),
    "diloco_topk2": ("diloco", ("--compress", "topk:0.02:2")),
    "sparseloco_2pct": ("sparseloco", ("--compress", "topk:0.02:2")),
    "sparseloco_1pct": ("sparseloco", ("--compress", "topk:0.01:2")),
    "streaming_fp4": ("streaming", ("--overlap-steps", "1", "--quantize", "fp4")),
    "noloco": ("noloco", ()),
    "noloco_sparse2": ("noloco", ("--compress", "topk:0.02:2")),
}
INNER = ("adamw", "muon")
SWEEP_H = (5, 10, 20, 50, 100)
STREAMING_H = (20, 100)
GRID_H = 20
DILOCO_GRID = [(lr, mu) for lr in (0.4, 0.7, 1.0) for mu in (0.6, 0.9)]
NOLOCO_GRID = [(alpha, beta) for alpha in (0.3, 0.5, 0.7) for beta in (0.5, 0.7, 0.9)]
PAPER = {"diloco": (0.7, 0.9), "noloco": (0.5, 0.7)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_run_flags(p, data=str(common.DEFAULT_DATA))
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    common.add_run_flags(p, {"steps": "inner steps of sweep/grid runs"}, replicas=4, steps=200,
                         batch_size=8, seq_len=64, lr=3e-3, warmup=20)
    p.add_argument("--seeds", type=int, default=3, help="seeds of the sweep")
    p.add_argument("--grid-seeds", type=int, default=2)
    p.add_argument("--long-steps", type=int, default=2000)
    p.add_argument("--long-batch-size", type=int, default=4)
    p.add_argument("--long-sync-every", type=int, default=50)
    p.add_argument("--eval-sequences", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 1 seed")
    common.add_output_flags(p, runs_dir="noloco-frontier in the temp directory; kept, so a "
                            "re-run resumes", wait_quiet=False)
    a = p.parse_args(argv)
    if a.quick:
        a.replicas, a.steps, a.batch_size, a.seq_len, a.warmup = 2, 20, 2, 32, 2
        a.seeds, a.grid_seeds, a.long_steps, a.long_batch_size = 1, 1, 40, 2
        a.long_sync_every, a.eval_sequences = 10, 4
    common.check_data(p, a.data)
    common.check_pairs(p, a.replicas)
    return a


# ---- one run --------------------------------------------------------------------------------

def train_args(a: argparse.Namespace, method: str, seed: int, *, steps: int | None = None,
               batch_size: int | None = None, eval_every: int | None = None,
               replicas: int | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    steps = steps or a.steps
    return [*common.flags(method=method, replicas=replicas or a.replicas, preset="tiny",
                          data=a.data, steps=steps, batch_size=batch_size or a.batch_size,
                          seq_len=a.seq_len, lr=a.lr, warmup=a.warmup,
                          eval_every=eval_every or steps, eval_sequences=a.eval_sequences,
                          seed=seed, device="cpu", log_every=0), *extra]


def run(name: str, args: list[str], runs: Path, *, checkpoints: bool = False
        ) -> dict[str, Any]:
    """One run, or its completed record read back; an interrupted checkpointed run resumes."""
    out = runs / name
    if (out / "summary.json").is_file():
        s = common.read_summary(out)
        if s.get("status") == "completed":
            return record(name, out, s, reused=True)
    resume = checkpoints and (out / "checkpoints").is_dir() and any(
        (out / "checkpoints").iterdir())
    cmd = ([*common.NOLOCO, "train", "--resume", str(out)] if resume else
           common.noloco_train([*args, "--checkpoint-every", "200" if checkpoints else "0"],
                               out))
    t0 = time.perf_counter()
    load = common.load_average()
    common.run_checked(cmd, name)
    s = common.read_summary(out)
    rec = record(name, out, s, reused=False)
    rec["process_seconds"], rec["load_average_before"] = time.perf_counter() - t0, load
    print(f"{name}: val {s['final_val_loss']:.4f}, {s['bytes_sent'] / 2**20:.1f} "
          f"MiB/replica, {time.perf_counter() - t0:.0f} s", flush=True)
    return rec


def record(name: str, out: Path, s: dict[str, Any], reused: bool) -> dict[str, Any]:
    curve = [{k: m.get(k) for k in ("step", "val_loss", "weight_spread", "bytes_sent")}
             for m in common.read_jsonl(out / "metrics.jsonl") if m.get("val_loss") is not None]
    keep = ("method", "replicas", "stages", "steps", "outer_steps", "sync_every",
            "final_val_loss", "final_val_loss_per_replica", "bytes_sent_per_replica",
            "weight_spread", "wall_seconds", "compute_utilisation")
    return {"name": name, "summary": common.kept(s, keep), "curve": curve,
            "reused": reused}


def mean_std(xs: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "n": len(xs), "values": xs}


# ---- the parts ------------------------------------------------------------------------------

def sweep_configs(a: argparse.Namespace) -> dict[str, tuple[str, tuple[str, ...], int]]:
    """config name → (method, extra flags, replicas)."""
    c: dict[str, tuple[str, tuple[str, ...], int]] = {
        "ddp": ("ddp", (), a.replicas), "single": ("single", (), 1)}
    hs = SWEEP_H if not a.quick else (5, 10)
    for h in hs:
        c[f"diloco_H{h}"] = ("diloco", ("--sync-every", str(h)), a.replicas)
        c[f"noloco_H{h}"] = ("noloco", ("--sync-every", str(h)), a.replicas)
    for h in (STREAMING_H if not a.quick else (8,)):
        c[f"streaming_H{h}"] = ("streaming", ("--sync-every", str(h), "--fragments", "4",
                                              "--overlap-steps", "1", "--quantize", "fp4"),
                                a.replicas)
    return c


def part_sweep(a: argparse.Namespace, runs: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (method, extra, n) in sweep_configs(a).items():
        recs = [run(f"sweep-{name}-s{seed}", train_args(a, method, seed, replicas=n,
                                                         extra=extra), runs)
                for seed in range(a.seeds)]
        out[name] = {"loss": mean_std([r["summary"]["final_val_loss"] for r in recs]),
                     "bytes_sent_per_replica": recs[0]["summary"]["bytes_sent_per_replica"],
                     "runs": recs}
    return out


def part_grid(a: argparse.Namespace, runs: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"diloco": [], "noloco": []}
    for method, grid in (("diloco", DILOCO_GRID), ("noloco", NOLOCO_GRID)):
        for x, y in (grid if not a.quick else grid[:2]):
            # DiLoCo: (outer lr, momentum μ); NoLoCo: (α = momentum, β = outer lr).
            lr, mom = (x, y) if method == "diloco" else (y, x)
            extra = ("--sync-every", str(GRID_H if not a.quick else 5), "--outer-lr", str(lr),
                     "--outer-momentum", str(mom))
            recs = [run(f"grid-{method}-{x}-{y}-s{seed}", train_args(a, method, seed,
                                                                     extra=extra), runs)
                    for seed in range(a.grid_seeds)]
            out[method].append({"point": [x, y], "paper_default": [x, y] == list(PAPER[method]),
                                "loss": mean_std([r["summary"]["final_val_loss"]
                                                  for r in recs])})
    for method in ("diloco", "noloco"):
        pts = out[method]
        best = min(pts, key=lambda p: p["loss"]["mean"])
        paper = next((p for p in pts if p["paper_default"]), None)
        out[f"{method}_best"] = best["point"]
        if paper is not None:
            out[f"{method}_paper_minus_best"] = paper["loss"]["mean"] - best["loss"]["mean"]
    return out


def part_why(a: argparse.Namespace, runs: Path) -> dict[str, Any]:
    """What the outer optimizer costs at small H: the sweep's settings with the outer step
    reduced to plain averaging (DiLoCo outer lr 1, no momentum; NoLoCo α = 0, β = γ = 1:
    each pair's plain average), 3 seeds each, next to the sweep's defaults."""
    out: dict[str, Any] = {}
    hs = (5, 20) if not a.quick else (5,)
    for h in hs:
        for name, method, extra in (
                ("diloco_avg", "diloco", ("--outer-lr", "1", "--outer-momentum", "0")),
                ("noloco_avg", "noloco", ("--outer-lr", "1", "--outer-momentum", "0"))):
            recs = [run(f"why-{name}_H{h}-s{seed}", train_args(
                a, method, seed, extra=("--sync-every", str(h), *extra)), runs)
                for seed in range(a.seeds)]
            out[f"{name}_H{h}"] = {
                "loss": mean_std([r["summary"]["final_val_loss"] for r in recs]),
                "bytes_sent_per_replica": recs[0]["summary"]["bytes_sent_per_replica"]}
    return out


def part_long(a: argparse.Namespace, runs: Path) -> dict[str, Any]:
    steps, h = a.long_steps, a.long_sync_every
    every = max(steps // 20, 1)
    if every % h == 0:  # evaluate mid-phase too, not only right after outer steps
        every += h // 2
    base = {"steps": steps, "batch_size": a.long_batch_size, "eval_every": every}
    configs = {
        "noloco": ("noloco", ("--sync-every", str(h))),
        "diloco": ("diloco", ("--sync-every", str(h))),
        "independent": ("diloco", ("--sync-every", str(steps + 1))),
        "noloco_2stages_random": ("noloco", ("--sync-every", str(h), "--stages", "2",
                                             "--routing", "random")),
        "noloco_2stages_fixed": ("noloco", ("--sync-every", str(h), "--stages", "2",
                                            "--routing", "fixed")),
    }
    out = {}
    for name, (method, extra) in configs.items():
        out[name] = run(f"long-{name}", train_args(a, method, 0, extra=extra, **base), runs,
                        checkpoints=True)
    rnd = {c["step"]: c["weight_spread"] for c in out["noloco_2stages_random"]["curve"]}
    fix = {c["step"]: c["weight_spread"] for c in out["noloco_2stages_fixed"]["curve"]}
    out["random_vs_fixed_spread_reduction"] = {
        s: 1 - rnd[s] / fix[s] for s in sorted(rnd) if s in fix and fix[s]}
    return out


def part_sparse(a: argparse.Namespace, runs: Path) -> dict[str, Any]:
    """Every SPARSE_CONFIGS row with each inner optimizer, ``--seeds`` seeds: final loss
    (mean ± std), bytes per replica, the weight spread at the end."""
    out: dict[str, Any] = {}
    rows = [("ddp", "ddp", ())] + [
        (f"{name}_H{h}", method, (*flags, "--sync-every", str(h),
                                  *(("--fragments", "2" if h < 20 else "4")
                                    if method == "streaming" else ())))
        for h in (SPARSE_H if not a.quick else (4, 8)) for name, (method, flags)
        in SPARSE_CONFIGS.items()]
    for inner in INNER:
        for name, method, flags in rows:
            extra = (*flags, "--inner-optimizer", inner)
            recs = [run(f"sparse-{name}-{inner}-s{seed}", train_args(a, method, seed,
                                                                       extra=extra), runs)
                    for seed in range(a.seeds)]
            out[f"{name}/{inner}"] = {
                "method": method, "flags": list(flags), "inner": inner,
                "loss": mean_std([r["summary"]["final_val_loss"] for r in recs]),
                "weight_spread": mean_std([r["summary"]["weight_spread"] or 0.0
                                           for r in recs]),
                "bytes_sent_per_replica": recs[0]["summary"]["bytes_sent_per_replica"],
                "runs": recs}
    return out


def judge_sparse(sp: dict[str, Any]) -> dict[str, Any]:
    """Issue 25's target at N = 4, per H and inner optimizer: SparseLoCo at 2% and 2 bits
    sends ≥ 40× fewer bytes per replica than fp32 DiLoCo and ≥ 5× fewer than Streaming fp4,
    within 2% of DiLoCo's loss (at the same H)."""
    out = {}
    hs = sorted({int(k.split("/")[0].rsplit("_H", 1)[1]) for k in sp if "_H" in k})
    for h, inner in ((h, inner) for h in hs for inner in INNER):
        if f"diloco_H{h}/{inner}" not in sp:
            continue
        d, s, f = (sp[f"{k}_H{h}/{inner}"]
                   for k in ("diloco", "sparseloco_2pct", "streaming_fp4"))
        ratio_d = d["bytes_sent_per_replica"] / s["bytes_sent_per_replica"]
        ratio_f = f["bytes_sent_per_replica"] / s["bytes_sent_per_replica"]
        over = s["loss"]["mean"] / d["loss"]["mean"] - 1
        out[f"H{h}/{inner}"] = {
            "bytes_fewer_than_diloco_fp32": ratio_d, "bytes_fewer_than_streaming_fp4": ratio_f,
            "sparseloco_loss_over_diloco": over,
            "met": ratio_d >= 40 and ratio_f >= 5 and over <= 0.02,
            "rows": {k.split("/")[0]: {"loss": v["loss"]["mean"], "std": v["loss"]["std"],
                                       "mib": v["bytes_sent_per_replica"] / 2**20,
                                       "spread": v["weight_spread"]["mean"]}
                     for k, v in sp.items() if k.endswith(f"/{inner}")
                     and (k.endswith(f"_H{h}/{inner}") or "_H" not in k)}}
    return out


# ---- targets --------------------------------------------------------------------------------

def judge(sweep: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, from the sweep's means and seed spreads."""
    single, ddp = sweep["single"]["loss"], sweep["ddp"]["loss"]
    hs = sorted(int(k.split("H")[1]) for k in sweep if k.startswith("diloco_H"))
    per_h = {}
    for h in hs:
        d, n = sweep[f"diloco_H{h}"]["loss"], sweep[f"noloco_H{h}"]["loss"]
        per_h[h] = {
            "noloco_over_diloco": n["mean"] / d["mean"] - 1,
            "noloco_within_2pct_of_diloco": n["mean"] <= 1.02 * d["mean"],
            # below the single replica by more than the seeds' spread (the larger of the two)
            "diloco_below_single": single["mean"] - d["mean"] > max(d["std"], single["std"]),
            "noloco_below_single": single["mean"] - n["mean"] > max(n["std"], single["std"]),
            "noloco_over_ddp": n["mean"] / ddp["mean"] - 1,
        }
    small = [h for h in hs if h <= 20]
    return {
        "per_h": per_h,
        "noloco_within_2pct_of_diloco_at_every_h": all(
            v["noloco_within_2pct_of_diloco"] for v in per_h.values()),
        "both_below_single_at_h_le_20": all(
            per_h[h]["diloco_below_single"] and per_h[h]["noloco_below_single"] for h in small),
        "noloco_within_10pct_of_ddp_at": [h for h, v in per_h.items()
                                          if v["noloco_over_ddp"] <= 0.10],
    }


# ---- plots ----------------------------------------------------------------------------------

def plot_sparse(sp: dict[str, Any], path: Path) -> Path | None:
    """Final loss against bytes sent per replica, every row, AdamW filled, Muon hollow."""
    plt = common.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    names = list(dict.fromkeys(k.split("/")[0] for k in sp))
    colors = {n: f"C{i % 10}" for i, n in enumerate(dict.fromkeys(
        n.rsplit("_H", 1)[0] for n in names))}
    for name in names:
        for inner, face in (("adamw", None), ("muon", "none")):
            v = sp.get(f"{name}/{inner}")
            if v is None:
                continue
            x = max(v["bytes_sent_per_replica"], 1) / 2**20
            ax.errorbar([x], [v["loss"]["mean"]], yerr=[v["loss"]["std"]],
                        capsize=3, color=colors[name.rsplit("_H", 1)[0]], mfc=face,
                        marker="o" if name.endswith("_H4") else "s",
                        label=name if inner == "adamw" else None)
    ax.set_xscale("log")
    ax.set_xlabel("MiB sent per replica (whole run)")
    ax.set_ylabel("final validation loss (mean ± std over seeds)")
    ax.set_title("sparse exchanges, N = 4: filled AdamW, hollow Muon; "
                 "circles H = 4, squares H = 20")
    ax.legend(fontsize=7)
    return common.save_figure(fig, path)


def plot(res: dict[str, Any], path: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    panels = [p for p in ("sweep", "long") if p in res]
    fig, axes = plt.subplots(1, 2 * ("sweep" in res) + ("long" in res),
                             figsize=(5.5 * (2 * ("sweep" in res) + ("long" in res)), 4))
    axes = list(axes) if hasattr(axes, "__len__") else [axes]
    i = 0
    if "sweep" in panels:
        sw = res["sweep"]
        ax1, ax2 = axes[0], axes[1]
        i = 2
        for method, color in (("diloco", "C0"), ("noloco", "C1"), ("streaming", "C2")):
            keys = sorted((k for k in sw if k.startswith(f"{method}_H")),
                          key=lambda k: int(k.split("H")[1]))
            if not keys:
                continue
            hs = [int(k.split("H")[1]) for k in keys]
            m = [sw[k]["loss"]["mean"] for k in keys]
            s = [sw[k]["loss"]["std"] for k in keys]
            b = [max(sw[k]["bytes_sent_per_replica"], 1) / 2**20 for k in keys]
            ax1.errorbar(hs, m, yerr=s, marker="o", capsize=3, color=color, label=method)
            ax2.errorbar(b, m, yerr=s, marker="o", capsize=3, color=color, label=method)
            for x, y, h in zip(b, m, hs, strict=True):
                ax2.annotate(f"H{h}", (x, y), fontsize=7, xytext=(3, 3),
                             textcoords="offset points")
        for ref, style in (("ddp", "--"), ("single", ":")):
            v = sw[ref]["loss"]
            for ax in (ax1, ax2):
                ax.axhline(v["mean"], ls=style, color="k", lw=1, label=f"{ref} "
                           f"({v['mean']:.3f} ± {v['std']:.3f})")
        ax2.scatter([sw["ddp"]["bytes_sent_per_replica"] / 2**20], [sw["ddp"]["loss"]["mean"]],
                    color="k", marker="s")
        ax1.set_xscale("log")
        ax1.set_xlabel("H (inner steps per outer step)")
        ax2.set_xscale("log")
        ax2.set_xlabel("MiB sent per replica")
        for ax in (ax1, ax2):
            ax.set_ylabel("final validation loss (mean ± std over seeds)")
        ax1.legend(fontsize=7)
        ax1.set_title("validation loss against H")
        ax2.set_title("the loss–communication frontier")
    if "long" in panels:
        ax = axes[i]
        for name, rec in res["long"].items():
            if not isinstance(rec, dict) or "curve" not in rec:
                continue
            pts = [(c["step"], c["weight_spread"]) for c in rec["curve"]
                   if c.get("weight_spread") is not None and c["step"] > 0]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=".", label=name)
        ax.set_xlabel("inner step")
        ax.set_ylabel("weight spread across replicas")
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.legend(fontsize=7)
        ax.set_title("long runs: weight spread")
    return common.save_figure(fig, path)


# ---- the driver -----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    # the sparse part alone has a record of its own (frontier_sparse.json): running it does
    # not overwrite the other parts' record
    name = "frontier_sparse" if a.parts == ["sparse"] else "frontier"
    json_path, png_path = common.out_paths(name, a.out_dir, a.quick, a.record)
    rec = common.start_record("frontier", common.config_of(a))
    runs = Path(a.runs_dir) if a.runs_dir else Path(tempfile.gettempdir()) / (
        "noloco-frontier-quick" if a.quick else "noloco-frontier")
    runs.mkdir(parents=True, exist_ok=True)
    print(f"run directories: {runs} (kept: re-running resumes)", flush=True)
    t0 = time.perf_counter()
    res: dict[str, Any] = {}
    for part in a.parts:
        res[part] = {"sweep": part_sweep, "grid": part_grid, "long": part_long,
                     "why": part_why, "sparse": part_sparse}[part](a, runs)
    if "sweep" in res:
        res["targets"] = judge(res["sweep"])
    if "sparse" in res:
        res["sparse_targets"] = judge_sparse(res["sparse"])
    common.write_record(json_path, rec, res, t0)
    drawn = plot(res, png_path) if set(res) - {"sparse", "sparse_targets"} else None
    if "sparse" in res:
        sparse_png = (png_path if name == "frontier_sparse"
                      else png_path.with_name(png_path.stem + "_sparse.png"))
        drawn = plot_sparse(res["sparse"], sparse_png) or drawn
    print(common.wrote(json_path, drawn))
    if "targets" in res:
        print(json.dumps({k: v for k, v in res["targets"].items() if k != "per_h"}))
    for inner, t in res.get("sparse_targets", {}).items():
        print(f"{inner}: " + json.dumps({k: v for k, v in t.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

