"""``noloco export RUN_DIR OUT_DIR``: a trained model in Hugging Face format.

Writes ``config.json`` (a ``LlamaConfig``: noloco's model is a Llama — pre-norm RMSNorm,
rotary attention, SwiGLU, untied output), ``model.safetensors`` and the tokenizer, so that
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` gives noloco's logits.

Two conventions differ and are converted, not approximated:
- rotary embeddings: noloco rotates interleaved pairs (x0, x1), (x2, x3), …; Hugging Face's
  Llama rotates the first half of each head against the second. Permuting the rows of
  ``wq`` and ``wk`` within each head (pair j → rows j and j + head_dim/2) makes the two the
  same function;
- the byte tokenizer: token b is byte b (0–255) and 256 ends a document. It is written as a
  ``tokenizers`` byte-level BPE without merges whose vocabulary maps each byte's printable
  stand-in to the byte's value, plus ``<|endoftext|>`` = 256.

Floor 6 of docs/architecture.md: launching and watching runs, and what reads a run directory.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from noloco.config import ConfigError

EOS = "<|endoftext|>"


def _permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from interleaved pairs to half-split, head by head."""
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return (w.view(n_heads, hd // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)
            .contiguous())


def hf_state_dict(state: dict[str, torch.Tensor], n_heads: int) -> dict[str, torch.Tensor]:
    """noloco parameter names and layouts → LlamaForCausalLM's."""
    names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    out = {}
    for k, v in state.items():
        v = v.detach().to(torch.float32).contiguous()
        if k == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = v
        elif k == "norm.weight":
            out["model.norm.weight"] = v
        elif k == "output.weight":
            out["lm_head.weight"] = v
        elif k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            part, leaf = rest.rsplit(".", 1)
            if part in ("attention.wq", "attention.wk"):
                v = _permute_rope(v, n_heads)
            out[f"model.layers.{i}.{names[part]}.{leaf}"] = v
        else:
            raise ValueError(f"no Hugging Face name for {k}")
    return out


HF_EXTRA = "export needs the 'hf' extra: pip install 'noloco[hf]'"


def llama_config(args: dict[str, Any], eos_id: int) -> Any:
    try:
        from transformers import LlamaConfig
    except ImportError:
        raise ConfigError(HF_EXTRA) from None

    return LlamaConfig(
        vocab_size=args["vocab_size"], hidden_size=args["dim"],
        intermediate_size=args["ffn_dim"], num_hidden_layers=args["n_layers"],
        num_attention_heads=args["n_heads"], num_key_value_heads=args["n_heads"],
        max_position_embeddings=args["max_seq_len"], rms_norm_eps=args["norm_eps"],
        rope_theta=args["rope_theta"], hidden_act="silu", attention_bias=False,
        mlp_bias=False, tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos_id,
        pad_token_id=None, torch_dtype="float32")


def byte_tokenizer() -> Any:
    """noloco's byte tokenizer as a Hugging Face fast tokenizer (ids = byte values)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise ConfigError(HF_EXTRA) from None

    stand_in = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins
    # GPT-2's byte → stand-in table: printable bytes map to themselves, the rest upwards.
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    assert set(table.values()) == set(stand_in)
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def export(run_dir: str | Path, out_dir: str | Path, which: str | None = None,
           overwrite: bool = False) -> Path:
    from safetensors.torch import save_file

    from noloco.checkpoint import MODEL_DIR, load_model

    run, out = Path(run_dir), Path(out_dir)
    index_path = run / MODEL_DIR / "model.json"
    if not index_path.is_file():
        raise ConfigError(f"{run} has no trained model (model/model.json is missing)")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    try:  # before anything is written
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError(HF_EXTRA) from None
    index = json.loads(index_path.read_text())
    try:
        model = load_model(run, which)
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    args = index["model_args"]
    tok_spec = index.get("tokenizer", "bytes")
    out.mkdir(parents=True, exist_ok=True)
    if args is None:  # trained with --hf-model: already a transformers model
        model.hf.save_pretrained(out)
    else:
        eos_id = args["vocab_size"] - 1  # bytes: 256; a tokenizer.json: its size + 1
        llama_config(args, eos_id).save_pretrained(out)
        save_file(hf_state_dict(model.state_dict(), args["n_heads"]),
                  str(out / "model.safetensors"), metadata={"format": "pt"})
    if tok_spec == "bytes":
        byte_tokenizer().save_pretrained(out)
    else:
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            raise ConfigError(HF_EXTRA) from None

        src = Path(tok_spec)
        src = src / "tokenizer.json" if src.is_dir() else src
        shutil.copyfile(src, out / "tokenizer.json")
        PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json")).save_pretrained(out)
    (out / "noloco.json").write_text(json.dumps({
        "run_dir": str(run.resolve()), "model": which or index["default"],
        "step": index.get("step"), "method": index.get("method")}, indent=2))
    return out


def add_subparser(sub: Any) -> None:
    p = sub.add_parser("export", help="write a trained model in Hugging Face format",
                       description="Write a run's trained model as a Hugging Face Llama "
                       "(config.json, model.safetensors, tokenizer).")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--which", default=None, help="'average' or 'replica-K' (default: the "
                   "average where saved, else replica 0)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    p.set_defaults(func=_main)


def _main(ns: argparse.Namespace) -> int:
    out = export(ns.run_dir, ns.out_dir, ns.which, ns.overwrite)
    print(f"wrote {out}/ (config.json, model.safetensors, tokenizer): "
          f"AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0
