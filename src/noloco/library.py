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
- the handle owns the method's state and, with ``checkpoint_dir``, its checkpoints (with the
  model's weights and the optimizer's state beside it, one consistent step); the loop owns
  its data order (read :attr:`step`) and its model's own checkpoints.

On a GPU: the model's parameters may live on one CUDA device (all on the same one). An elastic
run's traffic is gloo's (it crosses the internet), so its tensors go through pinned host
buffers (:class:`noloco.staging.HostStaged`); a static run goes through NCCL where the caller's
process group has it (``cpu:gloo,cuda:nccl``: the start-up checks are CPU tensors), and
through gloo on host copies otherwise (replicas sharing a GPU, which NCCL cannot serve).

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
import types
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from noloco import checkpoint as ckpt_mod
from noloco.addresses import ETCD_SCHEME, parse_address
from noloco.config import Config, ConfigError, MethodConfig, TrainConfig
from noloco.distributed import Layout
from noloco.elastic import auth
from noloco.elastic.communicator import ElasticCommunicator
from noloco.elastic.deadline import (
    Namespace,
    open_store_patiently,
    request_deadline,
    stopped_record,
    wait_reachable,
)
from noloco.elastic.join import Joiner, NoDonor
from noloco.elastic.keys import starts_key
from noloco.elastic.membership import Membership, live_replicas
from noloco.integrity import Sealer, payload_key
from noloco.methods import build_method
from noloco.methods.engine import split_model
from noloco.rundir import write_json_atomic
from noloco.spec import forced_host_staging
from noloco.staging import HostStaged
from noloco.train import LoopState, weights_checksum

LIBRARY_METHODS = ("noloco", "diloco", "streaming", "sparseloco")
"""the methods an elastic run serves"""
STATIC_METHODS = LIBRARY_METHODS
"""the methods of a static library run (per-step gradient averaging is torch's own DDP's
job: averaged inside ``optimizer.step()`` it would undo a clip or a GradScaler's unscale
done before it)"""
_FINGERPRINT_KEY = "noloco/library/{}"


class RunError(ConfigError):
    """A replica that cannot take part in the run as asked: a one-line reason, raised before
    its first step, with nothing written into the run."""


def join_run(model: nn.Module, optimizer: torch.optim.Optimizer, *, coordinator: str,
             run_id: str, replica: int, replicas: int, method: str = "diloco",
             secret_file: str | None = None, seed: int = 0, peer_timeout: float = 10.0,
             comm_timeout: float = 120.0, checkpoint_dir: str | Path | None = None,
             checkpoint_every: int | None = None, resume: bool = False,
             **settings: Any) -> ElasticLoop:
    """Replica ``replica`` of ``replicas`` joins run ``run_id`` at ``coordinator``
    (``HOST:PORT`` of a ``noloco coordinator``, or ``etcd://H:P,...``), with ``method`` and
    its ``settings`` (the :class:`noloco.config.MethodConfig` fields, as the CLI's flags:
    ``sync_every``, ``outer_lr``, ``outer_momentum``, ``compress``, ``fragments``, ...).
    ``checkpoint_dir``: this replica's own checkpoints go under it (``replica-K/``), every
    ``checkpoint_every`` steps (default: every outer step) and when it leaves; a replica
    started again that finds no live replica to join goes on from its newest. ``resume``: a
    run stopped as a whole (every replica left, or was killed) continues, each replica from
    its own newest checkpoint in ``checkpoint_dir`` (a new epoch of the run in the store:
    docs/library.md); a replica with none starts as without it. See the module docstring;
    :class:`RunError` on bad input."""
    if checkpoint_every is not None and checkpoint_every < 1:
        raise RunError(f"join_run: checkpoint_every must be at least 1, not {checkpoint_every}")
    if resume and checkpoint_dir is None:
        raise RunError("join_run: resume=True continues from this replica's own checkpoints: "
                       "pass the checkpoint_dir they were written to")
    _check_inputs("join_run", model, optimizer, method, settings, LIBRARY_METHODS,
                  "is not served by an elastic run")
    if not 0 <= replica < replicas:
        raise RunError(f"join_run: replica {replica} outside 0..{replicas - 1}")
    cfg = _config("join_run", method=method, replicas=replicas, elastic=True,
                  peer_timeout=peer_timeout, comm_timeout=comm_timeout, settings=settings,
                  train=dict(coordinator=coordinator, run_id=run_id, secret_file=secret_file,
                             seed=seed))
    return ElasticLoop(model, optimizer, cfg, replica,
                       None if checkpoint_dir is None else Path(checkpoint_dir),
                       checkpoint_every or cfg.method.sync_every or 1, resume)


def static_run(model: nn.Module, optimizer: torch.optim.Optimizer, *,
               method: str = "diloco", seed: int = 0, **settings: Any) -> StaticLoop:
    """Every process of the default ``torch.distributed`` process group (initialised by the
    caller or its launcher: torchrun, Lightning, ...) is one replica of a static run: no
    coordinator, no joins; a replica that dies stops the run, as any collective job. The
    same checks and the same ``optimizer.step()`` as :func:`join_run`, over a
    :class:`noloco.comm.TorchCommunicator` (gloo on CPU, NCCL on GPU)."""
    import torch.distributed as dist

    _check_inputs("static_run", model, optimizer, method, settings, STATIC_METHODS,
                  "is not a method of a static library run")
    if not dist.is_initialized():
        raise RunError("static_run: torch.distributed is not initialised "
                       "(init_process_group first, or run under torchrun)")
    cfg = _config("static_run", method=method,
                  replicas=dist.get_world_size(), elastic=False, settings=settings,
                  train=dict(seed=seed))
    return StaticLoop(model, optimizer, cfg)


def _check_inputs(fn: str, model: Any, optimizer: Any, method: str, settings: dict[str, Any],
                  allowed: tuple[str, ...], why: str) -> None:
    if not isinstance(model, nn.Module):
        raise RunError(f"{fn}: model must be a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise RunError(f"{fn}: optimizer must be a torch.optim.Optimizer, not "
                       f"{type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise RunError(f"{fn}: LBFGS evaluates its closure several times inside one step: "
                       f"not supported (one closure call, then the step)")
    if method not in allowed:
        raise RunError(f"{fn}: method {method!r} {why}: choose from {', '.join(allowed)}")
    known = {f.name for f in fields(MethodConfig)} - {"method", "replicas", "stages",
                                                       "elastic", "routing", "microbatches"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise RunError(f"{fn}: unknown method setting(s) {', '.join(unknown)}: the "
                       f"settings are those of noloco.config.MethodConfig")


def _config(fn: str, *, settings: dict[str, Any],
            train: dict[str, Any], **method: Any) -> Config:
    """The run's one config tree, resolved as the CLI resolves it (method defaults,
    validation): bad values are a RunError of one line."""
    try:
        cfg = Config(method=MethodConfig(**method, **settings),
                     train=TrainConfig(out="(the loop's own)", checkpoint_every="0", **train))
        return cfg.resolved()
    except (ConfigError, ValueError, TypeError) as e:
        raise RunError(f"{fn}: {str(e).splitlines()[0]}") from None


def _device(fn: str, params: list[torch.Tensor]) -> torch.device:
    """The one device that holds every parameter (RunError where they are spread)."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise RunError(f"{fn}: the model's parameters are on {names}: a replica's parameters "
                       f"must all be on one device")
    device = devices.pop()
    if device.type not in ("cpu", "cuda"):
        raise RunError(f"{fn}: parameters on {device} (the CPU or one CUDA GPU)")
    return device


def static_path(backend: str, device: torch.device, forced: bool = False) -> bool:
    """Whether a static run over a process group of ``backend`` stages its tensors through
    host memory (gloo with CUDA tensors: gloo cannot send one point to point); RunError where
    the group cannot carry the run: NCCL with CPU parameters, or NCCL with no gloo for the
    CPU tensors of the start-up checks."""
    nccl = "nccl" in backend
    if nccl and device.type != "cuda":
        raise RunError(f"static_run: the process group is {backend!r} and the model is on the "
                       f"CPU: NCCL carries CUDA tensors only (init the group with gloo, or "
                       f"move the model to its GPU)")
    if nccl and "gloo" not in backend:
        raise RunError(f"static_run: the process group is {backend!r}: the run's checks are "
                       f"small CPU tensors, which NCCL cannot carry (init_process_group("
                       f"'cpu:gloo,cuda:nccl'))")
    return forced or (device.type == "cuda" and not nccl)


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


class _NoCheckpoints:
    """No ``checkpoint_dir``: a restarted process joins from a donor, or fails."""

    enabled = False
    root = Path("/nonexistent/noloco-library")
    saved_step: int | None = None

    def due(self, step: int) -> bool:
        return False

    def save(self, step: int, state: dict[str, Any]) -> None:
        pass

    def poll(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self, wait: bool = True) -> None:
        pass


class _LoopJoiner(Joiner):
    def checkpoint_root(self) -> Path:
        return self.trainer.ckpt.root


class _Handle:
    """What both kinds of library run share: the step count, the wrapped
    ``optimizer.step`` and leaving."""

    cfg: Config
    lay: Layout
    method: Any
    comm: Any
    inner: torch.optim.Optimizer
    state: LoopState

    def _wrap(self, optimizer: torch.optim.Optimizer) -> None:
        self._closed = False
        self._step = optimizer.step
        handle = self

        def step(opt: torch.optim.Optimizer, closure: Any = None) -> Any:
            return handle._wrapped_step(closure)

        # A method of the optimizer (not of this handle): an LR scheduler built later re-binds
        # ``step.__func__`` to the optimizer, and must still reach this handle.
        self._installed = types.MethodType(step, optimizer)
        optimizer.step = self._installed  # type: ignore[method-assign]

    # ---- what the loop reads ---------------------------------------------------------------
    @property
    def step(self) -> int:
        """Inner steps this replica has taken in the run (a joiner: its donor's count)."""
        return self.state.step

    @property
    def replica(self) -> int:
        return self.lay.replica

    @property
    def replicas(self) -> int:
        return self.lay.replicas

    @property
    def outer_steps(self) -> int:
        return self.method.outer_steps

    @property
    def bytes_sent(self) -> int:
        return self.comm.bytes_sent

    @property
    def joins(self) -> list[dict[str, Any]]:
        """What this replica donated, took (joined, healed) and refused."""
        return []

    # ---- the step ---------------------------------------------------------------------------
    def _wrapped_step(self, closure: Any = None) -> Any:
        if self._closed:
            return self._step(closure)
        loss = None
        if closure is not None:
            # (Lightning computes the gradients inside step(closure): they must exist
            # before the method's part; the closure is called once, as SGD or AdamW do)
            with torch.enable_grad():
                loss = closure()
        self.method.sync_gradients()
        self._step()
        st = self.state
        st.step = st.step + 1
        self._counted(st.step)
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
        self._between_steps()
        self._after_step(self.state.step)
        return loss

    def _after_step(self, step: int) -> None:
        """After everything of a step: its checkpoint, when one is due."""

    def _counted(self, step: int) -> None:
        """The step just counted (heartbeats carry it)."""

    def _between_steps(self) -> None:
        """After the method's part of a step: what an elastic run does between two steps."""

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
        except BaseException:
            ok = False
            raise
        finally:
            self._leave(ok)
            if self.inner.step == self._installed:
                self.inner.step = self._step  # type: ignore[method-assign]
            # (else something wrapped it since, a scheduler: it passes through, closed)

    def _leave(self, ok: bool) -> None:
        pass

    def __enter__(self) -> Any:
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        self.close(ok=kind is None)


class ElasticLoop(_Handle):
    """One replica of an elastic run around a user's model and optimizer (:func:`join_run`
    builds it): the attributes :class:`noloco.elastic.join.Joiner` reads of the trainer it
    serves, and the wrapped ``optimizer.step``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config,
                 replica: int, checkpoint_dir: Path | None = None,
                 checkpoint_every: int = 1, resume: bool = False) -> None:
        m, t = cfg.method, cfg.train
        self.cfg, self.model, self.inner = cfg, model, optimizer
        self.lay = Layout(rank=replica, world=m.replicas, local_world=1, replica=replica,
                          stage=0, replicas=m.replicas, stages=1)
        self.runner = _Runner(model)
        self.params = self.runner.parameters()
        if not self.params:
            raise RunError("join_run: the model has no trainable parameters")
        self.device = _device("join_run", self.params)
        self.reader = _NoReader()
        self.status = _Status()
        self.state = LoopState()
        self.ckpt: Any = _NoCheckpoints()
        if checkpoint_dir is not None:
            self.ckpt = ckpt_mod.Checkpointer(checkpoint_dir / f"replica-{replica}", 0, 1,
                                              cfg.math_hash(), checkpoint_every,
                                              align=m.sync_every or 1)
        self.resumed_from: int | None = None
        self.t_start = self.t_loop = time.perf_counter()
        try:  # what the method will cut the model into, before anything reaches the run
            split_model(self.runner.named_parameters(), m.fragments, m.fragment_pattern)
        except ValueError as e:
            raise RunError(f"join_run: {str(e).splitlines()[0]}") from None
        address = t.coordinator
        assert address is not None
        try:
            if not address.startswith(ETCD_SCHEME):
                auth.use_secret(auth.load_secret(t.secret_file))
                wait_reachable(*parse_address(address), m.comm_timeout)
            self.ns = Namespace(cfg.run_id())
            store = open_store_patiently(address, request_deadline(m.peer_timeout), self.ns,
                                         m.comm_timeout, m.peer_timeout)
        except ConfigError as e:
            raise RunError(f"join_run: {str(e).splitlines()[0]}") from None
        except (OSError, RuntimeError) as e:
            raise RunError(f"join_run: cannot reach the run's store at {address}: "
                           f"{str(e).splitlines()[0][:200]}") from None
        try:
            if resume:
                self.ns.continue_stopped(
                    store, self._stopped_at(),
                    lambda: bool(set(live_replicas(store, m.replicas, 1)) - {replica}),
                    unknown_opens=False)
            self._enter(store, replica, resume)
            if self.ckpt.enabled:  # (a process killed before its first save resumes right)
                self._record_store()
        except RunError:
            raise
        except (OSError, RuntimeError) as e:
            raise RunError(f"join_run: replica {replica}: the run's store stopped answering "
                           f"({str(e).splitlines()[0][:200]})") from None
        self._wrap(optimizer)

    def _enter(self, store: Any, replica: int, resume: bool = False) -> None:
        """The checks, then this replica counted in, registered and (a joiner) given a live
        state; resuming (its first start in this epoch), its own newest checkpoint's."""
        m, t = self.cfg.method, self.cfg.train
        saved = ckpt_mod.steps_on_disk(self.ckpt.root) if self.ckpt.enabled else []
        own = resume and bool(saved)
        # What every replica must share, checked before this one counts itself in.
        arch = [(n, tuple(p.shape), str(p.dtype)) for n, p in self.runner.named_parameters()]
        self._agree(store, "architecture", _digest(arch),
                    "the model's parameters (names, shapes, dtypes) differ from the run's: "
                    "every replica must build the same architecture")
        self._agree(store, "settings", _digest(_settings(self.cfg)),
                    "the method settings differ from the run's: every replica must pass the "
                    "same method and settings")
        if store.add(starts_key(replica, 0), 0) == 0 and not own:
            # Its first start (also when it is about to take a donor's state: an unseeded
            # initialisation is said at once, by whichever replica starts second). A process
            # started again may hold weights of its own loading: it takes a donor's anyway;
            # one resuming takes its checkpoint's.
            self._agree(store, "start", str(weights_checksum(self.params)),
                        "its initial weights differ from those the run started from: seed "
                        "the model's initialisation alike on every replica")
        if self.ckpt.enabled and not resume and store.add(starts_key(replica, 0), 0) == 0 \
                and saved:
            # Its first start in this run: checkpoints there are another run's (or this
            # run's before its coordinator restarted empty), and would pass for its own.
            raise RunError(f"join_run: replica {replica}: {self.ckpt.root} holds checkpoints "
                           f"of an earlier run: move them away or pass another checkpoint_dir")
        incarnation = store.add(starts_key(replica, 0), 1) - 1
        # A replica started again, or for the first time while the others have trained,
        # takes a live state before its first step (out of snapshots meanwhile).
        # Resuming, its first start in this epoch goes on from its own checkpoint (the
        # others, resuming too, may have stepped already).
        resumes = own and incarnation == 0
        joins = incarnation > 0 or not resumes and any(
            int(b.get("step", 0)) > 0 for r, b in live_replicas(store, m.replicas, 1).items()
            if r != replica)
        self.membership = Membership(store, replica, m.replicas, m.peer_timeout, incarnation,
                                     0, 1)
        self.membership.joining = joins
        if resumes:  # its first beat says where it resumes: a replica with nothing saved
            # that starts meanwhile joins it, not trains from step 0 beside it
            self.membership.step = saved[0]
        self.membership.start()
        try:
            comm = ElasticCommunicator(self.membership, m.peer_timeout, m.comm_timeout)
            secret = auth.current_secret()
            if secret is not None and m.payload_mac:
                comm.sealer = Sealer(payload_key(secret))
            # gloo's, across the internet: a GPU's tensors go through host buffers
            staged = self.device.type == "cuda" or forced_host_staging()
            self.comm = HostStaged(comm, self.device) if staged else comm
            try:
                self.method = build_method(m, self.runner.named_parameters(), self.comm,
                                           seed=t.seed)
            except ValueError as e:
                raise RunError(f"join_run: {str(e).splitlines()[0]}") from None
            self.joiner = _LoopJoiner(self.membership)
            self.joiner.attach(self)  # type: ignore[arg-type]
            if resumes and not self._resume("resumed"):
                # (its checkpoints vanished since: it takes the others' state)
                joins = self.membership.joining = True
            if joins:
                try:
                    self.joiner.join()
                except NoDonor as e:
                    # Nobody left to take a state from: its own newest checkpoint, if any.
                    if not self._resume("no live replica to join"):
                        where = "" if self.ckpt.enabled else " (no checkpoint_dir)"
                        raise RunError(f"join_run: replica {replica}: "
                                       f"{str(e).splitlines()[0]}, and it has no checkpoint "
                                       f"of its own{where}") from None
                except ConfigError as e:
                    raise RunError(f"join_run: replica {replica}: "
                                   f"{str(e).splitlines()[0]}") from None
            self.membership.step = self.status.step = self.state.step
            self.membership.ready = True  # a donor from now on
            self.membership.joining = False
            self.membership.beat()
            self.membership.await_visible()
        except BaseException:
            self.membership.finish(stopped=True)
            raise

    def _agree(self, store: Any, what: str, value: str, why: str) -> None:
        key = _FINGERPRINT_KEY.format(what)
        got = store.compare_set(key, "", value)
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got != value:
            raise RunError(f"join_run: replica {self.lay.replica}: {why}")

    @property
    def joins(self) -> list[dict[str, Any]]:
        """What this replica donated, took (joined, healed) and refused."""
        return self.joiner.joins

    def _counted(self, step: int) -> None:
        self.status.step = self.membership.step = step

    def _between_steps(self) -> None:
        # (the step reaches the heartbeat from the beat thread: no store write per step here,
        # and none that could stall a replica cut off from the store)
        self.joiner.between_steps()  # serve joiners, heal (may move the step)

    def _leave(self, ok: bool) -> None:
        try:
            if ok and self.ckpt.enabled and self.ckpt.saved_step != self.state.step:
                self.ckpt.save(self.state.step, self.capture())  # where it left
            if self.ckpt.enabled:
                self._record_store()
            self.ckpt.close(wait=True)
        finally:
            self.membership.finish(stopped=not ok)

    # ---- checkpoints of its own ---------------------------------------------------------------
    def capture(self) -> dict[str, Any]:
        """What this replica's own checkpoint holds (the CLI's format): the model's weights
        and the optimizer's state beside the method's, so that a replica going on from it
        alone is consistent — the loop's own model checkpoints are its own affair."""
        return {
            "format": ckpt_mod.FORMAT, "step": self.state.step, "rank": self.lay.rank,
            "config_hash": self.cfg.math_hash(),
            "model": dict(self.runner.named_parameters()),
            "optimizer": self.inner.state_dict(), "method": self.method.state_dict(),
            "reader": {}, "rng": ckpt_mod.rng_state(), "comm": self.comm.state_dict(),
            "runner": {}, "loop": {"step": self.state.step},
        }

    @torch.no_grad()
    def _resume(self, why: str) -> bool:
        """Go on from its own newest checkpoint: False when there is none. ``why``: "resumed"
        (``resume=True``), or "no live replica to join" (a restarted process)."""
        if not self.ckpt.enabled:
            return False
        step, sd = ckpt_mod.agree_on_step(self.ckpt.root, 0, self.cfg.math_hash(),
                                          lambda x: [x])
        if step is None:
            return False
        named = dict(self.runner.named_parameters())
        if set(named) != set(sd["model"]):
            raise RunError(f"join_run: replica {self.lay.replica}: its checkpoint in "
                           f"{self.ckpt.root} holds other parameters than this model")
        for name, p in named.items():
            p.copy_(sd["model"][name])
        self.inner.load_state_dict(sd["optimizer"])
        self.method.load_state_dict(sd["method"])
        self.comm.load_state_dict(sd["comm"])
        ckpt_mod.set_rng_state(sd["rng"])
        self.state.step = self.status.step = self.membership.step = int(step)
        self.resumed_from = self.ckpt.saved_step = int(step)
        self.joiner.joins.append({"kind": "own checkpoint", "replica": self.lay.replica,
                                  "stage": 0, "step": int(step), "why": why,
                                  "epoch": self.ns.epoch, "t": time.time()})
        said = ("resumes the run" if why == "resumed"
                else "found no live replica to join; it goes on")
        print(f"noloco: replica {self.lay.replica} {said} from its own checkpoint at step "
              f"{step}", file=sys.stderr, flush=True)
        return True

    # Where the run stood in its store at this replica's newest checkpoint: what a resume
    # compares (Namespace.continue_stopped). Beside the checkpoints, written with each.
    STOPPED_FILE = "store.json"

    def _stopped_at(self) -> dict[str, Any] | None:
        try:
            got = json.loads((self.ckpt.root / self.STOPPED_FILE).read_text())
        except (OSError, ValueError):
            return None
        return stopped_record(got)

    def _record_store(self) -> None:
        """Written after each save is begun (a record a little newer than the checkpoint
        is what a resume needs: the epoch it would meet stale records in)."""
        if self.ns.boot is None:
            return
        try:
            self.ckpt.root.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.ckpt.root / self.STOPPED_FILE,
                              {"boot": self.ns.boot.decode(), "epoch": self.ns.epoch})
        except OSError as e:  # (a resume then finds the run as if it had no record)
            print(f"noloco: replica {self.lay.replica}: cannot write "
                  f"{self.ckpt.root / self.STOPPED_FILE} ({e.strerror})", file=sys.stderr,
                  flush=True)

    def _after_step(self, step: int) -> None:
        if self.ckpt.due(step):
            self.ckpt.save(step, self.capture())
            self._record_store()
        self.ckpt.poll()

    # ---- what the join protocol reads of a trainer -------------------------------------------

    def loop_seconds(self) -> float:
        return time.perf_counter() - self.t_loop

    def wall_seconds(self) -> float:
        return time.perf_counter() - self.t_start


class StaticLoop(_Handle):
    """One replica of a static library run (:func:`static_run` builds it): the default
    process group's ranks are the replicas."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config
                 ) -> None:
        import torch.distributed as dist

        from noloco.comm import TorchCommunicator

        m = cfg.method
        self.cfg, self.model, self.inner = cfg, model, optimizer
        rank = dist.get_rank()
        self.lay = Layout(rank=rank, world=m.replicas, local_world=1, replica=rank, stage=0,
                          replicas=m.replicas, stages=1)
        self.runner = _Runner(model)
        self.state = LoopState()
        named = self.runner.named_parameters()
        if not named:
            raise RunError("static_run: the model has no trainable parameters")
        self.device = _device("static_run", [p for _, p in named])
        comm = TorchCommunicator()
        staged = static_path(str(dist.get_backend()), self.device, forced_host_staging())
        self.comm = HostStaged(comm, self.device) if staged else comm
        # The run's contract, checked by every replica alike (one all-gather): what differs
        # is said by all of them, in one line each.
        arch = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        mine = [_digest(arch), _digest(_settings(cfg)),
                str(weights_checksum([p for _, p in named]))]
        with comm.uncounted():  # CPU tensors: gloo's side of the group
            got = comm.all_gather(torch.tensor([int(_digest(x)[:15], 16) for x in mine],
                                               dtype=torch.int64))
        for i, why in enumerate((
                "the model's parameters (names, shapes, dtypes) differ between replicas: "
                "every replica must build the same architecture",
                "the method settings differ between replicas: every replica must pass the "
                "same method and settings",
                "the initial weights differ between replicas: seed the model's "
                "initialisation alike on every replica")):
            if len({int(g[i]) for g in got}) > 1:
                raise RunError(f"static_run: replica {rank}: {why}")
        try:
            self.method = build_method(m, named, self.comm, seed=cfg.train.seed)
        except ValueError as e:
            raise RunError(f"static_run: {str(e).splitlines()[0]}") from None
        self._wrap(optimizer)


def _settings(cfg: Config) -> dict[str, Any]:
    """What every replica must share of the method: its settings, its seed (NoLoCo's groups
    are drawn from it) and whether payloads carry MACs."""
    return {**cfg.math_dict()["method"], "seed": cfg.train.seed,
            "payload_mac": cfg.method.payload_mac}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]

