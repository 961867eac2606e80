"""noloco's DiLoCo and Streaming DiLoCo side by side with torchft 0.2.0's, in one run.

torchft (``pip install -e '.[bench]'``; a benchmark-only extra, never needed by noloco) runs
the way its documentation sets it up: one ``torchft_lighthouse --min_replicas N`` and each
replica group under its own ``torchrun`` with ``TORCHFT_LIGHTHOUSE`` set; the replica group's
``Manager`` (synchronous quorum, gloo process group) drives ``torchft.local_sgd.DiLoCo``, whose
hooks on the inner optimizer do the outer steps. noloco runs ``python -m noloco train``. Both
sides train the same model (``noloco.model.build`` of ``--preset``, seed 0) on the same
batches (noloco's sharded reader: replica r reads shard r), AdamW with the same learning-rate
schedule (``noloco.train.lr_at``), gradient clipping at 1.0, outer SGD with Nesterov momentum
(lr 0.7, μ 0.9), one torch thread per replica.

Cases:

- ``diloco``: H inner steps, then the outer step. torchft with ``init_sync=False``: after k
  outer steps the parameters agree with noloco's to float32 rounding (torchft averages the
  outer gradients φ − θ_r, noloco the fast weights θ_r, then takes φ − mean).
- ``diloco_init_sync``: torchft with its default ``init_sync=True``. At the first quorum
  (after the first H steps) replica 1 heals from replica 0 and its H steps are thrown away:
  the first outer step equals the one computed from replica 0's fast weights alone,
  φ₁ = φ₀ − lr·(1 + μ)·(φ₀ − θ₀) — checked against replica 0's θ₀ captured in the
  ``diloco`` case.
- ``streaming``: P fragments (noloco's strided split of the blocks), τ = 0. torchft syncs its
  fragment k after (k + 1)·H/P steps, noloco its fragment p after p·H/P (fragment 0 after H),
  so torchft gets noloco's fragments in the order 1, …, P−1, 0; then the schedules coincide
  and the parameters agree like DiLoCo's.
- ``streaming_overlap``: τ = 1 with merge α = 0.5 on both sides (torchft's
  ``fragment_sync_delay`` and ``fragment_update_alpha``), compared for cost only: torchft
  starts a fragment's exchange τ steps before its turn and completes it on its turn, noloco
  starts on its turn and completes τ steps later, so their first windows differ by τ steps.

Quantised exchanges are not compared: torchft's quantised all-reduce needs CUDA (Triton).

Cost, per case: inner-step tokens/s (all replicas; median step time of the steps without an
outer step, seen from outside the same way on both sides: noloco's progress lines, torchft's
clock after each inner step), seconds per outer step (median outer-step step time minus
median inner step time: the time an outer step adds, quorum and commit included for
torchft), peak resident memory of a replica's process, and bytes sent per replica — the
payload of every all-reduce under the ring model 2·(N−1)/N·S (noloco's own accounting;
torchft's counted by wrapping ``Manager.allreduce``, with the number of all-reduce calls).
Runs alternate sides (noloco first in even repeats); costs are medians over ``--repeats``.

    python benchmarks/vs_torchft.py            # the recorded run (~6 min)
    python benchmarks/vs_torchft.py --quick    # smoke run, results in the temp directory
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TORCHFT_VERSION = "0.2.0"
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
TOLERANCE = 1e-5  # float32 rounding of a few outer steps; a real difference is ~1e-3 and up
CASES = ("diloco", "diloco_init_sync", "streaming", "streaming_overlap")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="builtin", help="training text (default: built-in corpus)")
    p.add_argument("--preset", default="tiny", help="model preset")
    p.add_argument("--replicas", type=int, default=2, help="replicas N (replica groups)")
    p.add_argument("--sync-every", type=int, default=20, help="H, inner steps per outer step")
    p.add_argument("--outer-steps", type=int, default=3, help="k, outer steps per run")
    p.add_argument("--fragments", type=int, default=2, help="P, streaming fragments")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step per replica")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="inner AdamW peak learning rate")
    p.add_argument("--warmup", type=int, default=10, help="inner warm-up steps")
    p.add_argument("--repeats", type=int, default=2, help="runs of each side per case")
    p.add_argument("--quick", action="store_true", help="smoke run: H 8, 2 outer steps, once")
    p.add_argument("--out-dir", default=None, help="where the JSON and PNG go "
                   "(default: the scratch directory; benchmarks/results with --record)")
    common.add_record_flag(p)
    p.add_argument("--ft-worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.sync_every, a.outer_steps, a.repeats, a.batch_size, a.seq_len = 8, 2, 1, 4, 64
        a.warmup = 2
    if a.replicas < 2 or a.outer_steps < 1 or a.repeats < 1:
        p.error("need --replicas >= 2, --outer-steps >= 1, --repeats >= 1")
    if a.fragments < 2 or a.sync_every % a.fragments or a.sync_every // a.fragments < 2:
        p.error(f"--sync-every {a.sync_every} must be a multiple of --fragments {a.fragments} "
                f"(>= 2) with H/P >= 2 (the overlap case needs tau = 1 < H/P)")
    return a


def case_settings(case: str, a: argparse.Namespace) -> dict[str, Any]:
    """What one case runs: fragments P, overlap τ, merge α, torchft's init_sync."""
    streaming = case.startswith("streaming")
    return {"fragments": a.fragments if streaming else 1,
            "overlap": 1 if case == "streaming_overlap" else 0,
            "alpha": 0.5 if case == "streaming_overlap" else 0.0,
            "init_sync": case == "diloco_init_sync"}


# ---- one torchft replica group (one process under torchrun) --------------------------------

def ft_worker(spec_path: str) -> None:
    from datetime import timedelta

    import torch
    from safetensors.torch import save_file
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from noloco.data import ShardedReader, load_corpus, make_tokenizer
    from noloco.methods.engine import split_model
    from noloco.model import build, lm_loss, preset
    from noloco.train import lr_at

    spec = json.loads(Path(spec_path).read_text())
    r, n, H = int(os.environ["REPLICA_GROUP_ID"]), spec["replicas"], spec["sync_every"]
    P, steps = spec["fragments"], spec["sync_every"] * spec["outer_steps"]
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    tok = make_tokenizer("bytes")
    corpus = load_corpus(spec["data"], tok, spec["seq_len"])
    reader = ShardedReader(corpus.train, spec["seq_len"], spec["batch_size"], r, n, seed=0)
    args = preset(spec["preset"], vocab_size=tok.vocab_size)
    model = build(args, seed=0)
    inner = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95),
                              weight_decay=0.0)
    # noloco's fragments (strided blocks), in the order torchft's schedule reaches them.
    named = list(model.named_parameters())
    _, groups = split_model(named, P, "strided", args.n_layers)
    order = list(range(1, P)) + [0] if P > 1 else [0]
    fragments = []
    for p in order:
        holder = torch.nn.Module()
        holder.params = torch.nn.ParameterList([named[i][1] for i in groups[p]])
        fragments.append(holder)
    outer = [torch.optim.SGD(f.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                             nesterov=True) for f in fragments]

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=120)),
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=n, use_async_quorum=False, init_sync=spec["init_sync"],
                      replica_id=f"replica_{r}", hostname="127.0.0.1",
                      timeout=timedelta(seconds=120), quorum_timeout=timedelta(seconds=120))
    sent = {"bytes": 0, "calls": 0}
    plain_allreduce = manager.allreduce

    def counted_allreduce(tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
        s = tensor.numel() * tensor.element_size()
        sent["bytes"] += 2 * (n - 1) * s // n
        sent["calls"] += 1
        return plain_allreduce(tensor, *args, **kw)

    manager.allreduce = counted_allreduce  # type: ignore[method-assign]
    out = Path(spec["out"])
    local_steps = [0]

    def before_first_sync(*_: Any) -> None:
        # Registered before DiLoCo's own hook, so it sees the fast weights θ of the first
        # outer step before torchft touches them (P = 1: the whole model syncs after H).
        local_steps[0] += 1
        if local_steps[0] == H and P == 1:
            save_file({k: v.detach().clone() for k, v in model.state_dict().items()},
                      str(out / f"theta0-replica{r}.safetensors"))

    inner.register_step_post_hook(before_first_sync)
    marks, phis = [], []
    with DiLoCo(manager, fragments, inner, outer, sync_every=H,
                fragment_sync_delay=spec["overlap"], fragment_update_alpha=spec["alpha"]):
        for step in range(steps):
            for g in inner.param_groups:
                g["lr"] = lr_at(step, spec["lr"], spec["warmup"], steps)
            x, y = reader.next_batch()
            loss = lm_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            inner.step()  # torchft's hook takes the outer step (of a fragment) when due
            inner.zero_grad(set_to_none=True)
            marks.append(time.perf_counter())
            if P == 1 and (step + 1) == H:
                phis.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
              str(out / f"final-replica{r}.safetensors"))
    if phis:
        save_file(phis[0], str(out / f"phi1-replica{r}.safetensors"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (out / f"ft-replica{r}.json").write_text(json.dumps({
        "marks": marks, "bytes_sent": sent["bytes"], "allreduce_calls": sent["calls"],
        "peak_rss_bytes": peak, "outer_steps": manager.current_step(), "loss": loss.item()}))
    manager.shutdown(wait=False)


def run_torchft(a: argparse.Namespace, case: str, out: Path) -> dict[str, Any]:
    """One torchft run: a lighthouse and N replica groups under torchrun."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {"replicas": a.replicas, "sync_every": a.sync_every, "outer_steps": a.outer_steps,
            "preset": a.preset, "data": a.data, "batch_size": a.batch_size,
            "seq_len": a.seq_len, "lr": a.lr, "warmup": a.warmup, "out": str(out),
            **case_settings(case, a)}
    (out / "spec.json").write_text(json.dumps(spec))
    port = common.free_port()
    lighthouse_bin = shutil.which("torchft_lighthouse")
    if lighthouse_bin is None:
        raise RuntimeError("torchft_lighthouse is not on PATH (pip install -e '.[bench]')")
    log = open(out / "lighthouse.log", "w")  # noqa: SIM115 - closed below
    lighthouse = subprocess.Popen(
        [lighthouse_bin, "--min_replicas", str(a.replicas), "--bind", f"127.0.0.1:{port}",
         "--join_timeout_ms", "2000", "--quorum_tick_ms", "50"], stdout=log, stderr=log)
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo", RUST_LOG="error")
    procs = []
    try:
        for r in range(a.replicas):
            logf = open(out / f"replica{r}.log", "w")  # noqa: SIM115 - inherited by the child
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "1", "--max-restarts", "0", __file__,
                 "--ft-worker", str(out / "spec.json")],
                env=dict(env, REPLICA_GROUP_ID=str(r)), stdout=logf, stderr=subprocess.STDOUT))
            logf.close()
        deadline = time.monotonic() + 900
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() for p in procs):
                break
            time.sleep(0.2)
        bad = [r for r, p in enumerate(procs) if p.poll() != 0]
        if bad:
            tail = (out / f"replica{bad[0]}.log").read_text().splitlines()[-25:]
            raise RuntimeError(f"torchft replica {bad[0]} failed ({case}):\n" + "\n".join(tail))
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
        lighthouse.terminate()
        lighthouse.wait(30)
        log.close()
    reps = [json.loads((out / f"ft-replica{r}.json").read_text()) for r in range(a.replicas)]
    marks = reps[0]["marks"]
    return {"step_seconds": [b - c for c, b in zip(marks, marks[1:], strict=False)],
            "bytes_sent_per_replica": statistics.mean(x["bytes_sent"] for x in reps),
            "allreduce_calls_per_replica": statistics.mean(x["allreduce_calls"] for x in reps),
            "peak_rss_bytes": max(x["peak_rss_bytes"] for x in reps),
            "outer_steps_committed": reps[0]["outer_steps"]}


# ---- noloco ----------------------------------------------------------------------------------

def run_noloco(a: argparse.Namespace, case: str, out: Path) -> dict[str, Any]:
    s = case_settings(case, a)
    steps = a.sync_every * a.outer_steps
    method = (["--method", "streaming", "--fragments", str(s["fragments"]),
               "--fragment-pattern", "strided", "--overlap-steps", str(s["overlap"]),
               "--merge-alpha", str(s["alpha"] if s["overlap"] else 0.5)]
              if s["fragments"] > 1 else ["--method", "diloco"])
    step_s, summary = common.run_noloco_timed(
        [*method, "--replicas", str(a.replicas), "--sync-every", str(a.sync_every),
         "--outer-lr", str(OUTER_LR), "--outer-momentum", str(OUTER_MOMENTUM),
         "--preset", a.preset, "--data", a.data, "--steps", str(steps),
         "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--lr", str(a.lr),
         "--warmup", str(a.warmup), "--weight-decay", "0", "--grad-clip", "1.0",
         "--eval-every", str(steps),
         "--eval-sequences", str(a.batch_size),
         "--checkpoint-every", "0",
         "--device", "cpu", "--seed", "0"], out)
    return {"step_seconds": step_s, "bytes_sent_per_replica": summary["bytes_sent"],
            "peak_rss_bytes": summary["peak_rss_bytes"],
            "outer_steps_committed": summary["outer_steps"], "run": str(out)}


# ---- comparing ------------------------------------------------------------------------------

def max_abs_diff(x: dict[str, Any], y: dict[str, Any]) -> float:
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


def noloco_final(run: Path, r: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(run / "model" / f"replica-{r}.safetensors"))


def numerics(a: argparse.Namespace, case: str, ft_out: Path, nl_run: Path | None,
             ref_out: Path | None) -> dict[str, Any]:
    from safetensors.torch import load_file

    ft = [load_file(str(ft_out / f"final-replica{r}.safetensors")) for r in range(a.replicas)]
    res: dict[str, Any] = {"replicas_equal_in_torchft": max_abs_diff(ft[0], ft[1])}
    if nl_run is not None:
        res["max_abs_diff_to_noloco"] = max(max_abs_diff(ft[r], noloco_final(nl_run, r))
                                            for r in range(a.replicas))
        res["agree"] = res["max_abs_diff_to_noloco"] <= TOLERANCE
    if case == "diloco_init_sync" and ref_out is not None:
        # φ₁ computed from replica 0's θ₀ alone (replica 1 healed from it), against torchft's
        # φ₁ with init_sync=True, and against the φ₁ of an average of both replicas' θ₀.
        import torch

        phi0 = {k: v.detach() for k, v in _initial_state(a).items()}
        th = [load_file(str(ref_out / f"theta0-replica{r}.safetensors"))
              for r in range(a.replicas)]
        phi1 = load_file(str(ft_out / "phi1-replica0.safetensors"))

        def step_from(thetas: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
            return {k: phi0[k] - OUTER_LR * (1 + OUTER_MOMENTUM)
                    * (phi0[k] - sum(t[k] for t in thetas) / len(thetas)) for k in phi0}

        res["phi1_diff_to_replica0_only_step"] = max_abs_diff(phi1, step_from(th[:1]))
        res["phi1_diff_to_all_replicas_step"] = max_abs_diff(phi1, step_from(th))
        res["replica1_first_steps_discarded"] = (
            res["phi1_diff_to_replica0_only_step"] <= TOLERANCE
            < res["phi1_diff_to_all_replicas_step"])
    return res


def _initial_state(a: argparse.Namespace) -> dict[str, Any]:
    from noloco.data import make_tokenizer
    from noloco.model import build, preset

    model = build(preset(a.preset, vocab_size=make_tokenizer("bytes").vocab_size), seed=0)
    return model.state_dict()


def costs(a: argparse.Namespace, case: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats of: inner tokens/s, seconds an outer step adds, peak RSS, bytes."""
    s = case_settings(case, a)
    every = a.sync_every // s["fragments"]  # a (fragment's) outer step after every H/P steps
    tokens = a.replicas * a.batch_size * a.seq_len
    per_run = []
    for run in runs:
        # step_seconds[i] is the time of inner step i + 2 (counted from 1): the first step,
        # which warms up, has no interval.
        times = run["step_seconds"]
        outer_i = [i for i in range(len(times)) if (i + 2) % every == 0]
        # torchft starts the exchange τ steps early: count those steps as outer steps too.
        if s["overlap"]:
            outer_i += [i for i in range(len(times)) if (i + 2 + s["overlap"]) % every == 0]
        inner_t = [x for i, x in enumerate(times) if i not in outer_i]
        inner = statistics.median(inner_t)
        per_run.append({"inner_tokens_per_second": tokens / inner,
                        "outer_step_added_seconds": statistics.median(
                            times[i] for i in sorted(set(outer_i))) - inner,
                        "peak_rss_mib": run["peak_rss_bytes"] / 2**20,
                        "bytes_sent_per_replica": run["bytes_sent_per_replica"]})
    out = {k: statistics.median(r[k] for r in per_run) for k in per_run[0]}
    out["repeats"] = per_run
    return out


# ---- the driver ----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.ft_worker:
        ft_worker(a.ft_worker)
        return 0
    try:
        from importlib.metadata import version

        import torchft  # noqa: F401

        have = version("torchft")
    except ImportError:
        print("vs_torchft: torchft is not installed (pip install -e '.[bench]')",
              file=sys.stderr)
        return 2
    if have != TORCHFT_VERSION:
        print(f"vs_torchft: needs torchft {TORCHFT_VERSION}, found {have}", file=sys.stderr)
        return 2
    json_path, png_path = common.out_paths("vs_torchft", a.out_dir, a.quick, a.record)
    rec = common.start_record("vs_torchft", vars(a))
    rec["torchft"] = have
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="noloco-vs-torchft-") as tmp_s:
        tmp = Path(tmp_s)
        for case in CASES:
            sides: dict[str, list[dict[str, Any]]] = {"noloco": [], "torchft": []}
            for rep in range(a.repeats):
                order = ("noloco", "torchft") if rep % 2 == 0 else ("torchft", "noloco")
                for side in order:
                    if side == "noloco" and case == "diloco_init_sync":
                        continue  # the same noloco run as "diloco"
                    out = tmp / f"{case}-{side}-{rep}"
                    run = (run_noloco if side == "noloco" else run_torchft)(a, case, out)
                    run["load_average"] = common.load_average()
                    sides[side].append(run)
            ref = tmp / "diloco-torchft-0"
            nl = (tmp / "diloco-noloco-0" if case == "diloco_init_sync"
                  else tmp / f"{case}-noloco-0")
            res = {"settings": case_settings(case, a),
                   "numerics": numerics(a, case, tmp / f"{case}-torchft-0", nl,
                                        ref if case == "diloco_init_sync" else None),
                   "torchft": costs(a, case, sides["torchft"]),
                   "torchft_allreduce_calls_per_replica":
                       sides["torchft"][0]["allreduce_calls_per_replica"],
                   "torchft_outer_steps_committed": sides["torchft"][0]["outer_steps_committed"]}
            if sides["noloco"]:
                res["noloco"] = costs(a, case, sides["noloco"])
            results[case] = res
            print(summary_line(case, res), flush=True)
    results["tolerance"] = TOLERANCE
    common.write_json(json_path, common.finish_record(rec, results, time.perf_counter() - t0))
    drawn = plot(results, png_path)
    print(f"wrote {json_path}" + (f" and {drawn}" if drawn else " (no plot: no matplotlib)"))
    return 0


def summary_line(case: str, res: dict[str, Any]) -> str:
    num, ft = res["numerics"], res["torchft"]
    parts = [f"{case}:"]
    if "max_abs_diff_to_noloco" in num:
        parts.append(f"max |noloco - torchft| {num['max_abs_diff_to_noloco']:.2e}")
    if "phi1_diff_to_replica0_only_step" in num:
        parts.append(f"phi1 vs replica-0-only step {num['phi1_diff_to_replica0_only_step']:.2e}"
                     f", vs both replicas {num['phi1_diff_to_all_replicas_step']:.2e}")
    for side in ("noloco", "torchft"):
        if side in res:
            c = res[side] if side == "noloco" else ft
            parts.append(f"{side} {c['inner_tokens_per_second']:,.0f} tok/s, outer "
                         f"+{c['outer_step_added_seconds']:.3f} s, {c['peak_rss_mib']:.0f} MiB, "
                         f"{c['bytes_sent_per_replica'] / 1e6:.1f} MB")
    return " | ".join(parts)


def plot(results: dict[str, Any], path: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    cases = [c for c in CASES if "noloco" in results[c]]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    keys = (("inner_tokens_per_second", "inner tokens/s (all replicas)"),
            ("outer_step_added_seconds", "seconds an outer step adds"),
            ("peak_rss_mib", "peak RSS per replica (MiB)"))
    for ax, (key, label) in zip(axes, keys, strict=True):
        xs = range(len(cases))
        ax.bar([x - 0.2 for x in xs], [results[c]["noloco"][key] for c in cases], 0.4,
               label="noloco")
        ax.bar([x + 0.2 for x in xs], [results[c]["torchft"][key] for c in cases], 0.4,
               label="torchft 0.2.0")
        ax.set_xticks(list(xs), cases, fontsize=8)
        ax.set_ylabel(label)
    axes[0].legend()
    return common.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
