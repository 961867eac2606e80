"""A Hugging Face model trained with DiLoCo, then sampled.

Writes a small Llama config (no download: any local model directory works the same way, with
its weights), trains it with DiLoCo on 4 local replicas with ``noloco train --hf-model``, and
samples from the result with ``noloco generate``.

    python examples/hf_diloco.py [--steps 200] [--out runs/hf-diloco] [--data FILE]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--data", default="builtin")
    p.add_argument("--out", default="runs/hf-diloco")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="more noloco train flags")
    a = p.parse_args()
    from transformers import LlamaConfig  # the 'hf' extra

    model_dir = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
    LlamaConfig(vocab_size=257, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                tie_word_embeddings=False).save_pretrained(model_dir)
    noloco = [sys.executable, "-m", "noloco"]
    subprocess.run([*noloco, "train", "--hf-model", str(model_dir), "--method", "diloco",
                    "--replicas", str(a.replicas), "--sync-every", str(a.sync_every),
                    "--steps", str(a.steps), "--data", a.data, "--out", a.out, "--overwrite",
                    *a.extra], check=True)
    subprocess.run([*noloco, "generate", a.out, "--prompt", "def ", "--max-tokens", "80"],
                   check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
