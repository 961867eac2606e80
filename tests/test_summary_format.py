"""summary.json: one key set for static and elastic runs (format 2, issue 33), and run
directories of the format before it still read — by `noloco report`, `noloco status` and
`noloco netsim predict` — from committed copies of real format-1 run directories
(tests/data/format1/: a static run of 2 NoLoCo replicas and an elastic one, written by noloco
at 5b3f1f3)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from noloco.cli import main
from noloco.config import Config, MethodConfig
from noloco.metrics import final_report, shared_summary
from noloco.rundir import ELASTIC_KEYS, SUMMARY_FORMAT, RunDir, upgrade_summary

OLD = Path(__file__).parent / "data" / "format1"


@pytest.fixture
def old(tmp_path: Path) -> Path:
    """Copies of the format-1 run directories (a reader must not need to write)."""
    for name in ("static", "elastic"):
        shutil.copytree(OLD / name, tmp_path / name)
    return tmp_path


def test_the_shared_keys_are_keyed_by_replica_and_their_means_are_one_replicas():
    cfg = Config(method=MethodConfig(method="diloco", replicas=3)).resolved()
    s = shared_summary(cfg, {0: {"val_loss": 2.0, "bytes_sent": 10, "sync_seconds": 1.0},
                             2: {"val_loss": 4.0, "bytes_sent": 30, "sync_seconds": 3.0}})
    assert s["format"] == SUMMARY_FORMAT == 2
    assert s["final_val_loss_per_replica"] == {"0": 2.0, "2": 4.0}
    assert s["bytes_sent_per_replica"] == {"0": 10, "2": 30}
    assert s["sync_seconds_per_replica"] == {"0": 1.0, "2": 3.0}
    assert (s["final_val_loss"], s["bytes_sent"], s["sync_seconds"]) == (3.0, 20, 2.0)
    assert s["replicas"] == 3 and s["method"] == "diloco" and s["status"] == "completed"


def test_a_format_1_static_summary_reads_in_format_2(old: Path):
    raw = json.loads((old / "static" / "summary.json").read_text())
    assert "format" not in raw and isinstance(raw["final_val_loss_per_replica"], list)
    s = RunDir(old / "static").read_summary()
    assert s["format"] == 2 and "elastic" not in s
    assert s["final_val_loss_per_replica"] == {
        str(r): v for r, v in enumerate(raw["final_val_loss_per_replica"])}
    assert s["bytes_sent"] == raw["bytes_sent"] > 0  # the mean, as it was
    assert s["bytes_sent_per_replica"] is None  # format 1 kept only the mean
    assert upgrade_summary(s) == s  # format 2 stays as it is


def test_a_format_1_elastic_summary_reads_in_format_2(old: Path):
    raw = json.loads((old / "elastic" / "summary.json").read_text())
    assert raw["elastic"] is True and "replicas_finished" in raw
    s = RunDir(old / "elastic").read_summary()
    el = s["elastic"]
    assert el["replicas_finished"] == raw["replicas_finished"] == [0, 1]
    assert el["joins"] == raw["joins"] and el["events"] == raw["events"]
    assert not set(ELASTIC_KEYS) & set(s)  # the section's keys left the top
    per = raw["bytes_sent_per_replica"]
    assert s["bytes_sent"] == sum(per.values()) / len(per)  # was their sum
    assert s["sync_seconds"] == pytest.approx(
        sum(raw["sync_seconds_per_replica"].values()) / 2)  # was their max
    assert "done: elastic noloco, 2 of 2 replicas finished" in final_report(s, "x")


def test_report_status_and_predict_read_format_1_run_directories(old: Path, capsys):
    assert main(["report", str(old / "static"), str(old / "elastic"),
                 "--out", str(old / "report")]) == 0
    rows = {r.split(" | ")[0].lstrip("| "): r.split(" | ")
            for r in (old / "report" / "report.md").read_text().splitlines()
            if r.startswith("| ") and not r.startswith("| run")}
    for name in ("static", "elastic"):
        s = RunDir(old / name).read_summary()
        assert rows[name][12] == f"{s['bytes_sent'] / 1e6:,.1f}"  # one replica's MB
        assert rows[name][10] == f"{s['final_val_loss']:.4f}"
    capsys.readouterr()
    assert main(["status", str(old / "elastic")]) == 0
    said = capsys.readouterr().out
    assert "finished" in said and "from its files" in said
    assert main(["status", str(old / "static")]) == 0
    assert "completed" in capsys.readouterr().out
    for name in ("static", "elastic"):
        assert main(["netsim", "predict", str(old / name), "--bandwidth", "1Gbit",
                     "--latency", "10ms"]) == 0


def test_format_1_edges_keep_their_numbers():
    """A format-1 static summary that wrote only bytes_sent_per_replica (the mean) keeps it as
    bytes_sent; a failed elastic one (no replica finished) has no mean, not a zero sum."""
    static = upgrade_summary({"status": "completed", "method": "ddp", "replicas": 2,
                              "bytes_sent_per_replica": 12_000_000.0})
    assert static["bytes_sent"] == 12_000_000.0 and static["bytes_sent_per_replica"] is None
    failed = upgrade_summary({"status": "failed", "elastic": True, "replicas_finished": [],
                              "bytes_sent": 0, "bytes_sent_per_replica": {},
                              "sync_seconds_per_replica": {}})
    assert failed["bytes_sent"] is None and failed["elastic"]["replicas_finished"] == []
