"""noloco's runs inside other training frameworks: a Lightning callback
(:mod:`noloco.integrations.lightning`, the ``lightning`` extra) and a Hugging Face Trainer
callback (:mod:`noloco.integrations.hf`, the ``hf`` extra). Both hand the framework's model
and optimizer to :mod:`noloco.library` — elastic at a coordinator, or static over the
default process group — and leave the framework's loop as it is.

Floor 5 of docs/architecture.md: a worker process.
"""

from __future__ import annotations

from typing import Any

from noloco.library import ElasticLoop, RunError, StaticLoop, join_run, static_run


class RunRequest:
    """What a framework callback was asked for (its constructor's arguments), and the run
    once started (:meth:`start`)."""

    def __init__(self, method: str = "diloco", *, coordinator: str | None = None,
                 run_id: str | None = None, replica: int | None = None,
                 replicas: int | None = None, **settings: Any) -> None:
        self.method, self.coordinator, self.run_id = method, coordinator, run_id
        self.replica, self.replicas, self.settings = replica, replicas, settings
        self.run: ElasticLoop | StaticLoop | None = None

    def start(self, model: Any, optimizer: Any) -> None:
        self.run = start_run(type(self).__name__, model, torch_optimizer(optimizer),
                             self.method, self.coordinator, self.run_id, self.replica,
                             self.replicas, self.settings)

    def stop(self, ok: bool) -> None:
        if self.run is not None:
            self.run.close(ok=ok)

    def check_reached(self, framework_steps: int) -> None:
        """The framework has taken ``framework_steps`` optimizer steps: if none of them
        reached the run, something replaced the optimizer's ``step`` after the run wrapped
        it (accelerate's fp16 GradScaler does): say so instead of training apart."""
        run = self.run
        if run is not None and framework_steps >= 2 and run.step == 0:
            raise RunError(f"{type(self).__name__}: {framework_steps} optimizer steps did not "
                           f"reach the noloco run: something replaced optimizer.step after "
                           f"the run wrapped it")

    def reached(self, max_steps: int) -> bool:
        """Whether the run's step (a joiner's is its donor's) reached ``max_steps`` (> 0)."""
        return self.run is not None and 0 < max_steps <= self.run.step


def start_run(name: str, model: Any, optimizer: Any, method: str, coordinator: str | None,
              run_id: str | None, replica: int | None, replicas: int | None,
              settings: dict[str, Any]) -> ElasticLoop | StaticLoop:
    """The run a framework callback asked for: elastic with a ``coordinator`` (then
    ``run_id``, ``replica`` and ``replicas`` are needed), else static over the default
    process group."""
    if coordinator is None:
        if run_id is not None or replica is not None or replicas is not None:
            raise RunError(f"{name}: run_id, replica and replicas name an elastic run: pass "
                           f"coordinator too (without one the run is static, over the "
                           f"default process group)")
        return static_run(model, optimizer, method=method, **settings)
    missing = [k for k, v in (("run_id", run_id), ("replica", replica),
                              ("replicas", replicas)) if v is None]
    if missing:
        raise RunError(f"{name}: an elastic run (coordinator=...) needs {', '.join(missing)}")
    assert run_id is not None and replica is not None and replicas is not None
    return join_run(model, optimizer, coordinator=coordinator, run_id=run_id,
                    replica=replica, replicas=replicas, method=method, **settings)


def torch_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` under a framework's wrappers (Lightning's
    ``LightningOptimizer``, accelerate's ``AcceleratedOptimizer``: both call its ``step``)."""
    seen = 0
    while hasattr(optimizer, "optimizer") and seen < 4:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer
