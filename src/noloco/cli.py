"""Command line: ``noloco train | netsim | report``.

Every ``train`` flag is generated from the config tree (:mod:`noloco.config`), so a flag, a
TOML key and a ``config.json`` field always share one name. Precedence: defaults < ``--config
FILE.toml`` < flags. Bad input is one line on stderr and exit code 2, before anything is
written.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from noloco.config import Config, ConfigError, apply_overrides, flag_name, load_toml, section_fields
from noloco.data import DataError

EXIT_USAGE = 2


class ArgParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints two)
        self.exit(EXIT_USAGE, f"noloco: error: {message}\n")


def _train_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train", help="train a model (one process, or N replicas x P stages of workers)",
        description="Train with --method single|ddp|diloco|noloco|streaming. Locally, "
        "--replicas N starts N worker processes; under torchrun, this process is one worker.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", metavar="FILE.toml",
                   help="TOML file of settings (sections [model] [data] [optim] [method] [train] "
                        "or flat keys named like the flags); flags override it")
    groups = {}
    for section, f in section_fields():
        g = groups.get(section) or p.add_argument_group(section)
        groups[section] = g
        default = getattr(getattr(Config(), section), f.name)
        help_text = f.metadata.get("help", "") + (f" (default: {default})" if default is not None
                                                   else "")
        flag = flag_name(f)
        if isinstance(default, bool):
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           help=help_text)
        else:
            typ = {"int": int, "float": float, "str": str}
            ftype = str(f.type).replace(" | None", "")
            g.add_argument(flag, dest=f.name, type=typ.get(ftype, str), metavar=f.name.upper(),
                           help=help_text)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = ArgParser(prog="noloco", description="Low-communication training of language "
                       "models: NoLoCo, DiLoCo, Streaming DiLoCo and data parallel.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgParser)
    _train_parser(sub)
    try:
        from noloco.netsim.cli import add_subparsers as add_netsim
        add_netsim(sub)
    except ImportError:  # pragma: no cover - netsim always ships with the package
        pass
    return parser


def config_from_args(ns: argparse.Namespace) -> Config:
    cfg = Config()
    values = vars(ns).copy()
    values.pop("command", None)
    values.pop("func", None)
    path = values.pop("config", None)
    if path:
        apply_overrides(cfg, load_toml(path), origin=str(path))
    apply_overrides(cfg, values, origin="the command line")
    return cfg


def train(ns: argparse.Namespace) -> int:
    from noloco.launch import launch_local, under_torchrun
    from noloco.rundir import RunDir

    cfg = config_from_args(ns).resolved()
    if under_torchrun():
        from noloco.worker import run
        run(cfg)
        return 0
    _preflight(cfg)
    RunDir(cfg.train.out).prepare(cfg, overwrite=cfg.train.overwrite)
    launch_local(cfg)
    return 0


def _preflight(cfg: Config) -> None:
    """Catch bad data before any worker starts or anything is written."""
    from pathlib import Path

    from noloco.data import make_tokenizer
    from noloco.rundir import RunDir

    RunDir(Path(cfg.train.out)).check(cfg.train.overwrite)
    src = cfg.data.data
    if src != "builtin" and not src.startswith("hf:"):
        p = Path(src)
        if not p.exists():
            raise DataError(f"data path not found: {src}")
    tok = make_tokenizer(cfg.data.tokenizer)
    from noloco.data import ShardedReader, load_corpus
    corpus = load_corpus(src, tok, cfg.data.seq_len, cfg.data.max_tokens)
    ShardedReader(corpus.train, cfg.data.seq_len, cfg.data.batch_size, 0, cfg.method.replicas)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        return int(e.code or 0)
    try:
        if ns.command == "train":
            return train(ns)
        return ns.func(ns)
    except (ConfigError, DataError) as e:
        print(f"noloco: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("noloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
