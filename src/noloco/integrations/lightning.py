"""noloco in a Lightning ``Trainer``: :class:`NolocoCallback` (``pip install
'noloco[lightning]'``).

    trainer = L.Trainer(max_steps=1000, callbacks=[NolocoCallback(
        "diloco", sync_every=50,
        coordinator="10.0.0.1:29400", run_id="mine", replica=k, replicas=8)])  # elastic
    trainer.fit(module, loader)

Without ``coordinator`` the run is static: the processes of the default ``torch.distributed``
process group (initialised before ``fit``, or by torchrun) are the replicas. Use Lightning's
single-device strategy per process (one replica per process): a DDP strategy would average
every step's gradients on top of the method.

At ``on_fit_start`` the callback gives the module's one optimizer to :mod:`noloco.library`:
from then on every ``optimizer.step()`` Lightning makes is also the run's step (outer steps,
serving joiners, heals). A replica that joins takes its donor's step; Lightning's own
``global_step`` counts this process's steps, so with ``max_steps`` set the callback stops
the fit when the run's step reaches it. ``on_fit_end`` leaves the run; an exception through
``fit`` leaves it as stopped.

Floor 5 of docs/architecture.md: a worker process.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("noloco.integrations.lightning needs Lightning: "
                      "pip install 'noloco[lightning]'") from e

from noloco.integrations import RunRequest
from noloco.library import RunError


class NolocoCallback(RunRequest, pl.Callback):
    """A Lightning callback that makes the fit one replica of a noloco run (module
    docstring). ``settings``: the method's, as :func:`noloco.library.join_run` takes them."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise RunError(f"NolocoCallback: the module must have exactly one optimizer, "
                           f"not {len(trainer.optimizers)}")
        if not pl_module.automatic_optimization:
            raise RunError("NolocoCallback: manual optimisation is not supported: call "
                           "noloco.library.join_run on the module and optimizer yourself")
        self.start(pl_module, trainer.optimizers[0])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.check_reached(trainer.global_step)
        if self.reached(trainer.max_steps):
            trainer.should_stop = True

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stop(ok=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self.stop(ok=False)
