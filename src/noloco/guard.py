"""The update guard (``--update-guard``): a replica never uses, or contributes, an update that
is not finite or is far larger than the updates it has been seeing.

One faulty accelerator, a bit flip or a bug makes one replica's weights NaN or huge. NoLoCo
averages whatever a partner sends, so without a guard one NaN reaches every replica within a
few outer steps (gossip); a DiLoCo all-reduce spreads it in one. The guard checks each update
before it is used:

- NoLoCo checks what each partner sent: it must be finite, of the fragment's size and dtype,
  and the partner's fast weights must lie within ``factor`` × the running median of recent
  distances from this replica's own slow weights φ. A rejected partner is left out of the
  mean, as if it had not come.
- DiLoCo and Streaming DiLoCo check their own outer gradient φ − θ before it enters the
  all-reduce: a replica whose own update fails sends a zero outer gradient instead (the
  mean's step is then (N−1)/N as long, and nothing bad is in it), and takes the others'
  step like everyone.

Distances are Euclidean norms over a fragment; the scale is the median of the last
:data:`WINDOW` accepted ones. A replica judges its own update first (‖θ_i − φ_i‖ for NoLoCo,
the outer gradient's norm for DiLoCo) and, accepted, it joins the median: the replica's own
progress sets the scale from its first outer step on, and the scale follows the learning
rate's schedule. Before any distance was accepted only finiteness is judged (a DiLoCo
replica's first outer step).

A replica whose *own* update is bad cannot repair itself by rejecting others; it says so
(an event ``own``) and, in NoLoCo, takes the mean of the partners it accepted in place of its
own weights, and in DiLoCo the all-reduced step; :attr:`UpdateGuard.restart_inner` then asks
the trainer to clear its inner optimizer state (which a NaN gradient poisoned too).

Floor 0 of docs/architecture.md: foundations.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

WINDOW = 32
"""accepted distances the running median is taken over"""
DEFAULT_FACTOR = 10.0
CHUNK = 1 << 20
"""elements per step of :func:`distance`"""


class UpdateGuard:
    """Judges updates against this replica's recent ones; keeps the rejections for the
    summary. ``factor`` is k: an update is rejected when its distance exceeds k × the running
    median."""

    def __init__(self, factor: float = DEFAULT_FACTOR, window: int = WINDOW) -> None:
        if not factor > 1.0:
            raise ValueError(f"the update guard's factor must be > 1, got {factor}")
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)
        self.rejected: list[dict[str, Any]] = []
        """every rejection: step, whose update, why"""
        self.checked = 0
        self.restart_inner = False
        """set when this replica's own update was bad: the trainer clears its inner
        optimizer state and resets this flag"""

    def scale(self) -> float | None:
        """The running median of recent accepted distances; None before there is any."""
        if not self.recent:
            return None
        values = sorted(self.recent)
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])

    def judge(self, distance: float, finite: bool, like: bool = True) -> str | None:
        """Why an update of this ``distance`` is rejected, or None when it is accepted (and
        its distance joins the running median). ``finite``: every value it carries is;
        ``like``: its size and dtype are the model's."""
        self.checked += 1
        if not like:
            return "not of the model's size and dtype"
        if not finite or not math.isfinite(distance):
            return "not finite"
        scale = self.scale()
        if scale is not None and scale > 0 and distance > self.factor * scale:
            return (f"distance {distance:.4g} is more than {self.factor:g} x the running "
                    f"median {scale:.4g}")
        self.recent.append(distance)
        return None

    def reject(self, step: int, source: int | str, why: str, **extra: Any) -> None:
        self.rejected.append({"step": step, "from": source, "why": why, **extra})

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "rejected": list(self.rejected),
                "checked": self.checked, "restart_inner": self.restart_inner}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.recent.clear()
        self.recent.extend(float(x) for x in sd["recent"])
        self.rejected = list(sd["rejected"])
        self.checked = int(sd["checked"])
        self.restart_inner = bool(sd.get("restart_inner", False))

    def report(self) -> dict[str, Any]:
        return {"factor": self.factor, "checked": self.checked, "rejected": list(self.rejected)}


def all_finite(x: torch.Tensor) -> bool:
    """Every value of ``x`` is finite (one pass; a uint8 wire buffer is finite by nature)."""
    if not x.is_floating_point():
        return True
    return bool(torch.isfinite(x).all())


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖₂, in float64 (a chunk at a time: no full-size copy) so that a huge update
    does not overflow to inf."""
    a, b = a.reshape(-1), b.reshape(-1)
    total = 0.0
    for x, y in zip(a.split(CHUNK), b.split(CHUNK), strict=True):
        total += float(torch.linalg.vector_norm(x.double() - y.double())) ** 2
    return math.sqrt(total)
