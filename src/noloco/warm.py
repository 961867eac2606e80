"""Workers forked from a warm parent: a worker starts in milliseconds, not seconds.

A fresh worker process spends about two seconds of CPU before its first step: importing torch
(~1 s), torch's compiler front end (``torch._dynamo``, imported by the first call into any
torch optimizer: ~1 s) and noloco. A local launcher pays that for every worker it starts, and
an elastic launcher again for every replica it respawns — on a small machine, most of a short
run. Instead the launcher starts one *warm parent* (``python -m noloco.warm``) that imports
all of it once and then forks one worker per request.

What makes a forked worker the same as a fresh one:

- the warm parent runs no tensor operation, starts no thread pool and touches no GPU (one
  thread when it forks, checked before every fork): the child starts its own thread pools
  with the thread count it sets, and initialises CUDA itself;
- the child runs with exactly the environment a fresh worker would get (``os.environ`` is
  replaced before any worker code reads it), in a session of its own, under the process name
  ``noloco r<replica>s<stage>`` (what ``ps`` and ``top`` show);
- it ends as a fresh worker ends (:func:`noloco.exiting.exit_now`: its exit code, non-daemon
  threads joined, atexit handlers, files flushed; no teardown of the interpreter), and the
  warm parent, which reaps it, reports its exit status to the launcher, whose handle answers
  like a :class:`subprocess.Popen` (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``);
- nothing outlives the launcher: a child dies with the warm parent and the warm parent with
  the launcher (``PR_SET_PDEATHSIG``); the warm parent exits when the launcher closes it and
  its last child has ended.

The command line (``python -m noloco``, the ``noloco`` command: :func:`allow_fork`) does not
even start the warm parent as a new program: it forks it from itself, a process that has
imported torch and noloco already, so the warm parent only adds what a worker needs beyond the
launcher (torch's compiler front end, the workers' modules). It forks only while it holds
nothing a child could disturb: one thread, no atexit handler but its imports', no open file
but its standard streams, no socket or mapping (:func:`_forkable`); the child closes every
descriptor but its pipes, resets the launcher's signal handlers and takes the environment a
started warm parent gets (what the launcher's imports read of the environment, such as
thread counts, they read as the launcher had it; every worker sets its own). A library
caller (an embedding program, a test process) starts it as a new program.

``NOLOCO_WARM_START=program`` starts the warm parent as a program even from the command line
(``benchmarks/warm_start.py`` compares the two). ``NOLOCO_WARM_START=0`` turns it off (every
worker a fresh ``python -m noloco.worker``), as does a platform without ``fork`` or ``prctl``,
or a warm parent that fails to start or finds a second thread in itself: then the launcher
starts fresh processes, as before.

Floor 5 of docs/architecture.md: a worker process.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, NoReturn

READY_SECONDS = 120.0
"""how long a launcher waits for its warm parent to import everything (else: fresh starts)"""
CLOSE_SECONDS = 10.0


_fork_allowed = False
_exit_handlers = 0
"""how many atexit handlers the imports had registered when the command line allowed forks"""


def enabled() -> bool:
    return (os.environ.get("NOLOCO_WARM_START", "1") != "0" and hasattr(os, "fork")
            and sys.platform.startswith("linux"))


def allow_fork() -> None:
    """This process is noloco's own command line, whose state noloco knows: its launchers may
    fork their warm parent from it instead of starting a new program."""
    global _fork_allowed, _exit_handlers
    _fork_allowed = True
    _exit_handlers = atexit._ncallbacks()


# ---- the launcher's side --------------------------------------------------------------------
class WarmProcess:
    """A worker forked by the warm parent: the part of :class:`subprocess.Popen` a launcher
    uses. Its exit status comes from the warm parent (it is not this process's child)."""

    def __init__(self, parent: WarmParent, pid: int, args: list[str]) -> None:
        self._parent, self.pid, self.args = parent, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._parent.cond:
            while self.returncode is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                self._parent.cond.wait(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # never a pid that may have been reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmParent:
    """The launcher's end of one warm parent: :meth:`start` forks a worker."""

    def __init__(self, env: dict[str, str]) -> None:
        req_r, self._req = os.pipe()
        self._resp, resp_w = os.pipe()
        env = dict(env, OPENBLAS_NUM_THREADS="1")
        try:
            # Its own session: a Ctrl-C at the terminal reaches the launcher, which stops the
            # workers in order; the warm parent ends after them.
            forked = _fork_warm_parent(env, req_r, resp_w) if _forkable() else None
            self.proc: _Forked | subprocess.Popen = forked or subprocess.Popen(
                [sys.executable, "-m", "noloco.warm", str(req_r), str(resp_w), str(os.getpid())],
                env=env, pass_fds=(req_r, resp_w), start_new_session=True)
        finally:
            os.close(req_r)
            os.close(resp_w)
        self.how = "forked" if forked is not None else "started"
        """forked from this process, or started as a new program"""
        self.cond = threading.Condition()
        self._procs: dict[int, WarmProcess] = {}
        self._answers: dict[int, dict[str, Any]] = {}
        self._ready: bool | None = None
        self._closed = False
        self._n = 0
        self._reader = threading.Thread(target=self._read, name="noloco-warm", daemon=True)
        self._reader.start()

    def ready(self, timeout: float = READY_SECONDS) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: self._ready is not None, timeout)
            return bool(self._ready)

    def start(self, args: list[str], env: dict[str, str]) -> WarmProcess | None:
        """Fork ``python -m noloco.worker ARGS`` with ``env``; None if the warm parent cannot
        (the caller starts a fresh process)."""
        if not self.ready():
            return None
        with self.cond:
            self._n += 1
            n = self._n
        try:
            _send(self._req, {"id": n, "args": args, "env": env})
        except OSError:
            return None
        with self.cond:
            self.cond.wait_for(lambda: n in self._answers or not self._ready, READY_SECONDS)
            answer = self._answers.pop(n, None)
            if answer is None or "pid" not in answer:
                self._ready = False  # a second thread, a failed fork: fresh starts from now
                return None
            p = WarmProcess(self, answer["pid"], args)
            # its exit may have been reported before this answer was read
            p.returncode = self._answers.pop(-answer["pid"], {}).get("code")
            self._procs[p.pid] = p
            return p

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._resp, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            with self.cond:
                for raw in lines:
                    msg = json.loads(raw)
                    if "ready" in msg:
                        self._ready = bool(msg["ready"])
                    elif "id" in msg:
                        self._answers[msg["id"]] = msg
                    elif msg["pid"] in self._procs:
                        self._procs.pop(msg["pid"]).returncode = msg["code"]
                    else:
                        self._answers[-msg["pid"]] = msg
                self.cond.notify_all()
        # The warm parent is gone: its children were killed with it (PR_SET_PDEATHSIG).
        with self.cond:
            self._ready = False
            for p in self._procs.values():
                if p.returncode is None:
                    p.returncode = -signal.SIGKILL
            self._procs.clear()
            self.cond.notify_all()
        with contextlib.suppress(OSError):
            os.close(self._resp)

    def close(self) -> None:
        """No more workers: the warm parent exits once its children have (the launcher stops
        its workers first)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.close(self._req)
        if not self._n:  # never used (the run failed before its workers): no need to wait
            self.proc.kill()
        try:
            self.proc.wait(timeout=CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=CLOSE_SECONDS)


class _Forked:
    """A warm parent forked from this process: the part of :class:`subprocess.Popen` that
    :class:`WarmParent` uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): as Popen does
                self.returncode = 0
                return 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["noloco.warm"], timeout or 0.0)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        if self.returncode is None:  # never a pid that may have been reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


_HOLDERS = (io.FileIO, socket.socket, mmap.mmap)
"""what holds a descriptor that a forked child would close while the object lives on"""


def _forkable() -> bool:
    """Whether this process may fork the warm parent: it is noloco's command line
    (:func:`allow_fork`), runs one thread (a fork copies another thread's locks, not the
    thread), has registered no atexit handler of its own since its imports (the child keeps
    the imports' handlers, as a started warm parent has them, and would run the others
    too), and holds no file but its standard streams and no socket or mapping (the child
    closes their descriptors; the objects, copied, would later flush or close into whatever
    took their numbers)."""
    if not _fork_allowed or os.environ.get("NOLOCO_WARM_START") == "program" \
            or _threads() != 1 or atexit._ncallbacks() != _exit_handlers:
        return False
    for obj in gc.get_objects():  # by type(), as exiting.flush_open_files does
        if issubclass(type(obj), _HOLDERS):
            if isinstance(obj, io.FileIO) and (obj.closed or obj.fileno() in (0, 1, 2)):
                continue
            if isinstance(obj, socket.socket) and obj.fileno() == -1:
                continue
            if isinstance(obj, mmap.mmap) and obj.closed:
                continue
            return False
    return True


def _fork_warm_parent(env: dict[str, str], req: int, resp: int) -> _Forked | None:
    """Fork this process into a warm parent (see the module's text); None if fork fails."""
    from noloco.exiting import flush_open_files

    flush_open_files()  # Python's and C's buffers: else the child would write them again
    launcher = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        return None
    if pid:
        return _Forked(pid)
    # The child. It never returns into the launcher's frames: it ends in exit_now.
    code = 1
    try:
        os.setsid()
        for s in signal.valid_signals():
            with contextlib.suppress(OSError, ValueError):
                h = signal.getsignal(s)
                if callable(h) and h is not signal.default_int_handler:
                    signal.signal(s, signal.SIG_DFL)
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        keep = {0, 1, 2, req, resp}
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in keep:
                with contextlib.suppress(OSError):
                    os.close(int(name))
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [__file__, str(req), str(resp), str(launcher)]
        code = serve(req, resp, launcher)
    except SystemExit as e:  # as the interpreter ends a started one on it
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - the launcher sees it as a warm parent that failed
        with contextlib.suppress(Exception):
            traceback.print_exc()
    from noloco.exiting import exit_now

    exit_now(code)


class Starter:
    """How a launcher starts its workers: forked from a warm parent where it can (started
    ahead by :meth:`prestart`, else with the first worker's environment), else as fresh
    processes."""

    def __init__(self) -> None:
        self.parent: WarmParent | None = None
        self._warm = enabled()
        self.how = "off"
        """the workers' start: "forked" (a warm parent forked from the launcher), "started" (a
        warm parent started as a program), "off" (fresh processes)"""

    def prestart(self, env: dict[str, str]) -> None:
        """Start the warm parent now, with ``env`` (what it reads as it imports: the thread
        counts), so that it imports while the launcher prepares the run."""
        if self._warm and self.parent is None:
            try:
                self.parent = WarmParent(env)
                self.how = self.parent.how
            except OSError:
                self._warm = False

    def start(self, args: list[str], env: dict[str, str]) -> Any:
        """``python -m noloco.worker ARGS`` in its own session: a :class:`WarmProcess` or a
        :class:`subprocess.Popen`."""
        self.prestart(env)
        if self._warm and self.parent is not None:
            p = self.parent.start(args, env)
            if p is not None:
                return p
            self._warm, self.how = False, "off"
        return subprocess.Popen([sys.executable, "-m", "noloco.worker", *args], env=env,
                                start_new_session=True)

    def close(self) -> None:
        if self.parent is not None:
            self.parent.close()
            self.parent = None


# ---- the warm parent ------------------------------------------------------------------------
def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _send(fd: int, msg: dict[str, Any]) -> None:
    data = memoryview(json.dumps(msg).encode() + b"\n")
    while data:
        data = data[os.write(fd, data):]


def serve(req: int, resp: int, launcher: int) -> int:
    """The warm parent's loop; in a forked child, what the worker returns (its exit code).

    Invariant: nothing on the path from a fork to this function's return in the child holds a
    lock, a thread or a ``finally`` of the parent's: the child unwinds straight into the
    interpreter's normal exit."""
    from noloco.worker import die_with

    die_with(launcher)
    try:
        import torch  # noqa: F401 - imported once, here, for every worker
        import torch._dynamo  # noqa: F401 - what an optimizer's first call imports

        import noloco.elastic.worker  # noqa: F401
        import noloco.worker  # noqa: F401
    except BaseException as e:  # noqa: BLE001 - the launcher starts fresh workers instead
        _send(resp, {"ready": False, "why": repr(e)[:200]})
        return 0
    _send(resp, {"ready": True})
    buf, open_ = b"", True
    children = 0
    while open_ or children:
        ready, _, _ = select.select([req] if open_ else [], [], [], 0.05)
        if ready:
            chunk = os.read(req, 1 << 20)
            if not chunk:  # the launcher closed us: end once the children have
                open_ = False
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                msg = json.loads(raw)
                if _threads() != 1:  # a fork would copy a thread's locks, not the thread
                    _send(resp, {"id": msg["id"], "error": "a second thread"})
                    continue
                me = os.getpid()
                pid = os.fork()
                if pid == 0:
                    return _child(msg, me, (req, resp))
                children += 1
                _send(resp, {"id": msg["id"], "pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children = 0
                break
            if pid == 0:
                break
            children -= 1
            _send(resp, {"pid": pid, "code": os.waitstatus_to_exitcode(status)})
    return 0


def _child(msg: dict[str, Any], parent: int, fds: tuple[int, int]) -> NoReturn:
    os.setsid()
    for fd in fds:
        os.close(fd)
    os.environ.clear()
    os.environ.update(msg["env"])
    from noloco.exiting import exit_now
    from noloco.worker import die_with, entry

    die_with(parent)
    sys.argv = ["noloco.worker", *msg["args"]]

    exit_now(entry(msg["args"]))


if __name__ == "__main__":
    from noloco.exiting import exit_now

    exit_now(serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
