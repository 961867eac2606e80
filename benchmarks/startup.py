"""Start-up of a run: time to the first step, seconds spent tokenising, memory, for 1, 4 and 8
local replicas, with the machine's token file (tokenised once, by the launcher; every worker
maps it) against tokenising in every worker (``NOLOCO_TOKEN_CACHE=off``, as before the file).

Each configuration is one ``noloco train --steps 1`` (NoLoCo; one replica: single) in a fresh
process with an empty token cache, so the file is built inside the measured run. Recorded per
run, from its summary.json ``startup`` and from outside:
- ``tokenize_seconds``: tokenising seconds summed over every process of the run (launcher
  included; a worker that maps the file adds 0) — target with the file: ≤ 1.2 × one replica's;
- ``import_seconds_max``: the most any worker took from its start to building its trainer
  (importing torch, mostly): start-up that is not tokenising, reported apart, for what it is;
- ``first_step_seconds_max``: from a worker's start to the end of its first step (the slowest);
- ``wall_seconds``: the whole command, start to exit;
- ``corpus_private_bytes_sum``: token bytes held privately, summed over workers (with the file:
  0, the tokens sit once in the machine's page cache); ``pss_bytes_sum``: the workers'
  proportional set sizes summed (shared pages counted once).

Tokenizers: the byte tokenizer, and (with the ``hf`` extra) a local Hugging Face BPE
tokenizer trained by this script on the corpus (``tokenizers``, vocabulary ``--vocab``).

    python benchmarks/startup.py --record     # built-in corpus cut to --max-tokens (few MB)
    python benchmarks/startup.py --quick      # 1 and 2 replicas, byte tokenizer only
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TARGET = 1.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_run_flags(p, {"data": "corpus (default: built-in)"}, data=common.DEFAULT_DATA)
    p.add_argument("--max-tokens", type=int, default=3_000_000,
                   help="tokens of the corpus (default 3M: a few MB)")
    p.add_argument("--replicas", default="1,4,8", help="replica counts (default 1,4,8)")
    p.add_argument("--vocab", type=int, default=2048, help="the HF tokenizer's vocabulary")
    p.add_argument("--no-hf", action="store_true", help="only the byte tokenizer")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 and 2 replicas, bytes")
    common.add_output_flags(p, runs_dir=None, wait_quiet=False)
    a = p.parse_args(argv)
    if a.quick:
        a.replicas, a.no_hf, a.max_tokens = "1,2", True, min(a.max_tokens, 300_000)
    a.replica_counts = common.replica_counts(p, a.replicas, 1)
    common.check_data(p, a.data)
    return a


def hf_tokenizer(data: str, max_tokens: int, vocab: int, where: Path) -> Path | None:
    """A byte-level BPE tokenizer trained on the corpus's first documents (local file)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        print("note: no 'hf' extra: the Hugging Face tokenizer is left out", file=sys.stderr)
        return None
    from noloco.data import documents

    def texts():
        total = 0
        for _, text in documents(data):
            yield text
            total += len(text)
            if total > 4 * max_tokens:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    path = where / "tokenizer.json"
    tok.save(str(path))
    return path


def run(a: argparse.Namespace, replicas: int, tokenizer: str, cache: str, out: Path
        ) -> dict[str, Any]:
    method = (common.flags(method="single") if replicas == 1 else
              common.flags(method="noloco", replicas=replicas))
    cmd = common.noloco_train([
        *common.flags(data=a.data, tokenizer=tokenizer, max_tokens=a.max_tokens), *method,
        *common.flags(steps=1, eval_every=1, eval_sequences=4, batch_size=4, seq_len=64,
                      checkpoint_every=0, log_every=0)], out)
    _, wall = common.run_checked(cmd, env={**os.environ, "NOLOCO_TOKEN_CACHE": cache})
    return {**common.read_summary(out)["startup"], "wall_seconds": wall}


def measure(a: Any, scratch: Path) -> dict[str, Any]:
    """Every tokenizer x mode x replica count, its runs and token caches under ``scratch``."""
    tokenizers = {"bytes": "bytes"}
    if not a.no_hf:
        path = hf_tokenizer(a.data, a.max_tokens, a.vocab, scratch)
        if path is not None:
            tokenizers["hf"] = str(path)
    results: dict[str, Any] = {}
    for name, spec in tokenizers.items():
        for mode in ("file", "every-worker"):
            for n in a.replica_counts:
                cache = str(scratch / f"cache-{name}-{mode}-{n}") if mode == "file" else "off"
                r = run(a, n, spec, cache, scratch / f"run-{name}-{mode}-{n}")
                results.setdefault(name, {}).setdefault(mode, {})[str(n)] = r
                print(f"{name:>5} {mode:>12} {n} replicas: tokenise {r['tokenize_seconds']:6.2f}"
                      f" s (summed) | import {r['import_seconds_max'] or 0:5.2f} s | first step "
                      f"{r['first_step_seconds_max'] or 0:6.2f} s | wall {r['wall_seconds']:6.2f}"
                      f" s | private tokens {r['corpus_private_bytes_sum'] / 1e6:6.1f} MB",
                      flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t_start = time.perf_counter()
    rec = common.start_record("startup", dict(vars(a)))
    with tempfile.TemporaryDirectory(prefix="noloco-startup-") as tmp:
        results = measure(a, Path(tmp))
    judged = {}
    for name, modes in results.items():
        one = modes["file"][str(min(a.replica_counts))]["tokenize_seconds"]
        most = modes["file"][str(max(a.replica_counts))]["tokenize_seconds"]
        judged[name] = {"ratio_most_to_one": most / one if one > 0 else None,
                        "meets_target": one > 0 and most <= TARGET * one,
                        "private_tokens_with_file": modes["file"][str(max(a.replica_counts))][
                            "corpus_private_bytes_sum"]}
    out = {"runs": results, "judged": judged, "target_ratio": TARGET}
    json_path, png_path = common.out_paths("startup", a.out_dir, a.quick, a.record)
    common.write_record(json_path, rec, out, t_start)
    plt = common.pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.8), squeeze=False)
        for ax, (name, modes) in zip(axes[0], results.items(), strict=True):
            for mode, style in (("every-worker", "o--"), ("file", "o-")):
                xs = a.replica_counts
                ax.plot(xs, [modes[mode][str(n)]["tokenize_seconds"] for n in xs], style,
                        label=f"tokenise, {mode}")
                ax.plot(xs, [modes[mode][str(n)]["first_step_seconds_max"] or 0 for n in xs],
                        style, alpha=0.4, label=f"first step, {mode}")
            ax.set_xlabel("local replicas")
            ax.set_ylabel("seconds")
            ax.set_title(f"start-up, {name} tokenizer")
            ax.legend(fontsize=7)
        common.save_figure(fig, png_path)
    print(common.wrote(json_path, png_path if plt is not None else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
