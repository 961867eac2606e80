"""Workers that share a GPU (issue 34): traffic staged through host buffers, the placement of
workers on GPUs, and the refusal of a run that cannot fit.

The staging path takes host tensors through the same code as device tensors, so on CPU a
staged run must equal an unstaged one bit for bit, with the same bytes and operations."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from test_streaming import train

from noloco import cli, distributed, footprint
from noloco.cli import main
from noloco.comm import NullCommunicator, TorchCommunicator
from noloco.config import Config
from noloco.methods import build_method
from noloco.model import ModelArgs, build
from noloco.staging import HostStaged

ARGS = ModelArgs(dim=16, n_layers=2, n_heads=2, ffn_dim=32, vocab_size=64, max_seq_len=16)

METHODS = {
    "ddp": dict(method="ddp"),
    "diloco": dict(method="diloco", sync_every=3),
    "noloco-fp4": dict(method="noloco", sync_every=3, quantize="fp4"),
    "diloco-topk": dict(method="diloco", sync_every=3, compress="topk:0.1:2"),
    "streaming": dict(method="streaming", sync_every=4, fragments=2, overlap_steps=1,
                      quantize="fp4"),
    "noloco": dict(method="noloco", sync_every=3),
    "noloco-topk": dict(method="noloco", sync_every=3, compress="topk:0.1:2"),
    "sparseloco": dict(method="sparseloco", sync_every=3),
}


def _train(rank: int, spec: dict, staged: bool, steps: int = 9) -> dict:
    cfg = Config.from_dict({"method": {"replicas": 2, **spec}}).resolved().method
    model = build(ARGS, seed=0)
    inner = TorchCommunicator()
    comm = HostStaged(inner, torch.device("cpu")) if staged else inner
    method = build_method(cfg, list(model.named_parameters()), comm, seed=3,
                          n_layers=ARGS.n_layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, method, opt, rank, steps)  # the streaming tests' loop (seeded batches)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"params": flat, "bytes": comm.bytes_sent, "ops": dict(comm.ops),
            "state": method.state_dict()}


def _staged_rank(rank: int, world: int) -> dict:
    return {name: (_train(rank, spec, False), _train(rank, spec, True))
            for name, spec in METHODS.items()}


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(180)
def test_a_staged_communicator_equals_the_plain_one_bit_for_bit() -> None:
    for per_rank in run_ranks(_staged_rank, 2):
        for name, (plain, staged) in per_rank.items():
            assert plain["ops"] and plain["ops"] == staged["ops"], name
            assert plain["bytes"] == staged["bytes"] > 0 or name == "ddp", name
            assert torch.equal(plain["params"], staged["params"]), name


def test_only_the_encoded_bytes_of_a_quantised_all_reduce_go_through_the_host() -> None:
    """Staged, the quantised all-reduce hands the caller's tensor itself to the inner
    communicator (the codec runs where it is) and tells it to move its two phases' messages
    through host copies, whose results land in the caller's buffers (via_host). That the
    phases give the same bits through host copies: the staged runs above, whose Streaming
    fp4 config runs TorchCommunicator's quantised all-reduce with host_phases set."""
    from noloco.comm import via_host

    class Recording(NullCommunicator):
        def all_reduce_mean_quantized_async(self, tensor, fmt, block_size=64):
            self.got = tensor
            return super().all_reduce_mean_quantized_async(tensor, fmt, block_size)

    inner = Recording()
    x = torch.randn(256)
    HostStaged(inner, torch.device("cpu")).all_reduce_mean_quantized_async(x, "fp4").wait()
    assert inner.host_phases and inner.got is x
    assert not TorchCommunicator.host_phases  # unstaged: the phases take the tensors as they are

    def a2a(recv, sent):
        recv.copy_(sent.flip(0))

    def gather(out, x):
        for i, o in enumerate(out):
            o.copy_(x + i)

    a2a_host, gather_host = via_host(a2a, gather)
    sent, recv = torch.arange(6, dtype=torch.uint8), torch.zeros(6, dtype=torch.uint8)
    a2a_host(recv, sent)
    out = [torch.zeros(3, dtype=torch.uint8) for _ in range(2)]
    gather_host(out, sent[:3])
    assert torch.equal(recv, sent.flip(0))
    assert [o.tolist() for o in out] == [[0, 1, 2], [1, 2, 3]]


def test_staging_passes_the_inner_communicators_state_through() -> None:
    inner = NullCommunicator()
    comm = HostStaged(inner, torch.device("cpu"))
    comm.bytes_sent += 5
    comm.sealer = "s"
    assert inner.bytes_sent == 5 and inner.sealer == "s" and comm.rank == 0 and comm.size == 1
    x = torch.arange(4.0)
    comm.all_reduce_mean(x)
    assert torch.equal(x, torch.arange(4.0)) and inner.ops["all_reduce"] == 1
    assert comm.state_dict() == inner.state_dict()
    with pytest.raises(ValueError):  # a NaN is refused at the call, as unstaged
        comm.all_reduce_mean_quantized_async(torch.tensor([float("nan")] * 64), "fp4")
    assert [b for bufs in comm._pool._free.values() for b in bufs], "the buffer went back"


def test_staging_passes_absent_replicas_and_failures_through() -> None:
    """An elastic all-gather has None for a replica that took no part; a failed operation
    gives its buffers back."""
    from noloco.comm import CommError, Pending

    class Inner(NullCommunicator):
        def all_gather_async(self, tensor):
            return Pending(self, [], lambda: [tensor.clone(), None])

        def all_reduce_mean_async(self, tensor):
            def fail():
                raise CommError("peer gone")
            return Pending(self, [], fail)

    comm = HostStaged(Inner(), torch.device("cpu"))
    got = comm.all_gather(torch.arange(3.0))
    assert torch.equal(got[0], torch.arange(3.0)) and got[1] is None
    with pytest.raises(CommError):
        comm.all_reduce_mean(torch.ones(5))
    assert comm._pool._free[((5,), torch.float32)], "the failed operation's buffer went back"


# ---- placement -------------------------------------------------------------------------------

@pytest.mark.parametrize("gpus,workers,expected", [
    (1, 4, [0, 0, 0, 0]), (2, 4, [0, 1, 0, 1]), (3, 4, [0, 1, 2, 0]), (4, 4, [0, 1, 2, 3])])
def test_workers_are_placed_on_the_gpus_round_robin(monkeypatch, gpus, workers,
                                                    expected) -> None:
    placed = []
    monkeypatch.setattr(distributed, "cuda_devices", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: placed.append(i))
    devices = [distributed.pick_device("cuda", r, workers) for r in range(workers)]
    assert [d.index for d in devices] == expected == placed
    assert distributed.pick_device("auto", 0, workers).type == "cuda"  # auto: the GPU
    assert distributed.workers_per_gpu(workers) == -(-workers // gpus)
    shared = distributed.host_staged(devices[0], workers)
    assert shared == (gpus < workers)  # NCCL only where each worker owns its GPU


def test_cuda_without_a_gpu_is_refused_and_auto_stays_on_the_cpu(monkeypatch) -> None:
    monkeypatch.setattr(distributed, "cuda_devices", lambda: 0)
    with pytest.raises(distributed.ConfigError, match="no GPU"):
        distributed.pick_device("cuda", 0, 4)
    assert distributed.pick_device("auto", 0, 4).type == "cpu"
    assert distributed.placement_line("auto", 4) is None
    assert not distributed.host_staged(torch.device("cpu"), 4)


# ---- what fits on a GPU ----------------------------------------------------------------------

def _fake_gpus(monkeypatch, n: int, gib: float) -> None:
    monkeypatch.setattr(distributed, "cuda_devices", lambda: n)
    monkeypatch.setattr(distributed, "gpu_memory_bytes", lambda i=0: int(gib * footprint.GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")


def test_workers_that_cannot_share_a_gpu_are_refused_in_one_line(monkeypatch, tmp_path,
                                                                 capsys) -> None:
    _fake_gpus(monkeypatch, 1, 16)
    out = tmp_path / "run"
    argv = ["train", "--method", "diloco", "--replicas", "4", "--preset", "small",
            "--seq-len", "1024", "--batch-size", "16", "--device", "cuda", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "4 workers on each Fake GPU of 16.0 GiB would need about" in err
    assert "activations" in err and "--batch-size" in err
    assert not out.exists()  # nothing written


def test_the_estimate_follows_the_run(monkeypatch, capsys) -> None:
    def fp(**over):
        spec = {"method": {"method": "diloco", "replicas": 4},
                "data": {"seq_len": 1024, "batch_size": 8}, **over}
        cfg = Config.from_dict(spec).resolved()
        return footprint.estimate(cfg, *footprint.model_shape(cfg, 256))

    base = fp()
    n = footprint.model_shape(Config().resolved(), 256)[0]
    assert base.weights == base.gradients == 4 * n and base.optimizer == 16 * n
    assert fp(train={"precision": "bf16"}).activations < base.activations
    assert fp(optim={"inner_optimizer": "muon"}).optimizer == 12 * n
    assert fp(method={"method": "noloco", "replicas": 4}).outer > base.outer
    assert fp(method={"method": "single"}).outer == 0
    two = fp(method={"method": "diloco", "replicas": 4, "stages": 2})
    assert two.weights == 2 * n and two.activations < base.activations
    # the run above fits 4 to an 80 GiB GPU: the start-up line says how they share it
    _fake_gpus(monkeypatch, 1, 80)
    cfg = Config.from_dict({"method": {"method": "diloco", "replicas": 4},
                            "train": {"device": "cuda"}})
    cli._check_gpus(cfg, 4, 256)
    assert capsys.readouterr().err.strip() == (
        "noloco: 4 workers on 1 GPU (Fake GPU: up to 4 share each; gloo between them, "
        "staged through pinned host memory)")


def test_ranks_that_would_pick_other_backends_are_refused_before_the_group() -> None:
    """A machine whose workers share a GPU (gloo) beside one whose workers own theirs (NCCL)
    would hang at the first collective: the ranks compare their choice with rank 0's."""
    import torch.distributed as dist

    store = dist.HashStore()
    distributed.agree_backend(store, 0, 0, "cpu:gloo,cuda:nccl")
    distributed.agree_backend(store, 1, 0, "cpu:gloo,cuda:nccl")  # the same: nothing said
    with pytest.raises(distributed.ConfigError, match="rank 2 would use 'gloo' and rank 0 "
                       "'cpu:gloo,cuda:nccl': every machine needs the same GPUs per worker"):
        distributed.agree_backend(store, 2, 0, "gloo")
    distributed.agree_backend(store, 0, 1, "gloo")  # a restart (attempt 1) chooses afresh
    distributed.agree_backend(store, 2, 1, "gloo")


@pytest.mark.parametrize("backend,ok,expected", [
    ("cpu:gloo,cuda:nccl", False, "abort"),  # a broken NCCL collective: never wait for it
    ("cpu:gloo,cuda:nccl", True, "destroy"),
    ("gloo", False, "destroy"),
])
def test_a_failed_nccl_group_is_aborted_not_destroyed(monkeypatch, backend, ok, expected):
    """Issue 34 item 5: destroying an NCCL group after a timed-out collective waits for its
    stuck kernels and may hang the worker on its way out with the error line."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: calls.append("destroy"))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group",
                        lambda *a: calls.append("abort"))
    distributed.DistContext(owns_group=True).close(ok)
    assert calls == [expected]
    calls.clear()
    distributed.DistContext(owns_group=False).close(ok)  # a caller's group: left alone
    assert calls == []
