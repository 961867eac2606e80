from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import lanes
import pytest

# Tests run many worker processes on few cores: one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The machine's token cache of this test session: its own, never the user's ~/.cache.
if "NOLOCO_TOKEN_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="noloco-tokens-")
    os.environ["NOLOCO_TOKEN_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# The run secret every `noloco coordinator` of the tests asks for, and every machine proves
# (noloco.elastic.auth): the multi-machine tests run the secure default end to end.
os.environ.setdefault("NOLOCO_SECRET", secrets.token_hex(32))

REPO = Path(__file__).resolve().parents[1]
CORPUS_CHARS = 1_100_000
"""the size of the tests' training text: as large as the runs of the tests were calibrated on"""


def make_corpus(path: Path) -> Path:
    """Write the tests' training text to ``path``: the first CORPUS_CHARS characters of the
    built-in corpus (Python's standard library in `noloco.data`'s order). Every machine that
    runs the tests has it, so a fresh clone tests with the same data as CI; the same text on
    every run of one Python version."""
    from noloco.data import builtin_documents

    parts, size = [], 0
    for _, text in builtin_documents():
        parts.append(text)
        size += len(text)
        if size >= CORPUS_CHARS:
            break
    path.write_text("".join(parts)[:CORPUS_CHARS], encoding="utf-8")
    return path


@pytest.fixture
def store():
    """A client of a TCPStore served in this process (a free port): the store protocol of
    membership, join and re-alignment, without a coordinator process."""
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=20),
                           wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=20))
    yield client
    del client, server


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """One text file of ~1.1 MB for the tests' training runs (see make_corpus)."""
    return make_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


# ---- tiers ----------------------------------------------------------------------------------
# `pytest -m "not slow"` is the fast tier: unit-level tests, in-process, a few minutes in all.
# A test that needs processes, namespaces, faketime, etcd or a browser is marked
# `@pytest.mark.slow("why")` (or a module's `pytestmark`); the reason is required, so the
# marker says what makes the test slow (tests/README.md).

LONGEST = ("test_elastic_machines.py", "test_partition.py", "test_coordinator.py")
"""files of tests that wait minutes (shaped links, cuts, a restarted coordinator)"""

FAST_TEST_SECONDS = 10.0
"""a fast-tier test that takes longer is named at the end of the run: mark it slow or trim it"""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow(why): needs processes, namespaces, faketime, etcd or a browser; "
        "left out of the fast tier (-m 'not slow')")
    config.addinivalue_line(
        "markers", "alone(why): keeps both cores busy by itself; in a parallel run (-n 3) it "
        "runs with no other test beside it (tests/lanes.py)")
    # The controller of a parallel run makes the lanes' lock before it starts them.
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        config._lanes_folder = lanes.make_folder()


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, "_lanes_folder", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


_lane = None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """In a lane of a parallel run: hold the lanes' lock from the test's setup to its teardown,
    exclusive for an ``alone`` test (tests/lanes.py)."""
    global _lane
    if _lane is None:
        _lane = lanes.for_this_lane() or False
    if not _lane:
        yield
        return
    with _lane.hold(alone=item.get_closest_marker("alone") is not None):
        yield


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups it is given
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name, example in (("slow", "4 worker processes"), ("alone", "4 replicas flat out")):
            mark = item.get_closest_marker(name)
            if mark is not None and not (mark.args and isinstance(mark.args[0], str)
                                         and mark.args[0].strip()):
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{name} needs its reason, "
                                        f'as in @pytest.mark.{name}("{example}")')
        # Tests that share a module-scoped fixture (a training run, a cluster) run in one
        # xdist worker (--dist loadgroup), so the fixture is built once, not once per worker.
        info = getattr(item, "_fixtureinfo", None)
        if info is not None and any(
                defs and defs[-1].scope == "module"
                for defs in (info.name2fixturedefs.get(n) for n in info.names_closure)):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # The slow tests first (stable within each tier), the longest waits of all first among
    # them: in three lanes (-n 3) they start at once and the short tests fill the gaps at the
    # end instead of trailing them.
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None,
                                 Path(str(item.fspath)).name not in LONGEST))


_fast_but_long: list[tuple[str, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.duration > FAST_TEST_SECONDS \
            and "slow" not in report.keywords:
        _fast_but_long.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _fast_but_long:
        terminalreporter.section("fast-tier tests over their budget")
        for nodeid, seconds in sorted(_fast_but_long, key=lambda x: -x[1]):
            terminalreporter.line(f"{seconds:6.1f} s  {nodeid}  (mark it slow, or trim it)")
