"""``noloco simulate`` (issue 35): N replicas in one process, the distributed run's math.

The fabric's operations against the distributed communicator's formulas, the stacked
replicas' step against one replica's, a simulated run against the multi-process run of the
same config (the weights after 3 outer steps, every byte), and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from run_utils import SMALL, cli, summary, weights

from noloco import quant
from noloco.comm import quantized_all_reduce_bytes, quantized_mean, quantized_messages
from noloco.model import build, lm_loss, preset
from noloco.simulate import Fabric, StackedReplicas

# ---- the fabric ------------------------------------------------------------------------------


def test_fabric_all_reduce_gather_exchange():
    comms = Fabric(3).communicators()
    xs = [torch.full((5,), float(r + 1)) for r in range(3)]
    pend = [c.all_reduce_mean_async(x) for c, x in zip(comms, xs, strict=True)]
    for p in pend:
        p.wait()
    for x in xs:
        assert torch.equal(x, torch.full((5,), 2.0))
    assert all(c.bytes_sent == 2 * 2 * 5 * 4 // 3 for c in comms)  # the ring's 2(N−1)/N·S
    assert comms[0].fabric.in_flight() == 0  # read by every replica: forgotten

    got = [c.all_gather_async(torch.tensor([float(r)])) for r, c in enumerate(comms)]
    assert [float(t) for t in got[1].wait()] == [0.0, 1.0, 2.0]

    # 0 and 2 exchange; 1 exchanges with nobody (posts all the same: one schedule)
    payload = [torch.tensor([10.0 * r]) for r in range(3)]
    peers = [[2], [], [0]]
    ex = [c.exchange_async(p, q) for c, p, q in zip(comms, payload, peers, strict=True)]
    assert [float(t) for t in ex[0].wait()] == [20.0]
    assert ex[1].wait() == []
    assert [float(t) for t in ex[2].wait()] == [0.0]
    assert comms[0].bytes_sent - comms[1].bytes_sent == 4  # one float to one peer
    assert [c.ops["exchange"] for c in comms] == [1, 1, 1]


def test_fabric_forgets_what_a_leaver_will_never_read():
    fabric = Fabric(2)
    fabric.elastic = True
    comms = fabric.communicators()
    pend = [c.all_reduce_mean_async(torch.ones(2)) for c in comms]
    pend[0].wait()
    assert fabric.in_flight() == 1
    fabric.leave(1)  # it posted, but leaves before reading
    assert fabric.in_flight() == 0


def test_fabric_quantized_all_reduce_is_the_distributed_one():
    n, size, fmt = 1000, 4, "fp4"
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=g) for _ in range(size)]
    comms = Fabric(size).communicators()
    mine = [x.clone() for x in xs]
    pend = [c.all_reduce_mean_quantized_async(x, fmt) for c, x in zip(comms, mine, strict=True)]
    for p in pend:
        p.wait()
    # one rank of the distributed two-phase exchange, its peers' messages at hand
    sends = [quantized_messages(x, size, fmt) for x in xs]
    m = sends[0].numel() // size
    rank = 2

    def all_to_all(recv, sent):
        recv.copy_(torch.cat([s[rank * m:(rank + 1) * m] for s in sends]))

    expected = quantized_mean(sends[rank], n, size, fmt, quant.DEFAULT_BLOCK_SIZE, all_to_all,
                              lambda out, x: _gather_phase2(out, sends, n, size, fmt))
    for x in mine:
        assert torch.equal(x, expected)
    assert comms[0].bytes_sent == quantized_all_reduce_bytes(n, size, fmt)


def _gather_phase2(out, sends, n, size, fmt):
    """Every rank's phase-2 message: its chunk's mean, encoded (what it all-gathers)."""
    from noloco.comm import _reduce_quantized_chunk, quantized_chunk_numel

    chunk = quantized_chunk_numel(n, size)
    m = sends[0].numel() // size
    for j in range(size):
        out[j].copy_(_reduce_quantized_chunk([s[j * m:(j + 1) * m] for s in sends], chunk,
                                             fmt, quant.DEFAULT_BLOCK_SIZE))


def test_fabric_refuses_a_read_before_every_replica_started():
    comms = Fabric(2).communicators()
    pending = comms[0].all_reduce_mean_async(torch.ones(3))
    with pytest.raises(RuntimeError, match="before replicas \\[1\\] started it"):
        pending.wait()
    with pytest.raises(RuntimeError, match="schedules differ"):
        comms[1].all_gather_async(torch.ones(3))


# ---- the stacked replicas ----------------------------------------------------------------------


def test_stacked_step_is_each_replicas_own_step():
    """Losses, gradients (clipped by each replica's own norm) and AdamW on the stacks equal
    each replica's, bit for bit."""
    args = preset("tiny", vocab_size=256, n_layers=2)
    n = 3
    stacked = StackedReplicas(build(args, seed=0), n)
    singles = [build(args, seed=0) for _ in range(n)]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 256, (n, 2, 16), generator=g), torch.randint(0, 256, (n, 2, 16),
                                                                          generator=g)
    opt = torch.optim.AdamW(stacked.params, lr=1e-2)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in singles]
    for _ in range(3):
        losses = stacked.losses(x, y)
        losses.sum().backward()
        norms = stacked.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        for r, (m, o) in enumerate(zip(singles, opts, strict=True)):
            loss = lm_loss(m(x[r]), y[r])
            loss.backward()
            assert torch.equal(norms[r], torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
            o.step()
            o.zero_grad()
            assert float(loss) == pytest.approx(float(losses[r].detach()), abs=1e-5)
    for r, m in enumerate(singles):
        for (name, view), (_, p) in zip(stacked.named_views(r), m.named_parameters(),
                                        strict=True):
            assert torch.equal(view, p), name


# ---- whole runs --------------------------------------------------------------------------------

EQUAL = [
    # (flags, largest weight difference allowed): bit for bit except the dense all-reduce,
    # whose sum gloo's ring adds in another order than the fabric's rank order
    (["--method", "diloco"], 2e-6),
    (["--method", "noloco"], 0.0),
    (["--method", "noloco", "--gamma", "0.5", "--quantize", "fp4", "--fragments", "2"], 0.0),
    (["--method", "noloco", "--compress", "topk:0.1:4"], 0.0),
    (["--method", "streaming", "--fragments", "2", "--overlap-steps", "1", "--quantize",
      "fp4"], 0.0),
    (["--method", "sparseloco"], 0.0),
    (["--method", "diloco", "--compress", "topk:0.05:2"], 2e-6),
    (["--method", "ddp"], 2e-6),
]


@pytest.mark.slow("a multi-process run and its simulation per method")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("flags,tol", EQUAL, ids=[" ".join(f[1:]) for f, _ in EQUAL])
def test_simulated_run_equals_the_distributed_run(tmp_path, corpus, flags, tol):
    """4 replicas, 3 outer steps: the same weights (within ``tol``; 0 is bit for bit), the
    same bytes per replica and operations."""
    common = ["--data", str(corpus), *SMALL, "--replicas", "4", "--steps", "18",
              "--sync-every", "6", "--eval-every", "18", *flags]
    sim, real = tmp_path / "sim", tmp_path / "real"
    r = cli("simulate", *common, "--out", str(sim))
    assert r.returncode == 0, r.stderr
    r = cli("train", *common, "--out", str(real))
    assert r.returncode == 0, r.stderr
    ws, wr = weights(sim), weights(real)
    assert ws.keys() == wr.keys()
    assert {f"replica-{i}.safetensors" for i in range(4)} <= ws.keys()
    def worst(files):
        return max(float((ws[f][k] - wr[f][k]).abs().max()) for f in files for k in ws[f])

    assert worst([f for f in ws if f.startswith("replica-")]) <= tol
    if "average.safetensors" in ws:  # (the distributed mean is a gloo all-reduce)
        assert worst(["average.safetensors"]) <= 2e-6
    s, t = summary(sim), summary(real)
    assert s["simulated"] is True
    assert s["bytes_sent_per_replica"] == t["bytes_sent_per_replica"]
    assert s["ops"] == t["ops"] and s["outer_steps"] == t["outer_steps"]
    assert s["final_val_loss"] == pytest.approx(t["final_val_loss"], abs=1e-5)
    lines = [json.loads(x) for x in (sim / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 18]


@pytest.mark.parametrize("flags,why", [
    (["--method", "diloco", "--checkpoint-every", "5"], "--checkpoint-every does not apply"),
    (["--method", "diloco", "--respawn", "2"], "--respawn does not apply"),
    (["--method", "diloco", "--data", "/nonexistent/x.txt"], "data path not found"),
    (["--stages", "2", "--method", "diloco"], "pipeline stages are not simulated"),
    (["--inner-optimizer", "muon", "--method", "diloco"], "only AdamW is batched"),
    (["--method", "diloco", "--elastic"], "elastic run is not simulated"),
])
def test_refused_in_one_line_and_nothing_written(tmp_path, flags, why):
    out = tmp_path / "run"
    r = cli("simulate", "--replicas", "2", *flags, "--out", str(out))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and why in r.stderr, r.stderr
    assert not out.exists()


def test_attention_folds_the_replicas_into_the_batch(monkeypatch):
    """The model's attention goes through the folded kernel (vmap's own fallback loops over
    the replicas, with work that grows as N²), and gives each replica its own numbers."""
    from noloco.simulate import replicas as mod

    calls = []
    original = mod._FlatAttention.vmap

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(mod._FlatAttention, "vmap", staticmethod(counted))
    args = preset("tiny", vocab_size=256, n_layers=2)
    stacked = StackedReplicas(build(args, seed=0), 2)
    x = torch.randint(0, 256, (2, 2, 8))
    losses = stacked.losses(x, x)
    assert len(calls) == 2  # one per block
    alone = build(args, seed=0)
    # (the loss's own mean may round differently batched; the gradients do not: see above)
    assert float(losses[1]) == pytest.approx(float(lm_loss(alone(x[1]), x[1])), abs=1e-6)


@pytest.mark.parametrize("cap,flag,expected", [("1", [], 1), ("", [], 4), ("3", ["2"], 2)])
def test_simulate_takes_the_cores_at_most_omp_num_threads(tmp_path, corpus, monkeypatch, cap,
                                                         flag, expected):
    """One process: this machine's cores (4 here), or --threads, and at most OMP_NUM_THREADS
    where that is set (something else may run on the same cores), as a worker's count is."""
    from noloco import cli as cli_mod
    from noloco import data as data_mod

    monkeypatch.setattr(data_mod, "cpu_count", lambda: 4)
    monkeypatch.setenv("OMP_NUM_THREADS", cap)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # (torchrun's: no cap)
    asked = []  # (this process's own thread counts stay as they were)
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    monkeypatch.setattr(torch, "set_num_interop_threads", lambda n: None)
    args = ["simulate", "--data", str(corpus), *SMALL, "--method", "noloco", "--replicas", "2",
            "--steps", "2", "--sync-every", "2", "--eval-every", "2", "--out", str(tmp_path / "r")]
    if flag:
        args += ["--threads", *flag]
    assert cli_mod.main(args) == 0
    assert asked == [expected]


@pytest.mark.parametrize("method,terms", [("diloco", 2 * 3), ("noloco", 1), ("ddp", 2 * 3)])
def test_modelled_wall_clock_on_a_link(tmp_path, corpus, method, terms):
    """--bandwidth, --latency, --step-time: every step's time, plus each operation's bytes
    over the link and its latency terms (a ring of 4: 2·3; a pair exchange: 1), in the
    summary and in every metrics line — DDP's from the first step on."""
    out = tmp_path / "run"
    r = cli("simulate", "--data", str(corpus), *SMALL, "--method", method, "--replicas", "4",
            "--steps", "12", "--sync-every", "6", "--eval-every", "6", "--bandwidth",
            "10Mbit", "--latency", "40ms", "--step-time", "0.25", "--out", str(out))
    assert r.returncode == 0, r.stderr
    s = summary(out)
    ops = sum(s["ops"].values())
    assert ops == (12 * 2 if method == "ddp" else 2)  # (DDP: 2 buckets of the small model)
    expected = 12 * 0.25 + s["bytes_sent"] * 8 / 10e6 + ops * terms * 0.04
    assert s["modelled"]["wall_seconds"] == pytest.approx(expected, rel=1e-9)
    assert s["modelled"]["exposed_sync_seconds"] == pytest.approx(expected - 3.0, rel=1e-9)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["modelled_seconds"] for x in lines] == pytest.approx([0.0, expected / 2,
                                                                     expected])


@pytest.mark.parametrize("flags,why", [
    (["--latency", "50ms"], "give --bandwidth too"),
    (["--bandwidth", "fast"], "cannot parse bandwidth"),
    (["--bandwidth", "1Gbit", "--step-time", "0"], "--step-time must be > 0"),
])
def test_bad_network_model_in_one_line(tmp_path, flags, why):
    out = tmp_path / "run"
    r = cli("simulate", "--replicas", "2", "--method", "diloco", *flags, "--out", str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and why in r.stderr, r.stderr
    assert not out.exists()


def test_too_many_replicas_are_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    r = cli("simulate", "--method", "noloco", "--preset", "small", "--replicas", "4096",
            "--out", str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "4096 replicas need about" in r.stderr and "fit" in r.stderr
    assert not out.exists()


def test_the_plan_is_said_before_the_run(tmp_path, corpus):
    r = cli("simulate", "--data", str(corpus), *SMALL, "--method", "diloco", "--replicas",
            "3", "--steps", "2", "--eval-every", "2", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith("noloco simulate: 3 replicas in one process on cpu: about")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_device_cuda_without_a_gpu(tmp_path):
    r = cli("simulate", "--replicas", "2", "--method", "diloco", "--device", "cuda", "--out",
            str(tmp_path / "r"))
    assert r.returncode == 2 and "no GPU is visible" in r.stderr
    assert not (tmp_path / "r").exists()


# ---- churn -------------------------------------------------------------------------------------


def test_fabric_leaves_a_leaver_out():
    fabric = Fabric(3)
    fabric.elastic = True
    comms = fabric.communicators()
    fabric.leave(1)
    assert comms[0].members() == [0, 2]
    xs = {r: torch.full((4,), float(r)) for r in (0, 2)}
    pend = [comms[r].all_reduce_mean_async(xs[r]) for r in (0, 2)]
    for p in pend:
        p.wait()
    assert torch.equal(xs[0], torch.full((4,), 1.0)) and torch.equal(xs[2], xs[0])
    assert comms[0].bytes_sent == 2 * 1 * 16 // 2  # a ring of the 2 in the run
    got = [comms[r].all_gather_async(torch.tensor([float(r)])) for r in (0, 2)]
    assert [None if t is None else float(t) for t in got[0].wait()] == [0.0, None, 2.0]
    assert comms[2].bytes_sent - comms[0].bytes_sent == 0
    fabric.join(1)
    comms[1].seq = comms[0].seq
    assert comms[1].members() == [0, 1, 2]


def _simulation(tmp_path, corpus, *flags):
    from noloco.cli import build_parser, config_from_args
    from noloco.rundir import RunDir
    from noloco.simulate import Simulation

    ns = build_parser().parse_args(["simulate", "--data", str(corpus), *SMALL, *flags,
                                    "--out", str(tmp_path / "run")])
    cfg = config_from_args(ns).resolved()
    rundir = RunDir(cfg.train.out)
    rundir.prepare(cfg, overwrite=False)
    return Simulation(cfg, rundir)


def test_a_joiner_takes_its_donors_state(tmp_path, corpus):
    """A replica that left misses the outer steps of its time away; joining, it takes the
    donor's weights, slow weights, outer momentum and operation count, owes no error
    feedback and restarts its moments; after the next outer step it holds what the others
    hold (DiLoCo: every replica in the run steps to the same φ)."""
    sim = _simulation(tmp_path, corpus, "--method", "diloco", "--replicas", "3",
                      "--sync-every", "2", "--steps", "8", "--compress", "topk:0.2:4")
    for _ in range(2):
        sim.inner_step()
    sim.fabric.leave(2)
    for _ in range(2):
        sim.inner_step()
    assert sim.methods[2].outer_steps == 1 and sim.methods[0].outer_steps == 2
    assert sim.comms[2].seq < sim.comms[0].seq
    sim.join(2, donor=0)
    views = [dict(sim.replicas.named_views(r)) for r in range(3)]
    assert all(torch.equal(views[2][k], views[0][k]) for k in views[0])
    m0, m2 = sim.methods[0], sim.methods[2]
    assert torch.equal(m2.frags[0].flat_phi, m0.frags[0].flat_phi)
    assert torch.equal(m2.outer_momentum()[0], m0.outer_momentum()[0])
    # a copy, as received over a network: not the donor's own buffer
    assert m2.outer_momentum()[0].data_ptr() != m0.outer_momentum()[0].data_ptr()
    assert m2.outer_steps == 2 and sim.comms[2].seq == sim.comms[0].seq
    assert all(float(e.abs().sum()) == 0 for e in m2.errors)
    assert any(float(e.abs().sum()) > 0 for e in m0.errors)
    for state in sim.inner.state.values():  # (it never left: nothing of its own kept)
        assert float(state["exp_avg"][2].abs().sum()) == 0
    for _ in range(2):
        sim.inner_step()
    assert torch.equal(m2.frags[0].flat_phi, m0.frags[0].flat_phi)
    assert sim.methods[1].outer_steps == 3


def test_churned_run(tmp_path, corpus):
    """--churn: replicas leave and join at outer steps, reproducibly; the summary lists the
    events and the replicas in the run at its end."""
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        r = cli("simulate", "--data", str(corpus), *SMALL, "--method", "noloco",
                "--replicas", "6", "--sync-every", "2", "--steps", "12", "--eval-every", "4",
                "--churn", "0.4", "--out", str(out))
        assert r.returncode == 0, r.stderr
        runs.append(summary(out))
    a, b = runs
    assert a["churn"]["events"] == b["churn"]["events"] and a["churn"]["left"] > 0
    assert a["final_val_loss"] == b["final_val_loss"]
    kinds = {e["kind"] for e in a["churn"]["events"]}
    assert kinds == {"left", "joined"}
    away = set()
    for e in a["churn"]["events"]:
        assert e["step"] % 2 == 0
        if e["kind"] == "left":
            away.add(e["replica"])
        else:
            assert e["replica"] in away and e["donor"] not in away
            away.discard(e["replica"])
    assert set(a["final_val_loss_per_replica"]) == {str(r) for r in range(6) if r not in away}


@pytest.mark.parametrize("flags,why", [
    (["--method", "diloco", "--churn", "1.0"], "--churn must lie in [0, 1)"),
    (["--method", "diloco", "--churn", "-0.1"], "--churn must lie in [0, 1)"),
    (["--method", "ddp", "--churn", "0.1"], "does not take"),
    (["--method", "diloco", "--churn-away", "2"], "--churn-away needs --churn"),
])
def test_bad_churn_in_one_line(tmp_path, flags, why):
    out = tmp_path / "run"
    r = cli("simulate", "--replicas", "2", *flags, "--out", str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and why in r.stderr, r.stderr
    assert not out.exists()


def test_a_returning_replica_keeps_its_own_moments_and_reports_no_loss_away(tmp_path,
                                                                             corpus):
    sim = _simulation(tmp_path, corpus, "--method", "noloco", "--replicas", "4",
                      "--sync-every", "2", "--steps", "8")
    for _ in range(2):
        sim.inner_step()
    before = [s["exp_avg"][3].clone() for s in sim._adam_states()]
    sim.leave(3)
    loss = sim.inner_step()
    assert torch.isnan(loss[3]) and not torch.isnan(loss[:3]).any()
    sim.unread_losses += [loss, sim.inner_step()]  # (as run() keeps them)
    sim.join(3, donor=0)
    after = [s["exp_avg"][3] for s in sim._adam_states()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    from noloco.metrics import Progress

    rec = sim.evaluate(4, Progress(enabled=False, total=8))
    # replica 3's training loss is of no step (NaN), and the run's is the others' mean
    assert rec["replicas_in_run"] == 4 and rec["train_loss"] == rec["train_loss"]


def test_a_gathered_mean_is_decoded_once_for_every_replica(tmp_path, corpus, monkeypatch):
    """SparseLoCo's all-gather hands every simulated replica the same messages: their mean
    is decoded once per outer step (N messages), not once per replica (N² of them), and
    every replica steps with it, each from its own copy."""
    from noloco import sparse

    calls = []
    decode = sparse.Compressor.decode

    def counted(self, *args, **kwargs):
        calls.append(1)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(sparse.Compressor, "decode", counted)
    sim = _simulation(tmp_path, corpus, "--method", "sparseloco", "--replicas", "4",
                      "--sync-every", "2", "--steps", "4")
    for _ in range(2):
        sim.inner_step()
    assert len(calls) == 4  # one outer step: the 4 messages, once
    phis = [m.frags[0].flat_phi for m in sim.methods]
    assert all(torch.equal(phis[0], p) for p in phis[1:])
    assert len({p.data_ptr() for p in phis}) == 4


def test_a_fragment_holds_no_buffer_between_syncs(tmp_path, corpus):
    """Between syncs a method holds φ and the outer optimizer's state: the flat copy of θ it
    sent is the sync's, and goes with it (a buffer kept for the run would cost the weights'
    size again per replica)."""
    sim = _simulation(tmp_path, corpus, "--method", "noloco", "--replicas", "2",
                      "--sync-every", "2", "--steps", "4")
    for _ in range(2):
        sim.inner_step()
    m = sim.methods[0]
    assert m.outer_steps == 1 and not m.inflight
    for frag in m.frags:
        held = {k for k, v in vars(frag).items() if isinstance(v, torch.Tensor) or (
            isinstance(v, list) and any(isinstance(x, torch.Tensor) for x in v))}
        assert held == {"flat_phi", "phi", "params"}  # φ, its views, the live weights
