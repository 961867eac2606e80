"""A Llama-style decoder. Nothing in this file knows about distribution.

RMSNorm, rotary position embeddings, SwiGLU MLP, causal scaled-dot-product attention and
untied input / output embeddings, as in the NoLoCo paper's models. Pipeline splitting and
fragmenting live in :mod:`noloco.split`; they address the blocks by their module names
(``tok_embeddings``, ``layers.K``, ``norm``, ``output``).

Floor 0 of docs/architecture.md: foundations.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    dim: int
    """hidden size d_model"""
    n_layers: int
    """transformer blocks"""
    n_heads: int
    """attention heads (dim must be divisible by it)"""
    ffn_dim: int
    """hidden size of the SwiGLU MLP"""
    vocab_size: int = 256
    """set from the tokenizer at build time"""
    max_seq_len: int = 2048
    """longest sequence the rotary tables are meant for"""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


PRESETS: dict[str, ModelArgs] = {
    # ~1M parameters with the byte tokenizer: trains in minutes on two CPU cores.
    "tiny": ModelArgs(dim=128, n_layers=4, n_heads=4, ffn_dim=384, max_seq_len=1024),
    # The NoLoCo paper's small / medium / large (768/12, 2048/24, 4096/32), sequence 1024.
    "small": ModelArgs(dim=768, n_layers=12, n_heads=12, ffn_dim=2048, max_seq_len=2048),
    "medium": ModelArgs(dim=2048, n_layers=24, n_heads=16, ffn_dim=5504, max_seq_len=2048),
    "large": ModelArgs(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=2048),
}


def preset(name: str, **overrides) -> ModelArgs:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    return replace(PRESETS[name], **overrides)


def plain_device(x: torch.Tensor) -> bool:
    """``x`` on the CPU or a GPU with autocast off there: where the inference forms below
    run (autocast would change their dtypes; it knows no "meta" device)."""
    return x.device.type in ("cpu", "cuda") and not torch.is_autocast_enabled(x.device.type)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype == self.weight.dtype == torch.float32 and not torch.is_grad_enabled()
                and plain_device(x)):
            # Inference in fp32 (evaluation, generation): one fused kernel on a GPU, where a
            # one-token step is bound by its count of kernels; on the CPU the same operations
            # as below, bit for bit (tested). Training keeps the lines below and their
            # gradients, whatever the device.
            return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions 0 .. seq_len - 1, shape (seq_len, head_dim/2),
    computed on the fly (cheap, never stored, so a model built on the meta device costs
    nothing; a :class:`KVCache` keeps the table of its own positions)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                          / head_dim)
    ang = torch.outer(torch.arange(seq_len, device=device,
                                   dtype=torch.float32), inv)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, heads, T, head_dim); rotate interleaved pairs (x0, x1) by the position's angle.
    x0, x1 = x[..., 0::2], x[..., 1::2]
    r0 = x0 * cos - x1 * sin
    r1 = x0 * sin + x1 * cos
    return torch.stack((r0, r1), dim=-1).flatten(-2)


def apply_rotation(x: torch.Tensor, rotation: torch.Tensor | None, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` as one complex product where ``rotation`` (``cos + i·sin``) is
    given and ``x`` is fp32: each pair (x0, x1) is the complex number x0 + i·x1, and
    (x0 + i·x1)(cos + i·sin) has the same two real parts. One kernel instead of seven on a
    GPU; on the CPU the same numbers, bit for bit (tested)."""
    if rotation is None or x.dtype != torch.float32:
        return apply_rope(x, cos, sin)
    z = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
    return torch.view_as_real(z * rotation).flatten(-2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.dim % args.n_heads:
            raise ValueError(f"dim {args.dim} not divisible by n_heads {args.n_heads}")
        self.n_heads = args.n_heads
        self.head_dim = args.head_dim
        self.theta = args.rope_theta
        self.dropout = args.dropout
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """With ``residual``: ``residual`` + the output (:func:`project_add`)."""
        b, t, d = x.shape
        h, hd = self.n_heads, self.head_dim
        if cache is None:
            q, k, v = (w(x).view(b, t, h, hd).transpose(1, 2)
                       for w in (self.wq, self.wk, self.wv))
            cos, sin = rope_tables(t, hd, self.theta, x.device, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            mask, causal = None, True
        else:
            # A cached step launches kernels, it hardly computes: q, k and v come from one
            # product (the three weights side by side) and q and k are rotated together.
            qkv = cache.project(self, (self.wq, self.wk, self.wv), x)
            qkv = qkv.view(b, t, 3 * h, hd).transpose(1, 2)
            cos, sin = cache.rope(t, qkv.dtype)
            q, k = apply_rotation(qkv[:, :2 * h], cache.rotation(t, qkv.dtype), cos,
                                  sin).split(h, 1)
            k, v = cache.append(self, k, qkv[:, 2 * h:])
            mask, causal = cache.mask(t, q.dtype), False
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0
        )
        return project_add(self.wo, y.transpose(1, 2).reshape(b, t, d), residual)


def project_add(linear: nn.Linear, x: torch.Tensor, residual: torch.Tensor | None
                ) -> torch.Tensor:
    """``linear(x)``, plus ``residual`` where given, added by the product itself (one kernel
    instead of two). Only a cached one-token step passes a residual (:meth:`Block.forward`):
    for one row the CPU gives the numbers of the separate sum, bit for bit (tested)."""
    if residual is None:
        return linear(x)
    d = residual.size(-1)
    return torch.addmm(residual.reshape(-1, d), x.reshape(-1, x.size(-1)),
                       linear.weight.t()).view(residual.shape)


STACK_LIMIT_BYTES = 512 * 2**20
"""the most that a cache's stacked copies of the projection weights may take (``small`` in
fp32: 0.22 GiB; ``medium``: 3.1 GiB, whose one-token step reads 12 GB of weights anyway)"""


ALIGN_SLOTS = 16
"""a cache's buffers hold a multiple of this many positions (its size rounded up, within the
context): a GPU's memory-efficient attention copies an additive mask whose rows are not
aligned (a multiple of 8 elements on CUDA, 16 on some other backends) into a padded one, in
every layer of every step (PyTorch's ``preprocess_mask``); the slots past the size are masked
out like any position not yet written"""


class KVCache:
    """Keys and values of the positions seen so far, for generation: each new token then
    costs one position's work instead of the whole context's.

    Static: every layer's keys and values live in buffers of ``size`` positions (rounded up
    to :data:`ALIGN_SLOTS`) allocated once, and the next position is a device tensor
    (``position``). A forward writes its positions in place and attends over the whole
    buffer through a mask (a key at a position not yet written is masked out), so a
    one-token step has the same shapes and the same memory every time and launches no
    host-dependent work: it can be captured in a CUDA graph and replayed
    (:mod:`noloco.generate`). ``length`` is the host's count of the positions
    written, kept by eager forwards only (a replayed graph runs no Python)."""

    def __init__(self, args: ModelArgs, batch: int, size: int, device: torch.device | str,
                 dtype: torch.dtype = torch.float32, fuse: bool | None = None) -> None:
        if not 0 < size <= args.max_seq_len:
            raise ValueError(f"a cache of {size} positions (the model's context is "
                             f"{args.max_seq_len})")
        slots = min(-(-size // ALIGN_SLOTS) * ALIGN_SLOTS, args.max_seq_len)
        shape = (args.n_layers, batch, args.n_heads, slots, args.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.size = size
        """the positions it holds (the buffers' slots past it: :data:`ALIGN_SLOTS`)"""
        self.position = torch.zeros((), dtype=torch.long, device=device)
        """the next position to write (a device tensor, advanced in place)"""
        self.length = 0
        self._slot: dict[int, int] = {}  # id(attention layer) -> its index in the buffers
        self._offsets = torch.arange(slots, device=device)
        cos, sin = rope_tables(slots, args.head_dim, args.rope_theta, torch.device(device),
                               torch.float32)
        self._cos, self._sin = cos, sin
        stacked = args.n_layers * (3 * args.dim ** 2 + 2 * args.dim * args.ffn_dim)
        self.fuse = (stacked * dtype.itemsize <= STACK_LIMIT_BYTES) if fuse is None else fuse
        """whether :meth:`project` stacks the weights (default: where the copies are small;
        a bigger model's step is bound by reading its weights, not by its launches)"""
        self.add_in_product = True
        """whether a one-token step adds each block's residual in its output products
        (:func:`project_add`; off: the separate sums, for comparison)"""
        self._weights: dict[int, torch.Tensor] = {}
        self._now: dict[tuple[Any, ...], Any] = {}
        """what every layer of the forward under way shares (its positions, their rotation
        and mask), computed by the first layer that asks: the positions only move in
        :meth:`advance`, which empties it"""

    def _shared(self, key: tuple[Any, ...], make: Any) -> Any:
        if key not in self._now:
            self._now[key] = make()
        return self._now[key]

    def _positions(self, t: int) -> torch.Tensor:
        # checked on the host's count (reading ``position`` would wait for the device); a
        # caller that replays a captured step keeps within ``size`` itself
        if self.length + t > self.size:
            raise ValueError(f"{self.length} + {t} positions do not fit a cache of {self.size}")
        return self._shared(("at", t), lambda: self.position + self._offsets[:t])

    def rope(self, t: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the ``t`` positions from ``position`` on."""
        at = self._positions(t)
        return self._shared(("rope", t, dtype),
                            lambda: (self._cos[at].to(dtype), self._sin[at].to(dtype)))

    def project(self, owner: nn.Module, linears: tuple[nn.Linear, ...], x: torch.Tensor
                ) -> torch.Tensor:
        """``x`` through each of ``linears`` (without bias), their outputs side by side: one
        product with their weights stacked, made the first time ``owner`` asks (the model's
        weights do not change while a cache lives: it serves one generation). On the CPU the
        same numbers as one product each (tested); without :attr:`fuse`, one product each."""
        if not self.fuse:
            return torch.cat([lin(x) for lin in linears], -1)
        w = self._weights.get(id(owner))
        if w is None:
            w = self._weights[id(owner)] = torch.cat([lin.weight for lin in linears])
        return F.linear(x, w)

    def rotation(self, t: int, dtype: torch.dtype) -> torch.Tensor | None:
        """cos + i·sin of the ``t`` positions from ``position`` on, for fp32 (else None)."""
        if dtype != torch.float32:
            return None
        cos, sin = self.rope(t, dtype)
        return self._shared(("rotation", t), lambda: torch.complex(cos, sin))

    def append(self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``layer``'s new keys and values at their positions; its whole buffers back."""
        i = self._slot.setdefault(id(layer), len(self._slot))
        at = self._positions(k.size(2))
        self.k[i].index_copy_(2, at, k.to(self.k.dtype))
        self.v[i].index_copy_(2, at, v.to(self.v.dtype))
        return self.k[i].to(k.dtype), self.v[i].to(v.dtype)

    def mask(self, t: int, dtype: torch.dtype) -> torch.Tensor:
        """(t, slots), additive: new query i (at position + i) sees the keys at positions up to
        its own (0), not the others (-inf: what attention makes of a boolean mask, made once
        for every layer instead of by each)."""
        at = self._positions(t)
        return self._shared(("mask", t, dtype), lambda: torch.zeros(
            (t, self._offsets.numel()), dtype=dtype, device=at.device).masked_fill_(
                self._offsets[None, :] > at[:, None], float("-inf")))

    def begin(self) -> None:
        """A forward starts (a forward that failed half way may have left its tables)."""
        self._now.clear()

    def advance(self, t: int) -> None:
        self.position += t
        self.length += t
        self._now.clear()


class SwiGLU(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """With ``residual``: ``residual`` + the output (:func:`project_add`)."""
        if cache is None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        gate, up = cache.project(self, (self.w1, self.w3), x).chunk(2, -1)  # (one product)
        return project_add(self.w2, F.silu(gate) * up, residual)


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = SwiGLU(args)
        self.drop = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        if (cache is not None and cache.add_in_product and x.size(0) * x.size(1) == 1
                and not (self.training and self.drop.p > 0) and plain_device(x)):
            # A one-token step (generation): each residual added by the output product
            # itself; a GPU's step is bound by its count of kernels
            x = self.attention(self.attention_norm(x), cache, residual=x)
            return self.feed_forward(self.ffn_norm(x), cache, residual=x)
        x = x + self.drop(self.attention(self.attention_norm(x), cache))
        return x + self.drop(self.feed_forward(self.ffn_norm(x), cache))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)  # untied
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2L)."""
        resid_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norm weights
            elif name.endswith("wo.weight") or name.endswith("w2.weight"):
                nn.init.normal_(p, std=resid_std)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """tokens (B, T) int64 → logits (B, T, vocab). With a cache, ``tokens`` continue the
        positions it holds, and their keys and values are added to it."""
        h = self.tok_embeddings(tokens)
        if cache is not None:
            cache.begin()
        for layer in self.layers:
            h = layer(h, cache)
        if cache is not None:
            cache.advance(tokens.size(1))
        return self.output(self.norm(h))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build(args: ModelArgs, device: str | torch.device = "cpu", seed: int | None = None
          ) -> Transformer:
    """Build a model; with a seed, every process gets bit-identical initial weights."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        return Transformer(args)


class Forward:
    """``module(x)``, through ``torch.compile`` when asked (``--compile``). A compiler that
    fails (none installed, an operation it cannot handle) is said in one line and the module
    runs eagerly from then on: the same numbers, only slower."""

    def __init__(self, module: nn.Module, compile: bool = False) -> None:
        self.module = module
        self.compiled = torch.compile(module) if compile else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None:
            try:
                return self.compiled(x)
            except Exception as e:  # noqa: BLE001 - any compiler failure: run eagerly
                line = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
                print(f"noloco: --compile: torch.compile failed ({line}); running eagerly",
                      file=sys.stderr, flush=True)
                self.compiled = None
        return self.module(x)


def autocast(device: torch.device, precision: str) -> torch.autocast:
    """The forward pass's precision (``--precision``): bf16 autocast, or nothing (fp32).
    Parameters, their gradients and everything computed from them outside the forward pass
    stay fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
