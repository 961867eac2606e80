"""noloco.library: the elastic machinery around a user's own model, optimizer and loop.

The multi-process tests host the run's store in this process (noloco.elastic.host.Host, what
`noloco coordinator` runs) and start replicas of tests/library_worker.py: a plain loop
around a small MLP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from noloco.library import RunError, join_run

WORKER = Path(__file__).with_name("library_worker.py")
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"),
       "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


@pytest.fixture
def host():
    from noloco.elastic import auth
    from noloco.elastic.host import Host

    # the run secret of the test session (conftest's NOLOCO_SECRET): the gate asks for it
    h = Host("127.0.0.1", 0, secret=auth.load_secret(None))
    yield h
    h.stop()


def worker(port: int, replica: int, replicas: int, steps: int, out: Path, *args: str,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), str(port), str(replica),
                             str(replicas), str(steps), str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, **(env or {})})


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str]]:
    got = []
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        got.append((p.returncode, err))
    return got


def results(tmp_path: Path, replicas: int) -> list[dict]:
    return [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(replicas)]


def no_cpp_dump(text: str) -> None:
    for sign in ("frame #", "Exception raised from", "terminate called", "Traceback"):
        assert sign not in text, text[-3000:]


@pytest.mark.slow("three replica processes at an in-process store")
@pytest.mark.timeout(180)
def test_a_plain_loop_trains_as_replicas_of_one_run(tmp_path, host):
    """Three processes, each its own loop, model and AdamW: outer steps happen inside
    optimizer.step(), every H = 5 steps; DiLoCo ends every outer step on the same weights."""
    procs = [worker(host.port, r, 3, 30, tmp_path / f"out{r}.json", "--step-seconds", "0.02",
                    "--barrier", str(tmp_path)) for r in range(3)]
    for code, err in finish(procs):
        assert code == 0, err[-3000:]
        no_cpp_dump(err)
    res = results(tmp_path, 3)
    assert all(x["step"] == 30 for x in res)
    assert all(x["weights"] == res[0]["weights"] for x in res)
    # (a replica that started after another had trained took its state: at most one
    # outer step's worth fewer of its own)
    assert all(x["outer_steps"] >= 5 for x in res), [x["outer_steps"] for x in res]


@pytest.mark.slow("replica processes, one killed and started again")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("staged", [False, True], ids=["plain", "host-staged"])
def test_a_killed_replica_started_again_rejoins_from_a_donor(tmp_path, host, staged):
    """Replica 1 is killed (SIGKILL) at step 12 of 80; its launcher (here, the test) starts
    it again: it takes a live replica's state inside join_run, resumes at the donor's step
    and finishes with the others, on the same weights. Host-staged: every tensor goes
    through host buffers (noloco.staging), the code a model on a GPU takes."""
    # (paced: the others still train when it is back; started together, however slowly
    # each process starts)
    pace = ["--step-seconds", "0.15", "--barrier", str(tmp_path)]
    env = {"NOLOCO_HOST_STAGING": "1" if staged else "0"}
    others = [worker(host.port, r, 3, 80, tmp_path / f"out{r}.json", *pace, env=env)
              for r in (0, 2)]
    first = worker(host.port, 1, 3, 80, tmp_path / "out1.json", "--die-at", "12", *pace,
                   env=env)
    first.communicate(timeout=120)
    assert first.returncode == -9
    again = worker(host.port, 1, 3, 80, tmp_path / "out1.json", *pace, env=env)
    for code, err in finish([*others, again]):
        assert code == 0, err[-3000:]
        no_cpp_dump(err)
    res = results(tmp_path, 3)
    assert all(x["step"] == 80 for x in res)
    rejoined = res[1]
    assert rejoined["first_step"] > 12  # it went on from the donor's step, not from 0
    assert "joined" in [j["kind"] for j in rejoined["joins"]]
    assert all(x["weights"] == res[0]["weights"] for x in res)
    assert all(x["staged"] == staged for x in res)


@pytest.mark.slow("replica processes, one of them refused")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("args,env,why", [
    (["--hidden", "16"], {}, "the model's parameters (names, shapes, dtypes) differ"),
    (["--sync-every", "4"], {}, "the method settings differ from the run's"),
    (["--seed", "7"], {}, "its initial weights differ"),
    ([], {"NOLOCO_SECRET": "x" * 40}, "secret"),
], ids=["architecture", "settings", "initial-weights", "secret"])
def test_a_replica_that_does_not_fit_the_run_is_refused_in_one_line(tmp_path, host, args,
                                                                     env, why):
    """Another architecture, other settings, other initial weights, a wrong secret:
    RunError before the first step (one line, a catchable exception); the run goes on
    without it."""
    ok = worker(host.port, 0, 2, 10, tmp_path / "out0.json", "--step-seconds", "0.3")
    assert ok.stdout is not None
    first = ok.stdout.readline()  # (it has defined the run: its first step is done)
    assert first.startswith("step 1 "), first + (ok.stderr.read() if ok.stderr else "")
    bad = worker(host.port, 1, 2, 10, tmp_path / "out1.json", *args, env=env)
    code, err = finish([bad])[0]
    assert code == 2 and why in err, err[-2000:]
    assert err.strip().count("\n") == 0, err  # one line
    (code0, err0), = finish([ok])
    assert code0 == 0, err0[-3000:]


@pytest.mark.parametrize("kwargs,why", [
    ({"method": "ddp"}, "is not served by an elastic run"),
    ({"sync_evry": 5}, "unknown method setting(s) sync_evry"),
    ({"replica": 4}, "replica 4 outside 0..3"),
    ({"compress": "topk:2"}, "compress"),
    ({"resume": True}, "pass the checkpoint_dir they were written to"),
])
def test_bad_settings_are_refused_before_anything_connects(kwargs, why):
    model = nn.Linear(2, 1)
    args = {"coordinator": "127.0.0.1:1", "run_id": "x", "replica": 0, "replicas": 4,
            **kwargs}
    with pytest.raises(RunError, match="join_run") as e:
        join_run(model, torch.optim.SGD(model.parameters(), lr=0.1), **args)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_an_unreachable_coordinator_is_one_line(monkeypatch):
    from noloco.elastic import auth

    monkeypatch.delenv("NOLOCO_SECRET", raising=False)  # (no gate to prove a secret to)
    for name in ("_secret", "_to_coordinator"):  # join_run sets them for the process
        monkeypatch.setattr(auth, name, getattr(auth, name))
    model = nn.Linear(2, 1)
    with pytest.raises(RunError, match="join_run") as e:
        join_run(model, torch.optim.SGD(model.parameters(), lr=0.1),
                 coordinator="127.0.0.1:1", run_id="x", replica=0, replicas=2,
                 comm_timeout=1.0, peer_timeout=1.0)
    assert "cannot reach the run's store at 127.0.0.1:1" in str(e.value)
    assert "\n" not in str(e.value)


def _static_replica(rank: int, world: int, method: str, sync_every: list[int], seed: int,
                    staged: bool = False) -> dict:
    """One rank of a static library run: a plain loop, 10 steps (``staged``: every tensor
    through host buffers, the code a model on a GPU takes over gloo)."""
    import torch.distributed as dist

    from noloco.library import static_run
    from noloco.staging import HostStaged

    os.environ["NOLOCO_HOST_STAGING"] = "1" if staged else "0"

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        run = static_run(model, opt, method=method, sync_every=sync_every[rank], seed=seed)
    except RunError as e:
        return {"refused": str(e)}
    with run:
        for step in range(10):
            g = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(16, 8, generator=g)
            nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()).backward()
            opt.step()
            opt.zero_grad()
    assert opt.step.__func__ is type(opt).step  # (close gave the optimizer its own step back)
    dist.barrier()
    return {"step": run.step, "outer_steps": run.outer_steps, "bytes": run.bytes_sent,
            "staged": isinstance(run.comm, HostStaged),
            "weights": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.slow("two processes in a gloo group")
@pytest.mark.timeout(120)
def test_a_static_run_of_a_plain_loop():
    """static_run over the default process group: DiLoCo's outer steps inside
    optimizer.step(), every H = 5 steps; both ranks end on the same weights."""
    from dist_utils import run_ranks

    got = run_ranks(_static_replica, 2, "diloco", [5, 5], 0)
    assert [r["step"] for r in got] == [10, 10] and [r["outer_steps"] for r in got] == [2, 2]
    assert all(r["bytes"] > 0 for r in got)
    assert all(torch.equal(a, b) for a, b in zip(got[0]["weights"], got[1]["weights"],
                                                  strict=True))
    # through host buffers (a GPU's path over gloo): the same run, bit for bit and byte for byte
    staged = run_ranks(_static_replica, 2, "diloco", [5, 5], 0, True)
    assert [r["staged"] for r in staged] == [True, True] and not got[0]["staged"]
    assert [r["bytes"] for r in staged] == [r["bytes"] for r in got]
    assert all(torch.equal(a, b) for a, b in zip(staged[0]["weights"], got[0]["weights"],
                                                  strict=True))


@pytest.mark.parametrize("backend,device,forced,staged,why", [
    ("gloo", "cpu", False, False, None),
    ("gloo", "cpu", True, True, None),
    ("gloo", "cuda", False, True, None),  # gloo cannot send a CUDA tensor point to point
    ("cpu:gloo,cuda:nccl", "cuda", False, False, None),
    ("cpu:gloo,cuda:nccl", "cpu", False, None, "NCCL carries CUDA tensors only"),
    ("nccl", "cuda", False, None, "init_process_group('cpu:gloo,cuda:nccl')"),
])
def test_a_static_run_picks_its_path_by_the_group_and_the_device(backend, device, forced,
                                                                   staged, why):
    from noloco.library import static_path

    if why is None:
        assert static_path(backend, torch.device(device), forced) is staged
    else:
        with pytest.raises(RunError, match=r"static_run: .*") as e:
            static_path(backend, torch.device(device), forced)
        assert why in str(e.value) and "\n" not in str(e.value)


def test_a_model_spread_over_devices_is_refused_in_one_line():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1, device="meta"))
    with pytest.raises(RunError, match="must all be on one device") as e:
        join_run(model, torch.optim.SGD(model.parameters(), lr=0.1), coordinator="127.0.0.1:1",
                 run_id="x", replica=0, replicas=2)
    assert "cpu, meta" in str(e.value)


@pytest.mark.slow("two processes in a gloo group")
@pytest.mark.timeout(120)
def test_a_static_run_with_other_settings_is_refused_on_every_rank():
    from dist_utils import run_ranks

    got = run_ranks(_static_replica, 2, "diloco", [5, 4], 0)
    assert all("the method settings differ between replicas" in r["refused"] for r in got)


@pytest.mark.parametrize("kwargs,why", [
    ({"run_id": "x"}, "name an elastic run: pass coordinator too"),
    ({"coordinator": "127.0.0.1:1", "run_id": "x"}, "needs replica, replicas"),
])
def test_a_framework_callback_asked_for_half_a_run_says_so(kwargs, why):
    from noloco.integrations import RunRequest

    model = nn.Linear(2, 1)
    req = RunRequest("diloco", **kwargs)
    with pytest.raises(RunError, match="RunRequest") as e:
        req.start(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert why in str(e.value)


def test_static_run_needs_a_process_group():
    from noloco.library import static_run

    model = nn.Linear(2, 1)
    with pytest.raises(RunError, match="torch.distributed is not initialised"):
        static_run(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.slow("replica processes, one started again after the others finished")
@pytest.mark.timeout(240)
def test_a_replica_with_nobody_left_to_join_goes_on_from_its_own_checkpoint(tmp_path, host):
    """With checkpoint_dir, a replica saves its own checkpoints (every outer step). Killed
    at step 12, and started again only after the others finished, it finds no live replica
    to take a state from: it goes on from its own checkpoint of step 10, alone, to the end.
    Without checkpoint_dir the same restart is refused in one line."""
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    together = ["--barrier", str(tmp_path)]
    other = worker(host.port, 0, 2, 30, tmp_path / "out0.json", "--step-seconds", "0.05",
                   *ckpt, *together)
    first = worker(host.port, 1, 2, 30, tmp_path / "out1.json", "--die-at", "12",
                   "--step-seconds", "0.05", *ckpt, *together)
    first.communicate(timeout=120)
    assert first.returncode == -9
    (code, err), = finish([other])
    assert code == 0, err[-3000:]
    assert (tmp_path / "ckpt" / "replica-0").is_dir()
    again = worker(host.port, 1, 2, 30, tmp_path / "out1.json", *ckpt)
    (code, err), = finish([again])
    assert code == 0, err[-3000:]
    assert "goes on from its own checkpoint at step 10" in err
    res = json.loads((tmp_path / "out1.json").read_text())
    assert res["first_step"] == 10 and res["step"] == 30
    assert [j["kind"] for j in res["joins"]] == ["own checkpoint"]
    # without checkpoints of its own: one line, exit 2
    bare = worker(host.port, 0, 2, 30, tmp_path / "out0b.json")
    (code, err), = finish([bare])
    assert code == 2 and "has no checkpoint of its own (no checkpoint_dir)" in err, err


@pytest.mark.slow("three replica processes twice, stopped and resumed, and a reference run")
@pytest.mark.timeout(300)
def test_a_run_stopped_as_a_whole_resumes_each_replica_from_its_own_checkpoint(tmp_path,
                                                                             host):
    """Three replicas leave the run at step 20 of 40 (their loops stopped: a checkpoint
    each, and where the run stood in the store). Started again with resume=True, they
    continue in a new epoch of the run, each from its own checkpoint, and end bit for bit
    where the same run without the stop ends (DiLoCo: the weights, moments and outer
    momentum all came back). resume=True on a first start, with nothing saved, is a plain
    start."""
    args = ["--step-seconds", "0.02", "--peer-timeout", "20"]  # (nobody left out under load)
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]

    def run(name: str, *extra: str) -> list[dict]:
        (tmp_path / name).mkdir()
        procs = [worker(host.port, r, 3, 40, tmp_path / name / f"out{r}.json", *args,
                        "--barrier", str(tmp_path / name), *extra) for r in range(3)]
        for r, (code, err) in enumerate(finish(procs)):
            (tmp_path / name / f"err{r}.txt").write_text(err)  # (for a failure's reader)
            assert code == 0, err[-3000:]
            no_cpp_dump(err)
        return [json.loads((tmp_path / name / f"out{r}.json").read_text()) for r in range(3)]

    ref = run("ref", "--run-id", "ref")
    first = run("first", *ckpt, "--resume", "--stop-at", "20")
    assert [(x["step"], x["resumed_from"], x["epoch"]) for x in first] == [(20, None, 0)] * 3
    assert all((tmp_path / "ckpt" / f"replica-{r}" / "store.json").is_file() for r in range(3))
    again = run("again", *ckpt, "--resume")
    assert [(x["first_step"], x["step"], x["resumed_from"], x["epoch"]) for x in again] \
        == [(20, 40, 20, 1)] * 3
    assert all([(j["kind"], j["why"]) for j in x["joins"]] == [("own checkpoint", "resumed")]
               for x in again), [x["joins"] for x in again]
    assert all(x["weights"] == ref[0]["weights"] for x in again + ref), [
        (x["replica"], x["outer_steps"], x["events"], x["joins"]) for x in ref + first + again]


@pytest.mark.slow("two replica processes per method")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["noloco", "streaming", "sparseloco"])
def test_every_elastic_method_runs_in_a_plain_loop(tmp_path, host, method):
    """NoLoCo (pairs), Streaming DiLoCo and SparseLoCo around the same plain loop: outer steps
    every H = 5 steps, bytes sent, finite weights. (Not compared for equality: under load an
    elastic outer step may go on without a late member, whose weights then differ.)"""
    procs = [worker(host.port, r, 2, 20, tmp_path / f"out{r}.json", "--method", method,
                    "--step-seconds", "0.02", "--barrier", str(tmp_path)) for r in range(2)]
    for code, err in finish(procs):
        assert code == 0, err[-3000:]
        no_cpp_dump(err)
    res = results(tmp_path, 2)
    assert all(x["step"] == 20 and x["outer_steps"] >= 3 and x["bytes_sent"] > 0
               for x in res), [(x["step"], x["outer_steps"], x["bytes_sent"]) for x in res]
    assert all(all(v == v for w in x["weights"] for v in w) for x in res)  # (no NaN)


@pytest.mark.slow("an etcd cluster and two replica processes")
@pytest.mark.timeout(180)
def test_a_plain_loop_meets_at_an_etcd_cluster(tmp_path):
    """coordinator="etcd://...": no noloco coordinator runs; the replicas meet through etcd."""
    from etcd_cluster import Cluster, available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    with Cluster(tmp_path / "etcd") as c:
        procs = [worker(0, r, 2, 20, tmp_path / f"out{r}.json", "--coordinator", c.address,
                        "--step-seconds", "0.02", "--barrier", str(tmp_path))
                 for r in range(2)]
        for code, err in finish(procs):
            assert code == 0, err[-3000:]
            no_cpp_dump(err)
    res = results(tmp_path, 2)
    assert all(x["step"] == 20 and x["outer_steps"] >= 3 for x in res)
    assert res[0]["weights"] == res[1]["weights"]


def test_lbfgs_is_refused():
    model = nn.Linear(2, 1)
    with pytest.raises(RunError, match="LBFGS"):
        join_run(model, torch.optim.LBFGS(model.parameters()), coordinator="127.0.0.1:1",
                 run_id="x", replica=0, replicas=2)


def test_steps_that_stop_reaching_the_run_are_said(monkeypatch):
    """A framework whose optimizer steps no longer reach the run (something replaced
    optimizer.step after the run wrapped it) fails in one line instead of training apart."""
    from types import SimpleNamespace

    from noloco.integrations import RunRequest

    req = RunRequest("diloco")
    req.run = SimpleNamespace(step=0)  # type: ignore[assignment]
    req.check_reached(1)  # (one step may still be on its way)
    with pytest.raises(RunError, match="2 optimizer steps did not reach the noloco run"):
        req.check_reached(2)
    req.run = SimpleNamespace(step=2)  # type: ignore[assignment]
    req.check_reached(2)


def test_a_scheduler_built_after_the_run_still_reaches_it(monkeypatch):
    """torch's LR schedulers re-bind ``optimizer.step.__func__`` to the optimizer: the run's
    step must survive that; and closing leaves the scheduler's wrapper working."""
    import torch.distributed as dist
    from dist_utils import free_port

    from noloco.library import static_run

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        model = nn.Linear(4, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        run = static_run(model, opt, method="diloco", sync_every=2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        with run:
            for _ in range(4):
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                sched.step()
        assert run.step == 4 and run.outer_steps == 2
        model(torch.randn(3, 4)).sum().backward()
        opt.step()  # closed: the optimizer's own step, through the scheduler's wrapper
        assert run.step == 4
    finally:
        dist.destroy_process_group()


@pytest.mark.slow("a store hosted in this process")
@pytest.mark.timeout(60)
def test_a_first_start_into_old_checkpoints_is_refused(tmp_path, host, monkeypatch):
    """A replica's first start in a run, into a checkpoint_dir that holds checkpoints (of an
    earlier run): refused in one line, nothing of them read or pruned."""
    from noloco import checkpoint as ckpt_mod
    from noloco.elastic import auth

    for name in ("_secret", "_to_coordinator"):  # join_run sets them for the process
        monkeypatch.setattr(auth, name, getattr(auth, name))
    old = ckpt_mod.step_dir(tmp_path / "ckpt" / "replica-0", 40)
    old.mkdir(parents=True)
    model = nn.Linear(2, 1)
    with pytest.raises(RunError, match="holds checkpoints of an earlier run"):
        join_run(model, torch.optim.SGD(model.parameters(), lr=0.1),
                 coordinator=f"127.0.0.1:{host.port}", run_id="old", replica=0, replicas=2,
                 checkpoint_dir=tmp_path / "ckpt", peer_timeout=2.0, comm_timeout=5.0)
    assert old.is_dir()


@pytest.mark.slow("three replica processes, one started late")
@pytest.mark.timeout(180)
def test_a_replica_that_starts_late_takes_the_live_state(tmp_path, host):
    """A replica whose first start comes after the others have trained (a machine that
    came up late) does not start from step 0: it takes a live replica's state before its
    first step and ends with the others on the same weights."""
    pace = ["--step-seconds", "0.1"]
    started = tmp_path / "late-started"
    # (the early ones hold at step 20 until the late process is up, about to join — under
    # load its start may take longer than their whole run — then serve its join)
    early = [worker(host.port, r, 3, 60, tmp_path / f"out{r}.json", *pace, "--hold",
                    f"20:{started}") for r in (0, 1)]
    assert early[0].stdout is not None
    for line in early[0].stdout:  # until the run has trained a while
        if line.startswith("step 10 "):
            break
    late = worker(host.port, 2, 3, 60, tmp_path / "out2.json", *pace, "--mark", str(started))
    for code, err in finish([*early, late]):
        assert code == 0, err[-3000:]
    res = results(tmp_path, 3)
    assert res[2]["first_step"] >= 10 and "joined" in [j["kind"] for j in res[2]["joins"]]
    assert all(x["step"] == 60 for x in res)
    assert all(x["weights"] == res[0]["weights"] for x in res)


def wait_for_files(files: list[Path], procs: list[subprocess.Popen], timeout: float) -> None:
    import time
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in files):
        assert time.monotonic() < deadline, [f.name for f in files if not f.exists()]
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(p.communicate()[1][-3000:])
        time.sleep(0.05)


@pytest.mark.slow("four replica processes; their coordinator killed and started again")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["diloco", "noloco"])
def test_a_coordinator_restarted_empty_the_loop_goes_on_in_a_new_epoch(tmp_path, method):
    """`noloco coordinator` is killed (SIGKILL) once four replicas passed step 30 of 160, and
    started again, empty, on the same address 4 s later. Every loop goes on through the
    outage without an exception (DiLoCo skips its outer steps, NoLoCo trains alone, then
    waits for the link), moves to epoch 1 and meets the others there again: bytes sent after
    the outage, and DiLoCo ends on the same weights everywhere."""
    import signal
    import time

    from test_coordinator import coordinator, free_port

    port = free_port()
    coord = coordinator(port)
    at = [tmp_path / f"at-{r}" for r in range(4)]
    procs = [worker(port, r, 4, 160, tmp_path / f"out{r}.json", "--method", method,
                    "--step-seconds", "0.1", "--barrier", str(tmp_path),
                    "--at", f"30:{at[r]}") for r in range(4)]
    try:
        wait_for_files(at, procs, 120)
        coord.send_signal(signal.SIGKILL)
        coord.wait()
        time.sleep(4)
        coord = coordinator(port)  # the same address, empty
        got = finish(procs, 200)
    finally:
        for p in [*procs, coord]:
            p.kill()
    for code, err in got:
        assert code == 0, err[-3000:]
        no_cpp_dump(err)
        assert "the run's store restarted empty; the run goes on in epoch 1" in err, err[-3000:]
    res = results(tmp_path, 4)
    assert all(x["step"] == 160 for x in res)
    for x in res:
        assert [o["epoch"] for o in x["outages"]] == [1], x["outages"]
        assert 30 <= x["outages"][0]["to_step"] < 130, x["outages"]
        kinds = [e["kind"] for e in x["events"]]
        assert "unreachable" in kinds and "realigned" in kinds, x["events"]
        # it met the others in the new epoch: bytes sent in its last 20 steps (a step
        # that a heal moved past is not in the record: the one before it)
        sent = {int(k): v for k, v in x["bytes_by_step"].items()}
        assert sent[160] > sent[max(k for k in sent if k <= 140)], sent
    if method == "diloco":
        assert all(x["weights"] == res[0]["weights"] for x in res)
