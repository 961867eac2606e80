"""What one worker holds on its device, estimated before anything starts, so that workers
sharing a GPU are refused in one line when they cannot fit instead of failing mid-run with an
out-of-memory error in one of them.

The estimate, per worker (its stage's share of the parameters, p of them):

- weights, 4·p bytes (fp32 master weights, whatever ``--precision``), and gradients, 4·p;
- the inner optimizer: AdamW's two moments, 8·p; Muon's momentum, 4·p (its AdamW part for
  the few non-matrix parameters is counted at Muon's rate: it is small); plus 8·p of
  temporaries (the optimizer's multi-tensor steps and gradient clipping allocate copies:
  on an H100 every method's measured peak sat ~8·p above the other terms);
- the method's outer state, fp32: DiLoCo, Streaming and NoLoCo keep the slow weights and an
  outer momentum (8·p) and an outgoing payload (4·p); NoLoCo also receives a partner's
  (4·p per partner); SparseLoCo keeps the slow weights and an error feedback (8·p) and a
  payload (4·p); ``--compress`` adds its error feedback (4·p); DDP a flat gradient (4·p);
- activations kept for backward, for the tokens of one forward pass (``--batch-size`` ×
  ``--seq-len``; with P stages, the microbatches 1F1B holds in flight): per layer and token
  about 23·dim values (12·dim for attention, norms and residuals and 4·ffn ≈ 11·dim for the
  SwiGLU with ffn ≈ 8/3·dim), 4 bytes each in fp32 and about 2.5 in bf16 (matmul outputs
  in bf16, norms in fp32); plus the logits, about 10 bytes per token and vocabulary entry
  (fp32 logits, their gradient, a bf16 copy) on the last stage;
- a fixed CUDA context and allocator reserve: :data:`CUDA_OVERHEAD`.

It is an estimate (``benchmarks/gpu.py`` records it beside the measured peak: record
``benchmarks/results/gpu_shared.json``, 4 replicas of ``small`` on one H100: before
the temporaries were counted, the estimate with its CUDA reserve was 2-8% below the measured
allocated peak, which holds no CUDA context at all); a run is refused only when its
estimate exceeds what the GPU holds in all.

Floor 1 of docs/architecture.md: a run's description.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from noloco.config import Config
from noloco.errors import plural

GIB = 1024 ** 3
CUDA_OVERHEAD = 600 * 1024 ** 2
"""the CUDA context and the caching allocator's slack, per process"""


@dataclass
class Footprint:
    weights: int
    gradients: int
    optimizer: int
    outer: int
    activations: int
    overhead: int = CUDA_OVERHEAD

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.outer + self.activations
                + self.overhead)

    def parts(self) -> str:
        names = ("weights", "gradients", "optimizer", "outer", "activations", "overhead")
        return ", ".join(f"{n} {getattr(self, n) / GIB:.1f}" for n in names)


def model_shape(cfg: Config, vocab_size: int) -> tuple[int, int, int, int] | None:
    """(parameters, layers, dim, vocabulary) of the run's builtin model, counted on the meta
    device (nothing allocated); None for a Hugging Face model (not estimated)."""
    if cfg.model.hf_model is not None:
        return None
    from noloco.model import Transformer, count_params, preset

    args = preset(cfg.model.preset, vocab_size=vocab_size, dropout=cfg.model.dropout)
    with torch.device("meta"):
        n = count_params(Transformer(args))
    return n, args.n_layers, args.dim, args.vocab_size


def estimate(cfg: Config, n_params: int, n_layers: int, dim: int, vocab: int) -> Footprint:
    """One worker's device memory (module docstring), for a resolved config."""
    m, o, d, t = cfg.method, cfg.optim, cfg.data, cfg.train
    stages = m.stages
    p = -(-n_params // stages)
    per_partner = 4 * p * max(m.group_size - 1, 1)
    outer = {
        "single": 0,
        "ddp": 4 * p,
        "diloco": 12 * p,
        "streaming": 12 * p,
        "noloco": 12 * p + per_partner,
        "sparseloco": 12 * p,
    }.get(m.method, 12 * p)
    if m.compress is not None and m.method != "sparseloco":
        outer += 4 * p
    optimizer = (4 * p if o.inner_optimizer == "muon" else 8 * p) + 8 * p
    in_flight = d.batch_size
    if stages > 1:
        microbatches = m.microbatches or 2 * stages
        in_flight = min(d.batch_size, -(-d.batch_size * stages // microbatches))
    tokens = in_flight * d.seq_len
    per_value = 4.0 if t.precision == "fp32" else 2.5
    layers = -(-n_layers // stages)
    acts = int(tokens * layers * 23 * dim * per_value) + tokens * vocab * 10
    return Footprint(weights=4 * p, gradients=4 * p, optimizer=optimizer, outer=outer,
                     activations=acts)


def check_fits(fp: Footprint, per_gpu: int, gpu_bytes: int, gpu_name: str = "GPU") -> None:
    """ConfigError when ``per_gpu`` workers of footprint ``fp`` exceed ``gpu_bytes``."""
    from noloco.config import ConfigError

    need = per_gpu * fp.total
    if need <= gpu_bytes:
        return
    raise ConfigError(
        f"{plural(per_gpu, 'worker')} on each {gpu_name} of {gpu_bytes / GIB:.1f} GiB would "
        f"need about {need / GIB:.1f} GiB ({fp.total / GIB:.1f} GiB each: {fp.parts()} GiB): "
        f"use fewer replicas per machine, a smaller --batch-size or --seq-len, "
        f"--precision bf16, or more GPUs")


# ---- model FLOPs utilisation -------------------------------------------------------------------

PEAK_FLOPS = {
    # dense tensor-core peaks from the vendors' data sheets (SXM parts), per precision:
    # bf16 autocast runs the matmuls in bf16; fp32 ("highest" matmul precision) in FP32
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
}


def peak_flops(gpu_name: str, precision: str) -> float | None:
    """The GPU's dense peak for ``precision`` (FLOP/s), None for a GPU not in the table."""
    for key, peaks in PEAK_FLOPS.items():
        if key in gpu_name:
            return peaks.get(precision)
    return None


def flops_per_token(n_params: int, n_layers: int, dim: int, vocab: int, seq_len: int) -> int:
    """Training FLOPs per token, forward and backward (PaLM's appendix B): 6·N for the
    parameters that multiply (all but the input embedding, a lookup) and 12·L·d·s for the
    attention scores and their weighted sum (full, not causal-halved: the usual count)."""
    return 6 * (n_params - vocab * dim) + 12 * n_layers * dim * seq_len
