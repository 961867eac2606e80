"""``noloco generate``: sample text from a trained model — the quickest proof that training
worked.

The model comes from a run directory (``model/``: a replica or the replicas' average) with
the tokenizer the run trained with, or from a Hugging Face model directory
(``config.json`` + weights + tokenizer, e.g. one written by ``noloco export``).
Sampling: temperature, then top-k, one token at a time over the last ``max_seq_len`` tokens.
The built-in model keeps its keys and values (:class:`noloco.model.KVCache`), so each new
token costs one position's work while the text fits its context; past it the window slides
and every token recomputes its window (rotary positions restart with it), as without a cache.
Hugging Face models sample through transformers' own ``generate()``.

``--device`` (auto, cpu, cuda; auto is the GPU where there is one) holds the model and its key
and value cache; the weights are read on the CPU (as ``noloco export`` reads them: it needs no
GPU) and moved there. Each token's logits come back to the CPU to be sampled there with the
seed's own generator, so a seed picks the same tokens on either device while the logits agree.

Floor 6 of docs/architecture.md: launching and watching runs, and what reads a run directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from noloco.config import ConfigError


class _Sampler:
    """A causal LM and its tokenizer behind one interface: ``logits(ids)`` of the last
    position; ``model`` the built-in Transformer (KV cache) or None; ``hf`` a transformers
    model whose ``generate()`` samples, or None."""

    def __init__(self, logits: Any, encode: Any, decode: Any, context: int,
                 model: Any = None, hf: Any = None, module: Any = None) -> None:
        self.logits, self.encode, self.decode, self.context = logits, encode, decode, context
        self.model, self.hf = model, hf
        self.module = module
        """the torch module that holds the weights (moved by :meth:`to`)"""
        self.device = torch.device("cpu")
        """where the weights are: token ids are made there"""

    def to(self, device: torch.device) -> _Sampler:
        if self.module is not None:
            self.module.to(device)
        self.device = device
        return self


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(spec: str) -> torch.device:
    """``--device``: cpu, cuda (refused in one line where no GPU is visible) or auto (the
    first GPU where there is one, else the CPU)."""
    if spec not in DEVICES:
        raise ConfigError(f"unknown --device {spec!r} (choose from {', '.join(DEVICES)})")
    gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if spec == "cuda" and not gpu:
        raise ConfigError("--device cuda: no GPU is visible to torch (use --device cpu or auto)")
    return torch.device("cuda") if spec != "cpu" and gpu else torch.device("cpu")


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
    builtin, hf_model = None, None
    if getattr(model, "args", None) is not None:
        context = model.args.max_seq_len
        builtin = model
    else:  # a Hugging Face model trained with --hf-model
        from noloco.hf import max_positions

        context = max_positions(model.config)
        hf_model = model.hf
    return _Sampler(lambda ids: model(ids)[:, -1], lambda t: [int(i) for i in tok.encode(t)],
                    tok.decode, context, model=builtin, hf=hf_model, module=model)


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
                    lambda ids: tok.decode(ids, skip_special_tokens=True), ctx, hf=model,
                    module=model)


def load_sampler(path: str | Path, which: str | None = None) -> _Sampler:
    """The model of a run or Hugging Face directory, on the CPU (:meth:`_Sampler.to` moves
    it)."""
    p = Path(path)
    if (p / "model" / "model.json").is_file():
        return _from_run(p, which)
    if (p / "config.json").is_file() and not (p / "summary.json").is_file():
        return _from_hf(p)
    if (p / "summary.json").is_file():
        raise ConfigError(f"{p} has no trained model (model/model.json): did the run finish?")
    raise ConfigError(f"{p} is neither a noloco run directory nor a Hugging Face model "
                      f"directory")


def _hf_generate(s: _Sampler, ids: list[int], max_tokens: int, temperature: float,
                 top_k: int | None, seed: int) -> list[int]:
    """transformers' ``generate()`` (its own KV cache); the context is cut as ours is."""
    torch.manual_seed(seed)
    ids = ids[-max(s.context - max_tokens, 1):]
    x = torch.tensor([ids], dtype=torch.long, device=s.device)
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k or 0)
    # eos_token_id=None: never stop early, as our own sampler (an end token decodes to nothing)
    out = s.hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                        eos_token_id=None, pad_token_id=0,
                        **(sampling if temperature > 0 else dict(do_sample=False)))
    return [int(i) for i in out[0, x.size(1):]]


@torch.no_grad()
def generate(path: str | Path, prompt: str, max_tokens: int = 200, temperature: float = 0.8,
             top_k: int | None = 40, seed: int = 0, which: str | None = None,
             cache: bool = True, device: str = "auto") -> str:
    """The prompt's continuation (without the prompt). ``cache=False``: recompute the whole
    window for every token (the built-in model; the same tokens, for comparison). ``device``:
    auto, cpu or cuda (module docstring)."""
    if max_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
        raise ConfigError("need --max-tokens >= 0, --temperature >= 0 and --top-k >= 1")
    dev = resolve_device(device)  # before anything is read: a bad --device fails at once
    s = load_sampler(path, which).to(dev)
    ids = s.encode(prompt) or [0]
    if s.hf is not None and max_tokens > 0:
        return s.decode(_hf_generate(s, ids, max_tokens, temperature, top_k, seed))
    return s.decode(sample(s, ids, max_tokens, temperature, top_k, seed, cache))


def sample(s: _Sampler, ids: list[int], max_tokens: int, temperature: float,
           top_k: int | None, seed: int, cache: bool = True) -> list[int]:
    from noloco.model import KVCache

    g = torch.Generator().manual_seed(seed)
    new: list[int] = []
    kv = KVCache() if cache and s.model is not None else None
    for _ in range(max_tokens):
        window = (ids + new)[-s.context:]
        if kv is not None and len(ids) + len(new) <= s.context:
            # the window still starts at the first token: feed only what the cache lacks
            x = torch.tensor([window[kv.length:]], dtype=torch.long, device=s.device)
            logits = s.model(x, kv)[0, -1]
        else:  # the window slides (or no cache): recompute it whole
            kv = None
            logits = s.logits(torch.tensor([window], dtype=torch.long, device=s.device))[0]
        # Sampled on the CPU with the seed's CPU generator: one vocabulary-sized copy per
        # token (the token must come back to extend the window anyway), and a seed draws the
        # same tokens on every device.
        logits = logits.float().cpu()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        new.append(nxt)
    return new


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
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context for "
                   "every token instead of keeping keys and values (slower; for comparison)")
    p.add_argument("--which", default=None, help="run directory: 'average' or 'replica-K' "
                   "(default: the average where saved, else replica 0)")
    p.add_argument("--device", default="auto", help="where the model and its key/value cache "
                   "run: auto (the GPU where there is one), cpu or cuda (default auto)")
    p.set_defaults(func=_main)


def _main(ns: Any) -> int:
    text = generate(ns.path, ns.prompt, ns.max_tokens, ns.temperature, ns.top_k, ns.seed,
                    ns.which, cache=not ns.no_cache, device=ns.device)
    print(ns.prompt + text)
    return 0
