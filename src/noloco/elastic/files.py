"""Where an elastic run's replicas keep their own files in the run directory: each replica
(stage) evaluates, checkpoints and summarises alone, and the launcher combines their files at
the end (:func:`noloco.elastic.worker.combine`).

Floor 4 of docs/architecture.md: what an elastic run adds to the trainer."""

from __future__ import annotations

from pathlib import Path

from noloco import checkpoint as ckpt_mod


def _worker_name(replica: int, stage: int, stages: int) -> str:
    return f"replica-{replica}" + (f".stage-{stage}" if stages > 1 else "")


def replica_metrics(out: Path, replica: int, stage: int = 0, stages: int = 1) -> Path:
    return Path(out) / "metrics" / f"{_worker_name(replica, stage, stages)}.jsonl"


def replica_checkpoints(out: Path, replica: int, stage: int = 0, stages: int = 1) -> Path:
    """Where a replica's (stage's) own checkpoints go: it saves and resumes alone."""
    root = out / "checkpoints" / f"replica-{replica}"
    return root / f"stage-{stage}" if stages > 1 else root


def newest_checkpoints(out: Path, replicas: list[int], stages: int = 1
                       ) -> dict[int, int | None]:
    """Each replica's newest checkpoint that every one of its stages holds complete, or None:
    where ``--resume`` continues it (its stages agree on that step as they resume,
    :meth:`noloco.train.Trainer.resume`)."""
    newest = {}
    for r in replicas:
        held = [set(ckpt_mod.complete_steps(replica_checkpoints(out, r, s, stages), 1))
                for s in range(stages)]
        common = set.intersection(*held)
        newest[r] = max(common) if common else None
    return newest


def replica_summary(out: Path, replica: int, stage: int = 0, stages: int = 1) -> Path:
    return Path(out) / "metrics" / f"{_worker_name(replica, stage, stages)}.json"
