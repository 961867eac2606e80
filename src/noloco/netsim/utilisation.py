"""Compute utilisation versus bandwidth between two datacenters (Streaming DiLoCo Table 4).

Model (SPEC §4 and §5; every assumption is numbered and repeated in ``docs/netsim.md``):

A1. One training step of one replica is a DAG with one node per layer for the forward pass
    (F_l), the backward pass with respect to activations (B_l, absent for layer 1) and with
    respect to parameters (W_l), plus one reduction node per layer (R_l): 4L - 1 compute and
    reduction nodes. The L transformer blocks are the layers; embeddings are not modelled
    separately.
A2. Compute is one serial stream in the order F_1..F_L, then B_L, W_L, ..., B_2, W_2, W_1.
    All 3L - 1 compute nodes take the same time, T / (3L - 1), so one step computes for exactly
    the given step time T (forward ~T/3, backward ~2T/3, the usual split).
A3. Parameters are spread evenly over the layers: layer l holds ``params / L`` parameters.
A4. The link between datacenters is one FIFO queue of bandwidth B (full duplex; ``B`` is what
    each direction carries). Latency is not modelled. A reduction of ``p`` parameters of
    ``bits`` bits over M datacenters sends ``2 (M - 1) / M * p * bits`` bits (ring all-reduce),
    i.e. exactly ``p * bits`` for M = 2.
A5. Layer l's (outer) gradient is released to the link when W_l finishes in a step that
    synchronises layer l (so reductions overlap the rest of the backward pass); data parallel
    releases every layer every step. The forward pass F_l of step ``s + 1 + tau`` waits until
    the reduction of layer l released in step ``s`` has arrived (tau = 0: the next step;
    tau = overlap steps for the "+ overlap" rows).
A6. DiLoCo synchronises the whole model every H steps; data parallel is the same DAG with
    H = 1 (its gradients and DiLoCo's outer gradients have the same size). Streaming DiLoCo
    splits the L layers into P = ceil(L / fragment_layers) strided fragments (layer l belongs
    to fragment l mod P); fragment p is synchronised in steps s with
    ``(s - floor(p H / P)) mod H == 0``.
A7. Unquantised reductions send 16-bit values (bf16); the FP4 rows 4-bit values. Scales and
    other metadata of the FP4 format are ignored.
A8. Utilisation = compute time / wall-clock time, measured in steady state over whole periods
    of H steps after a warm-up, for a grid of bandwidths. The bandwidth a target needs is the
    smallest grid value (``numpy.logspace(-1, 3, 50)`` Gbit/s, as the paper) whose utilisation
    reaches the target.
A9. Model sizes: the nominal 1e9 / 10e9 / 100e9 parameters (not a count derived from the
    architecture: the 1B model's d_model 2048, FFN 8192, 24 layers would give ~1.2e9 without
    embeddings, which moves every cell further from the paper; see docs/netsim.md).

The simulation is vectorised over the bandwidth grid: every array below has the bandwidths as
its first axis, so one pass over the steps evaluates the whole curve.

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from noloco.netsim.latency import NetsimError

PAPER_GRID_GBPS = np.logspace(-1, 3, 50)
"""The paper's bandwidth grid, in Gbit/s (each value x1.207 the previous)."""

TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
"""Utilisation targets of the paper's table."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model as the simulator sees it."""

    name: str
    params: float
    """Total parameters (A3, A9)."""
    layers: int
    """L: transformer blocks, one DAG node per layer and pass (A1)."""
    step_seconds: float
    """T: compute time of one inner step, forward plus backward (A2)."""

    def __post_init__(self) -> None:
        if not (self.params > 0 and math.isfinite(self.params)):
            raise NetsimError(f"params must be > 0, got {self.params}")
        if self.layers < 1:
            raise NetsimError(f"layers must be >= 1, got {self.layers}")
        if not (self.step_seconds > 0 and math.isfinite(self.step_seconds)):
            raise NetsimError(f"step time must be > 0, got {self.step_seconds}")


@dataclass(frozen=True, kw_only=True)
class Scheme:
    """A synchronisation scheme: which layers reduce when, and with how many bits (A5-A7)."""

    name: str
    sync_every: int = 1
    """H: steps between two synchronisations of a layer (1 = data parallel)."""
    fragment_layers: int | None = None
    """Layers per streaming fragment (None: the whole model is one fragment)."""
    overlap_steps: int = 0
    """tau: steps a reduction may overlap before the forward pass needs it (A5)."""
    bits: int = 16
    """Bits per exchanged value (A7)."""

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise NetsimError(f"sync_every (H) must be >= 1, got {self.sync_every}")
        if self.fragment_layers is not None and self.fragment_layers < 1:
            raise NetsimError(f"fragment_layers must be >= 1, got {self.fragment_layers}")
        if self.overlap_steps < 0:
            raise NetsimError(f"overlap_steps (tau) must be >= 0, got {self.overlap_steps}")
        if self.bits < 1:
            raise NetsimError(f"bits must be >= 1, got {self.bits}")

    def fragments(self, layers: int) -> int:
        """P: number of fragments for a model of ``layers`` layers."""
        if self.fragment_layers is None:
            return 1
        return max(1, math.ceil(layers / self.fragment_layers))


PAPER_MODELS = {
    "1B": ModelSpec(name="1B", params=1e9, layers=24, step_seconds=0.1),
    "10B": ModelSpec(name="10B", params=10e9, layers=48, step_seconds=0.8),
    "100B": ModelSpec(name="100B", params=100e9, layers=108, step_seconds=4.9),
}
"""The three models of Streaming DiLoCo Table 4 (A9)."""


def paper_schemes(
    sync_every: int = 100, fragment_layers: int = 3, overlap_steps: int = 1
) -> list[Scheme]:
    """The five rows of Table 4 (paper: H = 100, 3-layer fragments, tau = 1)."""
    h, f, tau = sync_every, fragment_layers, overlap_steps
    return [
        Scheme(name="data parallel"),
        Scheme(name="DiLoCo", sync_every=h),
        Scheme(name="Streaming", sync_every=h, fragment_layers=f),
        Scheme(name="+ overlap", sync_every=h, fragment_layers=f, overlap_steps=tau),
        Scheme(name="+ overlap + FP4", sync_every=h, fragment_layers=f, overlap_steps=tau, bits=4),
    ]


PAPER_TABLE: dict[tuple[str, str], tuple[float, ...]] = {
    ("1B", "data parallel"): (86.8, 152.6, 184.2, 222.3, 569.0),
    ("1B", "DiLoCo"): (1.4, 6.2, 13.3, 23.3, 86.8),
    ("1B", "Streaming"): (1.4, 5.2, 9.1, 16.0, 28.1),
    ("1B", "+ overlap"): (1.4, 4.3, 6.2, 9.1, 11.0),
    ("1B", "+ overlap + FP4"): (0.4, 0.9, 1.7, 2.0, 3.0),
    ("10B", "data parallel"): (104.8, 222.3, 222.3, 268.3, 471.5),
    ("10B", "+ overlap + FP4"): (0.4, 0.9, 1.4, 1.4, 1.7),
    ("100B", "data parallel"): (184.2, 323.8, 390.7, 390.7, 471.5),
    ("100B", "DiLoCo"): (3.0, 11.0, 23.3, 49.4, 184.2),
    ("100B", "+ overlap + FP4"): (0.5, 0.9, 1.1, 1.1, 1.4),
}
"""Bandwidth (Gbit/s) for 50/80/90/95/99% utilisation, as printed in the paper (SPEC §4)."""


def snap_to_grid(gbps: float, grid: np.ndarray = PAPER_GRID_GBPS) -> float:
    """The grid value nearest (in log scale) to ``gbps``: the paper prints rounded grid values."""
    return float(grid[int(np.argmin(np.abs(np.log(grid) - math.log(gbps))))])


def grid_steps_between(a: float, b: float, grid: np.ndarray = PAPER_GRID_GBPS) -> int:
    """How many grid steps ``a`` lies above ``b`` (both snapped to the grid)."""
    idx = {float(v): i for i, v in enumerate(grid)}
    return idx[snap_to_grid(a, grid)] - idx[snap_to_grid(b, grid)]


def _release_offsets(layers: int, node: float) -> np.ndarray:
    """Time from the end of the forward pass until W_l finishes, for l = 1..L (A2)."""
    offsets = np.zeros(layers)
    t = 0.0
    for layer in range(layers, 0, -1):
        if layer > 1:
            t += node  # B_l: gradient with respect to the layer's input
        t += node  # W_l: gradient with respect to the layer's parameters
        offsets[layer - 1] = t
    return offsets


def _fifo_finish(link_free: np.ndarray, release: np.ndarray, duration: np.ndarray) -> np.ndarray:
    """Finish times of transfers queued in order on one FIFO link (A4), vectorised.

    With D_k = duration_1 + ... + duration_k the k-th finish time is
    ``D_k + max(link_free, max_{j<=k}(release_j - D_{j-1}))`` (a max-plus scan).
    Arrays are (bandwidths, transfers); ``link_free`` is (bandwidths,).
    """
    cum = np.cumsum(duration, axis=1)
    slack = release - (cum - duration)
    start = np.maximum(link_free[:, None], np.maximum.accumulate(slack, axis=1))
    return start + cum


@dataclass(frozen=True, kw_only=True)
class UtilisationCurve:
    """Utilisation of one scheme on one model over a bandwidth grid."""

    model: ModelSpec
    scheme: Scheme
    bandwidth_gbps: np.ndarray
    utilisation: np.ndarray
    datacenters: int = 2
    payload_scale: float = 1.0
    targets: tuple[float, ...] = field(default=TARGETS)

    def required_gbps(self, targets: tuple[float, ...] | None = None) -> list[float | None]:
        """Smallest grid bandwidth whose utilisation reaches each target (None: not on grid)."""
        out: list[float | None] = []
        for target in targets or self.targets:
            ok = np.nonzero(self.utilisation >= target - 1e-12)[0]
            out.append(float(self.bandwidth_gbps[ok[0]]) if len(ok) else None)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": asdict(self.model),
            "scheme": asdict(self.scheme),
            "datacenters": self.datacenters,
            "payload_scale": self.payload_scale,
            "bandwidth_gbps": [float(x) for x in self.bandwidth_gbps],
            "utilisation": [float(x) for x in self.utilisation],
            "required_gbps": dict(
                zip([f"{t:g}" for t in self.targets], self.required_gbps(), strict=True)
            ),
        }


def simulate_utilisation(
    model: ModelSpec,
    scheme: Scheme,
    bandwidth_gbps: np.ndarray | list[float] = PAPER_GRID_GBPS,
    *,
    datacenters: int = 2,
    payload_scale: float = 1.0,
    targets: tuple[float, ...] = TARGETS,
) -> UtilisationCurve:
    """Steady-state compute utilisation for each bandwidth (A1-A8).

    ``payload_scale`` multiplies the bits of every reduction; it is 1 in every reported number
    and exists only to study how far the paper's table is from this model (docs/netsim.md).
    ``targets`` are the utilisations :meth:`UtilisationCurve.required_gbps` reports.
    """
    if datacenters < 1:
        raise NetsimError(f"datacenters (M) must be >= 1, got {datacenters}")
    if not (payload_scale > 0 and math.isfinite(payload_scale)):
        raise NetsimError(f"payload scale must be > 0, got {payload_scale}")
    if not all(0 < t <= 1 for t in targets):
        raise NetsimError(f"utilisation targets must lie in (0, 1], got {list(targets)}")
    bw = np.asarray(bandwidth_gbps, dtype=float)
    if bw.ndim != 1 or not np.all(bw > 0):
        raise NetsimError("bandwidths must be a list of positive numbers (Gbit/s)")
    L, T, H = model.layers, model.step_seconds, scheme.sync_every
    if datacenters == 1:  # nothing to exchange
        return UtilisationCurve(
            model=model,
            scheme=scheme,
            bandwidth_gbps=bw,
            utilisation=np.ones_like(bw),
            datacenters=1,
            payload_scale=payload_scale,
            targets=tuple(targets),
        )

    node = T / (3 * L - 1)  # A2: every compute node takes the same time
    release = _release_offsets(L, node)
    backward = release[0]  # W_1 is the last node of the step
    ring_factor = 2 * (datacenters - 1) / datacenters  # A4
    layer_bits = model.params / L * scheme.bits * ring_factor * payload_scale
    duration = layer_bits / (bw * 1e9)  # seconds per layer reduction, one per bandwidth

    P = scheme.fragments(L)
    fragment_of = np.arange(L) % P  # A6: strided fragments
    offset_of = np.array([p * H // P for p in range(P)])[fragment_of]
    depth = L - np.arange(L)  # forward nodes from F_l to the end of the forward pass

    warm_periods = max(1, math.ceil(10 / H))
    measured_periods = max(2, math.ceil(20 / H))
    n_steps = (warm_periods + measured_periods) * H

    nb = len(bw)
    clock = np.zeros(nb)  # end of the previous step (end of W_1)
    link_free = np.zeros(nb)
    arrivals: dict[int, np.ndarray] = {}  # step -> (nb, L) time layer l's weights are ready
    step_end = np.empty((n_steps, nb))
    for s in range(n_steps):
        fwd_end = clock + L * node
        ready = arrivals.pop(s, None)
        if ready is not None:  # F_l cannot start before its reduction has arrived (A5)
            fwd_end = np.maximum(fwd_end, np.max(ready + depth * node, axis=1))
        clock = fwd_end + backward
        step_end[s] = clock

        syncing = np.nonzero((s - offset_of) % H == 0)[0][::-1]  # released in order L..1
        if len(syncing) == 0:
            continue
        released = fwd_end[:, None] + release[syncing][None, :]
        finish = _fifo_finish(link_free, released, np.repeat(duration[:, None], len(syncing), 1))
        link_free = finish[:, -1]
        target = s + 1 + scheme.overlap_steps
        ready = np.full((nb, L), -np.inf)
        ready[:, syncing] = finish
        arrivals[target] = np.maximum(arrivals[target], ready) if target in arrivals else ready

    first, last = warm_periods * H - 1, n_steps - 1
    elapsed = step_end[last] - step_end[first]
    utilisation = (last - first) * T / elapsed
    return UtilisationCurve(
        model=model,
        scheme=scheme,
        bandwidth_gbps=bw,
        utilisation=utilisation,
        datacenters=datacenters,
        payload_scale=payload_scale,
        targets=tuple(targets),
    )


@dataclass(frozen=True, kw_only=True)
class TableCell:
    """One cell of Table 4: our required bandwidth against the paper's."""

    model: str
    scheme: str
    target: float
    ours_gbps: float | None
    paper_gbps: float | None
    ratio: float | None
    """ours / paper (paper value as printed)."""
    grid_steps: int | None
    """How many grid steps ours lies above the paper's (both snapped to the grid)."""


def paper_table(
    *,
    models: list[str] | None = None,
    sync_every: int = 100,
    fragment_layers: int = 3,
    overlap_steps: int = 1,
    datacenters: int = 2,
    payload_scale: float = 1.0,
) -> list[TableCell]:
    """Recompute Table 4 for the paper's models and schemes, next to the paper's numbers."""
    cells: list[TableCell] = []
    for name in models or list(PAPER_MODELS):
        if name not in PAPER_MODELS:
            raise NetsimError(f"unknown model {name!r} (choose from {', '.join(PAPER_MODELS)})")
        for scheme in paper_schemes(sync_every, fragment_layers, overlap_steps):
            curve = simulate_utilisation(
                PAPER_MODELS[name], scheme, datacenters=datacenters, payload_scale=payload_scale
            )
            paper = PAPER_TABLE.get((name, scheme.name))
            for i, (target, ours) in enumerate(zip(TARGETS, curve.required_gbps(), strict=True)):
                ref = paper[i] if paper else None
                both = ours is not None and ref is not None
                cells.append(
                    TableCell(
                        model=name,
                        scheme=scheme.name,
                        target=target,
                        ours_gbps=ours,
                        paper_gbps=ref,
                        ratio=ours / ref if both else None,
                        grid_steps=grid_steps_between(ours, ref) if both else None,
                    )
                )
    return cells
