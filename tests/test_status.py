"""A live view of elastic runs: `noloco status`, and the dashboard in a real browser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from run_utils import SMALL, cli, summary, wait_for
from test_coordinator import ENV, coordinator, evaluated, free_port

pytestmark = pytest.mark.slow("elastic worker processes and a browser (chromium)")

RUN = [*SMALL, "--replicas", "4", "--sync-every", "10", "--eval-every", "20",
       "--peer-timeout", "3"]


def browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(url: str, *args: str) -> subprocess.CompletedProcess:
    exe = browser()
    assert exe is not None
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", *args, url], capture_output=True, text=True,
                          timeout=90)


def png_colours(path: Path) -> int | None:
    """How many distinct colours the screenshot has (a blank page has one or two); None
    without Pillow to read it."""
    try:
        from PIL import Image
    except ImportError:
        return None
    with Image.open(path) as im:
        return len(im.convert("RGB").getcolors(maxcolors=1 << 20) or [])


@pytest.mark.timeout(300)
def test_status_and_dashboard_of_a_live_run(tmp_path, corpus):
    port, web = free_port(), free_port()
    coord = coordinator(port, "--dashboard", str(web))
    out = tmp_path / "run"
    # A replica is killed (and not respawned): the view must say it is dead.
    proc = subprocess.Popen(
        [sys.executable, "-m", "noloco", "train", "--data", str(corpus), *RUN,
         "--method", "noloco", "--steps", "3000", "--elastic", "--coordinator",
         f"127.0.0.1:{port}", "--run-id", "view", "--out", str(out),
         "--inject-fault", "kill:3@30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=ENV)
    try:
        wait_for(lambda: all(evaluated(out, r, 60) for r in range(3)), 150, "step 60")
        wait_for(lambda: "dead" in cli("status", f"127.0.0.1:{port}").stdout, 30,
                 "replica 3 seen dead")
        # The table, from the coordinator and from the run directory alike.
        for where in (f"127.0.0.1:{port}", str(out)):
            r = cli("status", where)
            assert r.returncode == 0, r.stderr
            lines = r.stdout.splitlines()
            assert lines[0].startswith("run view, epoch 0: 4 replicas"), r.stdout
            rows = {int(x.split()[0]): x.split() for x in lines[2:]}
            assert sorted(rows) == [0, 1, 2, 3]
            assert [rows[i][1] for i in range(3)] == ["training"] * 3 and rows[3][1] == "dead"
            assert all(int(rows[i][2]) >= 60 and float(rows[i][4]) < 6 for i in range(3))
        js = json.loads(cli("status", f"127.0.0.1:{port}", "--json").stdout)
        assert [row["state"] for row in js[0]["rows"]] == ["training"] * 3 + ["dead"]
        # The page: a row per replica and a loss plot, as a browser renders it.
        url = f"http://127.0.0.1:{web}/"
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "<meta http-equiv='refresh'" in page
        if browser() is None:
            pytest.skip("no chromium here (Debian's `chromium` package): the page was fetched "
                        "but not rendered")
        dom = chromium(url, "--dump-dom")
        assert dom.returncode == 0, dom.stderr[-2000:]
        rows = re.findall(r"<tr class=\"replica\" data-replica=\"(\d+)\" "
                          r"data-state=\"(\w+)\"", dom.stdout)
        assert sorted(int(r) for r, _ in rows) == [0, 1, 2, 3], dom.stdout[:3000]
        assert 'id="loss-plot"' in dom.stdout and dom.stdout.count('class="loss"') >= 3
        assert 'id="membership"' in dom.stdout
        shot = tmp_path / "dashboard.png"
        r = chromium(url, f"--screenshot={shot}", "--window-size=1100,900")
        # Text, coloured states and lines: no blank page (one compresses to a few kB).
        assert shot.is_file() and shot.stat().st_size > 20_000, r.stderr[-2000:]
        assert png_colours(shot) in (None, *range(21, 1 << 20))
    finally:
        proc.kill()
        coord.kill()
    # After the run (its store gone): from its files.
    proc.wait()


def test_status_says_what_is_wrong_in_one_line(tmp_path, capsys):
    from noloco.cli import main

    def status(where: str) -> tuple[int, str]:  # in this process
        code = main(["status", where])
        return code, capsys.readouterr().err

    code, err = status(str(tmp_path))
    assert code == 2 and "no elastic run directory" in err
    assert len(err.strip().splitlines()) == 1
    code, err = status("nowhere")
    assert code == 2 and "neither a run directory, HOST:PORT" in err
    code, err = status(f"127.0.0.1:{free_port()}")
    assert code == 1 and "nothing answers" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.timeout(200)
def test_a_local_run_serves_its_dashboard_and_status_reads_its_files_after(tmp_path,
                                                                           corpus):
    out, web = tmp_path / "run", free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "noloco", "train", "--data", str(corpus), *RUN,
         "--method", "diloco", "--steps", "200", "--elastic", "--dashboard", str(web),
         "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=ENV)
    try:
        wait_for(lambda: evaluated(out, 0, 40), 150, "step 40")

        def view() -> list[dict]:
            return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{web}/status.json",
                                                     timeout=5).read())

        wait_for(lambda: view() != [], 30, "a view")
        runs = view()
        assert len(runs) == 1 and len(runs[0]["rows"]) == 4
        # Every replica in it, training (or done). Waited for: under CI's load one replica's
        # process was seen still starting ("absent": no heartbeat yet) when replica 0 had
        # reached step 40 (the first snapshot waits half the peer timeout for late starters,
        # then goes on without them).
        wait_for(lambda: {row["state"] for row in view()[0]["rows"]}
                 <= {"training", "finished"}, 60, "every replica training in the view")
        _, err = proc.communicate(timeout=150)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert f"http://127.0.0.1:{web}/" in err
    r = cli("status", str(out))
    assert r.returncode == 0, r.stderr
    assert "from its files" in r.stdout and r.stdout.count("finished") == 4
    assert summary(out)["status"] == "completed"
