"""Command line: ``noloco train | netsim | report``.

Every ``train`` flag is generated from the config tree (:mod:`noloco.config`), so a flag, a
TOML key and a ``config.json`` field always share one name. Precedence: defaults < ``--config
FILE.toml`` < flags. Bad input is one line on stderr and exit code 2, before anything is
written.

Floor 7 of docs/architecture.md: the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

# c10d's C++ warnings (a store wait that timed out, a client's unresolvable hostname) are
# noise to a user: our own one-line events say what happened. Set before torch loads, so
# every command and every worker it starts inherits it; TORCH_CPP_LOG_LEVEL=INFO shows them.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from noloco.config import (
    FAULTS,
    LOGGING,
    METHODS,
    RESUMABLE,
    Config,
    ConfigError,
    apply_overrides,
    flag_name,
    load_toml,
    section_fields,
)
from noloco.data import DataError

EXIT_USAGE = 2


class ArgParser(argparse.ArgumentParser):
    """Every noloco parser and subparser: one-line errors, and no abbreviated flags (argparse
    would take ``--step 5`` as ``--steps 5`` without a word; a flag is spelt out or refused)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw["allow_abbrev"] = False
        super().__init__(*args, **kw)

    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints two)
        self.exit(EXIT_USAGE, f"noloco: error: {message}\n")


def _train_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train", help="train a model (one process, or N replicas x P stages of workers)",
        description=f"Train with --method {'|'.join(METHODS)}. Locally, --replicas N starts "
        "N worker processes; under torchrun, this process is one worker. Flags by section of "
        "the config (model, data, optim, method, train), then reliability, elastic and "
        "faults, then logging.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", metavar="FILE.toml",
                   help="TOML file of settings (sections [model] [data] [optim] [method] [train] "
                        "or flat keys named like the flags); flags override it")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest complete checkpoint, to "
                        "--steps total inner steps; only --steps, --eval-every, --log-every, "
                        "checkpointing, timeout and fault flags may differ from the run's")
    add_config_flags(p)
    return p


def _simulate_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "simulate", help="run N replicas of a training run in this one process, as a batch "
        "dimension: the distributed run's math, without its processes",
        description="Simulate --replicas N of a `noloco train` run in one process: every "
        "replica's weights and optimizer state stacked, one batched step for all, and the "
        "methods' own outer steps over an in-process network. Takes train's flags (those a "
        "simulation cannot serve are refused in one line); writes the same run directory.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", metavar="FILE.toml",
                   help="TOML file of settings, as for train; flags override it")
    net = p.add_argument_group("network model (a modelled wall-clock beside the measured one)")
    net.add_argument("--bandwidth", metavar="RATE",
                     help="each replica's link, e.g. 100Mbit, 1Gbit: metrics and the summary "
                          "gain the wall-clock the run would take on it (netsim's model)")
    net.add_argument("--latency", metavar="TIME", help="per message, e.g. 50ms (default 0)")
    net.add_argument("--step-time", metavar="SECONDS", type=float,
                     help="one replica's inner step on the modelled hardware (default: this "
                          "process's step time divided by the replicas)")
    ch = p.add_argument_group("churn (replicas leaving and joining, as in an elastic run)")
    ch.add_argument("--churn", metavar="RATE", type=float,
                    help="the probability that a replica leaves during one outer step, in "
                         "[0, 1) (default 0: nobody leaves)")
    ch.add_argument("--churn-away", metavar="K", type=int,
                    help="outer steps a replica that left stays away before it joins from a "
                         "donor (default 1)")
    add_config_flags(p)
    p.set_defaults(func=simulate)
    return p


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """Every setting of the config tree as a flag."""
    # One group per section of the config, in its order, then the groups of flags that belong
    # to no one section (the reliability and elastic flags live in method and train).
    groups = {name: p.add_argument_group(name) for name in
              [*dict.fromkeys(sec for sec, _ in section_fields()), FAULTS, LOGGING]}
    for section, f in section_fields():
        g = groups[f.metadata.get("group") or section]
        default = getattr(getattr(Config(), section), f.name)
        help_text = f.metadata.get("help", "") + (f" (default: {default})" if default is not None
                                                   else "")
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        flag = flag_name(f)
        if isinstance(default, bool):
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           help=help_text)
        else:
            typ = {"int": int, "float": float, "str": str}
            ftype = str(f.type).replace(" | None", "")
            choices = f.metadata.get("choices")
            metavar = "{" + ",".join(choices) + "}" if choices else f.name.upper()
            g.add_argument(flag, dest=f.name, type=typ.get(ftype, str), metavar=metavar,
                           help=help_text)


def build_parser() -> argparse.ArgumentParser:
    from noloco import __version__

    parser = ArgParser(prog="noloco", description="Low-communication training of language "
                       "models: NoLoCo, DiLoCo, Streaming DiLoCo, SparseLoCo and data parallel.")
    parser.add_argument("--version", action="version", version=f"noloco {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgParser)
    _train_parser(sub)
    _simulate_parser(sub)
    from noloco.export import add_subparser as add_export
    from noloco.generate import add_subparser as add_generate
    from noloco.report import add_subparser as add_report
    add_generate(sub)
    add_export(sub)
    add_report(sub)
    from noloco.elastic.coordinator import add_subparser as add_coordinator
    from noloco.elastic.status import add_subparser as add_status
    add_coordinator(sub)
    add_status(sub)
    try:
        from noloco.netsim.cli import add_subparsers as add_netsim
        add_netsim(sub)
    except ImportError:  # pragma: no cover - netsim always ships with the package
        pass
    return parser


def _given(ns: argparse.Namespace) -> tuple[dict[str, Any], str | None, str | None]:
    """(the settings given on the command line, the --config file, the --resume directory)."""
    values = vars(ns).copy()
    for key in ("command", "func"):
        values.pop(key, None)
    return values, values.pop("config", None), values.pop("resume", None)


def config_from_args(ns: argparse.Namespace) -> Config:
    values, path, _ = _given(ns)
    cfg = Config()
    if path:
        apply_overrides(cfg, load_toml(path), origin=str(path))
    apply_overrides(cfg, values, origin="the command line")
    return cfg


def resume_config(ns: argparse.Namespace) -> Config:
    """The config of the run being resumed, with the settings that may change applied. A
    setting that would change the computed numbers is refused, naming its flag."""
    from noloco.rundir import RunDir

    values, path, run_dir = _given(ns)
    saved = RunDir(run_dir).read_config()
    wanted = Config.from_dict(saved.to_dict())
    if path:
        apply_overrides(wanted, load_toml(path), origin=str(path))
    apply_overrides(wanted, values, origin="the command line")
    if values.get("out") not in (None, run_dir) and Path(values["out"]) != Path(run_dir):
        raise ConfigError(f"--out cannot be combined with --resume (the run directory is "
                          f"{run_dir})")
    was, now = saved.to_dict(), wanted.to_dict()
    for section, f in section_fields():
        old, new = was[section][f.name], now[section][f.name]
        if old != new and f"{section}.{f.name}" not in RESUMABLE:
            raise ConfigError(f"{flag_name(f)} cannot change when resuming: the run in "
                              f"{run_dir} used {old!r}, not {new!r} (only "
                              f"{', '.join(_resumable_flags())} may differ)")
    wanted.train.out, wanted.train.overwrite = str(run_dir), False
    return wanted.resolved()


def _resumable_flags() -> list[str]:
    return [flag_name(f) for sec, f in section_fields()
            if f"{sec}.{f.name}" in RESUMABLE and f.name not in ("out", "overwrite")]


def train(ns: argparse.Namespace) -> int:
    from noloco.launch import supervisor_for, under_torchrun
    from noloco.rundir import RunDir

    resuming = getattr(ns, "resume", None) is not None
    cfg = resume_config(ns) if resuming else config_from_args(ns).resolved()
    from noloco.metrics import check_extras
    check_extras(cfg.train.tensorboard, cfg.train.wandb)
    if os.environ.get("RANK", "0") == "0":
        warn_about(cfg)
    m = cfg.method
    # The first outer step (of any fragment) comes after H/P inner steps.
    first_sync = m.sync_every // max(m.fragments, 1) if m.sync_every is not None else None
    if (first_sync is not None and cfg.train.steps < first_sync and m.replicas > 1
            and os.environ.get("RANK", "0") == "0"):
        print(f"noloco: warning: --steps {cfg.train.steps} ends before the first outer step "
              f"(after {first_sync} steps, --sync-every {m.sync_every}): the {m.replicas} "
              f"replicas will train independently", file=sys.stderr)
    from noloco.spec import WorkerSpec
    if under_torchrun():
        from noloco.worker import main as worker_main
        return worker_main(WorkerSpec.under_torchrun(cfg, resume=resuming,
                                                     must_resume=resuming))
    # Static or elastic: decided here, once (the launcher, the workers and their trainers
    # take the elastic parts as components).
    policy = None
    if cfg.method.elastic:
        from noloco.elastic.launcher import ElasticRun
        policy = ElasticRun()
    sup = supervisor_for(cfg, resuming, resuming, policy)
    if sup is not None:  # its workers' warm parent imports torch while this one prepares
        sup.prestart()
    try:
        load = _preflight(cfg, resuming)
        rundir = RunDir(cfg.train.out)
        if resuming:
            _preflight_resume(cfg)
            rundir.write_config(cfg)
        else:
            rundir.prepare(cfg, overwrite=cfg.train.overwrite)
        if sup is not None:
            code = sup.run()
        else:
            from noloco.worker import main as worker_main
            code = worker_main(WorkerSpec.under_torchrun(cfg, resuming, resuming,
                                                         rundir_ready=True))
    finally:
        if sup is not None:
            sup.starter.close()
    _add_launcher_startup(rundir, load, sup.starter.how if sup is not None else None)
    return code


def simulate(ns: argparse.Namespace) -> int:
    """``noloco simulate``: the replicas of a run in this process (:mod:`noloco.simulate`)."""
    import torch

    from noloco import distributed
    from noloco.data import make_tokenizer
    from noloco.rundir import RunDir
    from noloco.simulate import Simulation, check_simulable
    from noloco.simulate.run import memory_plan

    given = [f"--{k.replace('_', '-')}" for k in vars(ns) if k in NOT_SIMULATED]
    if given:
        raise ConfigError(f"noloco simulate: {given[0]} does not apply to a simulation (it "
                          f"keeps no checkpoints, starts no processes and has no network)")
    link = _link_model(ns)
    rate, away = ns.__dict__.pop("churn", None), ns.__dict__.pop("churn_away", None)
    cfg = config_from_args(ns).resolved()
    check_simulable(cfg)
    churn = _churn(cfg, rate, away)
    warn_about(cfg)
    distributed.check_device(cfg.train.device, 1)
    device = torch.device("cuda" if distributed.uses_cuda(cfg.train.device) else "cpu")
    _, _, line = memory_plan(cfg, make_tokenizer(cfg.data.tokenizer).vocab_size, device)
    src = cfg.data.data
    if src != "builtin" and not src.startswith("hf:") and not Path(src).exists():
        raise DataError(f"data path not found: {src}")
    rundir = RunDir(cfg.train.out)
    rundir.check(overwrite=cfg.train.overwrite)
    # one process: the cores, or --threads, at most OMP_NUM_THREADS where that is set (as a
    # worker counts them: something else may run on the same cores; torchrun's is ignored)
    distributed.limit_threads(1, cfg.train.threads)
    sim = Simulation(cfg, rundir, link, device, churn)  # reads the data: refused first
    print(line, file=sys.stderr, flush=True)
    rundir.prepare(cfg, overwrite=cfg.train.overwrite)
    sim.run()
    return 0


NOT_SIMULATED = {
    "checkpoint_every", "keep_checkpoints", "max_restarts", "respawn", "comm_timeout",
    "stall_warning", "peer_timeout", "max_lonely_outer_steps", "payload_mac", "secret_file",
    "run_id", "dashboard", "coordinator_timeout", "routing", "microbatches",
}
"""train's settings for processes, checkpoints and networks: refused by ``simulate`` when
given (those that change the math a simulation cannot serve are refused by
:func:`noloco.simulate.check_simulable`)"""


def _churn(cfg: Any, rate: float | None, away: int | None) -> Any:
    """The churn a simulation runs with (``--churn``, ``--churn-away``), or None."""
    from noloco.simulate.churn import Churn

    if not rate:
        if away is not None:
            raise ConfigError("--churn-away needs --churn RATE")
        if rate is not None and rate < 0:
            raise ConfigError(f"--churn must lie in [0, 1), got {rate:g}")
        return None
    if cfg.method.sync_every is None:
        raise ConfigError(f"--churn: replicas leave and join at outer steps, which --method "
                          f"{cfg.method.method} does not take")
    try:
        return Churn(rate, 1 if away is None else away, cfg.train.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _link_model(ns: argparse.Namespace) -> Any:
    """The network a simulation models (its flags taken out of ``ns``), or None."""
    from noloco.netsim.latency import NetsimError
    from noloco.netsim.predict import parse_bandwidth, parse_latency
    from noloco.simulate.link import LinkModel

    bandwidth = ns.__dict__.pop("bandwidth", None)
    latency = ns.__dict__.pop("latency", None)
    step_time = ns.__dict__.pop("step_time", None)
    if bandwidth is None:
        if latency is not None or step_time is not None:
            raise ConfigError("--latency and --step-time model a network: give --bandwidth too")
        return None
    if step_time is not None and not step_time > 0:
        raise ConfigError(f"--step-time must be > 0 seconds, got {step_time}")
    try:
        return LinkModel(parse_bandwidth(bandwidth), parse_latency(latency or 0.0), step_time)
    except NetsimError as e:
        raise ConfigError(str(e)) from None


def warn_about(cfg: Config) -> None:
    """Settings that run but are known to train badly: one line each, on stderr."""
    m = cfg.method
    if m.compress is not None and m.method in ("diloco", "streaming") and m.outer_momentum:
        print(f"noloco: warning: --compress with --outer-momentum {m.outer_momentum:g}: the "
              f"momentum re-applies every burst the error feedback releases and trains far "
              f"worse (docs/sparse.md); the default with --compress is 0, or use --method "
              f"sparseloco", file=sys.stderr, flush=True)


def _add_launcher_startup(rundir: Any, load: Any, workers: str | None) -> None:
    """The launcher's own tokenising (it builds the machine's token file before any worker
    starts) into the summary's start-up figures."""
    try:
        summary = rundir.read_summary()
    except (OSError, ValueError):
        return
    st = summary.get("startup")
    if summary.get("status") != "completed" or not isinstance(st, dict):
        return
    st["launcher_tokenized"] = load.tokenized
    st["launcher_seconds"] = load.seconds
    st["workers_start"] = workers  # warm.Starter.how; None: the one worker ran in the launcher
    st["tokenize_seconds"] += load.seconds if load.tokenized else 0.0
    rundir.update_summary(startup=st)


def _preflight_resume(cfg: Config) -> None:
    from noloco.checkpoint import complete_steps

    root = Path(cfg.train.out) / "checkpoints"
    steps = _elastic_steps(cfg) if cfg.method.elastic else complete_steps(root, cfg.world_size)
    if not steps:
        raise ConfigError(f"no complete checkpoint in {root}: nothing to resume")
    # an elastic run: every replica's own newest (one may have finished, another not)
    reached = steps[-1] if cfg.method.elastic else steps[0]
    if reached >= cfg.train.steps:
        raise ConfigError(f"the run in {cfg.train.out} already reached step {reached}: pass "
                          f"--steps above it to train further")
    if cfg.optim.schedule_steps < cfg.train.steps:
        print(f"noloco: note: the learning-rate schedule of this run ends at step "
              f"{cfg.optim.schedule_steps} (its --schedule-steps); later steps keep its final "
              f"learning rate", file=sys.stderr)


def _elastic_steps(cfg: Config) -> list[int]:
    """The newest complete checkpoint (of all its stages) of each of this machine's replicas
    that has one, newest first: each resumes from its own."""
    from noloco.config import local_replicas
    from noloco.elastic.files import newest_checkpoints

    newest = newest_checkpoints(Path(cfg.train.out),
                                local_replicas(cfg.train.replica_ids, cfg.method.replicas),
                                cfg.method.stages)
    return sorted((s for s in newest.values() if s is not None), reverse=True)


def _local_workers(cfg: Config) -> int:
    """The workers this machine starts (its replicas' stages)."""
    from noloco.config import local_replicas

    return len(local_replicas(cfg.train.replica_ids, cfg.method.replicas)) * cfg.method.stages


def _check_gpus(cfg: Config, workers: int, vocab_size: int) -> None:
    """On GPUs: refuse workers that cannot fit on the GPUs they share (noloco.footprint),
    then say where the workers train."""
    from noloco import distributed, footprint

    if not distributed.uses_cuda(cfg.train.device):
        return
    shape = footprint.model_shape(cfg, vocab_size)
    if shape is not None:
        import torch

        fp = footprint.estimate(cfg.resolved(), *shape)
        footprint.check_fits(fp, distributed.workers_per_gpu(workers),
                             distributed.gpu_memory_bytes(0), torch.cuda.get_device_name(0))
    print(distributed.placement_line(cfg.train.device, workers), file=sys.stderr, flush=True)


def _preflight(cfg: Config, resuming: bool) -> Any:
    """Catch bad input before any worker starts or anything is written; build the machine's
    token file on the way (the workers map it). Returns how the corpus was had."""
    from noloco import distributed
    from noloco.data import ShardedReader, make_tokenizer
    from noloco.rundir import RunDir
    from noloco.token_cache import cached_corpus

    workers = _local_workers(cfg)
    distributed.check_device(cfg.train.device, workers)
    RunDir(Path(cfg.train.out)).check(overwrite=cfg.train.overwrite or resuming)
    src = cfg.data.data
    if src != "builtin" and not src.startswith("hf:"):
        p = Path(src)
        if not p.exists():
            raise DataError(f"data path not found: {src}")
    tok = make_tokenizer(cfg.data.tokenizer)
    _check_gpus(cfg, workers, tok.vocab_size)
    corpus, load = cached_corpus(src, tok, cfg.data.seq_len, cfg.data.max_tokens,
                                 allow_binary=cfg.data.allow_binary)
    ShardedReader(corpus.train, cfg.data.seq_len, cfg.data.batch_size, 0, cfg.method.replicas)
    return load


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
