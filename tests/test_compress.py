"""--compress for DiLoCo, Streaming DiLoCo and NoLoCo (sparse gossip), on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from run_utils import summary
from run_utils import train as cli_train

from noloco import sparse
from noloco.comm import NullCommunicator, Pending, TorchCommunicator
from noloco.methods import DiLoCo, NoLoCo, StreamingDiLoCo, groups_at
from noloco.methods.wire import sync_bytes
from noloco.model import ModelArgs, build, lm_loss
from noloco.netsim.predict import predict_run

# about 21k parameters: six chunks of 4096, the last one short
ARGS = ModelArgs(dim=32, n_layers=2, n_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
H = 2


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, ARGS.vocab_size, (2, 9), generator=g)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def train(method_of, rank: int, steps: int) -> tuple[torch.Tensor, object, list[torch.Tensor]]:
    """``steps`` AdamW steps under the method; the final weights, the method and φ after each
    outer step."""
    torch.manual_seed(0)
    model = build(ARGS, seed=0)
    method = method_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    slows = []
    for step in range(steps):
        tok = batch(rank, step)
        lm_loss(model(tok[:, :-1]), tok[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        outer = method.outer_steps
        method.after_inner_step()
        if method.outer_steps != outer:
            slows.append(flat(method.phi))
    method.finish()
    return flat(model.parameters()), method, slows


def _lossless_rank(rank: int, world: int) -> dict[str, float]:
    """Every method, dense against topk:1.0:32: the largest difference in final weights, and
    the largest entry left in any error-feedback buffer."""
    out = {}
    makers = {
        "diloco": lambda m, **c: DiLoCo(m, TorchCommunicator(), sync_every=H, **c),
        "streaming": lambda m, **c: StreamingDiLoCo(
            m, TorchCommunicator(), n_layers=ARGS.n_layers, sync_every=4, fragments=2,
            overlap_steps=1, **c),
        # the sparse message carries φ and Δ: γ ≠ β exchanges the same
        "noloco": lambda m, **c: NoLoCo(m, TorchCommunicator(), sync_every=H, gamma=0.6,
                                        n_layers=ARGS.n_layers, **c),
    }
    for name, make in makers.items():
        dense, _, dense_slows = train(make, rank, 8)
        lossless, method, slows = train(lambda m, make=make: make(
            m, compress="topk:1.0:32", ef_decay=0.5), rank, 8)
        out[name] = (dense - lossless).abs().max().item()
        out[f"{name}_first"] = (dense_slows[0] - slows[0]).abs().max().item()
        out[f"{name}_error"] = max(e.abs().max().item() for e in method.errors)
        out[f"{name}_moved"] = (dense - flat(build(ARGS, seed=0).parameters())).abs().max().item()
    return out


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(240)
def test_a_lossless_compressor_equals_the_dense_method():
    """topk:1.0 at 32 bits sends every entry exactly: DiLoCo, Streaming DiLoCo (fragments,
    overlap) and NoLoCo end where their dense runs do, to fp32 rounding, and the error
    feedback stays zero."""
    for res in run_ranks(_lossless_rank, 4):
        for name in ("diloco", "streaming", "noloco"):
            assert res[f"{name}_moved"] > 1e-2  # the runs trained
            assert res[name] < 2e-6, (name, res[name])
            # After the first outer step the two differ by the rounding of one mean alone
            # (of φ − θ instead of θ): an ulp or two of weights near 1 (measured 1.2e-7 to
            # 2.4e-7); the 8 AdamW steps after it amplify that, within 2e-6 above.
            assert res[f"{name}_first"] < 3e-7, (name, res[f"{name}_first"])
            assert res[f"{name}_error"] == 0.0


def _sparse_rank(rank: int, world: int, spec: str) -> dict:
    out = {}
    n_syncs = 4
    for name, make in {
        "diloco": lambda m: DiLoCo(m, TorchCommunicator(), sync_every=H, compress=spec),
        "streaming": lambda m: StreamingDiLoCo(m, TorchCommunicator(), n_layers=ARGS.n_layers,
                                               sync_every=4, fragments=2, overlap_steps=1,
                                               compress=spec),
        "noloco": lambda m: NoLoCo(m, TorchCommunicator(), sync_every=H, momentum=0.0,
                                   outer_lr=0.7, gamma=0.5, n_layers=ARGS.n_layers,
                                   compress=spec),
    }.items():
        final, method, slows = train(make, rank, H * n_syncs)
        out[name] = {"slows": slows, "bytes": method.comm.bytes_sent,
                     "sizes": [f.numel() for f in method.frags],
                     "syncs": method.fragment_syncs,
                     "error": max(e.abs().max().item() for e in method.errors),
                     "ops": dict(method.comm.ops)}
        if name == "noloco":
            out[name]["pulled"] = [method.pulled_chunks(e, method.frags[0].numel())
                                   for e in range(n_syncs)]
    return out


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(240)
def test_sparse_exchanges_keep_replicas_consistent_and_count_their_bytes():
    world, spec = 4, "topk:0.2:4"
    res = run_ranks(_sparse_rank, world, spec)
    fraction, bits = sparse.parse(spec)
    for name in ("diloco", "streaming", "noloco"):
        for r in res:
            got = r[name]
            # what did not go is kept, and every byte that went is counted
            assert got["error"] > 0
            expect = sum(s * sync_bytes(name, n, world, compress=spec)
                         for s, n in zip(got["syncs"], got["sizes"], strict=True))
            assert got["bytes"] == expect > 0
            op = "exchange" if name == "noloco" else "all_gather"
            assert got["ops"].get(op) == sum(got["syncs"]) and "all_reduce" not in got["ops"]
    # DiLoCo and Streaming: every replica decodes the same messages, so φ stays identical
    for name in ("diloco", "streaming"):
        for r in res[1:]:
            for a, b in zip(r[name]["slows"], res[0][name]["slows"], strict=True):
                assert torch.equal(a, b)
    # one message of DiLoCo's at 20% and 4 bits, against its fp32 all-reduce
    n = res[0]["diloco"]["sizes"][0]
    assert sync_bytes("diloco", n, world) / sync_bytes("diloco", n, world, compress=spec) > 1.5

    # NoLoCo's sparse gossip: after exchange e, the two members of each pair moved by the
    # same mean Δ̂, and their pull (γ = 0.5, no momentum) closed half their gap on the pulled
    # chunks and nothing elsewhere: the pull sums to zero over the pair.
    size, gamma = sparse.DEFAULT_CHUNK, 0.5
    numel = res[0]["noloco"]["sizes"][0]
    mask_of = []
    for pulled in res[0]["noloco"]["pulled"]:
        mask = torch.zeros(numel, dtype=torch.bool)
        for c in pulled:
            mask[c * size:(c + 1) * size] = True
        mask_of.append(mask)
    assert all(r["noloco"]["pulled"] == res[0]["noloco"]["pulled"] for r in res)
    start = flat(build(ARGS, seed=0).parameters())
    checked = 0
    for e in range(1, 4):
        for i, j in groups_at(e, world, 2):
            before_i = res[i]["noloco"]["slows"][e - 1]
            before_j = res[j]["noloco"]["slows"][e - 1]
            after_i, after_j = res[i]["noloco"]["slows"][e], res[j]["noloco"]["slows"][e]
            gap, new_gap = before_i - before_j, after_i - after_j
            m = mask_of[e]
            torch.testing.assert_close(new_gap[~m], gap[~m], atol=1e-6, rtol=0)
            torch.testing.assert_close(new_gap[m], (1 - gamma) * gap[m], atol=1e-6, rtol=0)
            checked += int(gap.abs().max() > 1e-4)
    assert checked >= 2  # pairs that had drifted apart before their exchange
    # after the first exchange (equal φ before it) each pair holds one φ
    for i, j in groups_at(0, world, 2):
        assert torch.equal(res[i]["noloco"]["slows"][0], res[j]["noloco"]["slows"][0])
        assert not torch.equal(res[i]["noloco"]["slows"][0], start)


def test_pulled_chunks_are_shared_seeded_and_sized():
    import torch.nn as nn

    from noloco.comm import NullCommunicator

    model = nn.Linear(100, 100)  # 10,100 values: 3 chunks
    a = NoLoCo(model, NullCommunicator(), compress="topk:0.5:2", seed=3)
    b = NoLoCo(nn.Linear(100, 100), NullCommunicator(), compress="topk:0.5:2", seed=3)
    assert a.pulled_chunks(7, 10_100) == b.pulled_chunks(7, 10_100)
    assert len(a.pulled_chunks(0, 10_100)) == 2  # round(0.5 · 3)
    draws = {tuple(a.pulled_chunks(e, 10_100)) for e in range(20)}
    assert len(draws) > 1  # a different draw from one exchange to the next
    assert all(0 <= c < 3 for d in draws for c in d)
    tiny = NoLoCo(model, NullCommunicator(), compress="topk:0.01:2")
    assert len(tiny.pulled_chunks(0, 10_100)) == 1  # never none
    with pytest.raises(ValueError, match="two encodings"):
        NoLoCo(model, NullCommunicator(), compress="topk:0.5", quantize="fp4")


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags", [
    ("--method", "streaming", "--fragments", "2", "--compress", "topk:0.05:4"),
    ("--method", "noloco", "--compress", "topk:0.02:2"),
])
def test_netsim_predicts_a_compressed_runs_bytes_exactly(tmp_path, corpus, flags):
    run = tmp_path / "run"
    assert cli_train(run, corpus, *flags, "--replicas", "2", "--steps", "8",
                     "--sync-every", "4", "--seq-len", "32", "--eval-every", "8",
                     "--eval-sequences", "2") == 0
    s = summary(run)
    assert s["compress"] == flags[-1] and s["ef_decay"] == 1.0
    got = predict_run(run, "100Mbit", "10ms", methods=(flags[1],)).methods[0]
    assert got.bytes_sent_per_replica == s["bytes_sent"] > 0
    assert got.wire_bits < 2


def test_the_guard_keeps_a_bad_update_out_of_the_error_feedback():
    """NoLoCo's sparse gossip judges its own update before folding it into e: a NaN step is
    rejected once, e stays finite, and the next exchanges are accepted again."""
    import torch.nn as nn

    from noloco.comm import NullCommunicator
    from noloco.guard import UpdateGuard

    torch.manual_seed(0)
    for make in (lambda m, g: NoLoCo(m, NullCommunicator(), sync_every=1, guard=g,
                                     compress="topk:0.05:2"),
                 lambda m, g: DiLoCo(m, NullCommunicator(), sync_every=1, guard=g,
                                     compress="topk:0.05:2")):
        model = nn.Linear(64, 64)
        guard = UpdateGuard()
        method = make(model, guard)
        for step in range(8):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
                if step == 2:
                    model.weight[0, 0] = float("nan")
            method.after_inner_step()
            assert all(torch.isfinite(e).all() for e in method.errors), step
        assert [r["step"] for r in guard.rejected] == [3], guard.rejected
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_error_feedback_lives_on_the_parameters_device_when_a_fragment_is_empty():
    """A pipeline stage can hold no block of fragment 0 (whose empty φ is a CPU tensor):
    the buffers go where the parameters are, not where fragment 0's φ is."""
    from noloco.comm import NullCommunicator
    from noloco.pipeline import Stage

    # (the meta device stands in for an accelerator: a CPU tensor beside it is as wrong)
    model = build(ModelArgs(dim=16, n_layers=4, n_heads=2, ffn_dim=32, vocab_size=64,
                            max_seq_len=16), seed=0).to("meta")
    stage = Stage(model, 2, 1)  # blocks 2 and 3
    for make in (DiLoCo, NoLoCo):
        method = make(list(stage.named_parameters()), NullCommunicator(), sync_every=4,
                      n_layers=4, fragments=2, fragment_pattern="sequential",
                      compress="topk:0.1:2")
        assert method.frags[0].numel() == 0 and method.frags[1].numel() > 0
        assert {e.device.type for e in method.errors} == {"meta"}


class _Gathered(NullCommunicator):
    """A communicator stand-in for replica 0 of four whose all-gather returns what a test
    sets in ``result`` (``SKIPPED``, or the messages with None for absent replicas)."""

    def __init__(self, may_skip: bool) -> None:
        super().__init__()
        self.may_skip, self.rank, self.size = may_skip, 0, 4
        self.result = lambda tensor: [tensor.clone()]

    def all_gather_async(self, tensor: torch.Tensor) -> Pending:
        self.ops["all_gather"] += 1
        got = self.result(tensor)
        return Pending(self, [], lambda: got)


def test_a_sparse_round_nobody_stepped_in_is_called_off_and_garbage_is_left_out():
    """Elastic DiLoCo with --compress: an all-gather that ended SKIPPED (nobody stepped)
    leaves φ and the error feedback as they were — the fast weights train on and the next
    round's outer gradient holds this one's again. A partner's malformed message is left out
    of the mean (and said in the summary); an absent one is no message."""
    import torch.nn as nn

    from noloco.comm import SKIPPED

    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    comm = _Gathered(may_skip=True)
    method = DiLoCo(model, comm, sync_every=1, compress="topk:0.05:2", ef_decay=0.9)
    step = lambda: [p.data.add_(0.01 * torch.randn_like(p)) for p in model.parameters()]  # noqa: E731
    comm.result = lambda t: [t.clone(), None, None, None]
    step()
    method.after_inner_step()  # a round with itself alone: e owes what it did not send
    e1, phi1 = method.errors[0].clone(), method.frags[0].slow().clone()
    comm.result = lambda t: SKIPPED
    step()
    method.after_inner_step()
    assert torch.equal(method.errors[0], e1) and torch.equal(method.frags[0].slow(), phi1)
    assert method.outer_steps == 1
    garbage = torch.full((sparse.wire_bytes(64 * 64 + 64, 0.05, 2),), 0xFF, dtype=torch.uint8)
    comm.result = lambda t: [t.clone(), garbage, None, t.clone()]
    step()
    method.after_inner_step()
    assert method.outer_steps == 2
    assert [(d["from"], d["fragment"]) for d in method.dropped] == [(1, 0)]
    assert "outside" in method.dropped[0]["why"]
    assert method.report()["dropped_messages"] == method.dropped
    # A static communicator never calls a round off: no copy of e is kept
    static = DiLoCo(nn.Linear(4, 4), _Gathered(may_skip=False), sync_every=1,
                    compress="topk:0.5:2")
    assert static.compress.feedback[0].before is None
