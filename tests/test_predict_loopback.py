"""`noloco netsim predict` against a real loopback run.

The network is measured first (two gloo ranks on loopback: latency from tiny all-reduces,
bandwidth from large ones), then a real DDP run is made and its training wall-clock is
predicted from its own compute seconds and bytes. Stated band: the prediction is within ±40%
of the measured training seconds (loopback timings on a shared 2-core machine are noisy;
the model itself is exact about bytes, which is checked exactly).
"""

from __future__ import annotations

import time

import pytest
import torch
from dist_utils import run_ranks

from noloco.cli import main
from noloco.comm import TorchCommunicator
from noloco.netsim.predict import predict_run


def _measure_link(rank: int, world: int) -> tuple[float, float]:
    comm = TorchCommunicator()
    small, big = torch.zeros(1), torch.zeros(4_000_000)
    for t in (small, big):  # warm-up
        comm.all_reduce_mean(t)

    def timed(t: torch.Tensor, reps: int) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            comm.all_reduce_mean(t)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    t_small, t_big = timed(small, 20), timed(big, 5)
    # Ring model with N = 2: 2 latency terms and S bytes through the link.
    latency = t_small / 2
    bandwidth_bps = 8 * big.numel() * 4 / max(t_big - 2 * latency, 1e-6)
    return latency, bandwidth_bps


@pytest.mark.timeout(420)
def test_predict_matches_a_measured_loopback_run(tmp_path, shakespeare):
    latency, bandwidth = run_ranks(_measure_link, 2)[0]
    out = tmp_path / "ddp"
    assert main(["train", "--method", "ddp", "--replicas", "2", "--data", str(shakespeare),
                 "--steps", "30", "--eval-every", "30", "--batch-size", "4", "--seq-len", "64",
                 "--eval-batches", "1", "--out", str(out)]) == 0
    pred = predict_run(out, bandwidth, latency, methods=("ddp",))
    ddp = pred.methods[0]
    measured = pred.measured
    # Bytes are exact: 30 ring all-reduces of the fp32 gradients over 2 ranks.
    assert measured["bytes_sent_per_replica"] == 30 * pred.run.param_bytes
    ratio = ddp.wall_seconds / measured["train_seconds"]
    assert 0.6 < ratio < 1.4, (ddp, measured, latency, bandwidth)
