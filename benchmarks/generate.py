"""Tokens per second of ``noloco generate`` with the key/value cache against without it.

One model of ``--preset`` (seed 0, random weights: speed does not depend on what was learnt)
samples ``--new-tokens`` tokens after a ``--prompt-tokens``-token prompt, with the cache
(each new token is one position's work) and without (each new token recomputes its whole
window, as before the cache), alternating which goes first over ``--repeats`` rounds, in one
process with the same threads. Both must give the same tokens (checked: the benchmark fails
otherwise). Target: cached ≥ 5× uncached on the ``small`` preset.

    python benchmarks/generate.py --record      # small preset, 256 new tokens
    python benchmarks/generate.py --quick       # tiny preset, 32 tokens (smoke run)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TARGET = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="model preset (default: small)")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens to sample (default 256)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default 32)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of both (default 2)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny, 32 tokens, 1 round")
    p.add_argument("--out-dir", default=None, help="where the JSON and PNG go")
    common.add_record_flag(p)
    a = p.parse_args(argv)
    if a.quick:
        a.preset, a.new_tokens, a.repeats = "tiny", 32, 1
    if min(a.new_tokens, a.prompt_tokens, a.repeats) < 1:
        p.error("--new-tokens, --prompt-tokens and --repeats must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import torch

    from noloco.data import ByteTokenizer
    from noloco.generate import _Sampler, sample
    from noloco.model import build, preset

    torch.set_num_threads(common.threads())
    t_start = time.perf_counter()
    args = preset(a.preset, vocab_size=257)
    if a.prompt_tokens + a.new_tokens > args.max_seq_len:
        raise SystemExit(f"prompt + new tokens exceed the preset's context {args.max_seq_len}")
    model = build(args, seed=0).eval()
    tok = ByteTokenizer()
    s = _Sampler(lambda ids: model(ids)[:, -1], tok.encode, tok.decode, args.max_seq_len,
                 model=model)
    prompt = [int(i) for i in torch.randint(0, 256, (a.prompt_tokens,),
                                            generator=torch.Generator().manual_seed(1))]
    rec = common.start_record("generate", vars(a))
    times: dict[str, list[float]] = {"cached": [], "uncached": []}
    tokens: dict[str, list[int]] = {}
    with torch.no_grad():
        for r in range(a.repeats):
            order = ["cached", "uncached"] if r % 2 == 0 else ["uncached", "cached"]
            for mode in order:
                t0 = time.perf_counter()
                out = sample(s, prompt, a.new_tokens, 0.8, 40, seed=0, cache=mode == "cached")
                times[mode].append(time.perf_counter() - t0)
                tokens.setdefault(mode, out)
                print(f"{mode:>8}: {a.new_tokens / times[mode][-1]:8.1f} tokens/s", flush=True)
    if tokens["cached"] != tokens["uncached"]:
        raise SystemExit("the cached and uncached samplers gave different tokens")
    tps = {m: a.new_tokens / statistics.median(t) for m, t in times.items()}
    results: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "seconds": times,
        "tokens_per_second": tps,
        "speedup": tps["cached"] / tps["uncached"],
        "same_tokens": True,
        "target_speedup": TARGET,
        "meets_target": tps["cached"] / tps["uncached"] >= TARGET,
    }
    print(f"speed-up {results['speedup']:.1f}x (target {TARGET}x on the small preset)")
    common.finish_record(rec, results, time.perf_counter() - t_start)
    json_path, png_path = common.out_paths("generate", a.out_dir, a.quick, a.record)
    common.write_json(json_path, rec)
    plt = common.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar(["uncached", "cached"], [tps["uncached"], tps["cached"]], color=["C1", "C0"])
        ax.set_ylabel("tokens / second")
        ax.set_title(f"generate, {a.preset}: {a.new_tokens} new tokens "
                     f"({results['speedup']:.1f}x)")
        common.save_figure(fig, png_path)
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
