"""A replica taking a live replica's state: joining (a respawned or relaunched replica) and
healing (a DiLoCo replica the quorum stepped without), from both ends.

The joiner asks a donor — a live replica that trains, the furthest along first — by
incrementing the donor's join counter and naming itself under the request's key; the donor
serves between two inner steps (never inside one), sending the live state — model, the
method's whole state (slow weights, outer momentum, syncs in flight), the step and the
operation count — over a two-member gloo group on the request's store prefix. The joiner
keeps its own inner optimizer and data position (from its newest checkpoint, if any). With
pipeline stages every stage takes its state from the donor's same stage, all at one step that
the donor's stage 0 fixes.

Floor 4 of docs/architecture.md: what an elastic run adds to the trainer.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from noloco import checkpoint as ckpt_mod
from noloco.comm import CommError
from noloco.config import ConfigError
from noloco.elastic.deadline import raw, store_errors
from noloco.elastic.files import replica_checkpoints
from noloco.elastic.keys import PREFIX, heartbeat_key, join_key, join_seen_key, missed_key
from noloco.elastic.membership import Membership, await_value, live_replicas, probe
from noloco.errors import StoreLost, Superseded
from noloco.guard import all_finite
from noloco.integrity import TAG_BYTES, chunk_bounds
from noloco.methods.base import shared_state
from noloco.train import Trainer, weights_checksum

STATE_SLACK = 64 << 20
"""bytes a received state may hold beyond :data:`STATE_COPIES` copies of the model"""
STATE_COPIES = 8
"""model-sized tensors a live state holds at most: the model, slow weights, outer momentum
and a sync in flight (what was sent and what each partner sent back)"""


class BadState(RuntimeError):
    """A donor's state that does not fit this model (size, names, shapes, dtypes) or is not
    finite: refused before it is used, as if the donor had failed."""


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a state (dicts by sorted key, lists in order): a fixed order on every
    replica."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in tensors_of(obj[k])]
    if isinstance(obj, list | tuple):
        return [t for x in obj for t in tensors_of(x)]
    return []


def join_streams(own: dict[str, Any] | None, seed: int, rank: int, step: int) -> None:
    """The random streams of a replica that joins (dropout's, and any other draw from the
    global generators): its own checkpoint's when it has one, else fresh ones keyed by
    (seed, rank, the step it joins at) — a respawn without a checkpoint would otherwise draw
    its first life's numbers again, from step 0."""
    import random

    import numpy as np

    if own is not None and "rng" in own:
        ckpt_mod.set_rng_state(own["rng"])
        return
    key = (seed * 1009 + rank) * 1_000_003 + step
    torch.manual_seed(key)
    random.seed(key)
    np.random.seed(key % 2**32)


class NoDonor(ConfigError):
    """A joining replica found no live replica to take a state from: the others finished,
    died or cannot be reached. It may go on from its own newest checkpoint instead
    (:func:`noloco.elastic.worker.run`)."""


class Joiner:
    """The join and heal protocol, from both ends: a component of an elastic replica
    (:class:`noloco.elastic.worker.ElasticReplica`), attached to the one trainer it serves
    (whose model, method, optimizers, state and communicator it reads and, joining, sets)."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.trainer: Trainer
        """the trainer this replica's training runs in (set by :meth:`attach`)"""
        self.joins: list[dict[str, Any]] = []
        """what this replica donated, took (joined, healed) and refused"""
        self.served = 0
        """join requests this replica has served (as a donor; a respawned one skips those
        made to its previous life, and those made while its trainer was being built)"""
        self.next_serve = 0
        self.generation = 0
        """the store's epochs this replica moved through (its join counters are the epoch's)"""
        self.synced_calls = 0
        """with pipeline stages and an all-reduce method: the operations up to which this
        replica's stages compared their standing (:meth:`_stages_heal_together`)"""
        self.heal_pending = False
        """a stage is behind, but not every stage could heal yet (cut off, not re-aligned)"""
        self.staged_heals = 0
        """heals this incarnation's stages made together (each heal's choice key is its own)"""
        self.choices: list[str] = []
        """the latest staged join's choice keys, one per attempt (a heal's are deleted after
        it)"""

    def attach(self, trainer: Trainer) -> None:
        """The trainer, built: from here this replica counts the join requests it serves."""
        self.trainer = trainer
        m = self.membership
        self.served = self.next_serve = m.store.add(join_key(m.replica), 0)
        self.generation = m.ns.generation if m.ns is not None else 0

    def checkpoint_root(self) -> Path:
        """Where this replica's (stage's) own checkpoints go: it saves and resumes alone."""
        t = self.trainer
        return replica_checkpoints(t.rundir.path, t.lay.replica, t.lay.stage, t.lay.stages)

    def gather_stages(self, x: int) -> list[int]:
        lay = self.trainer.lay
        if lay.stages == 1:
            return [x]
        # The replica's stages are the process group's whole world (noloco.elastic.worker.run)
        got = [torch.zeros(1, dtype=torch.int64) for _ in range(lay.stages)]
        dist.all_gather(got, torch.tensor([x], dtype=torch.int64))
        return [int(g) for g in got]

    # ---- join: donor side ------------------------------------------------------------------
    def live_state(self) -> dict[str, Any]:
        """What a joining replica takes from its donor (everything but the inner optimizer,
        the data position and the random streams, which are the joiner's own:
        :meth:`_adopt`). Slow weights equal to the fast ones — a DiLoCo replica between its
        outer step and its next inner step — are not sent twice: ``phi_is_model`` names those
        fragments, and the joiner rebuilds them from the model it receives."""
        method = shared_state(self.trainer.method.state_dict())
        frags = self.trainer.method.frags
        same = [i for i, f in enumerate(frags) if f.numel() and torch.equal(f.slow(), f.fast())]
        if same:
            method = {**method, "phi": [None if i in same else phi
                                        for i, phi in enumerate(method["phi"])]}
        return {"model": {n: p.detach().clone() for n, p in self.trainer.runner.named_parameters()},
                "method": method, "phi_is_model": same, "comm_calls": self.trainer.comm.calls,
                "comm_commits": self.trainer.comm.commits,
                "step": self.trainer.state.step, "donor": self.trainer.lay.replica}

    # ---- a partition: bounded drift while cut off, re-aligned when the link returns ----------
    def partition_check(self) -> bool:
        """Between two steps: False while this replica is cut off from the run's store (it
        trains on alone, up to the bound); True once it reaches the store, re-aligned with
        the others if it did operations alone meanwhile."""
        m, comm = self.membership, self.trainer.comm
        if m.cut_off():
            silent = time.monotonic() - m.last_beat
            if silent > self.trainer.cfg.train.coordinator_timeout:
                self._stop_without_store(silent)
            # (Pipeline stages train on alone: a stage that waited would hold the others
            # past --comm-timeout.)
            if comm.lonely < self.lonely_limit() or self.trainer.lay.stages > 1:
                return False
            if not self._wait_for_link():
                return False  # a stop signal: the step boundary saves and stops
        if comm.lonely:
            # Not re-aligned, it does not know where it stands: a heal now could find
            # nobody with more all-reduces yet (the others have still to step operations it
            # passed alone) and take its own state for the live one, its slow weights apart
            # from the run's for good (a CI failure after a coordinator outage: the training
            # thread's connection, broken with the old store, failed the re-alignment, then
            # renewed, and the heal ran). So: a fresh connection first, and nothing more until
            # the re-alignment went through.
            if m.broken:
                try:
                    m.renew()
                except Exception:  # noqa: BLE001 - the store is still out of reach: later
                    return False
            self._realign()
            return not comm.lonely
        return True

    def lonely_limit(self) -> int:
        """Operations a replica cut off does alone before it waits for the link:
        ``--max-lonely-outer-steps`` outer steps (each of them one operation per fragment)."""
        m = self.trainer.cfg.method
        return m.max_lonely_outer_steps * max(m.fragments, 1)

    def _wait_for_link(self) -> bool:
        """Cut off for ``--max-lonely-outer-steps`` outer steps alone: train no further until
        the run's store answers again (the others train on and are ahead when it returns, so
        it takes a live replica's state, :meth:`heal`), or save and stop at
        ``--coordinator-timeout``. Without the bound a replica cut off for minutes runs
        hundreds of steps ahead of the others and, its operations numbered beyond theirs,
        rarely meets them again. False: a stop signal came first."""
        m, comm, t = self.membership, self.trainer.comm, self.trainer
        t0, lonely = time.monotonic(), comm.lonely
        print(f"noloco: replica {t.lay.replica}: cut off from the run's store for "
              f"{lonely} operations alone (--max-lonely-outer-steps "
              f"{t.cfg.method.max_lonely_outer_steps}); waiting for the link at step "
              f"{t.state.step}", file=sys.stderr, flush=True)
        while m.cut_off():
            silent = time.monotonic() - m.last_beat
            if silent > t.cfg.train.coordinator_timeout:
                self._stop_without_store(silent)
            if t.status.stop_signal is not None:
                return False
            time.sleep(0.1)
        comm.events.append({"call": comm.calls, "step": t.state.step,
                            "kind": "waited_for_link", "lonely_ops": lonely,
                            "seconds": round(time.monotonic() - t0, 2)})
        return True

    def _realign(self) -> None:
        """The link is back after operations done alone. A replica that ran ahead of the others
        (they have not yet reached its latest operation) waits for them, out of new snapshots
        (its missed mark), until they have: then it is back, in the snapshot of the next
        operation they all come to — numbered alike everywhere, so the partners are the same
        on every replica. One behind them takes a live replica's state at its next operation
        (:meth:`~noloco.elastic.communicator.ElasticCommunicator._left_out`). The partition's
        record says how far it ran alone and how it re-aligned. (With pipeline stages a replica
        only waits, at the bound, while cut off.)"""
        m, comm, t = self.membership, self.trainer.comm, self.trainer
        lonely, since, last = comm.lonely, comm.lonely_from_step, comm.op_step
        t0 = time.monotonic()
        try:
            how, ahead = self._wait_if_ahead(last)
        except store_errors():  # out of reach again: once it answers
            m.broken = True
            return
        comm.lonely, comm.lonely_from_step = 0, None
        record = {"lonely_ops": lonely, "lonely_from_step": since, "last_op_step": last,
                  "ahead_steps": ahead, "realigned": how,
                  "waited_seconds": round(time.monotonic() - t0, 2)}
        comm.events.append({"call": comm.calls, "step": t.state.step, "kind": "realigned",
                            **record})
        if m.cuts and "realigned" not in m.cuts[-1]:
            m.cuts[-1].update(record)
        print(f"noloco: replica {t.lay.replica}: the link is back after {lonely} operations "
              f"alone (from step {since}); {how}"
              f"{f' for the others ({time.monotonic() - t0:.1f} s)' if how == 'waited' else ''}",
              file=sys.stderr, flush=True)

    def _wait_if_ahead(self, last: int) -> tuple[str, int | None]:
        """(how it re-aligned, how many steps it was ahead of the furthest other replica; None:
        there is none) — see :meth:`_realign`."""
        m, comm, t = self.membership, self.trainer.comm, self.trainer
        others = self._steps_of_others()
        ahead = last - max(others.values()) if others else None
        m_cfg = t.cfg.method
        interval = max(1, (m_cfg.sync_every or 1) // max(m_cfg.fragments, 1))
        how = ("alone" if ahead is None else "ahead" if ahead > 0
               else "behind" if -ahead >= interval  # they passed its next operation too
               else "level")
        # Ahead: the others have yet to reach its latest operation's step (level: all were
        # cut off alike, a coordinator outage, and none does that operation again).
        if ahead is not None and ahead > 0 and t.lay.stages == 1:
            how = "waited"
            m.store.set(missed_key(t.lay.replica), f"m:{comm.calls}")
            best, moved = max(others.values()), time.monotonic()
            while (others and max(others.values()) <= last and not m.cut_off()
                   and t.status.stop_signal is None):
                # Only while they train: the others' furthest step moves.
                if max(others.values()) > best:
                    best, moved = max(others.values()), time.monotonic()
                elif time.monotonic() - moved > t.cfg.method.peer_timeout:
                    break
                time.sleep(0.1)
                others = self._steps_of_others()
            comm.back()
            m.nudge()
        return how, ahead

    def _steps_of_others(self) -> dict[int, int]:
        """The step each other live replica that trains has reached (its heartbeat)."""
        live = live_replicas(self.membership.store, self.membership.replicas,
                             self.membership.stages)
        return {r: int(b.get("step", 0)) for r, b in live.items()
                if r != self.trainer.lay.replica and not b.get("joining")}

    def _stop_without_store(self, silent: float) -> None:
        """Past ``--coordinator-timeout`` without the run's store: a checkpoint, then stop
        (the launcher does not start this replica again)."""
        self.trainer.ckpt.save(self.trainer.state.step, self.trainer.capture())
        self.trainer.ckpt.wait()
        raise StoreLost(f"replica {self.trainer.lay.replica}: the run's store has not answered for "
                        f"{silent:.0f} s (--coordinator-timeout "
                        f"{self.trainer.cfg.train.coordinator_timeout:g}); saved a "
                        f"checkpoint at step "
                        f"{self.trainer.state.step} and stopped")

    def between_steps(self) -> None:
        m = self.membership
        if m.owner is not None:  # fenced: a newer process owns this replica's id
            raise Superseded(m.replica, m.stage, m.incarnation, m.owner)
        m.behind = self.trainer.comm.behind  # a behind replica is no donor (its heartbeat says so)
        m.commits = self.trainer.comm.commits
        m.info.update(outer=self.trainer.method.outer_steps,
                      blocked=round(self.trainer.comm.sync_seconds, 2),
                      joins=sum(j.get("kind") in ("joined", "healed") for j in self.joins))
        # The store restarted empty (a new epoch)? Before anything else (the partition check
        # below may use the store): the next snapshot, wherever this replica stands, is the
        # epoch's first and waits for the others to regroup. The communicator may have
        # entered the epoch first, at a snapshot: the join counters are reset here either way
        # — what this replica counted in the old epoch is gone with it.
        self.trainer.comm.epoch_check()
        if m.ns is not None and m.ns.generation != self.generation:
            self.generation = m.ns.generation
            self.served = self.next_serve = 0
        # Not through: cut off (nobody to heal from, nobody can ask: the others see it
        # dead), not re-aligned yet, or its connection not renewed yet.
        through = self.partition_check()
        if through and m.broken:
            try:
                m.renew()
            except Exception:  # noqa: BLE001 - the store is still out of reach: later
                through = False
        if self.trainer.lay.stages > 1:
            if self.trainer.cfg.method.method != "noloco":
                self._stages_heal_together(through)
            # A replica behind (every stage says the same since they compared) donates
            # nothing: its slow weights are not the run's.
            if through and not self.trainer.comm.behind:
                try:
                    self._serve_staged()
                except store_errors():  # out of reach: the joiner asks another donor
                    m.broken = True
            return
        if not through:
            return
        if self.trainer.comm.behind:
            m.nudge()
            try:
                self.heal()
            except store_errors():  # cut off while healing: again once the store answers
                m.broken = True
                return
            m.behind = self.trainer.comm.behind
            m.nudge()  # healed: eligible for the very next snapshot
        self._serve_requests()

    def _stages_heal_together(self, through: bool) -> None:
        """An all-reduce method with pipeline stages: after each operation the replica's
        stages compare their standing (one small all-reduce in their own process group, at
        the same step boundary on every stage: each stage counts the same operations), and
        if any of them is behind — its part of the all-reduce went on without it, so its
        slow weights are no longer the others' — all of them heal together, at this
        boundary, from one donor's same stages (:meth:`_join_staged`). Behind but not every
        stage through (cut off, not re-aligned): they compare again at every boundary until
        all are. The decision is the same on every stage: whether to heal, and from whom
        (stage 0 chooses, by the replica's fewest commits where no stage knows whether the
        others stepped)."""
        comm, m = self.trainer.comm, self.membership
        if comm.calls == self.synced_calls and not self.heal_pending:
            return
        flags = torch.tensor([int(comm.behind), int(comm.unsure), -comm.commits,
                              int(not through)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the replica's stages: their own group
        behind, unsure, fewest, waiting = (bool(flags[0]), bool(flags[1]), -int(flags[2]),
                                           bool(flags[3]))
        self.synced_calls = comm.calls
        # Behind on every stage: none of its stages donates meanwhile (its heartbeat says so).
        comm.behind, comm.unsure = behind, unsure and behind
        m.behind = behind
        self.heal_pending = behind and waiting
        if not behind or waiting:
            return
        m.nudge()
        resumed_from = self.trainer.resumed_from
        self.staged_heals += 1
        got: bool | None
        try:
            got = self._join_staged(None, heal=(fewest if unsure else None, fewest))
        except (*store_errors(), CommError, ConfigError) as e:
            # Out of reach, or a stage's answer never came (stage 0's choice, a transfer's
            # outcome): this stage does not know how the heal ended.
            m.broken = m.broken or isinstance(e, store_errors())
            got = None
        # One outcome for every stage: all healed, nobody to heal from (all read the one
        # choice) — or, where any stage's heal failed (every donor asked failed to serve,
        # or it does not know), all try again at the next boundary: a stage that took the
        # donor's state already takes one again then, with the others.
        codes = [True, False, None]
        outcome = torch.tensor([codes.index(got)], dtype=torch.int64)
        dist.all_reduce(outcome, op=dist.ReduceOp.MAX)
        got = codes[int(outcome)]
        if self.trainer.lay.stage == 0:
            # Every stage has read them (they all passed the outcome's all-reduce): the
            # heal's keys go, so the store holds none per heal, however many a run makes.
            with contextlib.suppress(*store_errors()):
                for choice in self.choices:
                    for key in [choice, *(f"{choice}/took/{st}"
                                          for st in range(self.trainer.lay.stages))]:
                        m.store.delete_key(key)
        if got is False:
            try:
                self._keep_own_state(unsure)
            except store_errors():  # decided alike everywhere; its record is what is lost
                m.broken = True
                comm.behind = comm.unsure = False
        self.heal_pending = got is None
        if got is None:
            comm.behind = True
        self.trainer.resumed_from = resumed_from
        self.synced_calls = comm.calls  # healed: the donor's count, the same on every stage
        m.behind = comm.behind
        m.nudge()  # healed: eligible for the very next snapshot

    def _serve_requests(self) -> None:
        """Donor side, one stage: send the live state to every joiner that asked since."""
        m, store = self.membership, self.membership.store
        counter = join_key(self.trainer.lay.replica)
        while self.served < self.membership.join_requests:
            self.served += 1
            tag = f"{counter}/{self.served}"
            t0 = time.perf_counter()
            try:
                # The joiner counts itself in, then names itself: it may die in between, or
                # stall. One that names itself after this gave up learns it from "no" at once
                # (else it would wait out its 3 x --peer-timeout for a "go").
                req = self._request(tag)
                if req is None:
                    store.compare_set(f"{tag}/go", "", "no")
                    raise RuntimeError("the request was never completed")
                # The joiner waits for "go", then the transfer; one that gave up first
                # wrote "no" (compare-and-set: exactly one of the two stands).
                if store.compare_set(f"{tag}/go", "", "go") != b"go":
                    raise RuntimeError("the joiner gave up waiting")
                nbytes = self._send_state(tag)
                for key in (tag, f"{tag}/go"):
                    store.delete_key(key)
            except RuntimeError as e:  # the joiner died meanwhile: go on
                if isinstance(e, store_errors()):
                    m.broken = True
                print(f"noloco: replica {self.trainer.lay.replica}: a state transfer (request "
                      f"{self.served}) failed ({str(e).splitlines()[0][:120]})",
                      file=sys.stderr, flush=True)
                continue
            self.joins.append({"kind": "donated", "to": req["replica"],
                               "step": self.trainer.state.step,
                               "bytes": nbytes, "seconds": time.perf_counter() - t0,
                               "checksum": self.checksum()})

    def _serve_staged(self) -> None:
        """Donor side with pipeline stages: every stage of the joiner takes its state from the
        same stage of this replica, all at one step. Stage 0 takes the requests and fixes
        the step: the next one. No other stage can have passed it yet — a stage finishes a
        step only with stage 0's activations of that step — so every stage of this replica
        serves at exactly that step."""
        store, lay = self.membership.store, self.trainer.lay
        counter = join_key(lay.replica)
        if self.next_serve >= self.membership.join_requests:
            return  # nothing asked (the common case: no store round trip)
        if lay.stage == 0:
            fixed = False
            while self.served < self.membership.join_requests:
                self.served += 1
                at = (self.trainer.state.step + 1
                      if self._request(f"{counter}/{self.served}") is not None else None)
                # Every request gets its answer, a step or None (never completed): the stages
                # take the answers in order, and a joiner's stages learn a refusal at once.
                # A joiner that gave up first wrote None (compare-and-set: one stands).
                got = store.compare_set(f"{counter}/serve/{self.served}", "",
                                        json.dumps({"step": at}))
                fixed |= at is not None and json.loads(got)["step"] == at
            if fixed:
                self._await_stages_looking()
        while True:
            key = f"{counter}/serve/{self.next_serve + 1}"
            if not store.check([key]):
                return
            at = json.loads(store.get(key))["step"]
            if at is not None and at > self.trainer.state.step:
                return
            self.next_serve += 1
            n = self.next_serve
            # None: not served (its joiner never named itself, or gave up). A past step
            # cannot happen (see above); a wrong step is never served.
            if at is None or at < self.trainer.state.step:
                continue
            t0 = time.perf_counter()
            try:
                nbytes = self._send_state(f"{counter}/{n}/s{lay.stage}")
            except RuntimeError as e:
                print(f"noloco: replica {lay.replica} stage {lay.stage}: a state transfer "
                      f"failed ({str(e).splitlines()[0][:120]})", file=sys.stderr, flush=True)
                continue
            self.joins.append({"kind": "donated", "request": n, "stage": lay.stage,
                               "step": self.trainer.state.step, "bytes": nbytes,
                               "seconds": time.perf_counter() - t0, "checksum": self.checksum()})

    def _await_stages_looking(self) -> None:
        """Stage 0, having fixed the next step for every stage to serve at: wait (at most
        ``--peer-timeout``) until each other stage has seen the request. A stage learns of
        requests from its heartbeat, off the training loop; one that had not yet would pass
        the step without serving, and the joiner's stage would wait for it in vain. Those
        stages finished this step already (a step ends on stage 0 with their gradients), so
        waiting here holds them before the step they serve at — the beats are at most a
        second apart."""
        store, lay = self.membership.store, self.trainer.lay
        deadline = time.monotonic() + self.trainer.cfg.method.peer_timeout
        for s in range(1, lay.stages):
            key = join_seen_key(lay.replica, s)
            while int((probe(store, key) or b"0").decode() or 0) < self.served \
                    and time.monotonic() < deadline:
                time.sleep(0.02)

    def _request(self, tag: str) -> dict[str, Any] | None:
        """A join request once the joiner has named itself (it counts itself in first, and
        may die in between): None if it never does within the timeout."""
        got = await_value(self.membership.store, tag, self.trainer.cfg.method.peer_timeout)
        if got is None:
            return None
        req = json.loads(got)
        sealer = self.trainer.comm.sealer
        context = self.trainer.comm.context("join-request/" + tag)
        if sealer is not None and not sealer.signed(context,
                                                    str(req.get("replica")), req.get("mac")):
            print(f"noloco: replica {self.trainer.lay.replica}: join request {tag} failed its MAC: "
                  f"ignored", file=sys.stderr, flush=True)
            return None
        return req

    def _ask(self, tag: str) -> str:
        """A join request (the joiner's id), signed when payloads carry MACs: the store is
        reached only through the gate, but this is what makes a donor send its whole state."""
        req: dict[str, Any] = {"replica": self.trainer.lay.replica}
        sealer = self.trainer.comm.sealer
        if sealer is not None:
            req["mac"] = sealer.sign(self.trainer.comm.context("join-request/" + tag),
                                     str(self.trainer.lay.replica))
        return json.dumps(req)

    def checksum(self) -> int:
        """Of the model and every tensor of the method's state — slow weights, outer
        momentum, syncs in flight — in a fixed order (the transfer is checked bit for bit
        with it: donor after sending, joiner after adopting)."""
        t = self.trainer
        return weights_checksum(t.params + tensors_of(shared_state(t.method.state_dict())))

    def _transfer_timeout(self) -> float:
        """A state transfer moves the whole model: it gets ``--comm-timeout`` (a slow link
        must not make every join fail), and at least the 3 × ``--peer-timeout`` a joiner of a
        pipeline allows the donor's stages to reach the step they serve at."""
        m = self.trainer.cfg.method
        return max(3 * m.peer_timeout, m.comm_timeout)

    def _send_state(self, tag: str) -> int:
        buf = io.BytesIO()
        torch.save(self.live_state(), buf)
        blob = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        pg = dist.ProcessGroupGloo(
            dist.PrefixStore(tag + "/pg", raw(self.membership.store)), 0, 2,
            timedelta(seconds=self._transfer_timeout()))
        pg.send([torch.tensor([blob.numel()], dtype=torch.int64)], 1, 0).wait()
        sealer = self.trainer.comm.sealer
        sent = self.trainer.comm.outgoing(blob.view(1, -1), "state").view(-1)
        if sealer is None:
            pg.send([sent], 1, 1).wait()
        else:
            # In chunks (tags 1..k), then the tag (k+1), hashed while the chunks are on the
            # wire; the joiner hashes each chunk as it lands (noloco.integrity).
            chunks = chunk_bounds(blob.numel())
            works = [pg.send([sent[a:b]], 1, 1 + i) for i, (a, b) in enumerate(chunks)]
            mac = sealer.seal(blob, self.trainer.comm.context("join/" + tag),
                              self.trainer.lay.replica,
                              ["joiner"])[0]
            works.append(pg.send([mac], 1, 1 + len(chunks)))
            for w in works:
                w.wait()
            self.trainer.comm.mac_bytes += TAG_BYTES
        # Both ends are connected (the joiner received): the rendezvous key is spent.
        self.membership.store.delete_key(f"{tag}/pg/0/0")
        return blob.numel() + 8

    # ---- join: joiner side -----------------------------------------------------------------
    def heal(self) -> None:
        """A replica that fell behind takes a live replica's state, step and operation count
        included — the way torchft heals a replica — keeping its own inner optimizer and data
        position. DiLoCo: the quorum stepped without it (it was late: stalled, slow), and its
        slow weights are no longer the others'. NoLoCo: it is a whole operation behind the
        others (it hung), so its partners would wait for it at every operation."""
        # An all-reduce method heals only from a replica that stepped with more all-reduces:
        # after an outage of the store that nobody could step through, everyone is marked
        # behind, yet every slow weight is alike and the next all-reduce takes everyone's
        # progress — taking one replica's state would throw the others' away.
        unsure = self.trainer.cfg.method.method != "noloco" and self.trainer.comm.unsure
        above = self.trainer.comm.commits if unsure else None
        donors = self.membership.donors(above)
        # A replica that stepped where this one did not may still say it is behind (an outage
        # marked everyone; it clears that at its next step): no donor yet, but one in a
        # moment — going on alone now would keep slow weights apart from the run's. At most
        # twice --peer-timeout: one that waits for the others to move before it steps again
        # (_realign, ahead after a cut) gives that up after one, then clears its flag. (A
        # replica's pipeline stages heal together instead: _stages_heal_together.)
        deadline = time.monotonic() + 2 * self.trainer.cfg.method.peer_timeout
        while (not donors and self.trainer.lay.stages == 1 and time.monotonic() < deadline
               and self.membership.catching_up(self.trainer.comm.commits)):
            time.sleep(0.1)
            donors = self.membership.donors(above)
        if donors:
            resumed_from = self.trainer.resumed_from
            # failed: again before the next step
            self.join(own=None, tries=1, kind="healed", commits_above=above)
            self.trainer.resumed_from = resumed_from
        else:  # nobody to take a state from: this replica's own is the live one
            self._keep_own_state(unsure)

    def _keep_own_state(self, unsure: bool) -> None:
        """A heal that found nobody to take a state from: this replica's own is the live
        one. Said, with how the others stood (read now): a replica whose slow weights then
        differ from the run's shows here why it did not heal."""
        comm = self.trainer.comm
        others = self.membership.beats_of(live_replicas(
            self.membership.store, self.membership.replicas, self.membership.stages))
        comm.events.append({"call": comm.calls, "step": self.trainer.state.step,
                            "kind": "own_state", "unsure": unsure,
                            "commits": comm.commits,
                            "others": {str(r): {k: b.get(k) for k in
                                                ("step", "commits", "behind", "ready")}
                                       for r, b in sorted(others.items())}})
        comm.behind = comm.unsure = False
        comm.back()

    def join(self, own: dict[str, Any] | None = None, tries: int | None = None,
             kind: str = "joined", commits_above: int | None = None) -> bool:
        """Take the live state from a live replica (see the module docstring): the one
        furthest along among those that train (never another joining one)."""
        if kind == "joined":
            own = self._own_checkpoint()
        if self.trainer.lay.stages > 1:
            return self._join_staged(own)
        store = self.membership.store
        deadline = time.monotonic() + 10 * self.trainer.cfg.method.peer_timeout
        failed: list[int] = []
        """donors that failed this join, in order: the next try asks another one"""
        live: dict[int, Any] = {}
        while time.monotonic() < deadline and (tries is None or tries > 0):
            live = live_replicas(store, self.membership.replicas, self.membership.stages)
            donors = self.membership.donors_among(live, commits_above)
            if not donors:
                if kind == "joined" and self._nobody_left(live):
                    break
                time.sleep(0.2)
                continue
            if tries is not None:
                tries -= 1
            fresh = [d for d in donors if d not in failed]
            donor = fresh[0] if fresh else min(donors, key=failed.index)  # else the longest ago
            t0 = time.perf_counter()
            try:
                state, nbytes = self._take_from(donor)
            except RuntimeError as e:  # the donor died, is stuck or finished: ask another
                if isinstance(e, BadState):  # or sent what this model cannot take
                    self.joins.append({"kind": "refused", "replica": self.trainer.lay.replica,
                                       "from": donor, "why": str(e)})
                    print(f"noloco: replica {self.trainer.lay.replica} refused the state of "
                          f"replica "
                          f"{donor}: {e}", file=sys.stderr, flush=True)
                if donor in failed:
                    failed.remove(donor)
                failed.append(donor)
                continue
            before = self.trainer.state.step
            self._adopt(state, own, new_life=kind == "joined")
            self.joins.append({"kind": kind, "replica": self.trainer.lay.replica, "from": donor,
                               "step": self.trainer.state.step,
                               "step_before": before, "bytes": nbytes,
                               "seconds": time.perf_counter() - t0,
                               "checksum": self.checksum(),
                               "own_checkpoint_step": own.get("step") if own else None,
                               "t": time.time()})
            print(f"noloco: replica {self.trainer.lay.replica} {kind} at step "
                  f"{self.trainer.state.step} with "
                  f"the state of replica {donor} ({nbytes / 1e6:.1f} MB in "
                  f"{time.perf_counter() - t0:.2f} s)", file=sys.stderr, flush=True)
            return True
        if kind == "joined":
            self._give_up(live)
        return False

    def _donor_finished(self, donor: int) -> bool:
        """The donor's own heartbeat, read now, says it finished (the monitor's published live
        set, which chose it, may be a beat interval older; a finished replica serves nobody)."""
        got = probe(self.membership.store, heartbeat_key(donor))
        return got is None or bool(json.loads(got).get("done"))  # (etcd: its lease expired)

    def _take_from(self, donor: int) -> tuple[dict[str, Any], int]:
        """Ask ``donor`` for its live state and receive it; RuntimeError if it does not send."""
        store = self.membership.store
        if self._donor_finished(donor):
            raise RuntimeError("the donor finished")
        n = store.add(join_key(donor), 1)
        tag = f"{join_key(donor)}/{n}"
        store.set(tag, self._ask(tag))
        # A donor answers between two steps; one that does not within the arrival deadline
        # (dead, stuck, finished) is not waited for the transfer's. Exactly one of its "go"
        # and a "no" stands (compare-and-set): this joiner's when it gives up, the donor's
        # when this request came too late for it.
        go = await_value(store, f"{tag}/go", 3 * self.trainer.cfg.method.peer_timeout,
                         gone=lambda: self._donor_finished(donor))
        if go == b"no":
            raise RuntimeError("the donor gave up waiting for this request")
        if go is None and store.compare_set(f"{tag}/go", "", "no") == b"no":
            raise RuntimeError("the donor did not answer")
        return self._receive_state(tag, donor)

    def _give_up(self, live: dict[int, Any]) -> None:
        """A join that found no donor. Nobody else alive: NoDonor (the replica goes on from
        its own checkpoint). Replicas alive that did not donate (joining, behind, failing to
        send): an error — going on from an old checkpoint beside them would train apart from
        the run; the launcher starts it again to join anew."""
        me = self.trainer.lay.replica
        if any(r != me for r in live):
            raise ConfigError(f"replica {me} could not take a state from the live replicas "
                              f"{sorted(r for r in live if r != me)} in time")
        raise NoDonor(f"replica {me} found no live replica to join")

    def _nobody_left(self, live: dict[int, Any]) -> bool:
        """No other replica alive (not merely none ready to donate: a joining one may become
        a donor), and every one of them finished: waiting out the join's deadline for a
        donor would only waste it."""
        me = self.trainer.lay.replica
        return not any(r != me for r in live) and self.membership.others_finished()

    def _join_staged(self, own: dict[str, Any] | None,
                     heal: tuple[int | None, int] | None = None) -> bool | None:
        """Joiner side with pipeline stages: stage 0 picks the donor and asks it; every stage
        takes its state from the donor's same stage (:meth:`_serve_staged`). A donor that does
        not serve the request (dead, stuck, finished since the live set was published) is
        given up by every stage alike — they read the one answer that stands — and stage 0
        asks another, in the next attempt's choice, until the join's deadline.

        ``heal``: (only donors with more commits than this, or None: any; the replica's fewest
        commits) — every stage heals together (:meth:`_stages_heal_together`), keeping its
        own inner optimizer and data position; False: nobody to heal from (decided by stage
        0 at once, or once no replica that stepped still says it is behind); None: every
        donor asked failed within the heal's time (2 x ``--peer-timeout``): again later."""
        store, lay, m = self.membership.store, self.trainer.lay, self.membership
        peer_timeout = self.trainer.cfg.method.peer_timeout
        deadline = time.monotonic() + (2 if heal else 10) * peer_timeout
        failed: list[int] = []
        """donors that did not serve, in order: the next attempt asks another one"""
        kind = "healed" if heal else "joined"
        # Each heal of this incarnation's stages has choice keys of its own.
        base = f"{PREFIX}/joinchoice/{lay.replica}/{m.incarnation}" + (
            f"/h{self.staged_heals}" if heal else "")
        self.choices = []
        for attempt in itertools.count():
            choice = base + (f"/{attempt}" if attempt else "")
            self.choices.append(choice)
            # Stage 0 decides by the deadline; the others give it a peer timeout more (from
            # now, where an answer awaited below ran past it), so none gives up on a choice
            # stage 0 is writing.
            wait_until = max(deadline, time.monotonic()) + peer_timeout
            if lay.stage == 0:
                self._choose_staged(choice, deadline, failed, heal)
            while not store.check([choice]):
                if time.monotonic() > wait_until:
                    raise ConfigError(f"replica {lay.replica} stage {lay.stage}: its stage 0 "
                                      f"chose no donor in time")
                time.sleep(0.05)
            c = json.loads(store.get(choice))
            if c["donor"] is None:
                if heal:
                    return None if c.get("retry") else False
                self._give_up({r: {} for r in c["live"]})
            # The donor's stage 0 answers between two of its steps with the step its stages
            # serve at; one that does not within 3 x --peer-timeout (dead, stuck, finished) is
            # not waited for the transfer's timeout. Every stage reads the same answer.
            serve = f"{join_key(c['donor'])}/serve/{c['n']}"
            got = await_value(store, serve, 3 * peer_timeout)
            if got is None:
                got = store.compare_set(serve, "", json.dumps({"step": None}))
            t0 = time.perf_counter()
            if json.loads(got)["step"] is None:
                why = "did not serve its join request in time"
            else:
                taken = self._take_staged(choice, c["donor"], c["n"])
                if isinstance(taken, tuple):
                    break
                why = f"broke off the transfer of its state ({taken})"
                # A transfer can break late (a stuck donor, up to the transfer's timeout):
                # time for one more donor's answer, whatever of the join's deadline is left.
                deadline = max(deadline, time.monotonic() + 3 * peer_timeout)
            if c["donor"] in failed:
                failed.remove(c["donor"])
            failed.append(c["donor"])
            if lay.stage == 0:
                print(f"noloco: replica {lay.replica}: replica {c['donor']} {why}; asking "
                      f"another", file=sys.stderr, flush=True)
            time.sleep(0.2)  # (one that refuses at once is not asked again in a tight loop)
        state, nbytes = taken
        before = self.trainer.state.step
        self._adopt(state, own, new_life=not heal)
        self.joins.append({"kind": kind, "replica": lay.replica, "from": c["donor"],
                           "stage": lay.stage, "step": self.trainer.state.step,
                           "step_before": before, "bytes": nbytes,
                           "seconds": time.perf_counter() - t0, "checksum": self.checksum(),
                           "own_checkpoint_step": own.get("step") if own else None,
                           "t": time.time()})
        if lay.stage == 0:
            print(f"noloco: replica {lay.replica} {kind} at step {self.trainer.state.step} "
                  f"with the state of replica {c['donor']}", file=sys.stderr, flush=True)
        return True

    def _take_staged(self, choice: str, donor: int, n: int
                     ) -> tuple[dict[str, Any], int] | str:
        """This stage's part of join request ``n`` to ``donor``: the donor's same stage's
        state and its bytes once every stage of this replica took its own part, else why
        one did not (its transfer broke: the donor died, or sent a bad state) — then none
        adopts its part and stage 0 asks another donor, as for one that did not serve: a
        replica's stages must hold one step's state."""
        store, lay = self.membership.store, self.trainer.lay
        tag = f"{join_key(donor)}/{n}/s{lay.stage}"
        try:
            state, nbytes = self._receive_state(tag, donor)
            error = None
        except RuntimeError as e:  # BadState too
            state, nbytes = {}, 0
            error = f"stage {lay.stage}: {str(e).splitlines()[0][:120] or type(e).__name__}"
        store.set(f"{choice}/took/{lay.stage}", json.dumps({"error": error}))
        errors = []
        for stage in range(lay.stages):
            # A stage's transfer ends within about the transfer's timeout, whichever way it
            # ends (its rendezvous and its receives are timed apart: twice, to be safe).
            got = await_value(store, f"{choice}/took/{stage}", 2 * self._transfer_timeout()
                              + self.trainer.cfg.method.peer_timeout)
            if got is None:  # that stage's process is gone: the replica's start fails
                raise CommError(f"replica {lay.replica} stage {lay.stage}: its stage {stage} "
                                f"did not say whether it took its state from replica "
                                f"{donor}")
            if json.loads(got)["error"] is not None:
                errors.append(json.loads(got)["error"])
        return "; ".join(errors) if errors else (state, nbytes)

    def _choose_staged(self, choice: str, deadline: float, failed: list[int],
                       heal: tuple[int | None, int] | None = None) -> None:
        """Stage 0 of a joiner with stages: pick the donor (one that has not failed this join
        first, else the one that failed longest ago), ask it, and write the choice every
        stage reads; by the deadline, with no donor, write that there is none. A heal
        (``heal``, see :meth:`_join_staged`) waits for a donor only while a replica that
        stepped where this one did not still says it is behind (as :meth:`heal` does)."""
        store, lay, m = self.membership.store, self.trainer.lay, self.membership
        above = heal[0] if heal else None
        while not (donors := m.donors_among(live := live_replicas(store, m.replicas,
                                                                  m.stages), above)):
            if time.monotonic() > deadline or self._nobody_left(live) or (
                    heal and not m.catching_up(heal[1])):
                break
            time.sleep(0.2)
        if donors and time.monotonic() <= deadline:
            fresh = [d for d in donors if d not in failed]
            donor = fresh[0] if fresh else min(donors, key=failed.index)
            n = store.add(join_key(donor), 1)
            store.set(f"{join_key(donor)}/{n}", self._ask(f"{join_key(donor)}/{n}"))
            store.set(choice, json.dumps({"donor": donor, "n": n}))
        else:  # every stage learns it: they go on from their own checkpoints together
            # (a heal whose donors failed: they try again later)
            store.set(choice, json.dumps(
                {"donor": None, "live": sorted(r for r in live if r != lay.replica),
                 "retry": bool(heal and failed)}))

    def _receive_state(self, tag: str, donor: int) -> tuple[dict[str, Any], int]:
        """The donor's live state (:meth:`_send_state` on the other end) and its bytes."""
        pg = dist.ProcessGroupGloo(
            dist.PrefixStore(tag + "/pg", raw(self.membership.store)), 1, 2,
            timedelta(seconds=self._transfer_timeout()))
        size = torch.zeros(1, dtype=torch.int64)
        pg.recv([size], 0, 0).wait()
        # The declared size is checked before anything is allocated: a peer cannot make
        # this replica allocate more than a few copies of its own model.
        bound = self._copies() * sum(p.numel() * 4 for p in self.trainer.params) + STATE_SLACK
        if not 0 < int(size.item()) <= bound:
            raise BadState(f"it declared {int(size.item())} bytes; this model's state takes "
                           f"at most {bound}")
        blob = torch.empty(int(size.item()), dtype=torch.uint8)
        sealer = self.trainer.comm.sealer
        if sealer is None:
            pg.recv([blob], 0, 1).wait()
        else:
            parts = [blob[a:b] for a, b in chunk_bounds(blob.numel())]
            mac = torch.empty(TAG_BYTES, dtype=torch.uint8)
            works = [pg.recv([x], 0, 1 + i) for i, x in enumerate(parts)]
            works.append(pg.recv([mac], 0, 1 + len(parts)))
            opener = sealer.opener(self.trainer.comm.context("join/" + tag), donor, "joiner",
                                   blob.numel())
            for w, x in zip(works, parts, strict=False):
                w.wait()
                opener.update(x)
            works[-1].wait()
            if not opener.verify(mac):
                raise BadState("its MAC does not match (altered on the way, or not from "
                               "the donor)")
        self.membership.store.delete_key(f"{tag}/pg/0/1")
        # Tensors and plain containers only: no pickled code runs (as with checkpoints).
        try:
            state = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
        except Exception as e:  # noqa: BLE001 - any malformed blob
            raise BadState(f"it is not a state ({type(e).__name__})") from None
        self._check_state(state)
        return state, blob.numel() + 8

    def _copies(self) -> int:
        """Model-sized tensors a live state of this method may hold: the model, slow weights
        and outer momentum, and a sync in flight — what was sent and what each partner of
        its group sent back, fast and slow weights each."""
        copies = max(STATE_COPIES, 3 + 2 * getattr(self.trainer.method, "group_size", 1) + 2)
        if self.trainer.method.compress is not None \
                and not hasattr(self.trainer.method, "group_size"):
            # an all-gather in flight: what was sent and every replica's sparse message, each
            # at most 1.5 fp32 copies (topk:1.0:32: a 2-byte index beside every value)
            copies += 2 * (self.trainer.lay.replicas + 1)
        return copies

    def _check_state(self, state: Any) -> None:
        """Raise :class:`BadState` unless ``state`` has this model's parameters (names, shapes,
        dtypes) and slow weights, all finite: ``copy_`` would broadcast a wrong shape
        silently, and a NaN would spread from here."""
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or \
                not isinstance(state.get("method"), dict):
            raise BadState("it is not a state")
        mine = dict(self.trainer.runner.named_parameters())
        theirs = state["model"]
        if set(theirs) != set(mine):
            raise BadState("its parameters are not this model's")
        for name, p in mine.items():
            t = theirs[name]
            if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != p.dtype:
                raise BadState(f"its {name} is not shaped {tuple(p.shape)} {p.dtype}")
            if not all_finite(t):
                raise BadState(f"its {name} is not finite")
        frags = self.trainer.method.frags
        phi = state["method"].get("phi", [])
        if len(phi) != len(frags):
            raise BadState("its slow weights are not this model's")
        for f, x in zip(frags, phi, strict=True):
            if x is None:
                continue  # equal to the model (phi_is_model)
            if not isinstance(x, torch.Tensor) or x.shape != f.flat_phi.shape \
                    or x.dtype != f.flat_phi.dtype or not all_finite(x):
                raise BadState(f"its slow weights of fragment {f.index} are not this model's "
                               f"or not finite")

    def _own_checkpoint(self) -> dict[str, Any] | None:
        root = self.checkpoint_root()
        if not root.is_dir():
            return None
        step, sd = ckpt_mod.agree_on_step(root, 0, self.trainer.cfg.math_hash(), lambda x: [x])
        return sd if step is not None else None

    @torch.no_grad()
    def _adopt(self, state: dict[str, Any], own: dict[str, Any] | None,
               new_life: bool = False) -> None:
        """Take a live state. ``new_life`` (a respawned or relaunched replica, not a heal):
        its random streams are its own checkpoint's, or else fresh ones keyed by the step
        it joins at — never its first life's from step 0 again (:func:`join_streams`)."""
        named = dict(self.trainer.runner.named_parameters())
        for name, p in named.items():
            p.copy_(state["model"][name])
        method = state["method"]
        if state.get("phi_is_model"):  # slow weights the donor did not send: its model's
            phi = list(method["phi"])
            for i in state["phi_is_model"]:
                phi[i] = self.trainer.method.frags[i].fast().clone()
            method = {**method, "phi": phi}
        guard = self.trainer.method.guard
        judged = (list(guard.rejected), guard.checked) if guard is not None else None
        self.trainer.method.load_state_dict(method)
        for e in self.trainer.method.errors:
            e.zero_()  # the donor's debt is not this replica's (shared_state)
        if guard is not None and judged is not None:
            # The donor's scale of distances, but this replica's own record of what it judged.
            guard.rejected, guard.checked = judged
        self.trainer.comm.calls = int(state["comm_calls"])
        self.trainer.comm.commits = int(state.get("comm_commits", self.trainer.comm.commits))
        if own is not None:  # this replica's own inner optimizer and data position
            self.trainer.inner.load_state_dict(own["optimizer"])
            self.trainer.reader.load_state_dict(own["reader"])
        if new_life:
            join_streams(own, self.trainer.cfg.train.seed, self.trainer.lay.rank,
                         int(state["step"]))
        self.trainer.state.step = self.trainer.status.step = int(state["step"])
        self.membership.step = self.trainer.state.step
        # Its next beat says the donor's count: a replica that heals from this one compares
        # it (Membership.donors_among, with commits_above).
        self.membership.commits = self.trainer.comm.commits
        self.trainer.resumed_from = self.trainer.state.step
        # A live state: not behind, and no longer marked for an operation it (or its
        # previous life) missed — maybe marked after this process started.
        self.trainer.comm.behind = self.trainer.comm.unsure = False
        self.trainer.comm.back()
