"""Ending a noloco process without tearing the interpreter down object by object.

A process that has imported torch (and torch's compiler front end, which any optimizer's first
call imports) spends about 0.8 s of CPU in the interpreter's finalisation: every module's
objects freed one by one, then the C++ static destructors. For a worker of a short run that is
a third of its life; for a local run of 4 replicas, seconds of CPU on a 2-core machine.

:func:`exit_now` keeps what a normal exit does that anyone can observe, in the interpreter's
order: non-daemon threads joined (thread pools told to end first), ``atexit`` handlers run,
every file still open for writing flushed, standard streams flushed; then ``os._exit``. What
it leaves out is freeing memory and closing descriptors, which the kernel does at exit anyway.

Used by the entry points of noloco's own processes (``python -m noloco``, a worker, the warm
parent and its forked workers). Never call it from library code: an embedding program owns its
own exit.

Floor 0 of docs/architecture.md: foundations.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import io
import os
import sys
import threading
from typing import NoReturn

_FILE_TYPES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair)
"""what holds written bytes in a buffer (FileIO and the rest write straight through)"""


def exit_now(code: int | None) -> NoReturn:
    """Exit with ``code`` (None: 0) as the interpreter would, minus its teardown.

    An exception on the way (a Ctrl-C while a thread is joined) is reported as ignored and the
    exit goes on with ``code``, as the interpreter's own exit does. Left out with the teardown:
    C++ static destructors and C ``atexit`` handlers (a profiler that writes its report there,
    such as Nsight's, wants a normal exit), and exit status 120 for a standard stream that
    cannot be flushed (a closed pipe)."""
    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None and threading.current_thread() is threading.main_thread():
            shutdown()  # as Py_Finalize does first: executors told to end, threads joined
        atexit._run_exitfuncs()
    except BaseException as e:  # noqa: BLE001 - the exit goes on, as Py_Finalize's does
        with contextlib.suppress(Exception):
            print(f"Exception ignored at exit: {e!r}", file=sys.stderr)
    finally:
        flush_open_files()
        os._exit(code or 0)


def flush_open_files() -> None:
    """Flush every file object still open for writing (a normal exit would flush it when the
    object is freed; ``os._exit`` frees nothing)."""
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    for obj in gc.get_objects():
        # by type() and the concrete classes: isinstance reads obj.__class__, and some objects
        # (torch's deprecated aliases) warn when it is read
        if issubclass(type(obj), _FILE_TYPES):
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
    # C's own stdio buffers (what C++ code printed: NCCL_DEBUG, MKL_VERBOSE), which exit()
    # would flush and _exit() does not
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)
