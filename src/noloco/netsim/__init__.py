"""Network model for low-communication training (``noloco netsim``).

- :mod:`~noloco.netsim.latency`: tree/ring all-reduce versus NoLoCo pair exchange with
  log-normal message times (NoLoCo Fig. 5A).
- :mod:`~noloco.netsim.blocking`: DiLoCo's global barrier versus NoLoCo's pairwise waits with
  log-normal inner-step times (NoLoCo Fig. 5B).
- :mod:`~noloco.netsim.utilisation`: compute utilisation versus bandwidth between datacenters,
  per-layer DAG simulation (Streaming DiLoCo Table 4).
- :mod:`~noloco.netsim.predict`: a finished run's wall-clock on another network.

Every modelling assumption is listed in ``docs/netsim.md``.

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from noloco.netsim.blocking import BlockingResult, blocking_sweep, simulate_blocking
from noloco.netsim.latency import (
    LatencyPoint,
    NetsimError,
    cv_to_sigma,
    expected_max_of_two,
    latency_point,
    latency_sweep,
    pair_exchange_time,
    ring_allreduce_time,
    sigma_to_cv,
    tree_allreduce_samples,
)
from noloco.netsim.predict import (
    MethodPrediction,
    Prediction,
    RunInfo,
    load_run,
    parse_bandwidth,
    parse_latency,
    predict_run,
    predict_sync_seconds,
)
from noloco.netsim.utilisation import (
    PAPER_GRID_GBPS,
    PAPER_MODELS,
    PAPER_TABLE,
    ModelSpec,
    Scheme,
    UtilisationCurve,
    paper_schemes,
    paper_table,
    simulate_utilisation,
)

__all__ = [
    "PAPER_GRID_GBPS",
    "PAPER_MODELS",
    "PAPER_TABLE",
    "BlockingResult",
    "LatencyPoint",
    "MethodPrediction",
    "ModelSpec",
    "NetsimError",
    "Prediction",
    "RunInfo",
    "Scheme",
    "UtilisationCurve",
    "blocking_sweep",
    "cv_to_sigma",
    "expected_max_of_two",
    "latency_point",
    "latency_sweep",
    "load_run",
    "paper_schemes",
    "paper_table",
    "pair_exchange_time",
    "parse_bandwidth",
    "parse_latency",
    "predict_run",
    "predict_sync_seconds",
    "ring_allreduce_time",
    "sigma_to_cv",
    "simulate_blocking",
    "simulate_utilisation",
    "tree_allreduce_samples",
]
