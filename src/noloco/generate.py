"""``noloco generate``: sample text from a trained model — the quickest proof that training
worked.

The model comes from a run directory (``model/``: a replica or the replicas' average) with
the tokenizer the run trained with, or from a Hugging Face model directory
(``config.json`` + weights + tokenizer, e.g. one written by ``noloco export``).
Sampling: temperature, then top-k, one token at a time over the last ``max_seq_len`` tokens;
the seed draws one uniform number per token and the token is the first of the top-k whose
cumulative probability exceeds it (:func:`pick`).
The built-in model keeps its keys and values in a static cache (:class:`noloco.model.KVCache`),
so each new token costs one position's work while the text fits its context; past it the
window slides and every token recomputes its window (rotary positions restart with it), as
without a cache. Hugging Face models sample through transformers' own ``generate()``.

``--device`` (auto, cpu, cuda; auto is the GPU where there is one) holds the model, its cache
and the sampling; the weights are read on the CPU (as ``noloco export`` reads them: it needs no
GPU) and moved there. The draws come from the seed's CPU generator, so a seed picks the same
tokens on either device while the logits agree. The cached loop never waits for the device (the
tokens are read once, at the end), and on a GPU its one-token step is a CUDA graph replayed.

Floor 6 of docs/architecture.md: launching and watching runs, and what reads a run directory.
"""

from __future__ import annotations

import json
import sys
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


def pick(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_k: int | None
         ) -> torch.Tensor:
    """The token that the uniform draw ``u`` (shape (1,), in [0, 1)) picks from ``logits``
    (the vocabulary's, 1-D): divided by the temperature, cut to the ``top_k`` likeliest, then
    the first whose cumulative probability exceeds ``u`` (inverse CDF). Greedy at temperature 0.
    On the logits' device, shape (1,), with no host read: a captured step can hold it, and a
    seed's draws pick the same tokens on every device while the logits agree."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    z = logits.float() / temperature
    k = z.numel() if top_k is None else min(top_k, z.numel())
    values, index = torch.topk(z, k)  # descending
    cdf = torch.cumsum(torch.softmax(values, -1), -1)
    j = torch.searchsorted(cdf, u.to(cdf.dtype) * cdf[-1:], right=True).clamp_(max=k - 1)
    return index[j]


@torch.no_grad()  # (a caller's gradients would keep every step's graph, and slow forms)
def sample(s: _Sampler, ids: list[int], max_tokens: int, temperature: float,
           top_k: int | None, seed: int, cache: bool = True, graph: bool | None = None
           ) -> list[int]:
    """``max_tokens`` token ids after ``ids``. The seed's CPU generator draws one uniform per
    token up front (:func:`pick`). While the text fits the context the built-in model runs on
    its key/value cache (:func:`_cached`); past it the window slides and every token
    recomputes its window (as ``cache=False`` does throughout). ``graph=False``: step eagerly
    on a GPU too, instead of replaying the cached step as a CUDA graph (on the CPU there is
    none)."""
    u = torch.rand(max_tokens, generator=torch.Generator().manual_seed(seed)).to(s.device)
    new: list[int] = []
    if cache and s.model is not None and 0 < len(ids) <= s.context and max_tokens > 0:
        n = min(max_tokens, s.context - len(ids) + 1)
        use_graph = s.device.type == "cuda" and graph is not False  # (a GPU's alone)
        new = _cached(s.model, ids, n, u, temperature, top_k, use_graph)
    for i in range(len(new), max_tokens):  # the sliding window (or no cache)
        window = torch.tensor([(ids + new)[-s.context:]], dtype=torch.long, device=s.device)
        new.append(int(pick(s.logits(window)[0], u[i:i + 1], temperature, top_k)))
    return new


def _cached(model: Any, ids: list[int], n: int, u: torch.Tensor, temperature: float,
            top_k: int | None, graph: bool) -> list[int]:
    """``n`` tokens after ``ids`` on a static key/value cache of exactly the positions they
    need. The prompt goes in one forward; every later token is one step that reads its input
    token, its draw and its output slot from device tensors, so the loop never waits for the
    device and the host reads the tokens once, at the end. On a GPU the step is captured once
    as a CUDA graph and replayed: a token then costs one launch instead of one per kernel."""
    from noloco.model import KVCache

    device = u.device
    dtype = next(model.parameters()).dtype
    kv = KVCache(model.args, 1, len(ids) + n - 1, device, dtype)
    out = torch.empty(n, dtype=torch.long, device=device)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    first = pick(model(x, kv)[0, -1], u[:1], temperature, top_k)
    out[:1].copy_(first)
    token = first.view(1, 1).clone()
    at = torch.ones(1, dtype=torch.long, device=device)  # the index of the token being drawn

    def step() -> None:
        nxt = pick(model(token, kv)[0, -1], u.index_select(0, at), temperature, top_k)
        out.index_copy_(0, at, nxt)
        token.copy_(nxt.view(1, 1))
        at.add_(1)

    left = n - 1
    if graph and left >= 3:
        replay = _capture(step, kv, token, at)
        if replay is not None:
            for _ in range(left):
                replay.replay()
            left = 0
    for _ in range(left):
        step()
    return out.tolist()


def _capture(step: Any, kv: Any, token: torch.Tensor, at: torch.Tensor) -> Any:
    """``step`` as a CUDA graph, the state as it was before (the warm-up step's writes are
    undone: its cache slot is masked until a replay writes it again). None, said in one line,
    where capture fails: the caller runs the step eagerly, with the same numbers."""
    saved = kv.position.clone(), kv.length, token.clone(), at.clone()

    def restore() -> None:
        kv.position.copy_(saved[0])
        kv.length = saved[1]
        token.copy_(saved[2])
        at.copy_(saved[3])

    try:
        if at.device.type != "cuda":
            raise RuntimeError(f"the step's tensors are on {at.device}, not a GPU")
        with torch.cuda.device(at.device):  # the model's GPU, whichever is current
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # kernels, cuBLAS handles and the allocator warmed
                step()
            torch.cuda.current_stream().wait_stream(side)
            restore()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            restore()
            return g
    except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly
        if at.is_cuda:  # the warm-up's kernels on the model's GPU, before the state is reset
            torch.cuda.synchronize(at.device)
        restore()
        line = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        print(f"noloco: generate: CUDA graph capture failed ({line}); stepping eagerly",
              file=sys.stderr, flush=True)
        return None


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
