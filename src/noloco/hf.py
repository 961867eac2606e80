"""Hugging Face causal LMs as noloco models: ``noloco train --hf-model PATH``.

PATH is a local model directory (``config.json``, with or without weights) or a
``config.json`` file. With weights, they are loaded; without, the model is initialised from
``--seed`` — the same on every worker, as every method requires. The model is wrapped so that
it looks like noloco's own: ``forward(tokens) → logits``, and its blocks are named
``…layers.K.…`` so fragments (Streaming DiLoCo) cut it by block. Pipeline stages are not
supported for these models yet (refused in one line).

Floor 0 of docs/architecture.md: foundations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from noloco.errors import ConfigError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("--hf-model needs the 'hf' extra: pip install 'noloco[hf]'") from None
    return transformers


def model_dir(path: str | Path) -> Path:
    p = Path(path)
    if p.is_file() and p.name.endswith(".json"):
        return p.parent
    if not (p / "config.json").is_file():
        raise ConfigError(f"--hf-model {path}: no config.json there")
    return p


def load_config(path: str | Path) -> Any:
    """The model's transformers config, from a directory or a config.json file."""
    p = Path(path)
    if p.is_dir():
        p = model_dir(p) / "config.json"
    if not p.is_file():
        raise ConfigError(f"--hf-model {path}: not found")
    try:
        return config_from_dict(json.loads(p.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--hf-model {path}: cannot read its config ({e})") from None


def config_from_dict(d: dict[str, Any]) -> Any:
    d = dict(d)
    model_type = d.pop("model_type", None)
    if not model_type:
        raise ValueError("config.json has no model_type")
    return _transformers().AutoConfig.for_model(model_type, **d)


def has_weights(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / f).is_file() for f in WEIGHT_FILES)


def n_layers(config: Any) -> int:
    return int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))


def max_positions(config: Any) -> int:
    return int(getattr(config, "max_position_embeddings", 0)
               or getattr(config, "n_positions", 0) or 2048)


class HFCausalLM(nn.Module):
    """A transformers causal LM behind noloco's model interface."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf
        self.config = hf.config

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits


def build(path: str | Path, seed: int, device: str | torch.device = "cpu") -> HFCausalLM:
    t = _transformers()
    if has_weights(path):
        hf = t.AutoModelForCausalLM.from_pretrained(str(path))
    else:
        torch.manual_seed(seed)  # identical on every worker
        hf = t.AutoModelForCausalLM.from_config(load_config(path))
    return HFCausalLM(hf.float()).to(device)


def from_config_dict(config: dict[str, Any]) -> HFCausalLM:
    """An HFCausalLM of the recorded config on the CPU (its weights are loaded next; its
    buffers, e.g. rotary tables, are computed here)."""
    cfg = config_from_dict(config)
    return HFCausalLM(_transformers().AutoModelForCausalLM.from_config(cfg).float())


# ---- pipeline stages of Llama-family models ---------------------------------------------------

def llama_like(model: HFCausalLM) -> str | None:
    """Why ``model`` cannot be cut into pipeline stages, or None if it can: the Llama layout
    (``model.embed_tokens``, ``model.layers`` of decoder layers taking rotary
    ``position_embeddings``, ``model.norm``, ``model.rotary_emb``, ``lm_head``) with untied
    input and output embeddings (tied ones would have to live on two stages at once)."""
    hf = model.hf
    base = getattr(hf, "model", None)
    if base is None or not all(hasattr(base, a) for a in
                               ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or not hasattr(hf, "lm_head"):
        return (f"a {type(hf).__name__} is not laid out like a Llama (embed_tokens, layers, "
                f"norm, rotary_emb, lm_head)")
    if getattr(model.config, "tie_word_embeddings", False):
        return "its input and output embeddings are tied (set tie_word_embeddings false)"
    return None


class LlamaStage(nn.Module):
    """Blocks ``blocks`` of a Llama-family model (stage 0 with the embeddings, the last stage
    with the final norm and the head). Parameter names keep the whole model's
    (``hf.model.layers.K...``), so fragments, checkpoints and the saved model are the same as
    with one stage."""

    def __init__(self, model: HFCausalLM, blocks: list[int], first: bool, last: bool) -> None:
        super().__init__()
        hf, base = model.hf, model.hf.model
        self.blocks, self.first, self.last = blocks, first, last
        self.hf = nn.Module()
        self.hf.model = nn.Module()
        self.hf.model.layers = nn.ModuleDict({str(k): base.layers[k] for k in blocks})
        self.hf.model.rotary_emb = base.rotary_emb  # buffers only
        if first:
            self.hf.model.embed_tokens = base.embed_tokens
        if last:
            self.hf.model.norm = base.norm
            self.hf.lm_head = hf.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.hf.model
        h = m.embed_tokens(x) if self.first else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = m.rotary_emb(h, positions)
        for layer in m.layers.values():
            # No mask: the attention is causal (sdpa's is_causal), as in the whole model.
            out = layer(h, attention_mask=None, position_ids=positions,
                        position_embeddings=rotary)
            h = out[0] if isinstance(out, tuple) else out
        return self.hf.lm_head(m.norm(h)) if self.last else h
