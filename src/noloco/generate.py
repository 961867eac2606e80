"""``noloco generate``: sample text from a trained model — the quickest proof that training
worked.

The model comes from a run directory (``model/``: a replica or the replicas' average) with
the tokenizer the run trained with, or from a Hugging Face model directory
(``config.json`` + weights + tokenizer, e.g. one written by ``noloco export``).
Sampling: temperature, then top-k, one token at a time over the last ``max_seq_len`` tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from noloco.config import ConfigError


class _Sampler:
    """A causal LM and its tokenizer behind one interface."""

    def __init__(self, logits: Any, encode: Any, decode: Any, context: int) -> None:
        self.logits, self.encode, self.decode, self.context = logits, encode, decode, context


def _from_run(path: Path, which: str | None) -> _Sampler:
    from noloco.checkpoint import MODEL_DIR, load_model
    from noloco.data import make_tokenizer

    index = json.loads((path / MODEL_DIR / "model.json").read_text())
    try:
        model = load_model(path, which)
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    tok = make_tokenizer(index.get("tokenizer", "bytes"))
    model.eval()
    if getattr(model, "args", None) is not None:
        context = model.args.max_seq_len
    else:  # a Hugging Face model trained with --hf-model
        from noloco.hf import max_positions

        context = max_positions(model.config)
    return _Sampler(lambda ids: model(ids)[:, -1], lambda t: [int(i) for i in tok.encode(t)],
                    tok.decode, context)


def _from_hf(path: Path) -> _Sampler:
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ConfigError("a Hugging Face model needs the 'hf' extra: "
                          "pip install 'noloco[hf]'") from None
    model = AutoModelForCausalLM.from_pretrained(str(path))
    tok = AutoTokenizer.from_pretrained(str(path))
    model.eval()
    ctx = getattr(model.config, "max_position_embeddings", 2048)
    return _Sampler(lambda ids: model(ids).logits[:, -1],
                    lambda t: tok.encode(t, add_special_tokens=False),
                    lambda ids: tok.decode(ids, skip_special_tokens=True), ctx)


def load_sampler(path: str | Path, which: str | None = None) -> _Sampler:
    p = Path(path)
    if (p / "model" / "model.json").is_file():
        return _from_run(p, which)
    if (p / "config.json").is_file() and not (p / "summary.json").is_file():
        return _from_hf(p)
    if (p / "summary.json").is_file():
        raise ConfigError(f"{p} has no trained model (model/model.json): did the run finish?")
    raise ConfigError(f"{p} is neither a noloco run directory nor a Hugging Face model "
                      f"directory")


@torch.no_grad()
def generate(path: str | Path, prompt: str, max_tokens: int = 200, temperature: float = 0.8,
             top_k: int | None = 40, seed: int = 0, which: str | None = None) -> str:
    """The prompt's continuation (without the prompt)."""
    if max_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
        raise ConfigError("need --max-tokens >= 0, --temperature >= 0 and --top-k >= 1")
    s = load_sampler(path, which)
    ids = s.encode(prompt) or [0]
    g = torch.Generator().manual_seed(seed)
    new: list[int] = []
    for _ in range(max_tokens):
        x = torch.tensor([(ids + new)[-s.context:]], dtype=torch.long)
        logits = s.logits(x)[0].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        new.append(nxt)
    return s.decode(new)


def add_subparser(sub: Any) -> None:
    p = sub.add_parser("generate", help="sample text from a trained model",
                       description="Sample text from a run directory's trained model (or a "
                       "Hugging Face model directory).")
    p.add_argument("path", metavar="RUN_DIR|HF_DIR")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens to sample (default 200)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens "
                   "(default 40)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--which", default=None, help="run directory: 'average' or 'replica-K' "
                   "(default: the average where saved, else replica 0)")
    p.set_defaults(func=_main)


def _main(ns: Any) -> int:
    text = generate(ns.path, ns.prompt, ns.max_tokens, ns.temperature, ns.top_k, ns.seed,
                    ns.which)
    print(ns.prompt + text)
    return 0
