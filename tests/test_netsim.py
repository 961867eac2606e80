"""Tests of the network model (``noloco netsim``) against SPEC §3-§5 and hand-computed numbers.

Monte Carlo parts use fixed seeds and modest sample sizes, so every number here is
deterministic; tolerances cover the sampling error of those sizes.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from noloco.netsim import (
    PAPER_GRID_GBPS,
    PAPER_MODELS,
    ModelSpec,
    NetsimError,
    Scheme,
    cv_to_sigma,
    expected_max_of_two,
    latency_point,
    load_run,
    paper_table,
    parse_bandwidth,
    parse_latency,
    predict_run,
    predict_sync_seconds,
    sigma_to_cv,
    simulate_blocking,
    simulate_utilisation,
)
from noloco.netsim.cli import add_subparsers, main
from noloco.netsim.latency import pair_exchange_samples, pair_exchange_time

# ---------------------------------------------------------------------------------------------
# latency (NoLoCo Fig. 5A)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [4, 16, 64, 256, 1024])
def test_constant_message_times_give_log2_n(n: int) -> None:
    p = latency_point(n, 0.0, samples=4)
    assert p.tree_over_pair == pytest.approx(math.log2(n), abs=1e-12)
    assert p.ring_over_pair == pytest.approx(n - 1, abs=1e-12)


def test_ratio_is_ten_at_1024_workers() -> None:
    assert latency_point(1024, 0.0, samples=2).tree_over_pair == pytest.approx(10.0)


def test_tree_pads_to_a_power_of_two() -> None:
    # 3 leaves: a 2-level tree, one parent has a single child.
    assert latency_point(3, 0.0, samples=2).tree_over_pair == pytest.approx(2.0)


@pytest.mark.parametrize("cv", [0.5, 1.0, 1.5, 2.0, 2.5])
def test_closed_form_max_of_two_matches_monte_carlo(cv: float) -> None:
    mc = pair_exchange_samples(cv, samples=400_000, seed=1).mean()
    assert mc == pytest.approx(pair_exchange_time(cv), rel=0.01)


def test_closed_form_with_nonzero_mu() -> None:
    rng = np.random.default_rng(3)
    mu, sigma = 1.0, 0.7
    t = rng.lognormal(mu, sigma, size=(400_000, 2)).max(axis=1).mean()
    assert t == pytest.approx(expected_max_of_two(mu, sigma), rel=0.01)


def test_cv_sigma_round_trip() -> None:
    for cv in (0.0, 0.3, 1.0, 2.5):
        assert sigma_to_cv(cv_to_sigma(cv)) == pytest.approx(cv)


# SPEC §5: a binary-tree Monte Carlo gives these tree/pair ratios at n = 1024.
FIG5A_1024 = {0.5: 12.4, 1.0: 17.0, 1.5: 23.6, 2.0: 31.1, 2.5: 38.8}


@pytest.mark.parametrize("cv", sorted(FIG5A_1024))
def test_fig5a_ratios_at_1024_workers(cv: float) -> None:
    p = latency_point(1024, cv, samples=1000, seed=0)
    assert p.tree_over_pair == pytest.approx(FIG5A_1024[cv], rel=0.05)


def test_ratio_grows_with_spread_and_workers() -> None:
    a = latency_point(64, 1.0, samples=500).tree_over_pair
    b = latency_point(64, 2.0, samples=500).tree_over_pair
    c = latency_point(256, 2.0, samples=500).tree_over_pair
    assert a < b < c


@pytest.mark.parametrize(
    "bad", [dict(workers=-4, cv=0.5), dict(workers=1, cv=0.5), dict(workers=16, cv=-0.1)]
)
def test_latency_rejects_bad_input(bad: dict) -> None:
    with pytest.raises(NetsimError):
        latency_point(bad["workers"], bad["cv"], samples=4)


# ---------------------------------------------------------------------------------------------
# blocking (NoLoCo Fig. 5B)
# ---------------------------------------------------------------------------------------------


def test_fig5b_diloco_takes_about_twenty_percent_longer() -> None:
    r = simulate_blocking(1024, 100, 250, mu=1.0, sigma2=0.5, seed=0)
    assert r.ratio == pytest.approx(1.195, rel=0.02)
    assert r.diloco_seconds > r.noloco_seconds > r.compute_seconds * 0.99


# SPEC §5: T_DiLoCo / T_NoLoCo at n = 1024 for H = 1 / 5 / 10 / 20 / 50.
FIG5B_SWEEP = {1: 3.24, 5: 2.11, 10: 1.75, 20: 1.49, 50: 1.28}


@pytest.mark.parametrize("h", sorted(FIG5B_SWEEP))
def test_fig5b_sweep_over_h(h: int) -> None:
    r = simulate_blocking(1024, h, 250, seed=0)
    # H = 1 is the noisiest point (we get 3.30-3.38 over seeds); 5% covers it.
    assert r.ratio == pytest.approx(FIG5B_SWEEP[h], rel=0.05 if h == 1 else 0.03)


def test_no_spread_means_no_waiting() -> None:
    r = simulate_blocking(64, 10, 20, sigma2=0.0)
    assert r.ratio == pytest.approx(1.0)
    assert r.noloco_seconds == pytest.approx(20 * 10 * math.e)


def test_one_group_of_everyone_is_a_global_barrier() -> None:
    r = simulate_blocking(16, 5, 30, group_size=16, seed=2)
    assert r.noloco_seconds == pytest.approx(r.diloco_seconds)


@pytest.mark.parametrize(
    "kw",
    [
        dict(workers=-2),
        dict(sync_every=0),
        dict(outer_steps=0),
        dict(sigma2=-1.0),
        dict(workers=10, group_size=4),
    ],
)
def test_blocking_rejects_bad_input(kw: dict) -> None:
    args = dict(workers=8, sync_every=2, outer_steps=3) | kw
    with pytest.raises(NetsimError):
        simulate_blocking(
            args.pop("workers"), args.pop("sync_every"), args.pop("outer_steps"), **args
        )


# ---------------------------------------------------------------------------------------------
# utilisation (Streaming DiLoCo Table 4)
# ---------------------------------------------------------------------------------------------

# Cells where the paper prints a truncated grid value (0.9 for 0.954, 1.1 for 1.151) and ours
# is one grid step higher, so ours / printed exceeds 1.25 (by at most 1.28). docs/netsim.md.
MISSES_25 = {
    ("1B", "+ overlap + FP4", 0.8),
    ("10B", "+ overlap + FP4", 0.8),
    ("100B", "+ overlap + FP4", 0.8),
    ("100B", "+ overlap + FP4", 0.9),
    ("100B", "+ overlap + FP4", 0.95),
}


@pytest.fixture(scope="module")
def table() -> list:
    return [c for c in paper_table() if c.paper_gbps is not None]


def test_table4_every_cell_within_one_grid_step(table: list) -> None:
    assert len(table) == 50
    assert all(c.grid_steps in (0, 1) for c in table), [
        (c.model, c.scheme, c.target, c.ours_gbps, c.paper_gbps)
        for c in table
        if c.grid_steps not in (0, 1)
    ]


def test_table4_within_25_percent_except_the_documented_cells(table: list) -> None:
    misses = {(c.model, c.scheme, c.target) for c in table if abs(c.ratio - 1) > 0.25}
    assert misses == MISSES_25
    assert max(c.ratio for c in table) < 1.29


def test_table4_values_are_on_the_paper_grid(table: list) -> None:
    for c in table:
        assert np.isclose(PAPER_GRID_GBPS, c.ours_gbps).any()


def test_payload_scale_analysis_documented_in_docs() -> None:
    # docs/netsim.md: scaling every payload by 0.84 puts 45 of 50 cells on the paper's value.
    cells = [c for c in paper_table(payload_scale=0.84) if c.paper_gbps is not None]
    assert sum(c.grid_steps == 0 for c in cells) >= 45


def test_data_parallel_link_bound_matches_hand_computation() -> None:
    # Far below the needed bandwidth the link is busy all the time: a step is the forward pass
    # (L nodes), B_L and W_L (2 nodes) until the first gradient leaves, then all C seconds of
    # reduction, and the next forward needs layer 1's gradient, which is sent last.
    m = ModelSpec(name="m", params=1e9, layers=24, step_seconds=0.1)
    bw = 0.5  # Gbit/s
    curve = simulate_utilisation(m, Scheme(name="dp"), [bw])
    node = 0.1 / (3 * 24 - 1)
    comm = 1e9 * 16 / (bw * 1e9)  # 2(M-1)/M = 1 for M = 2
    assert curve.utilisation[0] == pytest.approx(0.1 / (26 * node + comm), rel=1e-9)


def test_diloco_blocking_reduction_hand_computation() -> None:
    # DiLoCo at low bandwidth: one whole-model reduction every H steps, overlapping only the
    # backward pass after W_L of the last inner step.
    m = PAPER_MODELS["1B"]
    curve = simulate_utilisation(m, Scheme(name="d", sync_every=100), [1.389])
    node = 0.1 / 71
    comm = 16e9 / 1.389e9
    expected = 100 * 0.1 / (100 * 0.1 + comm - (71 - 26) * node)
    assert curve.utilisation[0] == pytest.approx(expected, rel=1e-9)
    assert curve.utilisation[0] < 0.5  # the paper's 50% cell is out of reach (docs/netsim.md)


def test_utilisation_rises_with_bandwidth_and_reaches_one() -> None:
    m = PAPER_MODELS["10B"]
    for scheme in (
        Scheme(name="dp"),
        Scheme(name="s", sync_every=100, fragment_layers=3, overlap_steps=1, bits=4),
    ):
        u = simulate_utilisation(m, scheme, np.logspace(-1, 5, 40)).utilisation
        assert np.all(np.diff(u) >= -1e-9)
        assert u[-1] > 0.999 and u[0] < 0.5


def test_one_fragment_without_overlap_is_diloco() -> None:
    m = PAPER_MODELS["1B"]
    a = simulate_utilisation(m, Scheme(name="a", sync_every=100)).utilisation
    b = simulate_utilisation(m, Scheme(name="b", sync_every=100, fragment_layers=24)).utilisation
    assert np.allclose(a, b)


def test_one_datacenter_needs_no_bandwidth() -> None:
    u = simulate_utilisation(PAPER_MODELS["1B"], Scheme(name="dp"), datacenters=1)
    assert np.all(u.utilisation == 1.0)


def test_utilisation_rejects_bad_models() -> None:
    with pytest.raises(NetsimError):
        ModelSpec(name="x", params=-1, layers=4, step_seconds=1)
    with pytest.raises(NetsimError):
        Scheme(name="x", sync_every=0)


# ---------------------------------------------------------------------------------------------
# predict
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, bps",
    [
        ("100Mbit", 1e8),
        ("1Gbit", 1e9),
        ("10Gbit", 1e10),
        ("10Gbit/s", 1e10),
        ("1Gbps", 1e9),
        ("125MB/s", 1e9),
        ("1e9", 1e9),
        ("2500000", 2.5e6),
        ("100M", 1e8),
        (1e9, 1e9),
    ],
)
def test_parse_bandwidth(text: str, bps: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["fast", "", "0", "-1Gbit", "1Qbit", "1 Gbit per s"])
def test_parse_bandwidth_rejects(text: str) -> None:
    with pytest.raises(NetsimError):
        parse_bandwidth(text)


@pytest.mark.parametrize(
    "text, s", [("50ms", 0.05), ("0.05", 0.05), ("200us", 2e-4), ("1s", 1.0), ("0", 0.0)]
)
def test_parse_latency(text: str, s: float) -> None:
    assert parse_latency(text) == pytest.approx(s)


def test_predict_sync_seconds_by_hand() -> None:
    # ring: 2 (n-1)/n * S * 8 / B + 2 (n-1) * latency; pair: S * 8 / B + latency
    assert predict_sync_seconds("ddp", 4, 1e6, 1e8, 0.01) == pytest.approx(0.12 + 0.06)
    assert predict_sync_seconds("diloco", 4, 1e6, 1e8, 0.0) == pytest.approx(0.12)
    assert predict_sync_seconds("noloco", 4, 1e6, 1e8, 0.01) == pytest.approx(0.08 + 0.01)
    assert predict_sync_seconds("noloco", 4, 1e6, 1e8, 0.01, pair_latency_terms=2) == pytest.approx(
        0.08 + 0.02
    )
    assert predict_sync_seconds("noloco", 8, 1e6, 1e8, 0.0, group_size=4) == pytest.approx(0.24)
    assert predict_sync_seconds("ddp", 1, 1e6, 1e8, 0.01) == 0.0
    with pytest.raises(NetsimError):
        predict_sync_seconds("gossip", 4, 1e6, 1e8, 0.0)


def _fake_run(tmp_path, **over) -> str:
    summary = {
        "method": "streaming",
        "replicas": 4,
        "stages": 1,
        "steps": 200,
        "params": 1_000_000,
        "param_bytes": 4_000_000,
        "bytes_sent_per_replica": 12_000_000.0,
        "sync_seconds": 2.0,
        "wall_seconds": 25.0,
        "compute_seconds": 20.0,
        "step_seconds": 0.1,
        "outer_steps": 4,
        "sync_every": 50,
        "group_size": None,
    } | over
    config = {
        "method": {
            "method": summary["method"],
            "fragments": 2,
            "overlap_steps": 1,
            "quantize": "none",
            "group_size": 2,
        }
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_predict_fabricated_run_by_hand(tmp_path) -> None:
    pred = predict_run(_fake_run(tmp_path), "100Mbit", "10ms")
    got = {m.method: m for m in pred.methods}
    # S = 4e6 bytes, N = 4, B = 1e8 bit/s, latency 0.01 s, 200 steps of 0.1 s, H = 50.
    ring = 1.5 * 4e6 * 8 / 1e8 + 6 * 0.01  # 0.54 s per full all-reduce
    assert got["ddp"].seconds_per_sync == pytest.approx(ring)
    assert got["ddp"].wall_seconds == pytest.approx(20 + 200 * ring)  # 128 s
    assert got["ddp"].compute_utilisation == pytest.approx(20 / 128)
    assert got["diloco"].sync_events == 4
    assert got["diloco"].wall_seconds == pytest.approx(20 + 4 * ring)  # 22.16 s
    pair = 4e6 * 8 / 1e8 + 0.01  # 0.33 s
    assert got["noloco"].wall_seconds == pytest.approx(20 + 4 * pair)  # 21.32 s
    assert got["noloco"].bytes_sent_per_replica == pytest.approx(4 * 4e6)
    # Streaming: P = 2 fragments of 2e6 bytes, tau = 1 step hides 0.1 s of each 0.30 s sync.
    frag = 1.5 * 2e6 * 8 / 1e8 + 6 * 0.01
    assert got["streaming"].sync_events == 8
    assert got["streaming"].exposed_sync_seconds == pytest.approx(8 * (frag - 0.1))  # 1.6 s
    assert got["streaming"].compute_utilisation == pytest.approx(20 / 21.6)
    assert got["streaming"].bytes_sent_per_replica == pytest.approx(8 * 1.5 * 2e6)
    assert pred.measured["compute_utilisation"] == pytest.approx(20 / 25)


def test_predict_overrides_and_quantisation(tmp_path) -> None:
    run = _fake_run(tmp_path, method="noloco", group_size=2)
    (tmp_path / "config.json").write_text(json.dumps({"method": {"quantize": "fp4"}}))
    pred = predict_run(run, 1e9, 0.0, replicas=8, sync_every=10, methods=("noloco", "diloco"))
    noloco, diloco = pred.methods
    assert noloco.replicas == 8 and noloco.sync_events == 20
    # Quantised NoLoCo sends Δ in fp4 and the slow weights' drift in int8, each with its block
    # scales: ~12.5 bits per value, not 4.
    from noloco import quant
    bits = 8 * (quant.wire_bytes(10**6, "fp4") + quant.wire_bytes(10**6, "int8")) / 10**6
    assert noloco.wire_bits == pytest.approx(bits) and 12 < bits < 13
    assert noloco.payload_bytes == pytest.approx(10**6 * bits / 8)
    assert diloco.wire_bits == 32  # the run's quantisation belongs to its own method
    assert diloco.seconds_per_sync == pytest.approx(2 * 7 / 8 * 4e6 * 8 / 1e9)


def test_predict_sparse_exchanges_by_hand(tmp_path) -> None:
    """SparseLoCo's message is all-gathered: (N - 1) messages per replica and N - 1 latency
    terms; a diloco run's own --compress is predicted the same way, a noloco run's as one
    message to its partner."""
    from noloco import sparse

    msg = sparse.wire_bytes(10**6, 0.02, 2)  # the default topk:0.02:2 of 1e6 values
    pred = predict_run(_fake_run(tmp_path, method="diloco"), "100Mbit", "10ms",
                       methods=("sparseloco", "diloco"))
    sp, dl = pred.methods
    assert sp.sync_events == 4 and sp.sync_every == 50
    assert sp.seconds_per_sync == pytest.approx(3 * (msg * 8 / 1e8 + 0.01))
    assert sp.bytes_sent_per_replica == pytest.approx(4 * 3 * msg)
    assert sp.wire_bits == pytest.approx(8 * msg / 10**6) and sp.wire_bits < 0.4
    assert dl.bytes_sent_per_replica == pytest.approx(4 * 1.5 * 4e6)  # the run's own: dense
    assert predict_sync_seconds("sparseloco", 4, 1e6, 1e8, 0.01) == pytest.approx(
        3 * (0.08 + 0.01))
    (tmp_path / "config.json").write_text(json.dumps(
        {"method": {"compress": "topk:0.1:4", "group_size": 2}}))
    own = predict_run(str(tmp_path), "100Mbit", "10ms", methods=("diloco", "noloco"))
    dl, nl = own.methods
    assert dl.bytes_sent_per_replica == pytest.approx(4 * 3 * sparse.wire_bytes(10**6, 0.1, 4))
    assert dl.seconds_per_sync == pytest.approx(3 * (sparse.wire_bytes(10**6, 0.1, 4) * 8 / 1e8
                                                     + 0.01))
    assert nl.bytes_sent_per_replica == pytest.approx(4 * 4e6)  # not the run's method: dense


def test_predict_pipeline_stages_split_the_payload(tmp_path) -> None:
    pred = predict_run(_fake_run(tmp_path, stages=2), "1Gbit", 0, methods=("diloco",))
    assert pred.methods[0].payload_bytes == pytest.approx(2e6)


def test_load_run_errors(tmp_path) -> None:
    with pytest.raises(NetsimError):
        load_run(tmp_path / "missing")
    with pytest.raises(NetsimError):
        load_run(tmp_path)  # no summary.json
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(NetsimError):
        load_run(tmp_path)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def test_cli_latency_json(capsys) -> None:
    assert (
        main(["latency", "--workers", "16", "1024", "--cv", "0", "--samples", "8", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    ratios = [p["tree_over_pair"] for p in out["points"]]
    assert ratios == pytest.approx([4.0, 10.0])
    assert {"tree_over_pair", "ring_over_pair"} <= set(out["points"][0])


def test_cli_tables(capsys, tmp_path) -> None:
    assert main(["blocking", "-n", "16", "-H", "1", "4", "--outer-steps", "10"]) == 0
    assert "DiLoCo/NoLoCo" in capsys.readouterr().out
    assert main(["utilisation", "--model", "1B"]) == 0
    out = capsys.readouterr().out
    assert "+ overlap + FP4" in out and "25 cells compared" in out
    assert main(["predict", _fake_run(tmp_path), "--bandwidth", "1Gbit", "--latency", "50ms"]) == 0
    out = capsys.readouterr().out
    assert "streaming" in out and "measured (streaming)" in out


def test_cli_custom_model(capsys) -> None:
    assert (
        main(["utilisation", "--params", "7e9", "--layers", "32", "--step-time", "0.5", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert len(out["curves"]) == 5 and out["curves"][0]["model"]["name"] == "custom"


@pytest.mark.parametrize(
    "argv",
    [
        ["latency", "--workers", "-4"],
        ["latency", "--cv", "-1"],
        ["blocking", "-n", "10", "--group-size", "4"],
        ["utilisation", "--model", "3B"],
        ["utilisation", "--params", "1e9"],
        ["predict", "/nonexistent/run", "--bandwidth", "1Gbit"],
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(argv: list[str], capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("noloco: error: ") and err.count("\n") == 1


def test_cli_unparsable_bandwidth(tmp_path, capsys) -> None:
    assert main(["predict", _fake_run(tmp_path), "--bandwidth", "fast"]) == 2
    assert capsys.readouterr().err.startswith("noloco: error: cannot parse bandwidth")


def test_cli_usage_errors_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["latency", "--workers", "many"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("noloco: error: ") and err.count("\n") == 1


def test_add_subparsers_registers_netsim(capsys) -> None:
    parser = argparse.ArgumentParser(prog="noloco")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subparsers(sub)
    ns = parser.parse_args(
        ["netsim", "blocking", "-n", "8", "-H", "2", "--outer-steps", "5", "--json"]
    )
    assert ns.func(ns) == 0
    assert json.loads(capsys.readouterr().out)["command"] == "blocking"


def test_cli_plots(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    for argv in (
        ["latency", "-n", "4", "16", "--cv", "0", "1", "--samples", "50"],
        ["blocking", "-n", "16", "-H", "1", "5", "--outer-steps", "5"],
        ["utilisation", "--model", "1B"],
        ["predict", _fake_run(tmp_path), "-b", "1Gbit", "-l", "5ms"],
    ):
        png = tmp_path / f"{argv[0]}.png"
        assert main([*argv, "--plot", str(png)]) == 0
        assert png.stat().st_size > 1000


# The bytes `predict` gives a run's own method are the bytes the run sent, to the byte, for
# every method and option that changes them.
EXACT_RUNS = {
    "ddp": ["--method", "ddp"],
    "diloco": ["--method", "diloco", "--sync-every", "4"],
    "noloco": ["--method", "noloco", "--sync-every", "4"],
    "noloco_gamma": ["--method", "noloco", "--sync-every", "4", "--gamma", "0.8"],
    "noloco_fp4_fragments": ["--method", "noloco", "--sync-every", "4", "--fragments", "2",
                             "--quantize", "fp4"],
    "streaming_fp4": ["--method", "streaming", "--sync-every", "4", "--fragments", "2",
                      "--overlap-steps", "1", "--quantize", "fp4"],
    "streaming_sequential": ["--method", "streaming", "--sync-every", "6", "--fragments", "3",
                             "--fragment-pattern", "sequential"],
    "ddp_stages": ["--method", "ddp", "--stages", "2"],
    "noloco_stages_int8": ["--method", "noloco", "--sync-every", "4", "--stages", "2",
                           "--quantize", "int8", "--fragments", "2"],
}


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(600)
def test_predict_reproduces_the_bytes_of_real_runs_exactly(tmp_path, corpus) -> None:
    from run_utils import train

    for name, args in EXACT_RUNS.items():
        out = tmp_path / name
        assert train(out, corpus, "--replicas", "2", "--steps", "9", "--preset", "tiny",
                     "--eval-every", "9", "--checkpoint-every", "0", *args) == 0, name
        pred = predict_run(out, "1Gbit", 0, methods=(load_run(out).method,))
        sent = json.loads((out / "summary.json").read_text())["bytes_sent"]
        assert sent > 0, name
        assert pred.methods[0].bytes_sent_per_replica == sent, name


# ---- churn ------------------------------------------------------------------------------------

def test_churn_without_failures_is_the_blocking_model():
    from noloco.netsim.churn import simulate_churn

    for n, h, g in ((64, 20, 2), (16, 5, 4), (1024, 10, 2)):
        b = simulate_blocking(n, h, 30, group_size=g, seed=3)
        c = simulate_churn(n, h, 30, group_size=g, seed=3)
        assert c.failures == 0
        assert c.diloco_seconds == b.diloco_seconds and c.noloco_seconds == b.noloco_seconds
        assert c.noloco_steps == c.diloco_steps == n * h * 30


def test_churn_hand_computed_case(monkeypatch):
    """2 replicas, steps of exactly 1 (mu 0, sigma² 0), H 1, timeout 0.5, back 2 after a
    failure; replica 1 fails at 0.5 in the first outer step, never again.

    NoLoCo: step 0: replica 0 ready at 1, its partner missing: leaves at 1 + 0.5 = 1.5 (1
    step kept); replica 1 back at 2.5. Step 1: replica 1 still away (2.5 > 1.5): replica 0
    alone, 1.5 → 2.5 (1 step). Step 2: both start at 2.5, meet at 3.5 (2 steps). 4 steps in
    3.5. DiLoCo: barrier at 1.5 (1 step), at 2.5 without replica 1 (1 step), at 3.5 with both
    (2 steps): 4 steps in 3.5 as well."""
    from noloco.netsim import churn

    draws = iter([np.array([math.inf, 0.5]), np.array([math.inf, 0.5])])

    def gap(self, n):
        return next(draws, None) if n == 2 else np.full(n, math.inf)

    monkeypatch.setattr(churn._Failures, "_gap", gap)
    r = churn.simulate_churn(2, 1, 3, mtbf=1.0, timeout=0.5, rejoin_delay=2.0, mu=0.0,
                             sigma2=0.0)
    assert r.failures == 1
    assert r.noloco_seconds == pytest.approx(3.5) and r.noloco_steps == 4
    assert r.diloco_seconds == pytest.approx(3.5) and r.diloco_steps == 4
    assert r.noloco_utilisation == pytest.approx(4 / (2 * 3.5))


def test_churn_costs_diloco_s_quorum_more_than_noloco_s_groups():
    """A failure stops DiLoCo's whole quorum for the timeout; NoLoCo's group waits, and that
    delay spreads through the gossip only as far as later partners wait for it."""
    from noloco.netsim.churn import simulate_churn

    clean = simulate_churn(256, 20, 40, timeout=300, seed=1)
    churned = simulate_churn(256, 20, 40, mtbf=2e4, timeout=300, rejoin_delay=600, seed=1)
    assert churned.failures > 50
    lost_d = 1 - churned.diloco_utilisation / clean.diloco_utilisation
    lost_n = 1 - churned.noloco_utilisation / clean.noloco_utilisation
    assert lost_d > 1.5 * lost_n > 0  # measured: 0.68 and 0.38


def test_churn_cli(capsys):
    assert main(["churn", "-n", "64", "-H", "10", "--outer-steps", "10", "--mtbf", "inf", "1e4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["mtbf"] for r in out["results"]] == [math.inf, 1e4]
    assert main(["churn", "--mtbf", "0"]) == 2
    assert "--mtbf and --timeout must be > 0" in capsys.readouterr().err
