"""``python -m noloco`` and the ``noloco`` command: the command line as a process of its own.

Floor 7 of docs/architecture.md: the command line."""

import os
from typing import NoReturn


def run() -> NoReturn:
    # numpy starts its BLAS thread pool as it is imported (with torch); the launcher does no
    # linear algebra of numpy's, and with one thread it stays a single-threaded process, one
    # that may fork its workers' warm parent (noloco.warm). Not passed on to anyone it starts.
    given = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1" if given is None else given
    from noloco import warm
    from noloco.cli import main
    from noloco.exiting import exit_now

    if given is None:
        del os.environ["OPENBLAS_NUM_THREADS"]
    warm.allow_fork()
    exit_now(main())


if __name__ == "__main__":
    run()
