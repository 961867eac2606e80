"""A partition: one "machine" (network namespace) cut off from the coordinator and the other
machine for a while, its link down, then back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_utils import SMALL
from test_elastic_machines import start_coordinator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import netns  # noqa: E402

OK, WHY = netns.available()
pytestmark = [pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}"),
              pytest.mark.slow("network namespaces, a link cut for seconds, elastic workers")]

CUT = 10.0
"""seconds machine 1's link is down (> 3 x the peer timeout)"""
TIMEOUT = 3.0
PACE = 0.25
"""seconds an inner step takes: the cut is 40 steps"""
RUN_OF = {"noloco": ["--sync-every", "2"], "diloco": ["--sync-every", "2"]}
"""an outer step every 2 inner steps (0.2 s paced): the cut spans ~50 outer steps"""
SPARSE_SAVES = ["--checkpoint-every", "100"]
"""a checkpoint every 100 steps, not every outer step (2 steps): nothing in the long cut's
test reads them, and 150 saves of 4 replicas were a fifth of its CPU"""
CPP_NOISE = ("connectFullMesh", "[E", "[W", "Traceback", "terminate called", "c10d")


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
        if path.is_file() else []


def start_machines(ns: netns.Namespaces, host: str, port: int, env: dict[str, str],
                   outs: list[Path], corpus: Path, method: str, steps: int,
                   pace: float = PACE, *extra: str) -> list[subprocess.Popen]:
    """Machine 0 runs replicas 0-1, machine 1 replicas 2-3, at the coordinator; every step
    takes ``pace`` seconds (it sleeps the rest: no CPU, and as long on a loaded machine as on
    an idle one) so that the run outlasts the cut with few steps."""
    return [ns.popen(m, [sys.executable, "-m", "noloco", "train", *SMALL,
                         "--data", str(corpus), "--method", method,
                         "--replicas", "4", "--steps", str(steps), *RUN_OF[method], *extra,
                         "--eval-every", "10", "--elastic", "--peer-timeout", str(TIMEOUT),
                         "--comm-timeout", "8",
                         "--inject-fault", ",".join(f"pace:{r}:{pace}" for r in range(4)),
                         "--coordinator", f"{host}:{port}", "--replica-ids", ids,
                         "--out", str(out)],
                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for m, (ids, out) in enumerate(zip(("0-1", "2-3"), outs, strict=True))]


def wait_for_step(metrics: Path, step: int, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 150
    while not any(r["step"] >= step for r in records(metrics)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.1)


MISSED = {"late", "absent", "not_in_snapshot", "lost", "unreachable"}
"""the events of an operation a replica did without (all of) its partners"""
LONELY = 2
"""--max-lonely-outer-steps of these runs (the default)"""
LONG_CUT = 16.0
"""seconds of the long cut: ~80 outer steps of 0.2 s (the others lose --comm-timeout of it to
an exchange in flight as the link goes down, and --peer-timeout before they leave the cut
replicas out)"""


@pytest.mark.timeout(400)
@pytest.mark.parametrize("method", ["noloco", "diloco"])
def test_a_machine_cut_off_for_many_outer_steps_meets_the_others_again(tmp_path, corpus,
                                                                      method):
    """Machine 0 (the coordinator, replicas 0-1) and machine 1 (replicas 2-3); machine 1's
    link goes down for 16 s mid-run, some 80 outer steps. Machine 1 trains on alone (it
    cannot reach anyone: no snapshot, no agreement of its own — no split brain) for at most
    --max-lonely-outer-steps, then waits for the link; when it returns the sides meet again
    (machine 1, behind, takes a live replica's state: NoLoCo exchanges, DiLoCo heals), and
    from two operations later every replica takes part in at least 90% of its operations.
    Both summaries name the partition (how far it ran alone, how it re-aligned), the loss is
    within 5% of the same run without the cut, and the logs hold one-line events, no C++
    error dumps."""
    port = 29474 if method == "noloco" else 29475
    ref = subprocess.Popen([sys.executable, "-m", "noloco", "train", *SMALL, "--data",
                            str(corpus), "--method", method, "--replicas", "4", "--steps",
                            "300", *RUN_OF[method], *SPARSE_SAVES, "--threads", "1", "--out",
                            str(tmp_path / "ref")], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    with netns.Namespaces([None, None], prefix="nlcp", subnet="10.79.4.0/24") as ns:
        host, env, coord = start_coordinator(ns, port)
        outs = [tmp_path / "m0", tmp_path / "m1"]
        procs = start_machines(ns, host, port, env, outs, corpus, method, 300, 0.1,
                               *SPARSE_SAVES)
        wait_for_step(outs[1] / "metrics" / "replica-2.jsonl", 60, procs)
        ns.cut(1)
        time.sleep(LONG_CUT)
        ns.cut(1, False)
        results = [p.communicate(timeout=300) for p in procs]
        coord.terminate()
        coord.wait(timeout=10)
    _, ref_err = ref.communicate(timeout=200)
    assert ref.returncode == 0, ref_err
    for p, (_, err), out in zip(procs, results, outs, strict=True):
        (out / "stderr.txt").write_text(err)  # kept for a look at a failure
        assert p.returncode == 0, err
        for noise in CPP_NOISE:
            assert noise not in err, err
    s0, s1 = (json.loads((o / "summary.json").read_text()) for o in outs)
    assert s0["elastic"]["replicas_finished"] == [0, 1]
    assert s1["elastic"]["replicas_finished"] == [2, 3]
    # Machine 1's replicas name their partition (a few seconds longer than the cut: the
    # store must answer again), how far they ran alone and how they re-aligned; machine 0's
    # none. On a loaded machine a beat held back for the peer timeout is listed too (cause
    # "stopped"): no part of this partition.
    cuts = [c for c in s1["elastic"]["partitions"] if c["cause"] == "unreachable"]
    assert sorted(c["replica"] for c in cuts) == [2, 3], s1["elastic"]["partitions"]
    assert not any(c["open"] for c in s1["elastic"]["partitions"])
    for c in cuts:
        assert LONG_CUT - 1 <= c["seconds"] <= LONG_CUT + 4 * TIMEOUT, c
        assert c["from_step"] < c["to_step"], c  # it trained on while cut off
        assert 1 <= c["lonely_ops"] <= LONELY, c  # for at most the bound
        # Usually behind: the others trained on meanwhile. Not always: an exchange in flight
        # as the link went down held them for --comm-timeout, and a loaded machine slows them.
        assert c["realigned"] in ("behind", "level", "waited"), c
    assert [c for c in s0["elastic"]["partitions"] if c["cause"] == "unreachable"] == []
    events = {**s0["elastic"]["events"], **s1["elastic"]["events"]}
    for r in ("2", "3"):
        assert "waited_for_link" in {e["kind"] for e in events[r]}, events[r]
    back = max(e["call"] for r in ("2", "3") for e in events[r] if e["kind"] == "realigned")
    calls = 300 // 2
    for r, evs in events.items():
        missed = {e["call"] for e in evs if e["kind"] in MISSED and e["call"] > back + 2}
        assert len(missed) <= 0.1 * (calls - back - 3), (r, back, sorted(missed))
    if method == "diloco":
        # The two sides' slow weights parted during the cut: after it the cut machine took
        # the quorum's committed state, and every replica ends with the same weights.
        healed = [j for j in s1["elastic"]["joins"] if j.get("kind") == "healed"]
        assert {j["replica"] for j in healed} == {2, 3}, s1["elastic"]["joins"]
        from safetensors.torch import load_file
        w = [load_file(str(o / "model" / f"replica-{r}.safetensors"))
             for o, r in ((outs[0], 0), (outs[0], 1), (outs[1], 2), (outs[1], 3))]
        for x in w[1:]:
            assert all((x[k] == w[0][k]).all() for k in w[0])
    # No worse than 5% above the calm run's loss (it may come out lower: 8 evaluation
    # sequences of a 300-step run are noisy, and a few outer steps alone are a longer H).
    # The calm run is an optimistic reference: the cut lasts about half of this run's outer
    # steps, and through it machine 0 trains with half the replicas (DiLoCo's cut side then
    # heals, its lonely steps dropped). Measured in CI: NoLoCo +2.1%, DiLoCo +3.2%; +0.4%
    # for NoLoCo alone on an idle machine. The loss is a coarse guard only: that the sides
    # meet again is the missed-operations check, and for DiLoCo the equal weights above.
    calm = json.loads((tmp_path / "ref" / "summary.json").read_text())["final_val_loss"]
    for s in (s0, s1):
        for r, loss in s["final_val_loss_per_replica"].items():
            assert loss <= 1.05 * calm, (r, loss, calm)


@pytest.mark.timeout(300)
def test_a_machine_cut_off_for_good_waits_then_saves_and_stops_in_one_line(tmp_path, corpus):
    """Machine 1's link goes down and stays down: its replicas train on alone for
    --max-lonely-outer-steps, wait for the link, and at --coordinator-timeout save a
    checkpoint and stop, in one line each; machine 0 finishes without them."""
    port = 29476
    with netns.Namespaces([None, None], prefix="nlcp", subnet="10.79.5.0/24") as ns:
        host, env, coord = start_coordinator(ns, port)
        outs = [tmp_path / "m0", tmp_path / "m1"]
        procs = start_machines(ns, host, port, env, outs, corpus, "noloco", 120, PACE,
                               "--coordinator-timeout", "25")
        wait_for_step(outs[1] / "metrics" / "replica-2.jsonl", 30, procs)
        ns.cut(1)
        results = [p.communicate(timeout=240) for p in procs]
        coord.terminate()
        coord.wait(timeout=10)
    assert procs[0].returncode == 0, results[0][1]
    assert procs[1].returncode == 1, results[1][1]
    for _, err in results:
        for noise in CPP_NOISE:
            assert noise not in err, err
    err = results[1][1]
    for r in (2, 3):
        assert f"noloco: replica {r}: cut off from the run's store for {LONELY} operations " \
               f"alone" in err, err
    assert "--coordinator-timeout" in err
    s0, s1 = (json.loads((o / "summary.json").read_text()) for o in outs)
    assert s0["elastic"]["replicas_finished"] == [0, 1]
    assert s0["elastic"]["steps_per_replica"] == {"0": 120, "1": 120}
    assert [f["kind"] for f in s1["failures"]] == ["store lost"] * 2
    for r in (2, 3):  # each saved where it stopped, far from the end
        saved = sorted((outs[1] / "checkpoints" / f"replica-{r}").glob("step-*"))
        assert saved and int(saved[-1].name.split("-")[1]) < 90, saved
