"""The run's coordination in an etcd cluster (`--coordinator etcd://...`): a store with
TCPStore's answers, gloo's rendezvous on it, heartbeats under leases, and a run that loses
an etcd member and a replica and goes on."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from etcd_cluster import Cluster, available
from run_utils import SMALL, cli, summary, wait_for
from test_coordinator import ENV, evaluated, free_port, no_cpp_dump

from noloco.elastic.etcd import EtcdStore, parse_endpoints

OK, WHY = available()
pytestmark = [pytest.mark.skipif(not OK, reason=WHY),
              pytest.mark.slow("an etcd cluster of three members, elastic worker processes")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("etcd")) as c:
        yield c


def script(store: dist.Store, tag: str) -> list:
    """The store operations the elastic code uses, and what each answered."""
    k = f"{tag}/"
    out = []
    store.set(k + "a", "1")
    out += [store.get(k + "a"), store.add(k + "n", 2), store.add(k + "n", 3),
            store.add(k + "n", 0), store.add(k + "fresh", 0)]
    out += [store.compare_set(k + "c", "", "x"), store.compare_set(k + "c", "", "y"),
            store.compare_set(k + "c", "x", "z"), store.compare_set(k + "none", "q", "r")]
    store.set(k + "e", "")  # an existing empty value matches an empty expectation
    out += [store.compare_set(k + "e", "", "m:3"), store.compare_set(k + "e", "", "m:4")]
    store.append(k + "l", "1,")
    store.append(k + "l", "2,")
    out += [store.get(k + "l"), store.check([k + "a", k + "l"]),
            store.check([k + "a", k + "missing"]), store.multi_get([k + "a", k + "l"])]
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.wait([k + "missing"], timedelta(seconds=0.3))
    out.append(0.25 < time.monotonic() - t0 < 3)
    out += [store.delete_key(k + "a"), store.delete_key(k + "a"), store.check([k + "a"])]
    return out


def test_the_etcd_store_answers_as_a_tcpstore_does(cluster):
    port = free_port()
    tcp = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=5),
                        wait_for_workers=False)
    etcd = EtcdStore(parse_endpoints(cluster.address), 5.0)
    assert script(etcd, "same") == script(tcp, "same")


def test_gloo_meets_through_etcd_and_a_heartbeat_lives_by_its_lease(cluster):
    clients = [EtcdStore(parse_endpoints(cluster.address), 10.0) for _ in range(2)]
    out: list = [None, None]

    def member(r: int) -> None:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", clients[r]), r, 2,
                                   timedelta(seconds=10))
        x = torch.full((3,), float(r + 1))
        pg.allreduce([x]).wait()
        out[r] = x

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(x is not None and x.tolist() == [3.0, 3.0, 3.0] for x in out)
    hb = EtcdStore(parse_endpoints(cluster.address), 5.0, lease_ttl=2)
    hb.set_leased("hb/0", "1")
    for _ in range(4):  # renewed: alive past its TTL
        time.sleep(0.8)
        hb.set_leased("hb/0", "2")
    assert hb.check(["hb/0"])
    wait_for(lambda: not hb.check(["hb/0"]), 10, "the lease to expire")  # stopped: gone


@pytest.mark.timeout(60)
def test_heartbeats_are_read_in_one_transaction_a_vanishing_one_costs_no_wait(cluster):
    """A heartbeat's lease may expire at any moment (its replica died or stalled). Read as a
    check, then a get, one that vanished in between made the get wait its whole request
    deadline and fail: the snapshot's writer or a healer then counted itself cut off. Here
    the key is deleted right after every check, as an expiry would: the read does not check
    at all, and answers at once — through each kind of connection the run makes."""
    from noloco.elastic.deadline import DeadlineStore, Namespace, Prefixed, Renewing
    from noloco.elastic.membership import read

    etcd = EtcdStore(parse_endpoints(cluster.address), 5.0)
    check = etcd.check

    def check_then_expire(keys: list[str]) -> bool:
        got = check(keys)
        for k in keys:
            if k.endswith("hb/1"):
                etcd.delete_key(k)
        return got

    etcd.check = check_then_expire  # type: ignore[method-assign]
    for store in (DeadlineStore(etcd, 5.0, ns=Namespace("vanish")),
                  Prefixed(etcd, "vanish2/"),
                  Renewing(DeadlineStore(etcd, 5.0, ns=Namespace("vanish3")), 5.0)):
        store.set("hb/0", "a")
        store.set("hb/1", "b")
        t0 = time.monotonic()
        assert read(store, ["hb/0", "hb/1"]) == ["a", "b"]  # (a check then a get: 5 s, error)
        assert read(store, ["hb/0", "hb/1", "hb/2"]) == ["a", "b", None]
        assert time.monotonic() - t0 < 2.0
    # a TCPStore has no such operation: the wrappers say so, and read() checks and gets
    tcp = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5),
                        wait_for_workers=False)
    tcp.set("x", "1")
    for store in (DeadlineStore(tcp, 5.0), Prefixed(tcp, ""), Renewing(DeadlineStore(tcp, 5.0),
                                                                       5.0)):
        assert getattr(store, "read_many", None) is None
        assert read(store, ["x", "y"]) == ["1", None]


@pytest.mark.timeout(400)
def test_an_elastic_run_on_etcd_loses_a_member_of_etcd_and_a_replica(tmp_path, corpus):
    """A cluster of its own (a member is killed). The replicas meet only through etcd: no
    noloco coordinator runs. The leading member is killed mid-run — training goes on with no
    event — and replica 2 is killed and started again: it joins from a live one."""
    with Cluster(tmp_path / "etcd") as c:
        out = tmp_path / "run"
        proc = subprocess.Popen(
            [sys.executable, "-m", "noloco", "train", "--data", str(corpus), *SMALL,
             "--replicas", "4", "--sync-every", "10", "--eval-every", "20",
             "--peer-timeout", "5", "--method", "noloco", "--steps", "200", "--elastic",
             "--coordinator", c.address, "--replica-ids", "0-3", "--respawn", "1",
             # Paced (0.1 s a step, sleeping): in CI's three lanes a replica starved of CPU
             # fell 40 s behind the others, which had finished before its respawn could join
             "--inject-fault", "kill:2@100," + ",".join(f"pace:{r}:0.1" for r in range(4)),
             "--out", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        try:
            wait_for(lambda: evaluated(out, 0, 40), 200, "step 40")
            c.kill(c.leader())
            wait_for(lambda: evaluated(out, 0, 60), 200, "step 60")
            r = cli("status", c.address)  # the live view reads etcd too
            assert r.returncode == 0 and r.stdout.count("training") >= 3, r.stdout + r.stderr
            _, err = proc.communicate(timeout=300)
        finally:
            proc.kill()
    assert proc.returncode == 0, err
    no_cpp_dump(err)
    s = summary(out)
    assert s["status"] == "completed" and s["elastic"]["replicas_finished"] == [0, 1, 2, 3], err
    assert [(f["replica"], f["kind"]) for f in s["failures"]] == [(2, "SIGKILL")]
    assert any(j.get("kind") == "joined" and j.get("replica") == 2 for j in s["elastic"]["joins"])
    # The lost etcd member cost nothing: no replica was cut off or missed an operation
    # but for replica 2's death.
    assert s["elastic"]["partitions"] == [] and s["elastic"]["store_restarts"] == []
    assert all(v == 0 for v in s["elastic"]["unreachable_operations"].values())
    for ev in s["elastic"]["events"].values():
        assert all(e.get("missing", [2]) == [2] and e["kind"] != "unreachable" for e in ev), ev
    assert json.loads((out / "store.json").read_text())["address"] == c.address


def _enable_auth(c: Cluster, user: str, password: str) -> None:
    """etcd's own authentication, switched on as an operator would (etcdctl's calls)."""
    import urllib.request

    for path, body in (("role/add", {"name": "root"}),
                       ("user/add", {"name": user, "password": password}),
                       ("user/grant", {"user": user, "role": "root"}), ("enable", {})):
        req = urllib.request.Request(f"http://127.0.0.1:{c.client[0]}/v3/auth/{path}",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200


@pytest.mark.timeout(240)
def test_etcd_authentication_admits_its_users_only(tmp_path, corpus):
    """With etcd's authentication on, a client needs a user (NOLOCO_ETCD_USER,
    NOLOCO_ETCD_PASSWORD): without one, or with a wrong password, it stops in one line; with
    it the store works, an expired token is fetched again, and a run trains."""
    from noloco.elastic.etcd import EtcdAuthError

    with Cluster(tmp_path / "etcd", members=1) as c:
        _enable_auth(c, "root", "pw-of-the-run")
        ends = parse_endpoints(c.address)
        with pytest.raises(EtcdAuthError, match="asks for a user: set NOLOCO_ETCD_USER"):
            EtcdStore(ends, 5.0, credentials=None).set("k", "v")
        with pytest.raises(EtcdAuthError, match="refused user 'root'"):
            EtcdStore(ends, 5.0, credentials=("root", "wrong")).set("k", "v")
        store = EtcdStore(ends, 5.0, credentials=("root", "pw-of-the-run"))
        assert script(store, "auth") == script(dist.HashStore(), "auth")
        store._token = "expired.1"  # as etcd's --auth-token-ttl would leave it
        assert store.add("auth/n", 1) == 6
        store.set_leased("auth/beat", "1")  # leases under the token too
        run = ["train", "--data", str(corpus), *SMALL, "--replicas", "2",
               "--sync-every", "10", "--eval-every", "20", "--method", "noloco", "--steps", "40",
               "--elastic", "--coordinator", c.address]
        env = {k: v for k, v in ENV.items() if not k.startswith("NOLOCO_ETCD")}
        r = cli(*run, "--out", str(tmp_path / "none"), env=env, timeout=60)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "asks for a user" in lines[0], r.stderr
        r = cli(*run, "--out", str(tmp_path / "run"), timeout=180,
                env=dict(env, NOLOCO_ETCD_USER="root", NOLOCO_ETCD_PASSWORD="pw-of-the-run"))
        assert r.returncode == 0, r.stderr
        assert summary(tmp_path / "run")["elastic"]["replicas_finished"] == [0, 1]
