"""Only the run's members reach its store (noloco.elastic.auth): the coordinator's gate admits
a connection once it proved the run secret; everything else is closed before the store sees a
byte. The other multi-machine tests run through the gate too (conftest sets NOLOCO_SECRET)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from run_utils import SMALL, cli, summary

from noloco.elastic import auth
from noloco.elastic.deadline import open_store
from noloco.elastic.host import Host

SECRET = b"a-test-secret-of-enough-length"


@pytest.fixture
def gated():
    host = Host("127.0.0.1", 0, secret=SECRET)
    yield host
    host.stop()


def keys_of(host: Host) -> int:
    return host.server.num_keys()


@pytest.mark.timeout(60)
def test_a_plain_store_client_and_a_raw_socket_can_neither_read_nor_write(gated):
    before = keys_of(gated)
    gated.server.set("secret/key", "kept")
    # torch's own client: its first exchange is not a proof, and the gate closes it.
    with pytest.raises(dist.DistError):
        c = dist.TCPStore("127.0.0.1", gated.port, None, False, timedelta(seconds=2))
        c.set("intruder", "1")
    # A raw socket that speaks the store's protocol (a set of "intruder") without the secret.
    with socket.create_connection(("127.0.0.1", gated.port), 5) as s:
        s.settimeout(5)
        assert s.recv(len(auth.MAGIC)) == auth.MAGIC  # the challenge, and nothing else
        s.recv(auth.NONCE)
        s.sendall(b"\x00" + (8).to_bytes(8, "little") + b"intruder" + (1).to_bytes(8, "little")
                  + b"1" + b"\x00" * 64)
        assert s.recv(100) == b""  # closed
    # ... nor one that sends nothing: closed after the handshake's deadline, store untouched.
    assert not gated.server.check(["intruder"])
    assert keys_of(gated) == before + 1
    assert gated.gate.refused >= 2 and gated.gate.admitted == 0


@pytest.mark.timeout(60)
def test_the_right_secret_reads_and_writes_through_the_door_and_a_wrong_one_is_one_line(gated):
    auth.check("127.0.0.1", gated.port, SECRET, 5.0)
    with pytest.raises(auth.AuthError, match="refused this machine: wrong run secret"):
        auth.check("127.0.0.1", gated.port, b"another-secret-of-enough-length", 5.0)
    door = auth.Door("127.0.0.1", gated.port, SECRET)
    c = dist.TCPStore("127.0.0.1", door.port, None, False, timedelta(seconds=5))
    c.set("member/key", "v")
    assert gated.server.get("member/key") == b"v" and c.get("member/key") == b"v"
    assert c.add("member/n", 2) == 2
    assert gated.gate.admitted == 2  # the check, and the door's connection
    # The door does the handshake for each connection: a second client works alike.
    d = dist.TCPStore("127.0.0.1", door.port, None, False, timedelta(seconds=5))
    assert d.get("member/key") == b"v"


class _Impostor:
    """A server on a free port that greets like a gate but cannot prove the secret (it
    admits any proof and answers with random bytes), or does not greet at all."""

    def __init__(self, greets: bool) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.greets = greets
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.greets:
                conn.sendall(auth.MAGIC + os.urandom(auth.NONCE))
                conn.recv(auth.NONCE + auth.MAC)
                conn.sendall(auth.READY + os.urandom(auth.MAC))
            time.sleep(2)  # silent for longer than the clients' 1 s timeouts
            conn.close()


@pytest.mark.timeout(60)
def test_a_coordinator_that_cannot_prove_the_secret_is_refused(monkeypatch):
    fake = _Impostor(greets=True)
    with pytest.raises(auth.AuthError, match="does not know the run secret"):
        auth.check("127.0.0.1", fake.port, SECRET, 5.0)
    silent = _Impostor(greets=False)
    with pytest.raises(OSError, match="did not ask for the run secret in time"):
        auth.check("127.0.0.1", silent.port, SECRET, 1.0)  # maybe busy: retryable
    # ... but a server that still sends no challenge is no gate: one line, not retried.
    monkeypatch.setattr(auth, "_secret", SECRET)
    monkeypatch.setattr(auth, "_to_coordinator", True)
    with pytest.raises(auth.AuthError, match="did not ask for the run secret .started with"):
        open_store("127.0.0.1", silent.port, 1.0)
    fake.sock.close()
    silent.sock.close()


def test_secrets_come_from_the_environment_or_a_file_and_short_ones_are_refused(
        tmp_path, monkeypatch):
    monkeypatch.delenv(auth.ENV, raising=False)
    f = tmp_path / "s"
    f.write_text("x" * 40 + "\n")
    f.chmod(0o600)
    assert auth.load_secret(str(f)) == b"x" * 40
    assert auth.load_secret(None) is None
    monkeypatch.setenv(auth.ENV, "y" * 20)
    assert auth.load_secret(str(f)) == b"y" * 20  # the environment wins
    monkeypatch.setenv(auth.ENV, "short")
    with pytest.raises(auth.ConfigError, match="shorter than 16 characters"):
        auth.load_secret(None)
    monkeypatch.delenv(auth.ENV)
    with pytest.raises(auth.ConfigError, match="cannot read the secret file"):
        auth.load_secret(str(tmp_path / "missing"))
    made = auth.create_secret(tmp_path / "new" / "coordinator.secret")
    assert len(made) == 64
    assert stat.S_IMODE((tmp_path / "new" / "coordinator.secret").stat().st_mode) == 0o600
    assert auth.create_secret(tmp_path / "new" / "coordinator.secret") == made  # kept


def _coordinator(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "noloco", "coordinator", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow("a coordinator process")
@pytest.mark.timeout(60)
def test_the_coordinator_creates_a_secret_readable_by_its_owner_and_says_where(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != auth.ENV}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME="")
    port = _free_port()
    p = _coordinator(env, "--host", "127.0.0.1", "--port", str(port))
    try:
        first, second = p.stdout.readline(), p.stdout.readline()
        assert "listening on 127.0.0.1" in first and "--secret-file FILE" in first
        path = tmp_path / ".config" / "noloco" / "coordinator.secret"
        assert f"the run secret is in {path} (new, readable by you only)" in second
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        p.terminate()
        p.wait(10)
    r = subprocess.run([sys.executable, "-m", "noloco", "coordinator", "--insecure",
                        "--secret-file", str(path)], env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "--insecure and --secret-file contradict" in r.stderr
    p = _coordinator(env, "--host", "0.0.0.0", "--port", str(port), "--insecure")
    try:
        assert "insecure: no secret" in p.stdout.readline()
    finally:
        p.terminate()
        _, err = p.communicate(timeout=10)
    assert "warning: --insecure on 0.0.0.0: anyone who reaches" in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow("a coordinator and elastic worker processes")
@pytest.mark.timeout(180)
def test_a_run_with_the_secret_trains_and_a_machine_without_it_stops_in_one_line(
        tmp_path, corpus):
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    coord = _coordinator(env, "--host", "127.0.0.1", "--port", str(port))
    try:
        assert "listening on" in coord.stdout.readline()
        run = ["train", "--data", str(corpus), *SMALL, "--replicas", "2", "--method",
               "noloco", "--sync-every", "10", "--steps", "40", "--eval-every", "20",
               "--elastic", "--coordinator", f"127.0.0.1:{port}"]
        r = cli(*run, "--out", str(tmp_path / "member"), timeout=150)
        assert r.returncode == 0, r.stderr
        s = summary(tmp_path / "member")
        assert s["elastic"]["replicas_finished"] == [0, 1] and s["bytes_sent_per_replica"]["0"] > 0
        for name, secret in (("wrong", "w" * 32), ("none", None)):
            e = {k: v for k, v in os.environ.items() if k != auth.ENV}
            if secret is not None:
                e[auth.ENV] = secret
            r = cli(*run, "--out", str(tmp_path / name), timeout=60, env=e)
            assert r.returncode == 2, r.stderr
            lines = [x for x in r.stderr.splitlines() if x.strip()]
            assert len(lines) == 1, r.stderr  # one line, no C++ dump
            assert ("wrong run secret" if secret else "asks for the run secret") in lines[0]
    finally:
        coord.terminate()
        coord.wait(10)


def test_a_door_serves_its_own_user_only(tmp_path):
    """The kernel's socket table names each loopback connection's owner: another user of the
    machine (uid 1234 here) is refused, this process's user (and root) admitted."""
    me = os.getuid()
    table = tmp_path / "tcp"
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
    row = ("   {n}: 0100007F:{a:04X} 0100007F:{b:04X} 01 00000000:00000000 00:00000000 "
           "00000000 {u}\n")
    table.write_text(head + row.format(n=0, a=40000, b=5000, u=1234)
                     + row.format(n=1, a=40001, b=5000, u=me))
    assert not auth.same_user(40000, 5000, str(table))
    assert auth.same_user(40001, 5000, str(table))
    assert not auth.same_user(40002, 5000, str(table))  # no such loopback connection


@pytest.mark.timeout(60)
def test_a_door_refuses_a_connection_of_another_user(gated, monkeypatch):
    door = auth.Door("127.0.0.1", gated.port, SECRET)
    monkeypatch.setattr(auth, "same_user", lambda peer, port: False)
    with pytest.raises(dist.DistError):
        c = dist.TCPStore("127.0.0.1", door.port, None, False, timedelta(seconds=2))
        c.set("intruder", "1")
    assert door.refused >= 1 and not gated.server.check(["intruder"])
