"""Fault tolerance in your own training loop: one replica of an elastic run, as a library.

``noloco train --elastic`` runs noloco's own loop. :func:`join_run` gives the same machinery
to any loop, any ``nn.Module`` and any ``torch.optim.Optimizer``:

    run = join_run(model, optimizer, coordinator="10.0.0.1:29400", run_id="mine",
                   replica=k, replicas=4, method="diloco", sync_every=50)
    with run:
        while run.step < steps:               # the run's step: a joiner's moves to its donor's
            x, y = my_batch(k, run.step)      # the data order is the loop's own
            loss_fn(model(x), y).backward()
            optimizer.step()                  # the inner step, then the method (outer steps,
            optimizer.zero_grad()             # arrivals, heals, serving joiners) inside it

What happens inside ``optimizer.step()`` is what :class:`noloco.train.Trainer` does around
its own: after the inner step the method's outer step (:mod:`noloco.methods`, over an
:class:`~noloco.elastic.communicator.ElasticCommunicator`: groups from membership
snapshots, nobody waits for a replica that died), then between two steps what
:class:`~noloco.elastic.join.Joiner` does for a CLI replica — serve a joiner its state, heal
when the others stepped without this replica, train on alone for a bounded number of outer
steps when cut off from the store. A process that starts again (its launcher — torchrun,
Slurm, Kubernetes, a shell loop — restarted it), or for the first time while the run has
already trained, takes the live state (weights, the method's state, the step) from a donor
while :func:`join_run` returns. Leaving the ``with`` block — at the end or by an exception —
tells the run, so nobody waits for this replica.

The contract (docs/library.md):

- every replica builds the same architecture, and the replicas that start together start
  from the same weights (seed the initialisation): both checked when the replica joins, by
  a fingerprint in the run's store;
- every replica passes the same method settings: checked the same way;
- the handle owns the method's state; the loop owns its data order (read :attr:`step`) and
  its model's own checkpoints.

Bad input — another model, other settings, a wrong secret, a coordinator that cannot be
reached — raises :class:`RunError` (one line, nothing written into the run) before the
first step.

Floor 4 of docs/architecture.md: what an elastic run adds to the trainer.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from noloco.addresses import ETCD_SCHEME, parse_address
from noloco.comm import NullCommunicator
from noloco.config import Config, ConfigError, MethodConfig, TrainConfig
from noloco.distributed import Layout
from noloco.elastic import auth
from noloco.elastic.communicator import ElasticCommunicator
from noloco.elastic.deadline import (
    Namespace,
    open_store_patiently,
    request_deadline,
    wait_reachable,
)
from noloco.elastic.join import Joiner, NoDonor
from noloco.elastic.keys import starts_key
from noloco.elastic.membership import Membership, live_replicas
from noloco.integrity import Sealer, payload_key
from noloco.methods import build_method
from noloco.train import LoopState, weights_checksum

LIBRARY_METHODS = ("noloco", "diloco", "streaming", "sparseloco")
"""the methods an elastic run serves"""
_FINGERPRINT_KEY = "noloco/library/{}"


class RunError(ConfigError):
    """A replica that cannot take part in the run as asked: a one-line reason, raised before
    its first step, with nothing written into the run."""


def join_run(model: nn.Module, optimizer: torch.optim.Optimizer, *, coordinator: str,
             run_id: str, replica: int, replicas: int, method: str = "diloco",
             secret_file: str | None = None, seed: int = 0, peer_timeout: float = 10.0,
             comm_timeout: float = 120.0, **settings: Any) -> ElasticLoop:
    """Replica ``replica`` of ``replicas`` joins run ``run_id`` at ``coordinator``
    (``HOST:PORT`` of a ``noloco coordinator``, or ``etcd://H:P,...``), with ``method`` and
    its ``settings`` (the :class:`noloco.config.MethodConfig` fields, as the CLI's flags:
    ``sync_every``, ``outer_lr``, ``outer_momentum``, ``compress``, ``fragments``, ...). See
    the module docstring; :class:`RunError` on bad input."""
    if not isinstance(model, nn.Module):
        raise RunError(f"join_run: model must be a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise RunError("join_run: optimizer must be a torch.optim.Optimizer, not "
                       f"{type(optimizer).__name__}")
    if method not in LIBRARY_METHODS:
        raise RunError(f"join_run: method {method!r} is not served by an elastic run: choose "
                       f"from {', '.join(LIBRARY_METHODS)}")
    known = {f.name for f in fields(MethodConfig)} - {"method", "replicas", "stages",
                                                       "elastic", "routing", "microbatches"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise RunError(f"join_run: unknown method setting(s) {', '.join(unknown)}: the "
                       f"settings are those of noloco.config.MethodConfig")
    if not 0 <= replica < replicas:
        raise RunError(f"join_run: replica {replica} outside 0..{replicas - 1}")
    try:
        cfg = Config(method=MethodConfig(method=method, replicas=replicas, elastic=True,
                                         peer_timeout=peer_timeout, comm_timeout=comm_timeout,
                                         **settings),
                     train=TrainConfig(coordinator=coordinator, run_id=run_id,
                                       secret_file=secret_file, seed=seed,
                                       out="(the loop's own)", checkpoint_every="0"))
        cfg = cfg.resolved()
    except (ConfigError, ValueError, TypeError) as e:
        raise RunError(f"join_run: {str(e).splitlines()[0]}") from None
    return ElasticLoop(model, optimizer, cfg, replica)


class _NoReader:
    """The loop reads its own data: nothing of a data position to save or take."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


class _Status:
    """The two things of a worker's status the join protocol reads."""

    def __init__(self) -> None:
        self.step = 0
        self.stop_signal: int | None = None


class _Runner:
    """The user's model, as the join protocol reads a trainer's runner."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def parameters(self) -> list[torch.Tensor]:
        return [p for _, p in self.named_parameters()]


class _Checkpoints:
    """No checkpoints of the handle's own yet: a restarted process joins from a donor."""

    enabled = False
    root = Path("/nonexistent/noloco-library")

    def save(self, step: int, state: dict[str, Any]) -> None:
        pass

    def wait(self) -> None:
        pass


class _LoopJoiner(Joiner):
    def checkpoint_root(self) -> Path:
        return _Checkpoints.root


class ElasticLoop:
    """One replica of an elastic run around a user's model and optimizer (:func:`join_run`
    builds it): the attributes :class:`noloco.elastic.join.Joiner` reads of the trainer it
    serves, and the wrapped ``optimizer.step``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config,
                 replica: int) -> None:
        m, t = cfg.method, cfg.train
        self.cfg, self.model, self.inner = cfg, model, optimizer
        self.lay = Layout(rank=replica, world=m.replicas, local_world=1, replica=replica,
                          stage=0, replicas=m.replicas, stages=1)
        self.runner = _Runner(model)
        self.params = self.runner.parameters()
        if not self.params:
            raise RunError("join_run: the model has no trainable parameters")
        if any(p.device.type != "cpu" for p in self.params):
            raise RunError("join_run: the model's parameters must be on the CPU for now (GPU "
                           "tensors are not yet staged through host buffers in a library run)")
        self.reader = _NoReader()
        self.status = _Status()
        self.state = LoopState()
        self.ckpt = _Checkpoints()
        self.resumed_from: int | None = None
        self.t_start = self.t_loop = time.perf_counter()
        self._closed = False
        address = t.coordinator
        assert address is not None
        try:
            if not address.startswith(ETCD_SCHEME):
                auth.use_secret(auth.load_secret(t.secret_file))
                wait_reachable(*parse_address(address), m.comm_timeout)
            store = open_store_patiently(address, request_deadline(m.peer_timeout),
                                         Namespace(cfg.run_id()), m.comm_timeout,
                                         m.peer_timeout)
        except ConfigError as e:
            raise RunError(f"join_run: {str(e).splitlines()[0]}") from None
        except (OSError, RuntimeError) as e:
            raise RunError(f"join_run: cannot reach the run's store at {address}: "
                           f"{str(e).splitlines()[0][:200]}") from None
        # What every replica must share, checked before this one counts itself in.
        arch = [(n, tuple(p.shape), str(p.dtype)) for n, p in self.runner.named_parameters()]
        self._agree(store, "architecture", _digest(arch),
                    "the model's parameters (names, shapes, dtypes) differ from the run's: "
                    "every replica must build the same architecture")
        self._agree(store, "settings", _digest(cfg.math_dict()["method"]),
                    "the method settings differ from the run's: every replica must pass the "
                    "same method and settings")
        if store.add(starts_key(replica, 0), 0) == 0:
            # Its first start (also when it is about to take a donor's state: an unseeded
            # initialisation is said at once, by whichever replica starts second). A process
            # started again may hold weights of its own loading: it takes a donor's anyway.
            self._agree(store, "start", str(weights_checksum(self.params)),
                        "its initial weights differ from those the run started from: seed "
                        "the model's initialisation alike on every replica")
        incarnation = store.add(starts_key(replica, 0), 1) - 1
        # A replica started again, or for the first time while the others have trained,
        # takes a live state before its first step (out of snapshots meanwhile).
        joins = incarnation > 0 or any(int(b.get("step", 0)) > 0 for r, b in live_replicas(
            store, m.replicas, 1).items() if r != replica)
        self.membership = Membership(store, replica, m.replicas, m.peer_timeout, incarnation,
                                     0, 1)
        self.membership.joining = joins
        self.membership.start()
        try:
            self.comm = ElasticCommunicator(self.membership, m.peer_timeout, m.comm_timeout)
            secret = auth.current_secret()
            if secret is not None and m.payload_mac:
                self.comm.sealer = Sealer(payload_key(secret))
            self.world = NullCommunicator()
            try:
                self.method = build_method(m, self.runner.named_parameters(), self.comm,
                                           seed=t.seed)
            except ValueError as e:
                raise RunError(f"join_run: {str(e).splitlines()[0]}") from None
            self.joiner = _LoopJoiner(self.membership)
            self.joiner.attach(self)  # type: ignore[arg-type]
            if joins:
                try:
                    self.joiner.join()
                except NoDonor as e:
                    raise RunError(f"join_run: replica {replica}: {e}") from None
            self.membership.step = self.status.step = self.state.step
            self.membership.ready = True  # a donor from now on
            self.membership.joining = False
            self.membership.beat()
        except BaseException:
            self.membership.finish(stopped=True)
            raise
        self._step = optimizer.step
        optimizer.step = self._wrapped_step  # type: ignore[method-assign]

    def _agree(self, store: Any, what: str, value: str, why: str) -> None:
        key = _FINGERPRINT_KEY.format(what)
        got = store.compare_set(key, "", value)
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got != value:
            raise RunError(f"join_run: replica {self.lay.replica}: {why}")

    # ---- what the loop reads ---------------------------------------------------------------
    @property
    def step(self) -> int:
        """Inner steps this replica has taken in the run (a joiner: its donor's count)."""
        return self.state.step

    @property
    def replica(self) -> int:
        return self.lay.replica

    @property
    def outer_steps(self) -> int:
        return self.method.outer_steps

    @property
    def bytes_sent(self) -> int:
        return self.comm.bytes_sent

    @property
    def joins(self) -> list[dict[str, Any]]:
        """What this replica donated, took (joined, healed) and refused."""
        return self.joiner.joins

    # ---- the step ---------------------------------------------------------------------------
    def _wrapped_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            return self._step(*args, **kwargs)
        self.method.sync_gradients()
        out = self._step(*args, **kwargs)
        st = self.state
        st.step = self.status.step = self.membership.step = st.step + 1
        self.method.after_inner_step()
        guard = self.method.guard
        if guard is not None and guard.restart_inner:
            # its own update was rejected: it took the synced weights; the optimizer's state,
            # poisoned by the same gradients, starts afresh
            self.inner.state.clear()
            guard.restart_inner = False
            print(f"noloco: replica {self.lay.replica}: its own update was rejected at step "
                  f"{st.step}; it took the synced weights and restarted its optimizer",
                  file=sys.stderr, flush=True)
        self.membership.nudge()
        self.joiner.between_steps()  # serve joiners, heal (may move the step)
        return out

    # ---- what the join protocol reads of a trainer -------------------------------------------
    def capture(self) -> dict[str, Any]:
        return {"step": self.state.step}

    def loop_seconds(self) -> float:
        return time.perf_counter() - self.t_loop

    def wall_seconds(self) -> float:
        return time.perf_counter() - self.t_start

    # ---- the end ------------------------------------------------------------------------------
    def close(self, ok: bool = True) -> None:
        """Leave the run: the syncs still in flight applied (``ok``), the run told that this
        replica is gone, the optimizer's own ``step`` back. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if ok:
                self.method.finish()
        finally:
            self.membership.finish(stopped=not ok)
            self.inner.step = self._step  # type: ignore[method-assign]

    def __enter__(self) -> ElasticLoop:
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        self.close(ok=kind is None)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]

