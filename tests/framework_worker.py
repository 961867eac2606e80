"""One replica of a noloco run inside a framework's own loop (tests/test_integrations.py):
a small MLP in a LightningModule, or a small Hugging Face model (a two-block Llama) in the
Hugging Face Trainer.

    python framework_worker.py {lightning,hf} OUT --replica K --replicas N --steps S
        [--port P (elastic: the run's store) | --init tcp://H:P (static: a gloo group)]
        [--die-at STEP] [--step-seconds T] [--mark FILE] [--hold STEP:FILE]

Writes OUT (JSON) at the end: the run's step, outer steps, joins and the final weights."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.body(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def dataset(replica: int, n: int = 4096) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(replica)
    x = torch.randn(n, 8, generator=g)
    y = x.sum(1, keepdim=True).sin()
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def settings(a: argparse.Namespace) -> dict:
    if a.port:
        return {"coordinator": f"127.0.0.1:{a.port}", "run_id": f"fw-{a.framework}",
                "replica": a.replica, "replicas": a.replicas, "sync_every": 5,
                "peer_timeout": 6.0}
    return {"sync_every": 5}


class Dier:
    """Kills this process (SIGKILL) once the run reaches a step; paces the steps; holds at a
    step (once) until a file exists, at most 120 s."""

    def __init__(self, at: int, pace: float, hold: str | None = None) -> None:
        self.at, self.pace = at, pace
        self.hold_at, self.hold_for = (int(hold.split(":")[0]), hold.split(":", 1)[1]) \
            if hold else (0, "")

    def check(self, step: int) -> None:
        if self.at and step >= self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.pace)
        if self.hold_at and step >= self.hold_at:
            self.hold_at = 0
            deadline = time.monotonic() + 120
            while not os.path.exists(self.hold_for) and time.monotonic() < deadline:
                time.sleep(0.05)


def mark(a: argparse.Namespace) -> None:
    """The framework is imported and its loop about to start (and join the run)."""
    if a.mark:
        open(a.mark, "w").close()


def with_lightning(a: argparse.Namespace, model: Net, dier: Dier) -> object:
    import lightning.pytorch as pl

    from noloco.integrations.lightning import NolocoCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: dict, idx: int) -> torch.Tensor:
            return self.net(batch["x"], batch["labels"])["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Die(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, idx) -> None:
            dier.check(cb.run.step)
            print(f"step {cb.run.step}", flush=True)

    cb = NolocoCallback("diloco", **settings(a))
    trainer = pl.Trainer(max_steps=a.steps, callbacks=[cb, Die()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1,
                         default_root_dir=tempfile.mkdtemp())
    loader = torch.utils.data.DataLoader(dataset(a.replica), batch_size=16, shuffle=True,
                                         generator=torch.Generator().manual_seed(a.replica))
    mark(a)
    trainer.fit(Module(), loader)
    return cb.run


def hf_model() -> nn.Module:
    """A small Hugging Face model (a two-block Llama, built from its config: no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same initial weights on every replica
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))


def hf_dataset(replica: int, n: int = 2048) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(replica)
    ids = torch.randint(0, 64, (n, 16), generator=g)
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]


def with_hf(a: argparse.Namespace, model: nn.Module, dier: Dier) -> object:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from noloco.integrations.hf import NolocoTrainerCallback

    class Die(TrainerCallback):
        def on_step_end(self, args, state, control, **kw) -> None:
            dier.check(cb.run.step)
            print(f"step {cb.run.step}", flush=True)

    cb = NolocoTrainerCallback("diloco", **settings(a))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=a.steps,
                             per_device_train_batch_size=16, learning_rate=1e-2,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             use_cpu=True, disable_tqdm=True, seed=a.replica,
                             dataloader_num_workers=0, lr_scheduler_type="constant")
    trainer = Trainer(model=model, args=args, train_dataset=hf_dataset(a.replica),
                      callbacks=[cb, Die()])
    mark(a)
    trainer.train()
    return cb.run


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("framework", choices=["lightning", "hf"])
    p.add_argument("out")
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--port", type=int)
    p.add_argument("--init")
    p.add_argument("--die-at", type=int, default=0)
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--mark", help="FILE: touched once the framework is imported, before its "
                   "loop starts (and joins the run)")
    p.add_argument("--hold", help="STEP:FILE: at STEP, wait until FILE exists (at most 120 s)")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.init:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=a.init, rank=a.replica,
                                world_size=a.replicas)
    torch.manual_seed(0)  # the same initial weights on every replica
    model = Net() if a.framework == "lightning" else hf_model()
    train = with_lightning if a.framework == "lightning" else with_hf
    run = train(a, model, Dier(a.die_at, a.step_seconds, a.hold))
    with open(a.out, "w") as f:
        json.dump({"replica": a.replica, "step": run.step, "outer_steps": run.outer_steps,
                   "joins": run.joins,
                   "weights": [p.detach().flatten().tolist() for p in model.parameters()]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
