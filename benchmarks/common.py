"""Shared helpers of the benchmark scripts: the self-describing record, JSON, statistics, plots.

Every benchmark writes one JSON record (into ``benchmarks/results/`` with ``--record``, else
into the scratch directory, so a re-run never overwrites the record) holding what it measured
together with everything needed to judge and re-run it: the full config, the exact command
line, Python / torch / numpy versions, the CPU model, core count, memory, the load average of
the machine while it ran (other processes share it), the git commit, and the date.
Plots use matplotlib, imported only when a plot is drawn (it is an optional dependency).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
DEFAULT_DATA = "builtin"
"""Data every clone has (noloco's built-in corpus). Records taken on another text say so in
their command (``--data``)."""
SCRATCH = Path(tempfile.gettempdir()) / "noloco-bench"
"""Where a run writes unless it is --record-ed (or given --out-dir): never over the record."""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def threads(processes: int = 1) -> int:
    """The threads each of ``processes`` processes of a benchmark may use: the cores divided
    among them (at least 1), at most OMP_NUM_THREADS where that is set — a cap per process,
    as noloco's workers count it (``noloco.distributed.default_threads``)."""
    n = max(1, cores() // max(processes, 1))
    cap = os.environ.get("OMP_NUM_THREADS", "").strip()
    return min(n, int(cap)) if cap.isdigit() and int(cap) > 0 else n


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        return None


def wait_for_quiet(max_wait_s: float, max_load: float | None = None, poll_s: float = 5.0
                   ) -> list[float] | None:
    """Wait (at most ``max_wait_s``) until the 1-minute load average is below ``max_load``
    (default: the core count), so a shared machine's other work disturbs the timing less.
    Returns the load average when the wait ended."""
    limit = cores() if max_load is None else max_load
    deadline = time.monotonic() + max_wait_s
    while True:
        load = load_average()
        if load is None or load[0] < limit or time.monotonic() >= deadline:
            return load
        time.sleep(poll_s)


def git_commit() -> str | None:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        return sha or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict[str, Any]:
    """Hardware and software this run measured on."""
    import numpy
    import torch

    return {
        "cpu": cpu_model(),
        "cores": cores(),
        "memory_gib": memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch_threads_default": torch.get_num_threads(),
        "git_commit": git_commit(),
    }


def start_record(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """The head of a benchmark's JSON record; fill ``results`` and call :func:`finish_record`."""
    return {
        "benchmark": name,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "config": config,
        "machine": machine(),
        "load_average_start": load_average(),
        "results": None,
    }


def finish_record(rec: dict[str, Any], results: Any, seconds: float) -> dict[str, Any]:
    rec["results"] = results
    rec["load_average_end"] = load_average()
    rec["benchmark_seconds"] = round(seconds, 1)
    return rec


def write_record(path: Path, rec: dict[str, Any], results: Any, started: float) -> Path:
    """Finish ``rec`` with ``results`` and the seconds since ``started`` (a ``perf_counter``
    reading) and write it to ``path``."""
    return write_json(path, finish_record(rec, results, time.perf_counter() - started))


def config_of(a: Any, leave_out: Sequence[str] = ("out_dir", "runs_dir")) -> dict[str, Any]:
    """A benchmark's flags as its record's config: all but where it writes (``leave_out``),
    which says nothing of what was measured."""
    return {k: v for k, v in vars(a).items() if k not in leave_out}


def print_verdict(verdict: dict[str, Any]) -> None:
    """One line per target: a number as it is, a judgement as met or MISSED."""
    for k, v in verdict.items():
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {'met' if v else 'MISSED'}")


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: Path, obj: Any) -> Path:
    """Write ``obj`` (NaN → null) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def quartiles(xs: Sequence[float]) -> dict[str, float]:
    """Median, first and third quartile, min, max and count of ``xs``."""
    xs = sorted(float(x) for x in xs)
    if not xs:
        raise ValueError("no samples")
    if len(xs) == 1:
        q1 = med = q3 = xs[0]
    else:
        q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": med, "q1": q1, "q3": q3, "min": xs[0], "max": xs[-1], "n": len(xs)}


def pyplot() -> Any | None:
    """matplotlib.pyplot with a file-only backend, or None (with a note) if not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install 'noloco[plot]'): no plot drawn",
              file=sys.stderr)
        return None
    return plt


def save_figure(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def out_paths(name: str, out_dir: str | Path | None, quick: bool, record: bool = False
              ) -> tuple[Path, Path]:
    """JSON and PNG paths of a benchmark: ``out_dir`` if given; ``benchmarks/results/`` (the
    committed record) only with ``--record``; else the scratch directory, so re-running a
    benchmark never overwrites the record by accident. --quick adds a suffix."""
    if out_dir:
        d = Path(out_dir)
    elif record and not quick:
        d = RESULTS
    else:
        d = SCRATCH
    stem = f"{name}_quick" if quick else name
    return d / f"{stem}.json", d / f"{stem}.png"


def plot_bytes_in_time(ax: Any, results: dict[str, dict[str, Any]], solid: str,
                       label: Callable[[str, Any], str | None]) -> None:
    """MB sent against seconds since the start, one line per replica and run (``results``:
    run name → its ``t0`` and ``metrics``, replica → its records): the run named ``solid``
    drawn solid, the others dotted; ``label(run, replica)`` names a line (None: unnamed)."""
    for n, r in results.items():
        for rep, recs in r["metrics"].items():
            ax.plot([x["t"] - r["t0"] for x in recs], [x["bytes_sent"] / 1e6 for x in recs],
                    "-" if n == solid else ":", label=label(n, rep), color=f"C{int(rep) % 10}",
                    lw=1.4 if n == solid else 1.0)


def wrote(json_path: Path, png_path: Path | None) -> str:
    """The last line of a benchmark: what it wrote (``png_path`` None: no plot was drawn)."""
    return f"wrote {json_path}" + (f" and {png_path}" if png_path else
                                   " (no plot: no matplotlib)")


@contextlib.contextmanager
def run_dirs(given: str | None, prefix: str) -> Iterator[Path]:
    """Where a benchmark's runs write their run directories: ``given`` (made if missing, and
    kept), else a temporary directory removed when the block ends."""
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield Path(tmp)


def add_record_flag(p: Any) -> None:
    p.add_argument("--record", action="store_true",
                   help="write the JSON and PNG into benchmarks/results/ (the committed record); "
                   "default: the scratch directory " + str(SCRATCH))


# ---- a training benchmark's flags and runs ------------------------------------------------

RUN_FLAGS: dict[str, tuple[type, str]] = {
    "data": (str, "training text (default: the built-in corpus)"),
    "preset": (str, "model preset"),
    "replicas": (int, "replicas N (processes)"),
    "stages": (int, "pipeline stages P"),
    "steps": (int, "inner steps per replica"),
    "batch_size": (int, "sequences per step per replica"),
    "seq_len": (int, "tokens per sequence"),
    "microbatches": (int, "pipeline microbatches per step (0: the default, 2 x stages)"),
    "lr": (float, "peak inner AdamW learning rate"),
    "warmup": (int, "linear warm-up steps"),
    "sync_every": (int, "H of DiLoCo and NoLoCo"),
    "eval_every": (int, "evaluate every K steps"),
    "eval_batches": (int, "validation batches per eval"),
    "seed": (int, "seed of every run"),
}
"""the flags of ``noloco train`` a training benchmark passes on: their types and help"""


def add_run_flags(p: Any, helps: dict[str, str] | None = None, **defaults: Any) -> None:
    """``--name`` for each of ``defaults`` (in that order; names of :data:`RUN_FLAGS`, help
    from there unless ``helps`` says otherwise)."""
    for name, default in defaults.items():
        kind, text = RUN_FLAGS[name]
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default,
                       help=(helps or {}).get(name, text))


def add_output_flags(p: Any, runs_dir: str | None = "a temporary directory",
                     wait_quiet: bool = True) -> None:
    """``--runs-dir`` (unless ``runs_dir``, where the run directories go without it, is None),
    ``--wait-quiet`` (where asked), ``--out-dir`` and ``--record``."""
    if runs_dir is not None:
        p.add_argument("--runs-dir", default=None,
                       help=f"keep the run directories here (default: {runs_dir})")
    if wait_quiet:
        p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                       help="before each run, wait up to this long for the load average to "
                       "drop below the core count (the machine may be shared)")
    p.add_argument("--out-dir", default=None, help="where the JSON and PNG go "
                   "(default: the scratch directory; benchmarks/results with --record)")
    add_record_flag(p)


def check_at_least_one(p: Any, a: Any, *names: str) -> None:
    """argparse error unless every flag of ``names`` is at least 1."""
    for name in names:
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")


def check_pairs(p: Any, replicas: int) -> None:
    """argparse error unless ``replicas`` is even and at least 2 (NoLoCo pairs replicas)."""
    if replicas < 2 or replicas % 2:
        p.error("--replicas must be even and >= 2 (NoLoCo pairs replicas)")


def replica_counts(p: Any, text: str, least: int, why: str = "") -> list[int]:
    """The counts of a ``--replicas`` list ("1,4,8"); argparse error unless each is at least
    ``least`` (``why`` says why, after the bound)."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        p.error("--replicas takes numbers separated by commas, e.g. "
                f"{p.get_default('replicas')}")
    if not counts or min(counts) < least:
        p.error(f"--replicas: each count must be >= {least}{why}")
    return counts


def flags(**values: Any) -> list[str]:
    """``--name value`` for each keyword, in the order given: underscores become dashes, a
    value is written as ``str`` writes it (so a command names a flag's value as it always
    did: ``0.003``, ``5.0``)."""
    return [x for name, value in values.items()
            for x in (f"--{name.replace('_', '-')}", str(value))]


NOLOCO = (sys.executable, "-m", "noloco")
"""the ``noloco`` command, in this interpreter (so in this environment)"""


def train_argv(args: Sequence[str], out: Path | str, after: Sequence[str] = ()) -> list[str]:
    """The arguments of ``noloco`` for a training run: ``train ARGS --out OUT --overwrite
    AFTER`` (a fresh run directory at ``out``, whatever an earlier run left there)."""
    return ["train", *args, "--out", str(out), "--overwrite", *after]


def noloco_train(args: Sequence[str], out: Path | str, after: Sequence[str] = ()
                 ) -> list[str]:
    """:data:`NOLOCO` :func:`train_argv`: the command of a training run."""
    return [*NOLOCO, *train_argv(args, out, after)]


def train_command(a: Any, out: Path, method: list[str], rest: list[str] = ()) -> list[str]:
    """``python -m noloco train``: ``method`` (the method and its layout), then the flags
    every training benchmark passes on from ``a`` (preset, data, steps, batch, sequence,
    learning rate, warm-up, evaluation, seed, on the CPU, into ``out``), then ``rest``."""
    return noloco_train([*method, *flags(
        preset=a.preset, data=a.data, steps=a.steps, batch_size=a.batch_size,
        seq_len=a.seq_len, lr=a.lr, warmup=a.warmup, eval_every=a.eval_every,
        eval_sequences=a.eval_batches * a.batch_size, seed=a.seed, device="cpu")], out, rest)


def run_checked(cmd: list[str], name: str | None = None, env: dict[str, str] | None = None
                ) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``cmd`` to its end, its output captured; the finished process and its wall
    seconds. RuntimeError, naming ``name`` (else the command) and quoting the end of its
    stderr, if it failed."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name or shlex.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return proc, wall


def read_summary(out: Path) -> dict[str, Any]:
    """The summary.json of the run directory ``out``."""
    return json.loads((Path(out) / "summary.json").read_text())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (metrics.jsonl), blank lines skipped; none if the
    file is not there yet."""
    path = Path(path)
    if not path.is_file():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def sample_loads(running: Any, loads: list[float], every: float = 5.0) -> None:
    """Append the 1-minute load average to ``loads`` every ``every`` seconds while
    ``running()`` (the first sample at once)."""
    while running():
        if (load := load_average()) is not None:
            loads.append(load[0])
        time.sleep(every)


def load_stats(loads: Sequence[float]) -> dict[str, float | None]:
    """Mean (to 2 places) and maximum of sampled load averages; None where none was taken."""
    return {"mean": round(sum(loads) / len(loads), 2) if loads else None,
            "max": max(loads, default=None)}


CURVE_KEYS = ("step", "tokens", "tokens_per_replica", "val_loss", "train_loss", "bytes_sent",
              "sync_seconds", "wall_seconds", "weight_spread")
"""what a benchmark keeps of each evaluation in metrics.jsonl"""


def kept(summary: dict[str, Any], keep: Sequence[str]) -> dict[str, Any]:
    """The ``keep`` keys of a run's summary.json, as a benchmark records them. A record's
    ``bytes_sent_per_replica`` is one replica's bytes (the mean over the replicas): what
    summary.json called it before its format 2 (issue 33), ``bytes_sent`` there now — the
    committed records keep their field."""
    return {k: summary.get("bytes_sent" if k == "bytes_sent_per_replica" else k)
            for k in keep}


def run_and_read(cmd: list[str], out: Path, name: str, keep: Sequence[str],
                 wait_quiet: float = 0.0, curve: Sequence[str] = CURVE_KEYS
                 ) -> dict[str, Any]:
    """Run a ``noloco train`` command (after waiting up to ``wait_quiet`` seconds for a quiet
    machine); the record of it: the command as typed, the ``keep`` keys of its summary, its
    process seconds, the load before it, and the ``curve`` keys of each evaluation.
    RuntimeError if it failed."""
    load = wait_for_quiet(wait_quiet) if wait_quiet else load_average()
    _, wall = run_checked(cmd, name)
    summary = read_summary(out)
    metrics = read_jsonl(out / "metrics.jsonl")
    return {
        "command": " ".join(cmd[2:]),  # as typed: noloco train ...
        "summary": kept(summary, keep),
        "process_seconds": wall,
        "load_average_before": load,
        "curve": [{k: m.get(k) for k in curve} for m in metrics],
    }


def check_data(p: Any, data: str) -> None:
    """argparse error unless ``data`` is 'builtin', an existing path or hf:..."""
    if data != "builtin" and not data.startswith("hf:") and not Path(data).exists():
        p.error(f"data not found: {data} (the default, 'builtin', needs no file)")


def run_noloco_timed(args: Sequence[str], out: Path) -> tuple[list[float], dict[str, Any]]:
    """``python -m noloco train ARGS --log-every 1 --out OUT``, with the arrival time of every
    progress line ("step N/S | ..."): the seconds between consecutive inner steps, as seen from
    outside, and the run's summary.json."""
    import re
    import threading

    cmd = noloco_train([*args, "--log-every", "1"], out)
    marks: list[float] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr))
    reader.start()
    for line in proc.stdout:
        if re.match(r"^step +\d+/", line):
            marks.append(time.perf_counter())
    reader.join()
    if proc.wait():
        raise RuntimeError(f"the noloco run failed ({shlex.join(cmd)}):\n" + "".join(err[-30:]))
    summary = read_summary(out)
    return [b - c for c, b in zip(marks, marks[1:], strict=False)], summary


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
