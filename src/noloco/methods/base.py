"""What every method shares: the hooks a training loop calls, and the outer-step plumbing.

A method wraps an unchanged training loop. The loop calls, per inner step::

    loss.backward()
    method.sync_gradients()        # DDP averages gradients here; the others do nothing
    clip_grad_norm_(...); optimizer.step(); optimizer.zero_grad()
    method.after_inner_step()      # DiLoCo / NoLoCo / Streaming run their outer steps here

or, to leave the loop entirely untouched, ``method.attach(optimizer)`` registers the same two
calls as the optimizer's pre- and post-step hooks.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from noloco.comm import Communicator

if TYPE_CHECKING:
    from noloco.guard import UpdateGuard
    from noloco.sparse import Compressor


def parameters_of(model: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    params = list(model.parameters()) if isinstance(model, nn.Module) else list(model)
    if not params:
        raise ValueError("the model has no parameters")
    return params


def shared_state(method: dict[str, Any]) -> dict[str, Any]:
    """The part of a method's state (:meth:`Method.state_dict`) a joining replica takes from
    its donor: all of it but the error feedback of a sparse exchange — what the donor has not
    sent yet is its own to send, never its joiner's (a joiner starts owing nothing). Saves the
    bytes of one model, too."""
    extra = method.get("extra") or {}
    if "errors" not in extra:
        return method
    # (the record of the messages it left out of means stays each replica's own, too)
    return {**method, "extra": {k: v for k, v in extra.items()
                                if k not in ("errors", "dropped")}}


class Method:
    """Base class: no communication at all (the ``single`` method, or independent replicas)."""

    name = "single"

    def __init__(self, model: nn.Module | Iterable[torch.Tensor], comm: Communicator) -> None:
        self.params = parameters_of(model)
        self.comm = comm
        self.inner_steps = 0
        """inner steps taken so far (t)"""
        self.outer_steps = 0
        # What a trainer may ask of any method; the methods with outer steps fill them in
        # (noloco.methods.engine), the others keep these empty values.
        self.guard: UpdateGuard | None = None
        """checks updates before they are used or contributed (:mod:`noloco.guard`)"""
        self.frags: list[Any] = []
        """the fragments synchronised one at a time (each with its slow weights)"""
        self.compress: Compressor | None = None
        """the sparse exchange's setting and error feedback (``--compress``)"""
        self.errors: list[torch.Tensor] = []
        """the error-feedback buffers of a sparse exchange, one per fragment"""
        self.dropped: list[dict[str, Any]] = []
        """messages left out of a mean: malformed or not finite"""

    @property
    def sync_every(self) -> int | None:
        return None

    def sync_gradients(self) -> None:
        """Called after backward, before clipping and the optimizer step."""

    def after_inner_step(self) -> None:
        """Called after every optimizer step: :meth:`start_outer`, then :meth:`complete_outer`."""
        self.start_outer()
        self.complete_outer()

    def start_outer(self) -> None:
        """The first half of :meth:`after_inner_step`: count the step, apply the syncs due,
        start the ones that start now. Many replicas driven by one process
        (:mod:`noloco.simulate`) call it on every replica before :meth:`complete_outer` on
        any: a sync applied at once (τ = 0) is complete only when every replica started it."""
        self.inner_steps += 1

    def complete_outer(self) -> None:
        """The second half of :meth:`after_inner_step`: apply the syncs that started in
        :meth:`start_outer` and are due at once."""

    def finish(self) -> None:
        """Called once after the last inner step: complete any communication still in flight."""

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook into ``optimizer.step()`` so the user's loop needs no extra calls.

        The pre-step hook (DDP's gradient averaging) runs inside ``optimizer.step()``, so a
        ``clip_grad_norm_`` in the loop clips each replica's own gradient before averaging;
        call ``sync_gradients()`` explicitly before clipping to clip the averaged gradient.
        """
        optimizer.register_step_pre_hook(lambda *_: self.sync_gradients())
        optimizer.register_step_post_hook(lambda *_: self.after_inner_step())

    def settings(self) -> dict[str, Any]:
        """The method's settings and its own record, for the summary (no communication)."""
        return {}

    def report(self) -> dict[str, Any]:
        """Extra fields for the run's summary.json (a method may make it collective)."""
        return self.settings()

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "inner_steps": self.inner_steps,
                "outer_steps": self.outer_steps}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("name") != self.name:
            raise ValueError(f"state of method {sd.get('name')!r} cannot load into {self.name!r}")
        self.inner_steps = int(sd["inner_steps"])
        self.outer_steps = int(sd["outer_steps"])


class Single(Method):
    """One replica, nothing to synchronise."""
