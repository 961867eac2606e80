"""Predict a real run's wall-clock on another network: ``noloco netsim predict RUN_DIR``.

The run directory gives the measured compute (``compute_seconds``, ``step_seconds``), the model
size (``param_bytes``) and the layout (``replicas``, ``stages``); the network is a bandwidth B
(bits/s, per worker, each direction) and a per-message latency. For every method the
prediction is ``wall = compute_seconds + exposed synchronisation seconds`` and
``compute utilisation = compute_seconds / wall``.

Assumptions (also in docs/netsim.md):

P1. Payload S per worker = ``param_bytes / stages`` (pipeline stages synchronise their own
    parameters in parallel, each on its own link), in the precision the run trained in.
    Outer-gradient methods may send fewer bits (``quantize`` in config.json, or ``wire_bits``).
P2. All-reduce (ddp, diloco, streaming) = ring all-reduce over the N replicas:
    ``2 (N - 1) / N * S`` bytes through each worker's link and 2 (N - 1) latency terms.
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
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from noloco.netsim.latency import NetsimError

METHODS = ("ddp", "diloco", "noloco", "streaming")
"""Methods predicted by default (``single`` has nothing to synchronise)."""

DEFAULT_SYNC_EVERY = {"diloco": 100, "noloco": 50, "streaming": 50}
"""H when the run itself has none (the package's defaults, SPEC §2-§4)."""

QUANT_BITS = {"none": None, "fp4": 4, "int8": 8, "fp8": 8}

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
    s = _read_json(root / "summary.json")
    cfg = _read_json(root / "config.json") if (root / "config.json").exists() else {}
    mcfg = cfg.get("method", {}) if isinstance(cfg.get("method"), dict) else {}
    missing = [k for k in ("method", "replicas", "steps", "compute_seconds") if s.get(k) is None]
    if missing:
        raise NetsimError(f"{root / 'summary.json'} lacks {', '.join(missing)}")
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
        bytes_sent_per_replica=s.get("bytes_sent_per_replica"),
        outer_steps=s.get("outer_steps"),
        sync_every=s.get("sync_every"),
        group_size=int(s.get("group_size") or mcfg.get("group_size") or 2),
        fragments=int(mcfg.get("fragments") or 1),
        overlap_steps=int(mcfg.get("overlap_steps") or 0),
        quantize=str(mcfg.get("quantize") or "none"),
    )


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
    steps, T = run.steps, run.step_seconds
    full = run.param_bytes / run.stages  # P1
    if method == "ddp":
        h, p, tau, bits = None, 1, 0, run.trained_bits
        events = steps
    else:
        h = sync_every or run.sync_every or DEFAULT_SYNC_EVERY[method]
        if h < 1:
            raise NetsimError(f"sync_every (H) must be >= 1, got {h}")
        own = method == run.method  # the run's fragments/tau/quantize belong to its method
        p, tau = 1, 0
        if method == "streaming":
            p = fragments or run.fragments
            tau = run.overlap_steps if overlap_steps is None else overlap_steps
        elif own and method == "noloco":
            p, tau = run.fragments, run.overlap_steps
        quant = QUANT_BITS.get(run.quantize) if own else None
        bits = wire_bits or quant or run.trained_bits
        events = steps // h * p  # every fragment is synchronised once per H steps
    payload = full / p * bits / run.trained_bits
    t = predict_sync_seconds(
        method,
        n,
        payload,
        bandwidth_bps,
        latency_s,
        group_size=run.group_size,
        pair_latency_terms=pair_latency_terms,
    )
    exposed = events * max(0.0, t - tau * T)  # P4
    if method == "noloco":
        sent = events * (min(run.group_size, n) - 1) * payload if n > 1 else 0.0
    else:
        sent = events * ring_allreduce_bytes(n, payload)
    wall = run.compute_seconds + exposed
    return MethodPrediction(
        method=method,
        replicas=n,
        sync_every=h,
        fragments=p,
        overlap_steps=tau,
        wire_bits=bits,
        payload_bytes=payload,
        sync_events=events,
        seconds_per_sync=t,
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
    ``wire_bits`` override what the run used.
    """
    info = run if isinstance(run, RunInfo) else load_run(run)
    bw, lat = parse_bandwidth(bandwidth_bps), parse_latency(latency_s)
    n = info.replicas if replicas is None else replicas
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
    return Prediction(run=info, bandwidth_bps=bw, latency_s=lat, methods=preds)
