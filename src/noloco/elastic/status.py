"""A live view of elastic runs: ``noloco status`` prints one table, and a dashboard serves the
same as a web page that refreshes itself (``noloco coordinator --dashboard PORT``, ``noloco
train --elastic --dashboard PORT``).

Everything comes from the store the run already keeps — each worker's heartbeat carries its
step, outer steps, last validation loss, blocked seconds and joins — so a view costs the run
nothing but one read of N heartbeats per refresh. A dashboard keeps what it read over time
(the loss of each replica against its step, and each replica's state): its plots start when it
does.

Floor 6 of docs/architecture.md: launching and watching runs, and what reads a run directory.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from noloco.elastic import auth
from noloco.elastic.deadline import Prefixed, open_address, store_errors
from noloco.elastic.host import runs_of
from noloco.elastic.keys import (
    heartbeat_key,
    live_key,
    missed_key,
    run_prefix,
    settings_key,
)
from noloco.elastic.membership import probe, read
from noloco.errors import plural
from noloco.rundir import upgrade_summary
from noloco.stop import StopEvent

STATES = ("training", "joining", "behind", "late", "dead", "finished", "stopped", "absent")
"""a replica's state in the view: training; joining (taking a live state); behind (an
all-reduce went on without it: it heals); late (it missed an arrival, out of snapshots until
back); dead (its heartbeat stopped); finished; stopped (interrupted: Ctrl-C or a stop signal,
it saved and a --resume continues it); absent (never started in this epoch)"""

COLOURS = {"training": "#2e7d32", "joining": "#1565c0", "behind": "#ef6c00", "late": "#f9a825",
           "dead": "#c62828", "finished": "#616161", "stopped": "#8e24aa", "absent": "#e0e0e0"}

STORE_FILE = "store.json"
"""in a run directory: where its store is (written by the launcher), for ``noloco status``"""


def runs_at(store: Any) -> dict[str, int]:
    """Run id → its newest epoch, of every run registered at the store (a client)."""
    out: dict[str, int] = {}
    for run, epoch in runs_of(store):
        out[run] = max(epoch, out.get(run, -1))
    return out


def collect(store: Any, run_id: str, epoch: int) -> dict[str, Any] | None:
    """One run epoch's rows (per replica, and per stage where it has several), or None
    before its first replica registered."""
    view = Prefixed(store, run_prefix(run_id, epoch))
    got = probe(view, settings_key())
    if got is None:
        return None
    st = json.loads(got)
    n, stages = int(st["replicas"]), int(st["stages"])
    keys = [heartbeat_key(r, s) for r in range(n) for s in range(stages)]
    values = read(view, keys + [missed_key(r) for r in range(n)])
    published = probe(view, live_key())
    live = None if published is None else {int(r) for r in json.loads(published)}
    rows = []
    for r in range(n):
        mark = values[n * stages + r] or ""
        for s in range(stages):
            raw = values[r * stages + s]
            beat = json.loads(raw) if raw else None
            rows.append(_row(r, s, beat, mark, live))
    return {"run_id": run_id, "epoch": epoch, "replicas": n, "stages": stages,
            "peer_timeout": st["peer_timeout"], "rows": rows}


def _row(replica: int, stage: int, beat: dict[str, Any] | None, mark: str,
         live: set[int] | None) -> dict[str, Any]:
    if beat is None:
        state = "absent"
    elif beat.get("done"):
        state = "stopped" if beat.get("stopped") else "finished"
    elif live is not None and replica not in live:
        # Not (yet) judged alive: one that never trained is starting, else it died.
        state = "dead" if beat.get("ready") else "joining"
    elif beat.get("joining"):
        state = "joining"
    elif beat.get("behind"):
        state = "behind"
    elif mark.startswith("m:"):
        state = "late"
    else:
        state = "training"
    b = beat or {}
    return {"replica": replica, "stage": stage, "state": state, "step": b.get("step"),
            "outer": b.get("outer"), "val_loss": b.get("val"), "blocked": b.get("blocked"),
            "joins": b.get("joins"), "restarts": b.get("incarnation")}


def table(run: dict[str, Any]) -> str:
    """The text table of one run epoch."""
    staged = run["stages"] > 1
    head = ["replica", *(["stage"] if staged else []), "state", "step", "outer", "val loss",
            "blocked s", "joins", "restarts"]
    lines = [head]
    for row in run["rows"]:
        lines.append([str(row["replica"]), *([str(row["stage"])] if staged else []),
                      row["state"], _fmt(row["step"]), _fmt(row["outer"]),
                      _fmt(row["val_loss"], ".4f"), _fmt(row["blocked"], ".1f"),
                      _fmt(row["joins"]), _fmt(row["restarts"])])
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    text = [f"run {run['run_id']}, epoch {run['epoch']}: {plural(run['replicas'], 'replica')}"
            + (f" x {run['stages']} stages" if staged else "")]
    text += ["  ".join(c.rjust(w) if i != (2 if staged else 1) else c.ljust(w)
                       for i, (c, w) in enumerate(zip(x, widths, strict=True))) for x in lines]
    return "\n".join(text)


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


# ---- the dashboard ---------------------------------------------------------------------------

class History:
    """What a dashboard saw over time, per run: each replica's (step, validation loss) points
    and its state changes (seconds since the dashboard started, state)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.loss: dict[str, dict[int, list[tuple[int, float]]]] = {}
        self.states: dict[str, dict[int, list[tuple[float, str]]]] = {}
        self.runs: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    def add(self, run: dict[str, Any]) -> None:
        now = time.monotonic() - self.t0
        with self.lock:
            name = run["run_id"]
            self.runs[name] = run
            loss, states = self.loss.setdefault(name, {}), self.states.setdefault(name, {})
            for row in run["rows"]:
                if row["stage"] != run["stages"] - 1:  # a replica's loss is its last stage's
                    continue
                r = row["replica"]
                pts = loss.setdefault(r, [])
                if row["val_loss"] is not None and row["step"] is not None and (
                        not pts or pts[-1][1] != row["val_loss"]):
                    pts.append((row["step"], row["val_loss"]))
                seen = states.setdefault(r, [])
                if not seen or seen[-1][1] != row["state"]:
                    seen.append((now, row["state"]))

    def page(self, refresh: float) -> str:
        with self.lock:
            now = time.monotonic() - self.t0
            parts = [f"<h2>run {html.escape(name)} · epoch {run['epoch']}</h2>"
                     + _html_table(run) + _loss_svg(self.loss.get(name, {}))
                     + _timeline_svg(self.states.get(name, {}), now)
                     for name, run in sorted(self.runs.items())]
        body = "".join(parts) or "<p>no run has registered here yet</p>"
        return (f"<!doctype html><html><head><meta charset='utf-8'>"
                f"<meta http-equiv='refresh' content='{refresh:g}'><title>noloco status</title>"
                f"<style>{_CSS}</style></head><body><h1>noloco</h1>{body}"
                f"<p class='note'>refreshes every {refresh:g} s</p></body></html>")


_CSS = ("body{font-family:sans-serif;margin:2em;color:#222}table{border-collapse:collapse}"
        "td,th{padding:.25em .8em;border-bottom:1px solid #ddd;text-align:right}"
        "td.state{text-align:left;font-weight:bold}.note{color:#777}svg{margin:1em 1em 0 0}")


def _html_table(run: dict[str, Any]) -> str:
    staged = run["stages"] > 1
    head = ["replica", *(["stage"] if staged else []), "state", "step", "outer", "val loss",
            "blocked s", "joins", "restarts"]
    rows = []
    for row in run["rows"]:
        cells = [str(row["replica"]), *([str(row["stage"])] if staged else [])]
        state = (f"<td class='state' style='color:{COLOURS[row['state']]}'>"
                 f"{row['state']}</td>")
        rest = [_fmt(row["step"]), _fmt(row["outer"]), _fmt(row["val_loss"], ".4f"),
                _fmt(row["blocked"], ".1f"), _fmt(row["joins"]), _fmt(row["restarts"])]
        rows.append(f"<tr class='replica' data-replica='{row['replica']}' "
                    f"data-state='{row['state']}'>"
                    + "".join(f"<td>{c}</td>" for c in cells) + state
                    + "".join(f"<td>{c}</td>" for c in rest) + "</tr>")
    return ("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
            + "".join(rows) + "</table>")


_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf"]


def _loss_svg(loss: dict[int, list[tuple[int, float]]], w: int = 560, h: int = 300) -> str:
    pts = [p for series in loss.values() for p in series]
    if not pts:
        return "<p class='note'>no validation loss yet</p>"
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1e-6)
    m = 45

    def xy(step: float, val: float) -> str:
        return (f"{m + (step - x0) / (x1 - x0) * (w - 2 * m):.1f},"
                f"{h - m - (val - y0) / (y1 - y0) * (h - 2 * m):.1f}")

    lines = []
    for i, (r, series) in enumerate(sorted(loss.items())):
        colour = _PALETTE[i % len(_PALETTE)]
        path = " ".join(xy(s, v) for s, v in series)
        lines.append(f"<polyline class='loss' data-replica='{r}' fill='none' "
                     f"stroke='{colour}' stroke-width='2' points='{path}'/>"
                     f"<text x='{w - m + 4}' y='{m + 14 * i}' font-size='11' "
                     f"fill='{colour}'>replica {r}</text>")
    axes = (f"<line x1='{m}' y1='{h - m}' x2='{w - m}' y2='{h - m}' stroke='#999'/>"
            f"<line x1='{m}' y1='{m}' x2='{m}' y2='{h - m}' stroke='#999'/>"
            f"<text x='{w / 2}' y='{h - 10}' font-size='12' text-anchor='middle'>step</text>"
            f"<text x='{m}' y='{m - 8}' font-size='12'>validation loss</text>"
            f"<text x='{m - 4}' y='{h - m}' font-size='10' text-anchor='end'>{y0:.2f}</text>"
            f"<text x='{m - 4}' y='{m + 4}' font-size='10' text-anchor='end'>{y1:.2f}</text>"
            f"<text x='{m}' y='{h - m + 14}' font-size='10'>{x0}</text>"
            f"<text x='{w - m}' y='{h - m + 14}' font-size='10' text-anchor='end'>{x1}</text>")
    return (f"<svg id='loss-plot' width='{w + 60}' height='{h}' "
            f"xmlns='http://www.w3.org/2000/svg'>{axes}{''.join(lines)}</svg>")


def _timeline_svg(states: dict[int, list[tuple[float, str]]], now: float, w: int = 560,
                  row: int = 16) -> str:
    if not states:
        return ""
    m, h = 70, 30 + row * len(states)
    span = max(now, 1e-6)
    bars = []
    for i, (r, changes) in enumerate(sorted(states.items())):
        y = 20 + i * row
        bars.append(f"<text x='{m - 6}' y='{y + row - 5}' font-size='11' "
                    f"text-anchor='end'>replica {r}</text>")
        for k, (t, state) in enumerate(changes):
            end = changes[k + 1][0] if k + 1 < len(changes) else now
            x, width = m + t / span * (w - m), max(1.0, (end - t) / span * (w - m))
            bars.append(f"<rect x='{x:.1f}' y='{y}' width='{width:.1f}' height='{row - 3}' "
                        f"fill='{COLOURS[state]}'><title>{state}</title></rect>")
    legend = " ".join(f"<tspan fill='{c}'>■ {s}</tspan>" for s, c in COLOURS.items())
    return (f"<svg id='membership' width='{w + 20}' height='{h + 14}' "
            f"xmlns='http://www.w3.org/2000/svg'><text x='{m}' y='12' font-size='12'>"
            f"membership over the last {now:.0f} s</text>{''.join(bars)}"
            f"<text x='{m}' y='{h + 10}' font-size='10'>{legend}</text></svg>")


class Dashboard:
    """Polls the store every ``every`` seconds and serves the page on ``host:port`` (port 0:
    a free one, then :attr:`port`). ``store``: a client of the store (not namespaced);
    ``run_id``: only that run (a launcher's), else every run registered there."""

    def __init__(self, store: Any, port: int, host: str = "127.0.0.1", every: float = 1.0,
                 run_id: str | None = None) -> None:
        self.store, self.every, self.run_id = store, every, run_id
        self.history = History()
        page = self.history.page

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                if self.path.startswith("/status.json"):
                    with outer.history.lock:
                        body = json.dumps(list(outer.history.runs.values())).encode()
                    kind = "application/json"
                else:
                    body, kind = page(max(1.0, 2 * every)).encode(), "text/html; charset=utf-8"
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        outer = self
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._stop = StopEvent()
        self._threads = [threading.Thread(target=self.server.serve_forever, name="noloco-web",
                                          daemon=True),
                         threading.Thread(target=self._poll, name="noloco-view", daemon=True)]
        for t in self._threads:
            t.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.every):
            try:
                runs = runs_at(self.store)
                for name, epoch in runs.items():
                    if self.run_id is None or name == self.run_id:
                        run = collect(self.store, name, epoch)
                        if run is not None:
                            self.history.add(run)
            except Exception:  # noqa: BLE001 - the store is restarting: next time
                continue

    def stop(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()


# ---- noloco status ---------------------------------------------------------------------------

def add_subparser(sub: Any) -> None:
    p = sub.add_parser("status", help="the replicas of elastic runs: state, step, loss",
                       description="One table per run: each replica's state (training, "
                       "joining, behind, late, dead, finished, stopped), step, outer steps, last "
                       "validation loss, seconds blocked, joins and restarts, and the epoch.")
    p.add_argument("where", metavar="COORDINATOR_OR_RUN_DIR",
                   help="HOST:PORT of a coordinator or etcd://H1:P1,... of an etcd cluster "
                        "(every run there), or a run directory: an elastic run's (its store "
                        "while it runs; its files after), or a static run's (its files: "
                        "state, step, losses)")
    p.add_argument("--run-id", help="only this run (at a coordinator)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--secret-file", metavar="FILE",
                   help="the run secret a coordinator asks for (or NOLOCO_SECRET)")
    p.set_defaults(func=run_status)


def run_status(ns: argparse.Namespace) -> int:
    from noloco.addresses import ETCD_SCHEME, parse_address, parse_endpoints
    from noloco.config import ConfigError

    where, run_id = ns.where, ns.run_id
    path = Path(where)
    if path.is_dir():
        info = path / STORE_FILE
        if not info.is_file() and (path / "config.json").is_file():
            return static_status(path, ns.json)
        if not info.is_file():
            print(f"noloco: error: {where} is no elastic run directory (no {STORE_FILE}) nor "
                  f"a static one (no config.json)", file=sys.stderr)
            return 2
        rec = json.loads(info.read_text())
        address, run_id = rec["address"], rec["run_id"]
        gated = rec.get("gated", False)
    else:
        address, gated = where, not where.startswith(ETCD_SCHEME)
    try:
        if address.startswith(ETCD_SCHEME):
            parse_endpoints(address)
        else:
            parse_address(address)
    except (ConfigError, ValueError):
        print(f"noloco: error: {where} is neither a run directory, HOST:PORT nor "
              f"etcd://HOST:PORT,...", file=sys.stderr)
        return 2
    try:
        if gated:  # a coordinator's gate (a local launcher's own store has none)
            auth.use_secret(auth.load_secret(ns.secret_file))
        store = open_address(address, 5.0)
        runs = runs_at(store)
        found = [collect(store, name, epoch) for name, epoch in sorted(runs.items())
                 if run_id is None or name == run_id]
    except ConfigError as e:  # the secret: missing, wrong, unreadable
        print(f"noloco: error: {e}", file=sys.stderr)
        return 2
    except store_errors() as e:
        if path.is_dir():
            return _from_files(path, ns.json)
        print(f"noloco: error: nothing answers at {address} "
              f"({str(e).splitlines()[0][:120]})", file=sys.stderr)
        return 1
    found = [f for f in found if f is not None]
    if not found:
        print(f"noloco: no {'run ' + run_id if run_id else 'run'} registered at {address}")
        return 1
    if ns.json:
        print(json.dumps(found, indent=1))
    else:
        print("\n\n".join(table(f) for f in found))
    return 0


def _from_files(path: Path, as_json: bool) -> int:
    """A run that is over (its store gone with its launcher): what its files say."""
    summary_path = path / "summary.json"
    if not summary_path.is_file():
        print(f"noloco: error: the run in {path} is not running and left no summary.json",
              file=sys.stderr)
        return 1
    s = upgrade_summary(json.loads(summary_path.read_text()))
    el = s.get("elastic") or {}
    finished = set(el.get("replicas_finished", []))
    failed = {f["replica"] for f in s.get("failures", [])}
    rows = []
    for r in range(int(s.get("replicas", 0))):
        m = path / "metrics" / f"replica-{r}.json"
        rec = json.loads(m.read_text()) if m.is_file() else {}
        rows.append({"replica": r, "stage": 0,
                     "state": "finished" if r in finished else "dead" if r in failed
                     else "absent",
                     "step": rec.get("steps"), "outer": rec.get("outer_steps"),
                     "val_loss": rec.get("final_val_loss"), "blocked": rec.get("sync_seconds"),
                     "joins": len(rec.get("joins", [])) if rec else None,
                     "restarts": rec.get("incarnation")})
    run = {"run_id": el.get("run_id", "?"), "epoch": max(
        [o["epoch"] for o in el.get("store_restarts", [])] or [0]), "replicas": len(rows),
           "stages": 1, "rows": rows}
    print(json.dumps([run], indent=1) if as_json else
          table(run) + f"\n(the run is {s.get('status', 'over')}: from its files)")
    return 0


def static_status(path: Path, as_json: bool) -> int:
    """A static run (no store to ask): what its files say. Rank 0 keeps summary.json's
    last_step current while it trains (at every log, evaluation and checkpoint), and
    metrics.jsonl holds every evaluation, each replica's validation loss included."""
    from noloco.rundir import read_jsonl

    try:
        cfg = json.loads((path / "config.json").read_text())
        s = upgrade_summary(json.loads((path / "summary.json").read_text())) if (
            path / "summary.json").is_file() else {}
        evals = read_jsonl(path / "metrics.jsonl") if (path / "metrics.jsonl").is_file() else []
    except (OSError, ValueError) as e:
        print(f"noloco: error: cannot read the run in {path}: {e}", file=sys.stderr)
        return 1
    m, steps = cfg["method"], cfg["train"]["steps"]
    state = s.get("status", "starting")
    done = state == "completed"
    step = s.get("steps") if done else s.get("last_step")
    last = evals[-1] if evals else {}
    per = (s.get("final_val_loss_per_replica") if done else None) or last.get(
        "val_loss_per_replica") or ([last.get("val_loss")] if m["replicas"] == 1 else [])
    rows = [{"replica": r, "state": state, "step": step,
             "val_loss": (per.get(str(r)) if isinstance(per, dict)  # summary.json's
                          else per[r] if r < len(per) else None),  # metrics.jsonl's
             "val_step": steps if done else last.get("step")} for r in range(m["replicas"])]
    run = {"run": str(path), "method": m["method"], "replicas": m["replicas"],
           "stages": m["stages"], "status": state, "step": step, "steps": steps,
           "train_loss": last.get("train_loss"), "updated_at": s.get("updated_at"),
           "reason": s.get("reason"), "newest_checkpoint": s.get("newest_checkpoint"),
           "rows": rows}
    if as_json:
        print(json.dumps(run, indent=1))
        return 0
    stages = f" x {plural(m['stages'], 'stage')}" if m["stages"] > 1 else ""
    age = (f" (summary.json written {max(time.time() - s['updated_at'], 0):.0f} s ago)"
           if state == "running" and s.get("updated_at") else "")
    text = [f"run {path}: {m['method']}, {plural(m['replicas'], 'replica')}{stages}, "
            f"{state} at step {_fmt(step)} of {steps}{age}"]
    if s.get("reason") and not done:
        text.append(f"  {s['reason']}")
    head = ["replica", "state", "step", "val loss", "at step"]
    lines = [head] + [[str(r["replica"]), r["state"], _fmt(r["step"]),
                       _fmt(r["val_loss"], ".4f"), _fmt(r["val_step"])] for r in rows]
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    text += ["  ".join(c.ljust(w) if i == 1 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(x, widths, strict=True))) for x in lines]
    print("\n".join(text))
    return 0
