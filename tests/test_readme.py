"""Every `noloco` command of the README runs as written, with few steps.

The commands are read from the README's ```bash blocks (``\\`` continuations joined, the parts
of ``a && b`` taken one by one); the TOML example is written where `--config` looks for it.
Each training command gets flags appended that shorten it (few steps, small batches: the last
value of a flag wins) — except resumes, which may only change --steps; `generate` samples 5
tokens. The two-machine torchrun
recipe needs two machines and is not run here; the GPU example is a ``console`` block (it
needs a GPU and the ``small`` preset).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from noloco.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
SHORT = ["--steps", "6", "--batch-size", "2", "--seq-len", "32", "--eval-sequences", "2",
         "--eval-every", "6", "--log-every", "0", "--checkpoint-every", "3"]


def readme_commands() -> list[list[str]]:
    text = README.read_text()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                part = part.split("#", 1)[0].strip()
                if part.startswith("noloco "):
                    cmds.append(shlex.split(part)[1:])
    return cmds


def test_readme_has_the_commands_it_should() -> None:
    cmds = readme_commands()
    assert len(cmds) >= 8
    assert {c[c.index("--method") + 1] for c in cmds if "--method" in c} >= {
        "ddp", "diloco", "noloco", "streaming"}


@pytest.mark.slow("every README command, with worker processes")
@pytest.mark.timeout(600)
def test_every_readme_command_runs(tmp_path, monkeypatch, capfd) -> None:
    monkeypatch.chdir(tmp_path)
    toml = re.search(r"```toml\n# (\S+)\n(.*?)```", README.read_text(), re.S)
    assert toml is not None
    Path(toml.group(1)).write_text(toml.group(2))
    for argv in readme_commands():
        if argv[0] in ("train", "simulate"):
            extra = ["--steps", "12"] if "--resume" in argv else SHORT
            if argv[0] == "simulate":  # (it keeps no checkpoints)
                extra = extra[:extra.index("--checkpoint-every")]
        else:
            extra = ["--max-tokens", "5"] if argv[0] == "generate" else []
        assert main([*argv, *extra]) == 0, " ".join(argv)
        out = capfd.readouterr().out
        if argv[0] in ("train", "simulate"):
            assert "done" in out and "nan" not in out, (argv, out[-2000:])
