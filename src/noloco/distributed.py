"""A worker's place in the job: its layout, its device and threads, its process group.

Layout of the N·P workers (N replicas × P pipeline stages): global rank = replica·P + stage,
so the P stages of one replica are neighbours (one machine each under ``torchrun
--nproc-per-node P``). Each stage has its own group of N replicas; outer steps run inside it.

Two communicators per worker, never mixed (:func:`make_comms`):
- the *training* communicator of this stage's replicas, handed to the method; its bytes and
  blocked seconds are what a run reports;
- the *metrics* communicator over the whole world, used only to check the start-up weights,
  agree on a checkpoint, gather evaluation losses and measure weight spread.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from noloco import data as data_mod
from noloco.comm import Communicator, NullCommunicator, TorchCommunicator
from noloco.config import Config, ConfigError
from noloco.errors import plural

if TYPE_CHECKING:
    from noloco.spec import WorkerSpec


@dataclass
class Layout:
    rank: int = 0
    world: int = 1
    local_world: int = 1
    replica: int = 0
    stage: int = 0
    replicas: int = 1
    stages: int = 1

    @classmethod
    def from_env(cls, replicas: int, stages: int) -> Layout:
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        if world != replicas * stages:
            raise ConfigError(f"world size {world} does not match --replicas {replicas} x "
                              f"--stages {stages} = {plural(replicas * stages, 'worker')}")
        return cls(rank=rank, world=world,
                   local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                   replica=rank // stages, stage=rank % stages, replicas=replicas,
                   stages=stages)

    @classmethod
    def of(cls, spec: WorkerSpec) -> Layout:
        """The layout of the worker ``spec`` places."""
        m = spec.config.method
        return cls(rank=spec.rank, world=spec.world, local_world=spec.local_world,
                   replica=spec.replica, stage=spec.stage, replicas=m.replicas, stages=m.stages)

    def stage_ranks(self, stage: int) -> list[int]:
        return [r * self.stages + stage for r in range(self.replicas)]

    def global_rank(self, replica: int, stage: int) -> int:
        return replica * self.stages + stage

    def describe(self, rank: int) -> str:
        return f"rank {rank} (replica {rank // self.stages}, stage {rank % self.stages})"


def default_threads(local_world: int) -> int:
    """Cores ÷ local workers (at least 1): N workers on a few cores must not oversubscribe —
    and no more than ``OMP_NUM_THREADS`` where the environment sets it, a cap chosen by the
    user, a scheduler, or something running beside this process on the same cores. Not under
    torchrun, which sets it to 1 itself for every worker of a multi-worker node."""
    n = max(1, data_mod.cpu_count() // max(local_world, 1))
    cap = os.environ.get("OMP_NUM_THREADS", "").strip()
    if "TORCHELASTIC_RUN_ID" in os.environ or not (cap.isdigit() and int(cap) > 0):
        return n
    return min(n, int(cap))


def limit_threads(local_world: int, threads: int | None = None) -> int:
    """``threads``, else :func:`default_threads`."""
    n = threads or default_threads(local_world)
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass
    return n


def cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_memory_bytes(index: int = 0) -> int:
    """What GPU ``index`` holds in all (its total memory)."""
    return int(torch.cuda.get_device_properties(index).total_memory)


def check_device(spec: str, local_world: int) -> None:
    """ConfigError if ``--device cuda`` cannot be honoured (no GPU at all). Workers may share
    GPUs: with fewer GPUs than local workers they are placed round-robin."""
    if spec == "cuda" and cuda_devices() == 0:
        raise ConfigError(f"--device cuda: no GPU is visible to this machine's "
                          f"{plural(local_world, 'worker')} (CUDA_VISIBLE_DEVICES, drivers); "
                          f"pass --device cpu")


def uses_cuda(spec: str) -> bool:
    """Whether workers of ``--device spec`` train on GPUs (``auto``: whenever one exists)."""
    return spec == "cuda" or (spec == "auto" and cuda_devices() > 0)


def workers_per_gpu(local_world: int) -> int:
    """The most workers any GPU serves, placed round-robin."""
    n = cuda_devices()
    return -(-local_world // n) if n else 0


def pick_device(spec: str, local_rank: int, local_world: int = 1) -> torch.device:
    """The GPU ``local_rank mod GPUs`` when GPUs are used (:func:`uses_cuda`), else the CPU."""
    check_device(spec, local_world)
    if uses_cuda(spec):
        n = cuda_devices()
        torch.cuda.set_device(local_rank % n)
        return torch.device("cuda", local_rank % n)
    return torch.device("cpu")


def host_staged(device: torch.device, local_world: int, forced: bool = False) -> bool:
    """Whether this worker's traffic goes through gloo on host copies
    (:mod:`noloco.staging`): on a GPU that other local workers share (NCCL serves one rank
    per device), or when ``forced`` (:data:`noloco.spec.HOST_STAGING_ENV`)."""
    if forced:
        return True
    return device.type == "cuda" and cuda_devices() < local_world


def placement_line(spec: str, local_world: int) -> str | None:
    """The start-up line that says where the workers train when GPUs are used, else None."""
    if not uses_cuda(spec):
        return None
    n = cuda_devices()
    used = min(n, local_world)
    if n >= local_world:
        how = "one GPU each; NCCL between them"
    else:
        how = (f"up to {workers_per_gpu(local_world)} share each; gloo between them, "
               f"staged through pinned host memory")
    return (f"noloco: {plural(local_world, 'worker')} on {plural(used, 'GPU')} "
            f"({torch.cuda.get_device_name(0)}: {how})")


# ---- process group and store -----------------------------------------------------------------

def attempt_number(store: Any = None, rank: int = 0, known: int | None = None) -> int:
    """0 for a first start; k after the k-th restart.

    Our launcher says which (``known``: the spec's attempt). Under torchrun every rank number
    counts its own starts in the store all nodes share: a restart starts every rank number
    once, so the counts move in lockstep. (``TORCHELASTIC_RESTART_COUNT`` does not: each
    node's agent counts only its own workers' failures, and a replacement node starts from
    0.)"""
    if known is not None:
        return known
    if store is not None:
        return store.add(f"noloco/starts/{rank}", 1) - 1
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


@dataclass
class DistContext:
    store: Any = None
    """the run's key-value store (heartbeats, checkpoint receipts, failure reports)"""
    attempt: int = 0
    owns_group: bool = False

    def close(self, ok: bool = True) -> None:
        """Tear the process group down. After a failure on NCCL (a timed-out or broken
        collective) it is aborted: destroying it waits for the stuck kernels and may hang the
        worker that is trying to exit with its error line."""
        if not (self.owns_group and dist.is_initialized()):
            return
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if not ok and abort is not None and "nccl" in str(dist.get_backend()):
            abort()
            return
        dist.destroy_process_group()


def init_distributed(lay: Layout, timeout_s: float, device: torch.device,
                     staged: bool = False, attempt: int | None = None) -> DistContext:
    """Join the process group of this attempt.

    The store is torchrun's (or our launcher's) agent store when the environment says so,
    else rank 0 hosts it, listening on MASTER_ADDR only. The process group is built on a
    prefix of the store named after the attempt: a restarted attempt reuses the same store,
    and without the prefix its gloo ranks would read the dead attempt's addresses and fail
    (``connectFullMesh ... Connection refused`` on torch 2.13).
    """
    if lay.world == 1:
        return DistContext(attempt=attempt_number(known=attempt))
    if dist.is_initialized():  # a caller (a test) built the group already
        return DistContext(store=dist.distributed_c10d._get_default_store(),
                           attempt=attempt_number(known=attempt))
    timeout = timedelta(seconds=timeout_s)
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        base = dist.TCPStore(host, port, lay.world, False, timeout)
    elif lay.rank == 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((socket.gethostbyname(host), port))
        sock.listen(1024)
        base = dist.TCPStore(host, port, lay.world, True, timeout, wait_for_workers=False,
                             master_listen_fd=sock.detach())
    else:
        base = dist.TCPStore(host, port, lay.world, False, timeout)
    attempt = attempt_number(base, lay.rank, attempt)
    # On GPUs each worker owns, the methods' tensors go through NCCL; the small CPU tensors of
    # metrics and start-up checks through gloo, in the same process group. Workers that share
    # a GPU use gloo alone, on host copies (noloco.staging).
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" and not staged else "gloo"
    agree_backend(base, lay.rank, attempt, backend)
    kw: dict[str, Any] = {}
    if "nccl" in backend:
        # NCCL's wait() otherwise returns at once (the stream waits, not the host): blocked
        # time would read ~0, and a peer that never posts would end in NCCL's watchdog
        # aborting this process instead of a CommError naming the peer. device_id creates
        # the communicators now, not at the first collective (a failure shows at start-up).
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        kw["device_id"] = device
    dist.init_process_group(backend, store=dist.PrefixStore(f"noloco/attempt-{attempt}", base),
                            rank=lay.rank, world_size=lay.world, timeout=timeout, **kw)
    return DistContext(store=base, attempt=attempt, owns_group=True)


def agree_backend(store: Any, rank: int, attempt: int, backend: str) -> None:
    """ConfigError unless this rank chose the backend rank 0 chose. Each picks it from local
    facts (its GPUs, --device, host staging); ranks on backends that differ would send one
    tensor through NCCL and its peer's through gloo, and hang."""
    key = f"noloco/backend/{attempt}"
    if rank == 0:
        store.set(key, backend)
        return
    theirs = store.get(key).decode()
    if theirs != backend:
        raise ConfigError(f"rank {rank} would use {backend!r} and rank 0 {theirs!r}: every "
                          f"machine needs the same GPUs per worker (NCCL where each worker "
                          f"owns a GPU, gloo with host staging where workers share one)")


def make_comms(cfg: Config, lay: Layout, staged_on: torch.device | None = None
               ) -> tuple[Communicator, Communicator]:
    """(this stage's communicator, the world's); both staged through host memory on
    ``staged_on`` when given (:func:`host_staged`)."""
    if lay.world == 1:
        return NullCommunicator(), NullCommunicator()
    mine, world = _make_comms(cfg, lay)
    if staged_on is None:
        return mine, world
    from noloco.staging import HostStaged
    return HostStaged(mine, staged_on), HostStaged(world, staged_on)


def _make_comms(cfg: Config, lay: Layout) -> tuple[Communicator, Communicator]:
    timeout = cfg.method.comm_timeout
    world = TorchCommunicator(list(range(lay.world)), group=dist.group.WORLD)
    # Every rank creates every stage group in the same order (new_group is world-collective).
    stage_groups = [TorchCommunicator(lay.stage_ranks(s), timeout=timeout)
                    for s in range(lay.stages)]
    mine = stage_groups[lay.stage] if lay.replicas > 1 else NullCommunicator()
    return mine, world
