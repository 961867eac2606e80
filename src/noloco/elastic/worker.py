"""One replica of an elastic run (``--elastic``): trains, evaluates and saves on its own.

The training loop is :class:`noloco.train.Trainer`'s; what differs is everything that would
involve every replica. No barrier anywhere:

- the method's communicator is an :class:`~noloco.elastic.communicator.ElasticCommunicator`
  (groups from membership snapshots, process groups built per operation for exactly its
  members);
- evaluation is local: each replica appends its own records to
  ``metrics/replica-K.jsonl`` and at the end writes ``metrics/replica-K.json`` and its weights
  ``model/replica-K.safetensors``; the launcher combines them when every replica has ended
  (:func:`combine`);
- checkpoints are per replica (``checkpoints/replica-K/``), complete on their own;
- a replica started again (``--respawn``) *joins*: it takes a live replica's state
  (:mod:`noloco.elastic.join`) and enters the gossip at the donor's next outer step.

Floor 4 of docs/architecture.md: what an elastic run adds to the trainer.
"""

from __future__ import annotations

import json
import math
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from noloco import checkpoint as ckpt_mod
from noloco.addresses import ETCD_SCHEME, parse_address
from noloco.comm import Communicator, NullCommunicator, flatten
from noloco.config import Config
from noloco.distributed import DistContext, Layout, limit_threads, pick_device
from noloco.elastic import auth
from noloco.elastic.communicator import ElasticCommunicator
from noloco.elastic.deadline import (
    Namespace,
    open_store_patiently,
    request_deadline,
    store_errors,
    wait_reachable,
)
from noloco.elastic.files import replica_metrics, replica_summary
from noloco.elastic.join import Joiner, NoDonor
from noloco.elastic.keys import PREFIX, starts_key, stop_key
from noloco.elastic.membership import Membership
from noloco.errors import Interrupted
from noloco.integrity import Sealer, payload_key
from noloco.metrics import Progress, shared_summary
from noloco.rundir import RunDir, append_line, read_jsonl, write_json_atomic
from noloco.spec import WorkerSpec
from noloco.staging import HostStaged
from noloco.train import AVERAGED_METHODS, StopBoard, Trainer


class ElasticReplica(Joiner):
    """What an elastic run adds to the one trainer (:class:`noloco.train.Trainer`'s
    ``elastic`` component): its communicator, its own checkpoints and files, joins and heals
    between steps (:class:`~noloco.elastic.join.Joiner`), a local evaluation and its own end."""

    def pipeline_layout(self, lay: Layout) -> Layout:
        # The replica's stages are a process group of their own (fixed routing: the samples
        # stay in their replica's pipeline), so one replica's failure touches no other.
        return Layout(rank=lay.stage, world=lay.stages, local_world=lay.local_world,
                      replica=0, stage=lay.stage, replicas=1, stages=lay.stages)

    def make_comms(self, cfg: Config, device: torch.device, staged: bool
                   ) -> tuple[Communicator, Communicator]:
        comm = ElasticCommunicator(self.membership, cfg.method.peer_timeout,
                                   cfg.method.comm_timeout)
        secret = auth.current_secret()
        if secret is not None and cfg.method.payload_mac:
            comm.sealer = Sealer(payload_key(secret))
        # Elastic traffic is gloo's (it crosses the internet): a GPU's tensors go through
        # host buffers (noloco.staging).
        if device.type == "cuda" or staged:
            return HostStaged(comm, device), NullCommunicator()
        return comm, NullCommunicator()

    def stop_board(self) -> StopBoard | None:
        """A replica's pipeline stages stop at one step after a signal (they cannot train
        apart: each step passes through all of them), agreed in the run's store under the
        replica's incarnation (a respawned replica's stages agree anew). A replica itself
        stops alone: its operations with the others wait for nobody that stopped."""
        lay, m = self.trainer.lay, self.membership
        if lay.stages == 1:
            return None
        return StopBoard(m.store, stop_key(lay.replica, m.incarnation), lay.stages,
                         lay.stage, store_errors())

    @property
    def metrics_file(self) -> Path:
        lay = self.trainer.lay
        return replica_metrics(self.trainer.rundir.path, lay.replica, lay.stage, lay.stages)

    # ---- evaluation: this replica only -----------------------------------------------------
    def record(self, step: int, val: float | None, losses: list[float], log: Progress
               ) -> dict[str, Any]:
        """This replica's evaluation record (``val``: None on a stage before the last),
        appended to its own metrics file; its line printed where it speaks for the machine."""
        t = self.trainer
        rec = {"step": step, "replica": t.lay.replica, "stage": t.lay.stage,
               "val_loss": val, "train_loss": sum(losses) / len(losses) if losses else None,
               "bytes_sent": t.comm.bytes_sent, "sync_seconds": t.comm.sync_seconds,
               "tokens_per_replica": step * t.tokens_per_step,
               "wall_seconds": t.loop_seconds(), "t": time.time()}
        if val is not None:
            self.membership.info["val"] = round(val, 5)
        self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        append_line(self.metrics_file, json.dumps(rec))
        if val is not None:  # the last stage (the loss) of this machine's lowest replica
            log.eval_line(rec, speaks=t.lay.replica == t.speaker)
        return rec

    # ---- the end: own weights and own summary ----------------------------------------------
    def end(self, rec: dict[str, Any]) -> dict[str, Any]:
        """After the final evaluation ``rec``: this replica's weights and summary, on its own
        (the launcher combines every replica's, :func:`combine`)."""
        t = self.trainer
        lay, method = t.lay, t.method
        ckpt_mod.save_weights(
            t.rundir.path / ckpt_mod.MODEL_DIR
            / ckpt_mod.shard_name(f"replica-{lay.replica}", lay.stage, lay.stages),
            dict(t.runner.named_parameters()),
            {"step": str(t.state.step), "method": t.cfg.method.method})
        comm: ElasticCommunicator = t.comm  # type: ignore[assignment]
        self.membership.finish()  # nobody waits for it now; a cut still open is listed
        summary = {
            "replica": lay.replica, "stage": lay.stage,
            "incarnation": self.membership.incarnation,
            "steps": t.state.step, "final_val_loss": rec["val_loss"],
            "outer_steps": method.outer_steps, "bytes_sent": comm.bytes_sent,
            "sync_seconds": comm.sync_seconds, "compute_seconds": t.state.compute_s,
            "train_seconds": t.loop_seconds() - t.state.eval_s,
            "wall_seconds": t.wall_seconds(), "partial_operations": comm.partial,
            "retries": comm.retries, "longest_wait_seconds": comm.longest_wait,
            "arrival_seconds": comm.arrival_seconds,
            "payload_mac": comm.sealer is not None, "mac_bytes": comm.mac_bytes,
            "partitions": self.membership.cuts, "unreachable_ops": comm.unreachable_ops,
            "store_restarts": [
                {**o, "operations_skipped": sum(o["from_step"] <= s <= o["to_step"]
                                                for s in comm.unreachable_steps)}
                for o in self.membership.outages],
            "epoch": self.membership.ns.epoch if self.membership.ns is not None else 0,
            "run_id": t.cfg.run_id(),
            "ops": dict(comm.ops),
            "events": comm.events, "joins": self.joins,
            "guard_rejected": [{"replica": lay.replica, "stage": lay.stage, **r}
                               for r in (method.guard.rejected
                                         if method.guard is not None else [])],
            "guard_checked": method.guard.checked if method.guard is not None else 0,
            # messages left out of a sparse mean (malformed or not finite)
            "dropped_messages": [{"replica": lay.replica, **d} for d in method.dropped],
            # the method's settings (fragments, the exchange's encoding), for noloco report
            "settings": {k: v for k, v in method.settings().items()
                         if k not in ("update_guard", "dropped_messages")},
            "served": self.served, "resumed_from_step": t.resumed_from,
            "threads_per_worker": t.threads, "params": t.n_params_total,
            "param_bytes": t.param_bytes, "device": str(t.device),
            "host_staged": t.host_staged,
            "peak_gpu_memory_bytes": (torch.cuda.max_memory_allocated(t.device)
                                      if t.device.type == "cuda" else None),
            "tokens_per_step": t.tokens_per_step,
        }
        write_json_atomic(replica_summary(t.rundir.path, lay.replica, lay.stage, lay.stages),
                          summary)
        return summary


def run(spec: WorkerSpec, status: Any) -> dict[str, Any] | None:
    """One replica (stage) of an elastic run, as ``spec`` places it (its store:
    ``spec.store``). ``spec.resume`` (``--resume``): its first start in the run's epoch
    continues from its own newest checkpoint (with pipeline stages: the newest every stage
    holds; none: it joins from a live replica, as a respawned one does); a later start joins,
    as always (a machine resuming while the run trains on elsewhere)."""
    cfg = spec.config
    m, t = cfg.method, cfg.train
    lay = Layout.of(spec)
    replica, stage = lay.replica, lay.stage
    status.lay, status.out = lay, t.out
    threads = limit_threads(lay.local_world, t.threads)
    device = pick_device(t.device, spec.local_rank, lay.local_world)
    # The run's store: an etcd cluster, else the launcher's or coordinator's TCPStore.
    address = spec.store
    if address is None:
        raise ValueError("an elastic worker's spec names no store")  # launchers name it
    if not address.startswith(ETCD_SCHEME):
        if t.coordinator:  # a coordinator's gate
            auth.use_secret(auth.load_secret(t.secret_file))
        wait_reachable(*parse_address(address), m.comm_timeout)
    # Every key under the run's id and epoch (a coordinator may serve many runs, and restart);
    # from here every request has a deadline (connecting above waited for a coordinator that
    # may start after this machine): a partition holds no request longer than the peer
    # timeout (noloco.elastic.deadline).
    store = open_store_patiently(address, request_deadline(m.peer_timeout),
                                 Namespace(cfg.run_id()), m.comm_timeout, m.peer_timeout)
    # How many times this worker started before, counted in the store: a respawn, or a
    # machine's command run again after a crash, joins from the live replicas.
    incarnation = store.add(starts_key(replica, stage), 1) - 1
    status.store, status.attempt = store, incarnation  # the launcher reads a failure report
    membership = Membership(store, replica, m.replicas, m.peer_timeout, incarnation, stage,
                            m.stages).start()
    status.store = membership.store
    if m.stages > 1:
        # The replica's stages: a world of their own, on a store prefix of this incarnation
        # (a respawned replica must not read its dead predecessor's addresses).
        dist.init_process_group("gloo", store=dist.PrefixStore(
            f"{PREFIX}/replica/{replica}/{incarnation}", store.raw), rank=stage,
            world_size=m.stages, timeout=timedelta(seconds=m.comm_timeout))
    # attempt = incarnation: injected faults fire in the first incarnation only.
    ctx = DistContext(store=None, attempt=incarnation)
    elastic = ElasticReplica(membership)
    trainer = None
    ok = False
    try:
        trainer = Trainer(cfg, lay, device, threads, RunDir(Path(t.out)), ctx, status, elastic)
        if incarnation > 0:
            try:
                elastic.join()
            except NoDonor as e:
                # Nobody left to take a state from, and the run has steps left: this
                # replica goes on from its own newest checkpoint, alone if it must.
                trainer.resume(required=False)
                if trainer.resumed_from is None:
                    raise NoDonor(f"{e}, and it saved no checkpoint of its own") from None
                membership.step = status.step = trainer.state.step
                elastic.joins.append({"kind": "own checkpoint", "replica": replica,
                                      "stage": stage, "step": trainer.state.step,
                                      "why": "no live replica to join", "t": time.time()})
                if stage == 0:
                    print(f"noloco: replica {replica} found no live replica to join; it goes "
                          f"on from its own checkpoint at step {trainer.state.step}",
                          file=sys.stderr, flush=True)
        elif spec.resume:
            trainer.resume(required=False)
            if trainer.resumed_from is None:  # it never saved: it joins the others instead
                elastic.join()
            membership.step = status.step = trainer.state.step
        membership.ready = True  # a donor from now on
        membership.joining = False  # a member of new snapshots
        membership.beat()
        membership.await_visible()
        summary = trainer.train()
        ok = True
        return summary
    except Interrupted:
        # Stopped for good (a resume starts it anew): nobody waits for it, and a machine
        # that resumes the run finds it gone at once (ElasticRun._resume_epoch).
        membership.finish(stopped=True)
        raise
    finally:
        membership.stop()
        if trainer is not None:
            trainer.close(ok)
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- the run's numbers, from the replicas' own files (the launcher, at the end) -------------

def combine(cfg: Config, out: Path, failures: list[dict[str, Any]],
            joins: list[dict[str, Any]], wall_seconds: float,
            store: dict[str, Any] | None = None) -> dict[str, Any]:
    """summary.json, metrics.jsonl and the model index of an elastic run, from the files the
    replicas left: the mean over the replicas that reported, at each evaluation step. With
    pipeline stages a replica's bytes are its stages' sum, its losses its last stage's.
    ``cfg`` resolved (the command line's); ``store``: where the run stands in its
    coordinator's store at the end, its boot token and epoch (what a ``--resume`` of it
    compares, ElasticRun._resume_epoch)."""
    m = cfg.method
    P, last = m.stages, m.stages - 1
    finished: dict[int, dict[str, Any]] = {}
    for r in range(m.replicas):
        parts = [replica_summary(out, r, s, P) for s in range(P)]
        if all(p.is_file() for p in parts):
            stages = [json.loads(p.read_text()) for p in parts]
            finished[r] = {**stages[last],
                           "bytes_sent": sum(x["bytes_sent"] for x in stages),
                           "sync_seconds": max(x["sync_seconds"] for x in stages),
                           "longest_wait_seconds": max(x["longest_wait_seconds"]
                                                       for x in stages),
                           "arrival_seconds": max(x.get("arrival_seconds", 0.0)
                                                  for x in stages),
                           "partial_operations": sum(x["partial_operations"] for x in stages),
                           "retries": sum(x["retries"] for x in stages),
                           "events": [e for x in stages for e in x["events"]],
                           "joins": [j for x in stages for j in x["joins"]],
                           "guard_rejected": [g for x in stages
                                              for g in x.get("guard_rejected", [])],
                           "partitions": [c for x in stages for c in x.get("partitions", [])],
                           "unreachable_ops": max(x.get("unreachable_ops", 0)
                                                  for x in stages),
                           "store_restarts": [o for x in stages
                                              for o in x.get("store_restarts", [])],
                           "param_bytes": sum(x["param_bytes"] for x in stages)}
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in range(m.replicas):
        # A respawned replica appends to its files; where its new life repeats a step (its
        # donor was behind it), the newest record of the step counts.
        per_stage = []
        for s in range(P):
            path = replica_metrics(out, r, s, P)
            per_stage.append({rec["step"]: rec for rec in (read_jsonl(path)
                                                           if path.is_file() else [])})
        for step, rec in per_stage[last].items():
            rec = {**rec, "bytes_sent": sum(x[step]["bytes_sent"] for x in per_stage
                                            if step in x)}
            by_step.setdefault(step, []).append(rec)
    rundir = RunDir(out)
    lines = []
    for step in sorted(by_step):
        recs = by_step[step]
        vals = [x["val_loss"] for x in recs]
        lines.append({"step": step, "val_loss": sum(vals) / len(vals),
                      "val_loss_per_replica": {str(x["replica"]): x["val_loss"] for x in recs},
                      "replicas_reporting": len(recs),
                      "bytes_sent": sum(x["bytes_sent"] for x in recs),
                      "sync_seconds": max(x["sync_seconds"] for x in recs),
                      "tokens_per_replica": recs[0]["tokens_per_replica"],
                      "wall_seconds": max(x["wall_seconds"] for x in recs)})
    rundir.metrics_path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    spread = None
    names = [f"replica-{r}" for r in sorted(finished)]
    if finished:
        spread = _spread_and_average(cfg, out, sorted(finished))
        if m.method in AVERAGED_METHODS and len(finished) > 1:
            names.append("average")
    every = {str(r): s for r, s in finished.items()}
    summary = shared_summary(cfg, {r: {"val_loss": s["final_val_loss"],
                                       "bytes_sent": s["bytes_sent"],
                                       "sync_seconds": s["sync_seconds"]}
                                   for r, s in finished.items()})
    summary.update({
        "status": "completed" if finished else "failed",
        "outer_steps": max((s["outer_steps"] for s in finished.values()), default=0),
        "update_guard": {
            "factor": m.guard_factor,
            "checked": sum(s.get("guard_checked", 0) for s in finished.values()),
            "rejected": sorted((g for s in finished.values() for g in s["guard_rejected"]),
                               key=lambda g: (g["step"], g["replica"], g["stage"]))}
        if m.update_guard else None,
        "dropped_messages": sorted((d for s in finished.values()
                                    for d in s.get("dropped_messages", [])),
                                   key=lambda d: (d["step"], d["replica"])),
        "failures": failures,
        "weight_spread": spread,
        "wall_seconds": wall_seconds,
        # what only an elastic run has (noloco.rundir.ELASTIC_KEYS)
        "elastic": {
            "peer_timeout": m.peer_timeout,
            "replicas_finished": sorted(finished),
            "steps_per_replica": {r: s["steps"] for r, s in every.items()},
            "partial_operations": {r: s["partial_operations"] for r, s in every.items()},
            "retries": {r: s["retries"] for r, s in every.items()},
            "longest_wait_seconds": {r: s["longest_wait_seconds"] for r, s in every.items()},
            "arrival_seconds_per_replica": {r: s.get("arrival_seconds", 0.0)
                                            for r, s in every.items()},
            "events": {r: s["events"] for r, s in every.items()},
            # payload MACs (noloco.integrity): their tags' bytes, apart from bytes_sent
            "payload_mac": any(s.get("payload_mac") for s in finished.values()),
            "mac_bytes_per_replica": {r: s.get("mac_bytes", 0) for r, s in every.items()},
            "partitions": [c for s in finished.values() for c in s["partitions"]],
            "unreachable_operations": {r: s["unreachable_ops"] for r, s in every.items()},
            "store_restarts": [o for s in finished.values() for o in s["store_restarts"]],
            "run_id": cfg.run_id(),
            "store": store,
            "joins": joins + [j for s in finished.values() for j in s["joins"]],
        },
    })
    if finished:
        any_s = next(iter(finished.values()))
        summary.update(any_s.get("settings", {}))
        summary.update(params=any_s["params"], param_bytes=any_s["param_bytes"],
                       device=any_s["device"], threads_per_worker=any_s["threads_per_worker"],
                       host_staged=any_s.get("host_staged"))
        peaks = [s.get("peak_gpu_memory_bytes") for s in finished.values()]
        if any(p is not None for p in peaks):
            summary["peak_gpu_memory_bytes"] = max(p for p in peaks if p is not None)
        train_s = sum(s["train_seconds"] for s in finished.values())
        summary["compute_utilisation"] = (sum(s["compute_seconds"] for s in finished.values())
                                          / train_s if train_s > 0 else None)
        summary["tokens_per_replica"] = cfg.train.steps * any_s["tokens_per_step"]
        _write_index(cfg, out, names)
    rundir.write_summary(summary)
    return summary


def _spread_and_average(cfg: Config, out: Path, replicas: list[int]) -> float:
    """Weight spread of the finished replicas' final weights (the metric of
    :func:`noloco.metrics.weight_spread`: root mean squared distance to their mean),
    and ``model/average.safetensors``."""
    from safetensors.torch import load_file

    model_dir = out / ckpt_mod.MODEL_DIR
    P = cfg.method.stages
    sq, count = 0.0, 0
    for s in range(P):  # one stage at a time: memory O(stage × replicas)
        sds = [load_file(str(model_dir / ckpt_mod.shard_name(f"replica-{r}", s, P)))
               for r in replicas]
        names = list(sds[0])
        flats = torch.stack([flatten([sd[n] for n in names], torch.float64) for sd in sds])
        sq += float(((flats - flats.mean(0)) ** 2).sum())
        count += flats.numel()
        if cfg.method.method in AVERAGED_METHODS and len(replicas) > 1:
            avg = {n: torch.stack([sd[n].float() for sd in sds]).mean(0) for n in names}
            ckpt_mod.save_weights(model_dir / ckpt_mod.shard_name("average", s, P), avg,
                                  {"step": str(cfg.train.steps), "method": cfg.method.method})
    return math.sqrt(sq / count) if len(replicas) > 1 else 0.0


def _write_index(cfg: Config, out: Path, names: list[str]) -> None:
    from noloco import data as data_mod
    from noloco.model import preset

    d = cfg.data
    tokenizer = data_mod.make_tokenizer(d.tokenizer)
    args = None
    hf_config = None
    if cfg.model.hf_model is not None:
        from noloco import hf
        hf_config = hf.load_config(cfg.model.hf_model).to_dict()
    else:
        args = preset(cfg.model.preset, vocab_size=tokenizer.vocab_size,
                      dropout=cfg.model.dropout)
    ckpt_mod.write_model_index(out, args, names, cfg.method.stages, {
        "hf_config": hf_config, "tokenizer": d.tokenizer, "tokenizer_name": tokenizer.name,
        "preset": cfg.model.preset, "step": cfg.train.steps, "method": cfg.method.method})
