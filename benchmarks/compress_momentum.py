"""Why DiLoCo with ``--compress`` trains badly: error feedback under an outer momentum.

DiLoCo with a top-k exchange and error feedback (``--compress topk:0.02:2``) ended 28% above
dense DiLoCo after 80 outer steps (issue 35), where SparseLoCo — the same messages without
the outer momentum, the buffer decaying instead — trains. This benchmark separates the two
changes, with ``noloco simulate`` (4 replicas, tiny preset, H = 12, 80 outer steps):

- dense DiLoCo (outer SGD, Nesterov μ 0.9, lr 0.7): the reference;
- DiLoCo top-k + error feedback, as it was the default: μ 0.9 Nesterov, buffer decay 1;
- the same with the outer momentum off (μ 0), decay 1;
- the same with μ 0.9 and the buffer decaying (0.95);
- DiLoCo with ``--compress`` and nothing else: the library's default for it;
- SparseLoCo (μ 0, decay 0.95, lr 1).

Per run: the final validation loss, its gap to dense DiLoCo, and the curve (the overshoot
shows as a loss that rises after outer steps). docs/sparse.md reads the record.

    python benchmarks/compress_momentum.py --record
    python benchmarks/compress_momentum.py --quick
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROWS = {
    "diloco_dense": ["--method", "diloco"],
    "diloco_topk_momentum": ["--method", "diloco", "--compress", "topk:0.02:2",
                             "--outer-momentum", "0.9", "--ef-decay", "1.0"],
    "diloco_topk_no_momentum": ["--method", "diloco", "--compress", "topk:0.02:2",
                                "--outer-momentum", "0", "--ef-decay", "1.0"],
    "diloco_topk_momentum_decay": ["--method", "diloco", "--compress", "topk:0.02:2",
                                   "--outer-momentum", "0.9", "--ef-decay", "0.95"],
    "diloco_topk_default": ["--method", "diloco", "--compress", "topk:0.02:2"],
    "sparseloco": ["--method", "sparseloco"],
}
COLORS = {"diloco_dense": "k", "diloco_topk_momentum": "tab:red",
          "diloco_topk_no_momentum": "tab:blue", "diloco_topk_momentum_decay": "tab:orange",
          "diloco_topk_default": "tab:purple", "sparseloco": "tab:green"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--sync-every", type=int, default=12)
    p.add_argument("--outer-steps", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seeds", default="0")
    p.add_argument("--data", default=str(common.DEFAULT_DATA))
    p.add_argument("--quick", action="store_true")
    common.add_record_flag(p)
    p.add_argument("--out-dir")
    p.add_argument("--runs-dir")
    a = p.parse_args(argv)
    if a.quick:
        a.outer_steps, a.sync_every, a.batch_size, a.seq_len, a.warmup = 3, 4, 2, 32, 2
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    json_path, png_path = common.out_paths("compress_momentum", a.out_dir, a.quick, a.record)
    rec = common.start_record("compress_momentum", common.config_of(a))
    started = time.perf_counter()
    steps = a.sync_every * a.outer_steps
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ROWS}
    with common.run_dirs(a.runs_dir, "noloco-compress-") as root:
        for seed in [int(s) for s in a.seeds.split(",")]:
            for name, flags in ROWS.items():
                out = root / f"{name}-s{seed}"
                cmd = [*common.NOLOCO, "simulate", *flags, *common.flags(
                    replicas=a.replicas, sync_every=a.sync_every, steps=steps,
                    batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, warmup=a.warmup,
                    eval_every=max(steps // 20, 1), eval_sequences=64, seed=seed,
                    data=a.data, log_every=0, device="cpu", out=str(out))]
                _, wall = common.run_checked(cmd, out.name)
                s = common.read_summary(out)
                curve = common.read_jsonl(out / "metrics.jsonl")
                runs[name].append({"seed": seed, "final_val_loss": s["final_val_loss"],
                                   "bytes_sent_per_replica": s["bytes_sent"],
                                   "outer_momentum": s.get("momentum"),
                                   "process_seconds": wall, "command": " ".join(cmd[2:]),
                                   "curve": [{"step": m["step"], "val_loss": m["val_loss"]}
                                             for m in curve]})
                print(f"  {out.name}: {s['final_val_loss']:.4f}", flush=True)
    mean = {n: sum(r["final_val_loss"] for r in rs) / len(rs) for n, rs in runs.items()}
    ref = mean["diloco_dense"]
    results = {"runs": runs, "mean_final_val_loss": mean,
               "gap_to_dense_diloco": {n: v / ref - 1 for n, v in mean.items()}}
    common.write_record(json_path, rec, results, started)
    plt = common.pyplot()
    png = None
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name, rs in runs.items():
            c = rs[0]["curve"]
            ax.plot([x["step"] for x in c], [x["val_loss"] for x in c], color=COLORS[name],
                    label=f"{name} ({mean[name]:.3f})")
        ax.set_xlabel("inner step")
        ax.set_ylabel("validation loss")
        ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
        ax.legend(fontsize=7)
        ax.set_title(f"top-k 2%/2-bit + error feedback under DiLoCo's outer step "
                     f"(N={a.replicas}, H={a.sync_every})", fontsize=9)
        png = common.save_figure(fig, png_path)
    for n, g in results["gap_to_dense_diloco"].items():
        print(f"{n}: {mean[n]:.4f} ({g:+.1%} against dense DiLoCo)")
    print(common.wrote(json_path, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
