"""noloco in a Hugging Face ``Trainer``: :class:`NolocoTrainerCallback` (the ``hf`` extra).

    trainer = Trainer(model=model, args=TrainingArguments(max_steps=1000, ...),
                      train_dataset=ds, callbacks=[NolocoTrainerCallback(
                          "diloco", sync_every=50,
                          coordinator="10.0.0.1:29400", run_id="mine", replica=k, replicas=8)])
    trainer.train()

Without ``coordinator`` the run is static over the default ``torch.distributed`` process group
(initialised before ``train``). Run one process per replica without the Trainer's own data
parallelism (no torchrun-launched DDP): the method replaces the per-step gradient average.

At ``on_train_begin`` the callback gives the model and the Trainer's optimizer (under
accelerate's wrapper) to :mod:`noloco.library`: every ``optimizer.step()`` the Trainer makes
is then also the run's step. With ``max_steps`` set, training stops when the run's step
reaches it (a joiner's is its donor's). ``on_train_end`` leaves the run. The Trainer has no
hook for an exception: a process that dies is found dead by the others after the peer
timeout, as any killed replica.

Floor 5 of docs/architecture.md: a worker process.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("noloco.integrations.hf needs transformers: pip install 'noloco[hf]'"
                      ) from e

from noloco.integrations import RunRequest
from noloco.library import RunError


class NolocoTrainerCallback(RunRequest, TrainerCallback):
    """A ``transformers.TrainerCallback`` that makes training one replica of a noloco run
    (module docstring). ``settings``: the method's, as :func:`noloco.library.join_run`
    takes them."""

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if model is None or optimizer is None:
            raise RunError("NolocoTrainerCallback: the Trainer passed no model or optimizer")
        if getattr(optimizer, "scaler", None) is not None:
            # (accelerate's fp16 step re-installs the optimizer's original step each time)
            raise RunError("NolocoTrainerCallback: fp16 with a GradScaler is not supported: "
                           "train in bf16 or fp32")
        self.start(model, optimizer)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.check_reached(state.global_step)
        if self.reached(args.max_steps):
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.stop(ok=True)
