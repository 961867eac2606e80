"""Cutting a model into pieces by module name, outside the model.

- :func:`stage_blocks` — which transformer blocks pipeline stage s holds (balanced, contiguous;
  stage 0 also holds the input embedding, the last stage the final norm and output head).
- :func:`fragment_of_block` / :func:`fragment_parameters` — Streaming DiLoCo's fragments: block k
  belongs to fragment k mod P (``strided``, the paper's default) or to the k-th contiguous
  slice (``sequential``). Parameters outside the blocks go with the fragment of their nearest
  block: the input embedding with block 0's fragment, the final norm and output head with the
  last block's fragment.

Floor 0 of docs/architecture.md: foundations.
"""

from __future__ import annotations

import re

import torch
from torch import nn

_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def stage_blocks(n_layers: int, stages: int, stage: int) -> range:
    """Contiguous, balanced block range of ``stage`` (earlier stages take the remainder)."""
    if not 1 <= stages <= n_layers:
        raise ValueError(f"{stages} stages cannot split {n_layers} blocks")
    base, extra = divmod(n_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def block_index(param_name: str) -> int | None:
    m = _BLOCK.search(param_name)
    return int(m.group(1)) if m else None


def fragment_of_block(block: int, n_layers: int, fragments: int, pattern: str = "strided") -> int:
    if not 1 <= fragments <= n_layers:
        raise ValueError(f"{fragments} fragments cannot split {n_layers} blocks")
    if pattern == "strided":
        return block % fragments
    if pattern == "sequential":
        return next(f for f in range(fragments)
                    if block in stage_blocks(n_layers, fragments, f))
    raise ValueError(f"unknown fragment pattern {pattern!r}")


def fragment_parameters(named: list[tuple[str, torch.Tensor]] | nn.Module, n_layers: int,
                        fragments: int, pattern: str = "strided") -> list[list[torch.Tensor]]:
    """Parameters grouped by fragment, each in model order (the same on every rank).

    ``named`` may be a module or its ``named_parameters()`` (a pipeline stage passes only its
    own). Non-block parameters: names before the first block (embedding) go with block 0,
    names after (norm, output) with block n_layers − 1.
    """
    items = list(named.named_parameters()) if isinstance(named, nn.Module) else list(named)
    out: list[list[torch.Tensor]] = [[] for _ in range(fragments)]
    for name, p in items:
        b = block_index(name)
        if b is None:
            # (Hugging Face models: ...embed_tokens / wte before the blocks)
            b = 0 if name.startswith("tok_embeddings") or "embed" in name or ".wte." in name \
                else n_layers - 1
        out[fragment_of_block(b, n_layers, fragments, pattern)].append(p)
    return out
