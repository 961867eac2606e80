"""Streaming DiLoCo and streaming NoLoCo: schedule, overlap, quantised exchange, equivalences."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from noloco import quant
from noloco.cli import main
from noloco.comm import (
    Communicator,
    NullCommunicator,
    Pending,
    TorchCommunicator,
    quantized_all_reduce_bytes,
    quantized_chunk_numel,
    ring_all_reduce_bytes,
)
from noloco.methods import DiLoCo, FragmentSchedule, NoLoCo, StreamingDiLoCo, groups_at
from noloco.methods.diloco import outer_sgd_
from noloco.methods.noloco import SLOW_FORMAT
from noloco.methods.streaming import split_model
from noloco.model import ModelArgs, build, lm_loss

ARGS = ModelArgs(dim=16, n_layers=4, n_heads=2, ffn_dim=32, vocab_size=64, max_seq_len=16)
BATCH, SEQ = 2, 8


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=g)


def train(model, method, opt, rank: int, steps: int) -> None:
    for step in range(steps):
        tok = batch(rank, step)
        lm_loss(model(tok[:, :-1]), tok[:, 1:]).backward()
        method.sync_gradients()
        opt.step()
        opt.zero_grad()
        method.after_inner_step()
    method.finish()


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ---- the schedule ----------------------------------------------------------------------------

@pytest.mark.parametrize(("H", "P"), [(4, 1), (6, 2), (8, 4), (12, 3), (10, 10)])
def test_schedule_offsets_each_fragment_once_per_h(H, P):
    s = FragmentSchedule(H, P)
    starts = {t: s.starting(t) for t in range(1, 5 * H + 1)}
    assert all(len(v) <= 1 for v in starts.values()), "two fragments started in one step"
    for p in range(P):
        ts = [t for t, v in starts.items() if p in v]
        t_p = p * H // P
        assert s.offset(p) == t_p
        assert ts[0] == (t_p if t_p > 0 else H)
        assert all(b - a == H for a, b in zip(ts, ts[1:], strict=False))
        assert all((t - t_p) % H == 0 for t in ts)
    # P = 1 is DiLoCo's schedule: steps H, 2H, ...
    if P == 1:
        assert [t for t, v in starts.items() if v] == [H, 2 * H, 3 * H, 4 * H, 5 * H]


@pytest.mark.parametrize(("H", "P", "tau"), [(8, 2, 1), (8, 4, 1), (12, 3, 3), (6, 1, 5)])
def test_schedule_completes_tau_steps_later(H, P, tau):
    s = FragmentSchedule(H, P, tau)
    for t in range(1, 4 * H):
        assert s.completing(t + tau) == s.starting(t)
    assert all(s.completing(t) == [] for t in range(1, tau + 1))


@pytest.mark.parametrize(("H", "P", "tau"), [(8, 3, 0), (8, 2, 4), (8, 2, -1), (0, 1, 0),
                                             (4, 8, 0)])
def test_schedule_rejects_impossible_settings(H, P, tau):
    with pytest.raises(ValueError):
        FragmentSchedule(H, P, tau)


# ---- single process, instrumented communicator --------------------------------------------------

class FakeComm(Communicator):
    """Rank 0 of 2, whose partner's tensor is ``partner(tensor)``: the all-reduce returns the
    mean of the two. Records when each operation starts and when it is waited for."""

    rank, size = 0, 2

    def __init__(self, clock, partner=lambda x: torch.zeros_like(x)) -> None:
        super().__init__()
        self.clock, self.partner = clock, partner
        self.log: list[tuple[str, int, int]] = []

    def all_reduce_mean_async(self, tensor: torch.Tensor) -> Pending:
        self.log.append(("start", self.clock(), tensor.numel()))
        other = self.partner(tensor.clone())
        comm, n = self, tensor.numel()

        class Work:
            def wait(self) -> None:
                comm.log.append(("wait", comm.clock(), n))
                tensor.add_(other).div_(2)

            def is_completed(self) -> bool:
                return False

        return Pending(self, [Work()])

    def all_gather_async(self, tensor):  # pragma: no cover - not used by streaming
        raise NotImplementedError

    def exchange_async(self, tensor, peers: Sequence[int]):  # pragma: no cover
        raise NotImplementedError


def named_toy(sizes=(3, 5, 7, 11, 2)) -> list[tuple[str, torch.nn.Parameter]]:
    """Embedding, 3 blocks, final norm: fragments (strided, P = 3) hold 8, 7 and 13 values."""
    names = ["tok_embeddings.weight", "layers.0.w", "layers.1.w", "layers.2.w", "norm.weight"]
    g = torch.Generator().manual_seed(0)
    return [(n, torch.nn.Parameter(torch.randn(k, generator=g))) for n, k in zip(
        names, sizes, strict=True)]


def test_fragments_follow_blocks_strided_and_sequential():
    named = named_toy()
    params, idx = split_model(named, 3, "strided", n_layers=3)
    assert idx == [[0, 1], [2], [3, 4]]  # embedding with block 0, norm with the last block
    _, idx = split_model(named, 3, "sequential", n_layers=3)
    assert idx == [[0, 1], [2], [3, 4]]
    model = build(ARGS, seed=0)
    _, idx = split_model(model, 2, "strided", n_layers=4)
    names = [n for n, _ in model.named_parameters()]
    frag0 = {names[i] for i in idx[0]}
    assert "tok_embeddings.weight" in frag0 and "output.weight" not in frag0
    assert all(n.startswith(("layers.0.", "layers.2.", "tok_")) for n in frag0)
    _, seq = split_model(model, 2, "sequential", n_layers=4)
    assert {names[i] for i in seq[0]} >= {n for n in names if n.startswith("layers.1.")}
    with pytest.raises(ValueError, match="named"):
        split_model([p for _, p in named], 2)


def test_streaming_schedule_on_instrumented_comm():
    step = [0]
    comm = FakeComm(lambda: step[0])
    named = named_toy()
    m = StreamingDiLoCo(named, comm, n_layers=3, sync_every=6, fragments=3, overlap_steps=1)
    sizes = m.fragment_numel()
    assert sizes == [8, 7, 13]
    for t in range(1, 13):
        step[0] = t
        m.after_inner_step()
    starts = [(t, n) for kind, t, n in comm.log if kind == "start"]
    waits = [(t, n) for kind, t, n in comm.log if kind == "wait"]
    # Fragment p starts at t_p = 2p (+6k), t ≥ 1; each is waited for one step later.
    assert starts == [(2, 7), (4, 13), (6, 8), (8, 7), (10, 13), (12, 8)]
    assert waits == [(t + 1, n) for t, n in starts[:-1]]
    assert m.fragment_syncs == [1, 2, 2] and len(m.inflight) == 1
    m.finish()
    assert m.fragment_syncs == [2, 2, 2] and not m.inflight


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8])
def test_overlap_applies_sync_of_t_at_t_plus_tau_merged_with_alpha(alpha):
    tau, H = 2, 4
    step = [0]
    comm = FakeComm(lambda: step[0], partner=lambda x: x + 1.0)  # partner is 1 ahead
    p = torch.nn.Parameter(torch.zeros(5))
    m = StreamingDiLoCo([p], comm, sync_every=H, overlap_steps=tau, merge_alpha=alpha,
                        outer_lr=0.7, momentum=0.9, nesterov=True)
    phi, buf = [torch.zeros(5)], [torch.zeros(5)]
    theta = torch.zeros(5)
    sent = None
    for t in range(1, 3 * H + 1):
        with torch.no_grad():
            p.add_(0.1 * t)  # an "inner step"
        theta = theta + 0.1 * t
        step[0] = t
        m.after_inner_step()
        if t % H == 0:
            sent = theta.clone()
        if t > tau and (t - tau) % H == 0:
            # What should have happened: outer step with mean(θ_t, θ_t + 1) from step t − τ.
            outer_sgd_(phi, [sent + 0.5], buf, 0.7, 0.9, True)
            theta = alpha * theta + (1 - alpha) * phi[0]
        torch.testing.assert_close(p.detach(), theta, atol=1e-6, rtol=0)
    torch.testing.assert_close(m.slow[0][0], phi[0])
    waits = [t for kind, t, _ in comm.log if kind == "wait"]
    assert waits == [H + tau, 2 * H + tau]


def test_nan_reaching_the_quantiser_is_an_error():
    p = torch.nn.Parameter(torch.zeros(300))
    m = StreamingDiLoCo([p], NullCommunicator(), sync_every=1, quantize="fp4")
    with torch.no_grad():
        p[7] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        m.after_inner_step()
    with pytest.raises(ValueError, match="non-finite"):
        NullCommunicator().all_reduce_mean_quantized_async(
            torch.tensor([1.0, float("inf")]), "int8")


def test_bad_method_arguments_raise():
    p = named_toy()
    for kw in ({"merge_alpha": 1.5}, {"quantize": "fp2"}, {"overlap_steps": 4},
               {"fragments": 3, "sync_every": 4}):
        with pytest.raises(ValueError):
            StreamingDiLoCo(p, NullCommunicator(), sync_every=kw.pop("sync_every", 4), **kw)
        with pytest.raises(ValueError):
            NoLoCo(p, NullCommunicator(), sync_every=4, **kw)


# ---- real gloo ranks -------------------------------------------------------------------------

def _equivalence_rank(rank: int, world: int) -> dict:
    out = {}
    for kind in ("diloco", "streaming", "noloco", "noloco_ref"):
        torch.manual_seed(0)
        model = build(ARGS, seed=0)
        comm = TorchCommunicator()
        if kind == "diloco":
            method = DiLoCo(model, comm, sync_every=3, outer_lr=0.7, momentum=0.9)
        elif kind == "streaming":
            method = StreamingDiLoCo(model, comm, n_layers=ARGS.n_layers, sync_every=3,
                                     fragments=1, overlap_steps=0, merge_alpha=0.5,
                                     quantize="none", outer_lr=0.7, momentum=0.9)
        elif kind == "noloco":
            method = NoLoCo(model, comm, sync_every=3, outer_lr=0.7, momentum=0.5, gamma=0.6,
                            fragments=1, overlap_steps=0, quantize="none", n_layers=4)
        else:
            method = ReferenceNoLoCo(model, comm, sync_every=3, beta=0.7, alpha=0.5, gamma=0.6)
        train(model, method, adamw(model), rank, 12)
        out[kind] = flat_params(model)
        out[kind + "_ops"] = dict(comm.ops)
    return out


class ReferenceNoLoCo:
    """Plain NoLoCo written out from SPEC §3 with an all-gather (a test oracle, not a method)."""

    def __init__(self, model, comm, sync_every, beta, alpha, gamma) -> None:
        self.params = list(model.parameters())
        self.comm, self.H, self.beta, self.alpha, self.gamma = comm, sync_every, beta, alpha, gamma
        self.slow = [p.detach().clone() for p in self.params]
        self.delta = [torch.zeros_like(p) for p in self.params]
        self.t = self.outer = 0

    def sync_gradients(self) -> None:
        pass

    def finish(self) -> None:
        pass

    @torch.no_grad()
    def after_inner_step(self) -> None:
        self.t += 1
        if self.t % self.H:
            return
        group = next(g for g in groups_at(self.outer, self.comm.size, 2) if self.comm.rank in g)
        self.outer += 1
        for p, phi, d in zip(self.params, self.slow, self.delta, strict=True):
            thetas = self.comm.all_gather(p.detach().clone())
            phis = self.comm.all_gather(phi.clone())
            mean_delta = torch.stack([thetas[j] - phis[j] for j in group]).mean(0)
            mean_phi = torch.stack([phis[j] for j in group]).mean(0)
            d.mul_(self.alpha).add_(self.beta * mean_delta).sub_(self.gamma * (phi - mean_phi))
            phi.add_(d)
            p.copy_(phi)


def _two_ranks(rank: int, world: int) -> dict:
    return {**_equivalence_rank(rank, world), **_streaming_quantized_rank(rank, world)}


def _four_ranks(rank: int, world: int) -> dict:
    return {**_equivalence_rank(rank, world), **_quantized_rank(rank, world, N_QUANT)}


# One spawn of 2 and one of 4 ranks serve several tests (process start-up dominates).
@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_ranks, 2)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_four_ranks, 4)


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"])
def test_p1_tau0_unquantised_equals_diloco_and_noloco(ranks, request):
    for r in request.getfixturevalue(ranks):
        assert torch.equal(r["streaming"], r["diloco"])  # bit for bit
        assert r["streaming_ops"] == r["diloco_ops"] == {"all_reduce": 4}
        torch.testing.assert_close(r["noloco"], r["noloco_ref"], atol=1e-6, rtol=0)
        assert r["noloco_ops"] == {"exchange": 4}


def _quantized_rank(rank: int, world: int, n: int) -> dict:
    comm = TorchCommunicator()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, generator=g) * (rank + 1)
    x[:300] *= 1e-3  # a block of small values, to exercise the scales
    out = {"x": x.clone()}
    for fmt in ("fp4", "int8", "fp8"):
        y = x.clone()
        before = comm.bytes_sent
        comm.all_reduce_mean_quantized_async(y, fmt).wait()
        out[fmt] = y
        out[fmt + "_bytes"] = comm.bytes_sent - before
    y = x.clone()
    comm.all_reduce_mean_quantized_async(y, "none").wait()
    out["none"] = y
    out["ops"] = dict(comm.ops)
    return out


def _error_bound(xs: list[torch.Tensor], fmt: str) -> torch.Tensor:
    """Per-element bound of quantise-each, mean, quantise-the-mean (quant.py's bounds)."""
    def bound(x: torch.Tensor) -> torch.Tensor:
        s = torch.cat([c.abs().max().expand(c.numel()) for c in x.split(256)])
        if fmt == "fp4":
            return torch.maximum(x.abs() / 3, s * 2.0**-7)
        if fmt == "int8":
            return s / 254
        return x.abs() * 2.0**-4 + s * 2.0**-10 / 448

    first = torch.stack([bound(x) for x in xs]).mean(0)
    deq = torch.stack([quant.dequantize(quant.quantize(x, fmt)) for x in xs]).mean(0)
    return first + bound(deq) + 1e-6


N_QUANT = 5000  # not a multiple of ranks × block: the chunks are padded


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(120)
def test_quantised_all_reduce_mean_bound_and_bytes(four_ranks):
    res, world, n = four_ranks, 4, N_QUANT
    xs = [r["x"] for r in res]
    mean = torch.stack(xs).mean(0)
    chunk = quantized_chunk_numel(n, world)
    assert chunk == 1280  # 5000 / 4 = 1250 → 5 blocks of 256
    for fmt in ("fp4", "int8", "fp8"):
        for r in res[1:]:
            assert torch.equal(r[fmt], res[0][fmt]), "ranks disagree"
        err = (res[0][fmt] - mean).abs()
        assert bool((err <= _error_bound(xs, fmt)).all()), fmt
        assert err.max() > 0  # it really was quantised
        # Real bytes: two phases of N − 1 encoded chunks each.
        expected = 2 * (world - 1) * quant.wire_bytes(chunk, fmt)
        assert res[0][fmt + "_bytes"] == expected == quantized_all_reduce_bytes(n, world, fmt)
    # FP4 ≈ 2·(N−1)/N·S/8 + scales (S = 4n bytes), up to the padding of the chunks.
    ideal = 2 * (world - 1) / world * (4 * n / 8 + 4 * n / 256)
    assert abs(res[0]["fp4_bytes"] / ideal - 1) < 0.1
    assert res[0]["fp4_bytes"] < ring_all_reduce_bytes(4 * n, world) / 7
    torch.testing.assert_close(res[0]["none"], mean)
    assert res[0]["ops"] == {"all_reduce_quantized": 3, "all_reduce": 1}


def _streaming_quantized_rank(rank: int, world: int) -> dict:
    out = {}
    # Streaming DiLoCo, P = 2, τ = 1, FP4: slow weights identical everywhere, bytes as counted.
    model = build(ARGS, seed=0)
    comm = TorchCommunicator()
    m = StreamingDiLoCo(model, comm, n_layers=4, sync_every=4, fragments=2, overlap_steps=1,
                        quantize="fp4")
    train(model, m, adamw(model), rank, 10)
    out["slow"] = torch.cat([s.reshape(-1) for f in m.slow for s in f])
    out["syncs"] = m.fragment_syncs
    out["bytes"] = comm.bytes_sent
    out["numel"] = m.fragment_numel()
    # Quantised streaming NoLoCo, 2 replicas (one group), P = 2: the recorded update equals
    # the documented formula computed here from all replicas' decoded messages.
    model = build(ARGS, seed=0)
    comm = TorchCommunicator()
    m = NoLoCo(model, comm, sync_every=4, fragments=2, n_layers=4, quantize="fp4",
               outer_lr=0.7, momentum=0.5, gamma=0.7)
    oracle = TorchCommunicator(group=dist.group.WORLD)  # the test's own gathers, counted apart
    opt = adamw(model)
    frag = m.fragment_index
    checks = []
    for step in range(8):
        tok = batch(rank, step)
        lm_loss(model(tok[:, :-1]), tok[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        due = m.schedule.starting(step + 1)
        if due:
            p = due[0]
            theta = torch.cat([m.params[i].detach().reshape(-1) for i in frag[p]])
            phi = torch.cat([m.slow[i].reshape(-1) for i in frag[p]])
            phi0 = torch.cat([m.start[i].reshape(-1) for i in frag[p]])
            d_old = torch.cat([m.delta[i].reshape(-1) for i in frag[p]])
            thetas, phis = oracle.all_gather(theta.clone()), oracle.all_gather(phi.clone())
        m.after_inner_step()
        if due:
            dq = [quant.dequantize(quant.quantize(t - f, "fp4")) for t, f in zip(thetas, phis,
                                                                                strict=True)]
            fq = [phi0 + quant.dequantize(quant.quantize(f - phi0, SLOW_FORMAT)) for f in phis]
            want_d = 0.5 * d_old + 0.7 * torch.stack(dq).mean(0) - 0.7 * (
                fq[rank] - torch.stack(fq).mean(0))
            got_phi = torch.cat([m.slow[i].reshape(-1) for i in frag[p]])
            checks.append(float((got_phi - (phi + want_d)).abs().max()))
    out["noloco_checks"] = checks
    out["noloco_bytes"] = comm.bytes_sent
    out["noloco_ops"] = dict(comm.ops)
    return out


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(120)
def test_quantised_streaming_diloco_and_noloco_on_two_ranks(two_ranks):
    res = two_ranks
    assert torch.equal(res[0]["slow"], res[1]["slow"])  # everyone decodes the same bytes
    n0, n1 = res[0]["numel"]
    # H = 4, P = 2, 10 steps: fragment 0 at 4, 8; fragment 1 at 2, 6, 10 (applied by finish).
    assert res[0]["syncs"] == [2, 3]
    assert res[0]["bytes"] == 2 * quantized_all_reduce_bytes(n0, 2, "fp4") + 3 * \
        quantized_all_reduce_bytes(n1, 2, "fp4")
    for r in res:
        assert len(r["noloco_checks"]) == 4 and max(r["noloco_checks"]) < 1e-5
        assert r["noloco_ops"] == {"exchange": 4}
    wire = [quant.wire_bytes(n, "fp4") + quant.wire_bytes(n, SLOW_FORMAT) for n in (n0, n1)]
    assert res[0]["noloco_bytes"] == 2 * wire[0] + 2 * wire[1]
    assert res[0]["noloco_bytes"] < 0.4 * 4 * 2 * (n0 + n1)  # vs the fp32 θ exchange


# ---- the command line ------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "msg"), [
    (["--method", "streaming", "--sync-every", "8", "--fragments", "2", "--overlap-steps", "4"],
     "overlap-steps"),
    (["--method", "streaming", "--fragments", "8", "--sync-every", "16"], "fragments"),
    (["--method", "noloco", "--replicas", "2", "--merge-alpha", "1.5"], "merge-alpha"),
    (["--method", "streaming", "--merge-alpha", "-0.1"], "merge-alpha"),
    (["--method", "streaming", "--quantize", "fp2"], "quantization format"),
    (["--method", "noloco", "--replicas", "2", "--quantize", "bf3"], "quantization format"),
    (["--method", "diloco", "--quantize", "fp4"], "streaming or noloco"),
    (["--method", "streaming", "--overlap-steps", "-1"], "overlap-steps"),
])
def test_bad_streaming_input_exits_2_and_writes_nothing(tmp_path, capsys, argv, msg):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("noloco: error:") and msg in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(240)
def test_streaming_end_to_end_reports_fragments_and_peak_bytes(tmp_path, corpus):
    out = tmp_path / "run"
    argv = ["train", "--method", "streaming", "--replicas", "2", "--fragments", "2",
            "--overlap-steps", "1", "--quantize", "fp4", "--sync-every", "4",
            "--data", str(corpus), "--steps", "8", "--eval-every", "8",
            "--eval-sequences", "4", "--batch-size", "4", "--seq-len", "32", "--warmup", "0",
            "--lr", "3e-3", "--out", str(out)]
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["method"] == "streaming" and s["fragments"] == 2 and s["quantize"] == "fp4"
    n0, n1 = s["fragment_numel"]
    per_sync = [quantized_all_reduce_bytes(n, 2, "fp4") for n in (n0, n1)]
    assert s["fragment_syncs"] == [2, 2]
    assert s["bytes_sent"] == 2 * sum(per_sync)
    assert s["peak_step_bytes"] == max(per_sync)
    assert 0 <= s["sync_wait_last_arrival_seconds"] <= s["sync_wait_mean_seconds"]
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert s["final_val_loss"] < first["val_loss"]
