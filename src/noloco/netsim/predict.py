"""Predict a real run's wall-clock on another network: ``noloco netsim predict RUN_DIR``.

The run directory gives the measured compute (``compute_seconds``, ``step_seconds``), the model
size (``param_bytes``) and the layout (``replicas``, ``stages``); the network is a bandwidth B
(bits/s, per worker, each direction) and a per-message latency. For every method the
prediction is ``wall = compute_seconds + exposed synchronisation seconds`` and
``compute utilisation = compute_seconds / wall``.

Assumptions (also in docs/netsim.md):

P1. Bytes are the methods' own: :func:`noloco.methods.wire.sync_bytes`, the function their
    communication is accounted with, applied to the run's model (``model/model.json``): DDP's
    buckets, each fragment of each pipeline stage (stages synchronise their own parameters in
    parallel, each on its own link), the run's quantisation format (with its block scales;
    quantised NoLoCo also sends its slow-weight drift in int8) and, for NoLoCo with γ ≠ β,
    θ and φ. A prediction's bytes for the run's own method are the run's bytes, exactly. A
    run without ``model/model.json`` is split evenly (approximate); ``wire_bits`` overrides
    the bits per value (no framing). ``--precision bf16`` changes no byte here: replicas
    exchange their fp32 master weights (or ``--quantize``'s format); the activations between
    pipeline stages, which bf16 halves, are part of the measured step time (P5) and of the
    run's own ``activation_bytes`` (``noloco report`` shows them with the precision).
P2. All-reduce (ddp, diloco, streaming) = ring all-reduce over the N replicas:
    ``2 (N - 1) / N * S`` bytes through each worker's link and 2 (N - 1) latency terms (a
    DDP step: one such all-reduce per bucket). A compressed exchange (sparseloco, and a
    diloco or streaming run's own ``--compress``) is an all-gather of every replica's sparse
    message of S bytes: ``(N - 1) * S`` bytes through each worker's link, growing with N, and
    N - 1 latency terms (a ring's steps).
P3. NoLoCo group exchange: every member sends its S bytes to each of the other n - 1 members
    of its group, all at once on a full-duplex link: ``(n - 1) * S`` bytes and one latency term
    by default (``pair_latency_terms=2`` gives the paper's 2 t_c count).
P4. No overlap for ddp (gradients are reduced after the backward pass; real DDP overlaps
    buckets with the backward pass, so this is an upper bound) and diloco/noloco (the outer
    step blocks). Streaming sends P fragments of S/P, one every H/P steps; with overlap tau a
    fragment's sync is hidden behind tau inner steps: exposed = max(0, t - tau * step_seconds).
    Streaming takes P and tau from the run's config.json (1 and 0 unless the run set them) or
    from ``fragments`` / ``overlap_steps``; a NoLoCo run's own fragments, tau and
    ``quantize`` apply to the noloco prediction only (and a streaming run's quantize to
    streaming only). H is ``sync_every``, else the run's H, else 100 for diloco and 50 for
    noloco/streaming.
P5. Step times are the run's measured mean (no stragglers; see ``netsim blocking`` for those).
    Evaluation, start-up and logging are not part of the predicted wall-clock.

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from noloco.netsim.latency import NetsimError
from noloco.rundir import upgrade_summary

METHODS = ("ddp", "diloco", "noloco", "streaming", "sparseloco")
"""Methods predicted by default (``single`` has nothing to synchronise)."""

DEFAULT_SYNC_EVERY = {"diloco": 100, "noloco": 50, "streaming": 50, "sparseloco": 50}
"""H when the run itself has none (the package's defaults, SPEC §2-§4)."""

ONE_REPLICA_DEFAULT = 8
"""N predicted for a one-replica run unless ``replicas`` says otherwise: one replica exchanges
nothing, so its own N would predict every method at 0 bytes (DiLoCo's paper trains 8)"""

SPARSELOCO_COMPRESS = "topk:0.02:2"
"""sparseloco's message when the run is not a sparseloco run (its default)"""


_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BANDWIDTH = re.compile(
    r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"
    r"(?P<prefix>[kKmMgGtT]?)(?P<unit>bit|bits|b|B|byte|bytes)?\s*(?P<per>/s|ps)?\s*$"
)
_LATENCY = re.compile(
    r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?P<unit>s|ms|us|µs|ns)?\s*$"
)
_LATENCY_UNITS = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str | float) -> float:
    """Bandwidth in bits/s from '100Mbit', '1Gbit', '10Gbit/s', '1Gbps', '125MB/s' or '1e9'.

    Prefixes are decimal (k = 1e3, M = 1e6, G = 1e9, T = 1e12). A capital 'B' (or 'byte')
    means bytes; a plain number, or a prefix alone ('100M'), is bits/s.
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _BANDWIDTH.match(text)
        if not m:
            raise NetsimError(
                f"cannot parse bandwidth {text!r} (try 100Mbit, 1Gbit, 10Gbit or plain bits/s)"
            )
        unit = m["unit"] or "bit"
        value = float(m["num"]) * _SI[m["prefix"].lower()]
        if unit in ("B", "byte", "bytes"):
            value *= 8
    if not (value > 0 and math.isfinite(value)):
        raise NetsimError(f"bandwidth must be > 0, got {text!r}")
    return value


def parse_latency(text: str | float) -> float:
    """Per-message latency in seconds from '50ms', '0.05', '200us' or '1s'."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _LATENCY.match(text)
        if not m:
            raise NetsimError(f"cannot parse latency {text!r} (try 50ms, 0.05 or 200us)")
        value = float(m["num"]) * _LATENCY_UNITS[m["unit"]]
    if not (value >= 0 and math.isfinite(value)):
        raise NetsimError(f"latency must be >= 0 seconds, got {text!r}")
    return value


def ring_allreduce_bytes(n: int, payload_bytes: float) -> float:
    """Bytes each worker sends in a ring all-reduce of ``payload_bytes`` over n workers."""
    return 2 * (n - 1) / n * payload_bytes if n > 1 else 0.0


def predict_sync_seconds(
    method: str,
    n: int,
    payload_bytes: float,
    bandwidth_bps: float,
    latency_s: float,
    *,
    group_size: int = 2,
    pair_latency_terms: int = 1,
) -> float:
    """Seconds of one synchronisation of ``payload_bytes`` per worker among n replicas (P2, P3).

    - ddp, diloco, streaming (one all-reduce or one fragment's all-reduce):
      ``2 (n - 1) / n * S * 8 / B + 2 (n - 1) * latency``;
    - noloco (one group exchange, group size g): ``(g - 1) * S * 8 / B + terms * latency``;
    - sparseloco (one all-gather of messages of S bytes):
      ``(n - 1) * S * 8 / B + (n - 1) * latency``;
    - single, or n = 1: 0.
    """
    if method not in (*METHODS, "single"):
        raise NetsimError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    if n < 1 or payload_bytes < 0 or not bandwidth_bps > 0 or latency_s < 0:
        raise NetsimError("need n >= 1, payload >= 0, bandwidth > 0 and latency >= 0")
    if method == "single" or n == 1:
        return 0.0
    if method == "noloco":
        g = min(group_size, n)
        return (g - 1) * payload_bytes * 8 / bandwidth_bps + pair_latency_terms * latency_s
    if method == "sparseloco":
        return (n - 1) * (payload_bytes * 8 / bandwidth_bps + latency_s)
    return ring_allreduce_bytes(n, payload_bytes) * 8 / bandwidth_bps + 2 * (n - 1) * latency_s


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """What the prediction needs from a run directory (summary.json + config.json)."""

    path: str
    method: str
    replicas: int
    stages: int
    steps: int
    params: int
    param_bytes: float
    compute_seconds: float
    step_seconds: float
    wall_seconds: float | None
    train_seconds: float | None
    """Training-loop seconds without evaluation (newer runs; None if absent)."""
    sync_seconds: float | None
    bytes_sent_per_replica: float | None
    outer_steps: int | None
    sync_every: int | None
    group_size: int
    fragments: int
    overlap_steps: int
    quantize: str
    compress: str | None = None
    """the run's ``--compress`` (sparse messages, all-gathered or gossiped)"""
    fragment_pattern: str = "strided"
    gamma_differs: bool = False
    """NoLoCo with γ ≠ β sends its slow weights too"""
    model_args: dict[str, Any] | None = None
    """the model's shape (``model/model.json``): bytes are then exact, fragment by fragment"""

    @property
    def trained_bits(self) -> float:
        """Bits per parameter as trained (32 for fp32)."""
        return 8 * self.param_bytes / self.params if self.params else 32.0


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise NetsimError(f"{path} not found (is this a run directory?)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise NetsimError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise NetsimError(f"{path} does not hold a JSON object")
    return data


def load_run(run_dir: str | Path) -> RunInfo:
    """Read ``summary.json`` (required) and ``config.json`` (optional) of a run."""
    root = Path(run_dir)
    if not root.is_dir():
        raise NetsimError(f"run directory {root} not found")
    s = upgrade_summary(_read_json(root / "summary.json"))
    cfg = _read_json(root / "config.json") if (root / "config.json").exists() else {}
    mcfg = cfg.get("method", {}) if isinstance(cfg.get("method"), dict) else {}
    if s.get("status") not in (None, "completed"):
        raise NetsimError(f"{root} did not complete (status {s['status']!r}): it measured no "
                          f"compute time to predict from")
    if s.get("compute_seconds") is None and s.get("elastic") is not None:
        s = {**s, **_elastic_compute(root)}
    missing = [k for k in ("method", "replicas", "steps", "compute_seconds") if s.get(k) is None]
    if missing:
        raise NetsimError(f"{root / 'summary.json'} lacks {', '.join(missing)}")
    sent = s.get("bytes_sent")  # one replica's, the mean
    params = int(s.get("params") or 0)
    param_bytes = s.get("param_bytes") or 4 * params  # fp32 when only the count is known
    if not param_bytes:
        raise NetsimError(f"{root / 'summary.json'} has neither param_bytes nor params")
    steps = int(s["steps"])
    if steps < 1:
        raise NetsimError(f"{root / 'summary.json'}: steps must be >= 1")
    compute = float(s["compute_seconds"])
    return RunInfo(
        path=str(root),
        method=str(s["method"]),
        replicas=int(s["replicas"]),
        stages=int(s.get("stages") or 1),
        steps=steps,
        params=params,
        param_bytes=float(param_bytes),
        compute_seconds=compute,
        step_seconds=float(s.get("step_seconds") or compute / steps),
        wall_seconds=s.get("wall_seconds"),
        train_seconds=s.get("train_seconds"),
        sync_seconds=s.get("sync_seconds"),
        bytes_sent_per_replica=sent,
        outer_steps=s.get("outer_steps"),
        sync_every=s.get("sync_every"),
        group_size=int(s.get("group_size") or mcfg.get("group_size") or 2),
        fragments=int(mcfg.get("fragments") or 1),
        overlap_steps=int(mcfg.get("overlap_steps") or 0),
        quantize=str(mcfg.get("quantize") or "none"),
        compress=mcfg.get("compress") or None,
        fragment_pattern=str(mcfg.get("fragment_pattern") or "strided"),
        gamma_differs=(mcfg.get("gamma") is not None and mcfg.get("outer_lr") is not None
                       and mcfg["gamma"] != mcfg["outer_lr"]),
        model_args=_model_args(root),
    )


def _elastic_compute(root: Path) -> dict[str, float]:
    """An elastic run's compute and training-loop seconds, which its summary.json does not
    carry: the mean over the workers' own summaries (``metrics/replica-K[-stage-S].json``),
    as a static run's summary is the mean over its workers."""
    workers = [_read_json(f) for f in sorted((root / "metrics").glob("*.json"))]
    workers = [w for w in workers if w.get("compute_seconds") is not None]
    if not workers:
        raise NetsimError(f"{root / 'summary.json'} (an elastic run) lacks compute_seconds and "
                          f"{root / 'metrics'} holds no worker summary to take it from")
    out = {"compute_seconds": sum(w["compute_seconds"] for w in workers) / len(workers)}
    loops = [w["train_seconds"] for w in workers if w.get("train_seconds") is not None]
    if len(loops) == len(workers):
        out["train_seconds"] = sum(loops) / len(loops)
    return out


def _model_args(root: Path) -> dict[str, Any] | None:
    index = root / "model" / "model.json"
    if not index.is_file():
        return None
    args = _read_json(index).get("model_args")
    return args if isinstance(args, dict) else None


def _stage_units(run: RunInfo, method: str, fragments: int) -> list[list[int]]:
    """Per pipeline stage, the values of each synchronisation unit: DDP's buckets, or the
    method's fragments (0 where a stage holds no block of a fragment) — from the model's
    shape when the run recorded it (exact), else an even split of the parameters."""
    if run.model_args is None:
        per_stage = (run.params or int(run.param_bytes // 4)) // run.stages
        return [[per_stage] if method == "ddp" else [per_stage // fragments] * fragments
                for _ in range(run.stages)]
    import torch

    from noloco.methods.ddp import bucket_layout
    from noloco.methods.engine import split_model
    from noloco.model import ModelArgs, Transformer
    from noloco.pipeline import Stage

    with torch.device("meta"):
        model = Transformer(ModelArgs(**run.model_args))
    units = []
    for s in range(run.stages):
        named = (list(Stage(model, run.stages, s).named_parameters()) if run.stages > 1
                 else list(model.named_parameters()))
        numels = [p.numel() for _, p in named]
        if method == "ddp":
            units.append([sum(numels[i] for i in b) for b in bucket_layout(numels)])
        else:
            _, groups = split_model(named, fragments, run.fragment_pattern,
                                    model.args.n_layers)
            units.append([sum(numels[i] for i in g) for g in groups])
    return units


@dataclass(frozen=True, kw_only=True)
class MethodPrediction:
    """The predicted cost of training the run's model with one method."""

    method: str
    replicas: int
    sync_every: int | None
    """H (None for ddp: every step)."""
    fragments: int
    overlap_steps: int
    wire_bits: float
    payload_bytes: float
    """Bytes per worker in one synchronisation event (a fragment for streaming)."""
    sync_events: int
    seconds_per_sync: float
    exposed_sync_seconds: float
    """Synchronisation time not hidden behind compute, summed over the run."""
    bytes_sent_per_replica: float
    compute_seconds: float
    wall_seconds: float
    compute_utilisation: float


@dataclass(frozen=True, kw_only=True)
class Prediction:
    run: RunInfo
    bandwidth_bps: float
    latency_s: float
    methods: list[MethodPrediction]
    note: str | None = None
    """why N differs from the run's own (a one-replica run), for the user"""

    @property
    def measured(self) -> dict[str, Any]:
        """What the run itself measured (its own method, its own network)."""
        r = self.run
        loop = r.train_seconds or r.wall_seconds  # prefer the loop without evaluation
        return {
            "method": r.method,
            "wall_seconds": r.wall_seconds,
            "train_seconds": r.train_seconds,
            "sync_seconds": r.sync_seconds,
            "compute_seconds": r.compute_seconds,
            "compute_utilisation": r.compute_seconds / loop if loop else None,
            "bytes_sent_per_replica": r.bytes_sent_per_replica,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": self.run.path,
            "bandwidth_bps": self.bandwidth_bps,
            "latency_s": self.latency_s,
            "run": asdict(self.run),
            "measured": self.measured,
            "predicted": [asdict(m) for m in self.methods],
            "note": self.note,
        }


def _predict_method(
    run: RunInfo,
    method: str,
    n: int,
    bandwidth_bps: float,
    latency_s: float,
    *,
    sync_every: int | None,
    fragments: int | None,
    overlap_steps: int | None,
    wire_bits: float | None,
    pair_latency_terms: int,
) -> MethodPrediction:
    from noloco.methods.engine import FragmentSchedule
    from noloco.methods.wire import sync_bytes

    steps, T = run.steps, run.step_seconds
    own = method == run.method  # the run's fragments/tau/quantize belong to its method
    quantize, gamma_differs = "none", False
    compress = SPARSELOCO_COMPRESS if method == "sparseloco" else None
    if method == "ddp":
        h, p, tau = None, 1, 0
    else:
        h = sync_every or run.sync_every or DEFAULT_SYNC_EVERY[method]
        if h < 1:
            raise NetsimError(f"sync_every (H) must be >= 1, got {h}")
        p, tau = 1, 0
        if method == "streaming":
            p = fragments or run.fragments
            tau = run.overlap_steps if overlap_steps is None else overlap_steps
        elif own and method == "noloco":
            p, tau = run.fragments, run.overlap_steps
        if own:
            quantize = run.quantize if method in ("noloco", "streaming") else "none"
            gamma_differs = run.gamma_differs and method == "noloco"
            compress = run.compress or compress
    element_size = max(1, round(run.trained_bits / 8))
    units = _stage_units(run, method, p)

    gathered = compress is not None and method != "noloco"  # an all-gather (P2)

    def unit_bytes(numel: int) -> float:
        """One worker's bytes for one unit (the methods' own accounting, P2/P3)."""
        if numel == 0:
            return 0.0
        if wire_bits is not None and gathered:  # every value of the message at wire_bits
            return (n - 1) * numel * wire_bits / 8
        if wire_bits is not None:  # an override: that many bits per value, no framing
            return sync_bytes(method, numel, n, element_size=1, group_size=run.group_size,
                              gamma_differs=gamma_differs) * wire_bits / 8
        return float(sync_bytes(method, numel, n, element_size=element_size,
                                group_size=run.group_size, quantize=quantize,
                                gamma_differs=gamma_differs, compress=compress))

    terms = pair_latency_terms if method == "noloco" else (n - 1) * (1 if gathered else 2)
    lat = terms * latency_s

    def seconds(nbytes: float) -> float:
        return nbytes * 8 / bandwidth_bps + lat if nbytes > 0 else 0.0

    # Events: (bytes per stage worker, seconds): stages synchronise in parallel, each on its
    # own link, so an event takes as long as its slowest stage.
    if method == "ddp":
        per_stage = [sum(unit_bytes(u) for u in st) for st in units]
        step_t = max(sum(seconds(unit_bytes(u)) for u in st) for st in units)
        events = [(per_stage, step_t)] * (steps if n > 1 else 0)
    else:
        try:
            sched = FragmentSchedule(h, p, tau)
        except ValueError as e:
            raise NetsimError(str(e)) from None
        events = []
        for t in range(1, steps + 1):
            for f in sched.starting(t):
                b = [unit_bytes(st[f]) for st in units]
                events.append((b, max(seconds(x) for x in b)))
    sent = sum(sum(b) for b, _ in events)
    exposed = sum(max(0.0, t - tau * T) for _, t in events)  # P4
    wall = run.compute_seconds + exposed
    k = max(len(events), 1)
    from noloco import quant
    from noloco.methods.wire import exchange_message_bytes

    values = max(sum(sum(st) for st in units) // (run.stages * max(len(units[0]), 1)), 1)
    if wire_bits is not None:
        bits = float(wire_bits)
    elif method == "noloco":
        bits = 8 * exchange_message_bytes(values, element_size, quantize, gamma_differs,
                                          compress) / values
    elif gathered:
        from noloco import sparse

        fraction, nbits = sparse.parse(compress or SPARSELOCO_COMPRESS)
        bits = 8 * sparse.wire_bytes(values, fraction, nbits) / values
    elif quantize != "none":
        bits = 8 * quant.wire_bytes(values, quantize) / values
    else:
        bits = run.trained_bits
    payload = values * bits / 8  # one message of an average unit, before the ring's factor
    return MethodPrediction(
        method=method,
        replicas=n,
        sync_every=h,
        fragments=p,
        overlap_steps=tau,
        wire_bits=bits,
        payload_bytes=payload,
        sync_events=len(events),
        seconds_per_sync=sum(t for _, t in events) / k,
        exposed_sync_seconds=exposed,
        bytes_sent_per_replica=sent,
        compute_seconds=run.compute_seconds,
        wall_seconds=wall,
        compute_utilisation=run.compute_seconds / wall if wall > 0 else 1.0,
    )


def predict_run(
    run: RunInfo | str | Path,
    bandwidth_bps: float | str,
    latency_s: float | str,
    *,
    methods: tuple[str, ...] = METHODS,
    replicas: int | None = None,
    sync_every: int | None = None,
    fragments: int | None = None,
    overlap_steps: int | None = None,
    wire_bits: float | None = None,
    pair_latency_terms: int = 1,
) -> Prediction:
    """Predict wall-clock and compute utilisation of each method for the run's model (P1-P5).

    ``replicas``, ``sync_every`` (H), ``fragments`` (P), ``overlap_steps`` (tau) and
    ``wire_bits`` override what the run used; a one-replica run is predicted at
    :data:`ONE_REPLICA_DEFAULT` replicas unless ``replicas`` is given (the prediction's note
    says so).
    """
    info = run if isinstance(run, RunInfo) else load_run(run)
    bw, lat = parse_bandwidth(bandwidth_bps), parse_latency(latency_s)
    n = info.replicas if replicas is None else replicas
    note = None
    if replicas is None and info.replicas == 1:
        n = ONE_REPLICA_DEFAULT
        note = (f"the run had 1 replica, which exchanges nothing: predicting N = {n} "
                f"replicas (pass -N to choose another)")
    if n < 1:
        raise NetsimError(f"replicas must be >= 1, got {n}")
    for name, v in (("sync_every", sync_every), ("fragments", fragments), ("wire_bits", wire_bits)):
        if v is not None and v < 1:
            raise NetsimError(f"{name} must be >= 1, got {v}")
    if overlap_steps is not None and overlap_steps < 0:
        raise NetsimError(f"overlap_steps must be >= 0, got {overlap_steps}")
    if pair_latency_terms not in (1, 2):
        raise NetsimError(f"pair_latency_terms must be 1 or 2, got {pair_latency_terms}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise NetsimError(f"unknown method {unknown[0]!r} (choose from {', '.join(METHODS)})")
    preds = [
        _predict_method(
            info,
            m,
            n,
            bw,
            lat,
            sync_every=sync_every,
            fragments=fragments,
            overlap_steps=overlap_steps,
            wire_bits=wire_bits,
            pair_latency_terms=pair_latency_terms,
        )
        for m in methods
    ]
    return Prediction(run=info, bandwidth_bps=bw, latency_s=lat, methods=preds, note=note)
