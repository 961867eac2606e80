"""Payload MACs (noloco.integrity): what replicas send each other is sealed under a key from
the run secret; a payload altered on the way is dropped as if its sender were absent."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import free_port
from run_utils import SMALL

from noloco.faults import Tamper, parse_faults
from noloco.integrity import (
    TAG_BYTES,
    Sealer,
    chunk_bounds,
    open_messages,
    payload_key,
    sealed_messages,
)

KEY = payload_key(b"a-test-secret-of-enough-length")


def test_a_seal_verifies_only_the_same_bytes_context_sender_and_receiver():
    s = Sealer(KEY)
    x = torch.randn(1000)
    tag = s.seal(x, "run/0/op/3", 1, [2])[0]
    assert tag.dtype == torch.uint8 and tag.numel() == TAG_BYTES
    assert s.check(x, tag, "run/0/op/3", 1, 2)
    y = x.clone()
    y.view(torch.uint8)[17] ^= 1  # one bit
    assert not s.check(y, tag, "run/0/op/3", 1, 2)
    assert not s.check(x, tag, "run/0/op/4", 1, 2)  # replayed in another operation
    assert not s.check(x, tag, "run/0/op/3", 3, 2)  # passed off as another sender's
    assert not s.check(x, tag, "run/0/op/3", 1, 0)  # meant for another receiver
    assert not Sealer(payload_key(b"another-secret-of-enough-length")).check(
        x, tag, "run/0/op/3", 1, 2)
    assert payload_key(b"a-test-secret-of-enough-length") != b"a-test-secret-of-enough-length"


def test_a_signed_join_request_verifies_only_as_written():
    s = Sealer(KEY)
    mac = s.sign("run/0/join-request/join/2/1", "3")
    assert s.signed("run/0/join-request/join/2/1", "3", mac)
    assert not s.signed("run/0/join-request/join/2/1", "1", mac)  # another joiner
    assert not s.signed("run/0/join-request/join/2/2", "3", mac)  # another request
    assert not s.signed("run/0/join-request/join/2/1", "3", None)  # unsigned
    assert not s.signed("run/0/join-request/join/2/1", "3", 42)


def test_chunks_cover_the_payload_exactly_and_an_opener_takes_them_in_order():
    for n in (1, 5, 1 << 18, (1 << 18) + 1, 3_675_648, 300_000_000):
        b = chunk_bounds(n)
        assert b[0][0] == 0 and b[-1][1] == n
        assert all(x[1] == y[0] for x, y in zip(b, b[1:], strict=False))
        assert len(b) <= max(8, -(-n // (1 << 24)))
    s = Sealer(KEY)
    x = torch.randn(918_912)
    tag = s.seal(x, "c", 0, [1])[0]
    o = s.opener("c", 0, 1, x.numel() * 4)
    for a, c in chunk_bounds(x.numel() * 4):
        o.update(x.view(torch.uint8)[a:c])
    assert o.verify(tag)


def test_sealed_messages_name_the_sender_whose_message_was_altered():
    s = Sealer(KEY)
    members = [0, 2, 5]
    # what member 2 receives in an all-to-all: from each member its message for member 2
    # (each sends 3 messages of 10 bytes, one per member, each sealed for its receiver)
    got = torch.cat([sealed_messages(s, torch.arange(30, dtype=torch.uint8) + m, "a2a", m,
                                     members).view(3, -1)[1] for m in members])
    body, bad = open_messages(s, got, "a2a", members, 2)
    assert bad == [] and body.view(3, 10)[1].tolist() == list(range(12, 22))
    got.view(3, -1)[2, 3] ^= 0xFF
    assert open_messages(s, got, "a2a", members, 2)[1] == [5]


def test_the_first_outcome_names_whom_every_member_retries_without():
    """After a failed MAC the members must retry in one group (its store key names it): the
    outcome that stands — the first report — carries the senders to leave out, also to the
    members that saw nothing wrong."""
    from datetime import timedelta

    import torch.distributed as dist

    from noloco.elastic.communicator import ElasticCommunicator
    from noloco.elastic.membership import Membership

    server = dist.TCPStore("127.0.0.1", free_port(), None, True, timedelta(seconds=20),
                           wait_for_workers=False)
    store = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=20))
    comms = [ElasticCommunicator(Membership(store, r, 3, 5.0), 5.0) for r in range(3)]
    first = comms[0]._outcome(0, "op/0", [0, 1, 2], False, [2])
    assert first == (False, [2])
    assert comms[1]._outcome(0, "op/0", [0, 1, 2], True) == (False, [2])  # it saw nothing
    assert comms[2]._outcome(0, "op/0", [0, 1, 2], False, [1]) == (False, [2])
    assert comms[1]._outcome(0, "op/1", [0, 1], True) == (True, [])
    assert comms[0]._outcome(0, "op/2", [0, 1], False) == (False, [])
    del store, server


def test_tamper_is_a_fault():
    (f,) = parse_faults("tamper:1@20", 4, 1)
    assert (f.kind, f.replica, f.step) == ("tamper", 1, 20)


def _run(tmp_path: Path, name: str, corpus: Path, *args: str, steps: int = 60) -> dict:
    """4 elastic replicas at a coordinator with the run secret (the suite's NOLOCO_SECRET)."""
    port = free_port()
    coord = subprocess.Popen([sys.executable, "-m", "noloco", "coordinator", "--host",
                              "127.0.0.1", "--port", str(port)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        assert coord.stdout is not None and "listening on" in coord.stdout.readline()
        r = subprocess.run(
            [sys.executable, "-m", "noloco", "train", "--data", str(corpus), *SMALL,
             "--replicas", "4", "--steps", str(steps), "--sync-every", "10", "--eval-every", "30",
             "--elastic", "--peer-timeout", "3", "--threads", "1", "--coordinator",
             f"127.0.0.1:{port}", "--replica-ids", "0-3", "--out", str(tmp_path / name),
             *args], capture_output=True, text=True, timeout=240)
    finally:
        coord.terminate()
        coord.wait(timeout=10)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp_path / name / "summary.json").read_text())


def _forged(s: dict) -> dict[str, set[int]]:
    """replica → the senders whose payloads it dropped for a failed MAC"""
    return {r: {x for e in evs for x in e.get("missing", []) + e.get("bad_mac", [])
                if e["kind"] == "bad_mac" or "bad_mac" in e}
            for r, evs in s["elastic"]["events"].items()}


@pytest.mark.slow("elastic worker processes")
@pytest.mark.timeout(300)
def test_noloco_drops_altered_exchanges_and_a_joiner_refuses_an_altered_state(tmp_path,
                                                                            corpus):
    """Replicas 0 and 1 send altered payloads from step 5 (tamper: after the seal, as a
    machine on the path would). Every partner drops them as from an absent sender; replica 3,
    killed at 25 and respawned, asks the furthest-along replica first (0 or 1: replica 2 is
    slower), refuses its altered state, and joins from replica 2."""
    # slowed (2 s of 1) so that the run outlasts the respawn's start-up on a loaded machine
    s = _run(tmp_path, "run", corpus, "--method", "noloco", "--respawn", "1",
             "--inject-fault", "tamper:0@5,tamper:1@5,slow:0:2,slow:1:2,slow:2:5,kill:3@25",
             steps=120)
    el = s["elastic"]
    assert el["payload_mac"] and all(v > 0 for v in el["mac_bytes_per_replica"].values())
    forged = _forged(s)
    assert forged["2"] <= {0, 1} and forged["2"], el["events"]  # partners of 0 and 1 dropped
    assert forged["0"] <= {1} and forged["1"] <= {0}           # (and those two each other)
    assert not any(2 in v or 3 in v for v in forged.values())   # nothing honest was dropped
    refused = [j for j in s["elastic"]["joins"] if j.get("kind") == "refused"]
    assert refused and all(j["from"] in (0, 1) and "MAC" in j["why"] for j in refused), el["joins"]
    joined = [j for j in s["elastic"]["joins"] if j.get("kind") == "joined"]
    assert joined and joined[-1]["from"] == 2, s["elastic"]["joins"]
    assert all(math.isfinite(v) for v in s["final_val_loss_per_replica"].values())


@pytest.mark.slow("elastic worker processes")
@pytest.mark.timeout(400)
def test_quantised_all_reduce_macs_change_no_number_and_leave_a_tamperer_out(tmp_path,
                                                                            corpus,
                                                                            monkeypatch):
    """Streaming DiLoCo with fp4 messages: sealed and unsealed runs compute the same numbers
    and count the same payload bytes (tags apart). With replica 1's messages altered from
    step 30, its all-reduces fail their MACs on every member, who retry without it (as
    without a member that died) and step together: no outer step is given up."""
    args = ["--method", "streaming", "--fragments", "2", "--quantize", "fp4"]
    sealed = _run(tmp_path, "sealed", corpus, *args)
    plain = _run(tmp_path, "plain", corpus, *args, "--no-payload-mac")
    assert sealed["elastic"]["payload_mac"] and not plain["elastic"]["payload_mac"]
    assert sealed["final_val_loss_per_replica"] == plain["final_val_loss_per_replica"]
    assert sealed["bytes_sent_per_replica"] == plain["bytes_sent_per_replica"]
    assert all(v > 0 for v in sealed["elastic"]["mac_bytes_per_replica"].values())
    assert all(v == 0 for v in plain["elastic"]["mac_bytes_per_replica"].values())
    assert not any(sealed["elastic"]["events"].values())
    # staged through host buffers (a GPU's path: the codec where the tensor is, the sealed
    # messages through host copies): the same numbers, payload bytes and tags
    with monkeypatch.context() as m:
        m.setenv("NOLOCO_HOST_STAGING", "1")
        staged = _run(tmp_path, "staged", corpus, *args)
    assert staged["final_val_loss_per_replica"] == sealed["final_val_loss_per_replica"]
    assert staged["bytes_sent_per_replica"] == sealed["bytes_sent_per_replica"]
    assert (staged["elastic"]["mac_bytes_per_replica"]
            == sealed["elastic"]["mac_bytes_per_replica"])

    hit = _run(tmp_path, "tampered", corpus, *args, "--inject-fault", "tamper:1@30")
    forged = _forged(hit)
    assert all(forged[r] == {1} for r in ("0", "2", "3")), hit["elastic"]["events"]
    kinds = {e["kind"] for evs in hit["elastic"]["events"].values() for e in evs}
    assert "gave_up" not in kinds, hit["elastic"]["events"]
    # the three went on stepping together after the tampering began
    assert all(hit["bytes_sent_per_replica"][r] > sealed["bytes_sent_per_replica"][r] * 0.6
               for r in ("0", "2", "3"))
    assert all(math.isfinite(v) for v in hit["final_val_loss_per_replica"].values())


def test_tamper_alters_a_copy_of_every_message_from_outside():
    """The fault is a wire filter installed from outside: one byte of every row flipped (a
    state's last, every other message's first), in a copy — never the sender's own tensor."""
    msgs = torch.arange(8, dtype=torch.uint8).view(2, 4)
    before = msgs.clone()
    out = Tamper()(msgs, "all_to_all")
    assert torch.equal(msgs, before)
    assert out[:, 0].tolist() == [0 ^ 0xFF, 4 ^ 0xFF] and torch.equal(out[:, 1:], msgs[:, 1:])
    state = Tamper()(msgs[:1], "state")
    assert state[0, -1] == 3 ^ 0xFF and torch.equal(state[0, :-1], msgs[0, :-1])
