"""The one typed config tree behind every run.

Every field carries its command-line flag and help text in its metadata, so `noloco train
--help`, TOML config files and the resolved `config.json` of a run all speak the same names.
Values left at ``None`` are resolved per method by :meth:`Config.resolved` (SPEC defaults:
NoLoCo H = 50, DiLoCo H = 100, ...). Validation raises :class:`ConfigError`, which the CLI
turns into a one-line message and exit code 2 before anything is written.

Floor 1 of docs/architecture.md: a run's description.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from noloco.addresses import ETCD_SCHEME, parse_address, parse_endpoints
from noloco.errors import ConfigError as ConfigError  # re-exported: its home is noloco.errors

# ---- each method's own rules ---------------------------------------------------------------
# Grouped and named per method here, on the config floor, not beside each method's module
# (noloco.methods, floor 2): the command line validates a config before it launches anything,
# in a process that imports no method, and nothing here may import above its floor
# (tests/test_layers.py). Rules that the method modules registered when imported would be
# skipped there without a sound; this table names every method (METHODS is its keys), so a
# new method has no name to validate without an entry (tests/test_cli.py checks the rules run
# with no method imported).


def _single_settings(m: MethodConfig) -> None:
    if m.replicas != 1:
        raise ConfigError("--method single runs one replica; use ddp, diloco, noloco or "
                          "streaming for --replicas > 1")


def _sparseloco_settings(m: MethodConfig) -> None:
    if m.outer_momentum is not None:
        raise ConfigError("--method sparseloco takes no --outer-momentum (its error feedback "
                          "is the momentum)")


def _noloco_settings(m: MethodConfig) -> None:
    if m.group_size < 2:
        raise ConfigError(f"--group-size must be >= 2, got {m.group_size}")
    if m.group_size > m.replicas:
        raise ConfigError(f"--group-size {m.group_size} is larger than --replicas "
                          f"{m.replicas}")
    if m.replicas % m.group_size:
        raise ConfigError(f"--replicas {m.replicas} is not divisible by --group-size "
                          f"{m.group_size}")


def _unfragmented(m: MethodConfig) -> None:
    """A method that syncs the whole model at once, unquantised."""
    if m.fragments > 1 or m.overlap_steps > 0 or m.quantize != "none":
        raise ConfigError("--fragments, --overlap-steps and --quantize apply to "
                          "--method streaming or noloco only")


def _fragment_schedule(m: MethodConfig) -> None:
    """Streaming DiLoCo's and NoLoCo's: H splits into P fragments' turns, and a sync in
    flight lands before its fragment's next turn."""
    if m.sync_every is None:
        return
    if m.sync_every % m.fragments:
        raise ConfigError(f"--sync-every {m.sync_every} must be divisible by "
                          f"--fragments {m.fragments}")
    if m.overlap_steps >= m.sync_every // m.fragments:
        raise ConfigError(f"--overlap-steps {m.overlap_steps} must be < H/P = "
                          f"{m.sync_every // m.fragments}")


class MethodRules(NamedTuple):
    """One method's own rules (:meth:`Config._validate_method` runs them in its order)."""

    fragments: Callable[[MethodConfig], None]
    """what it makes of --fragments, --overlap-steps and --quantize: checked once every
    method's ranges of them are (fragments >= 1, ...)"""
    settings: Callable[[MethodConfig], None] | None = None
    """its other settings: checked before the ranges every method shares"""


METHOD_RULES: dict[str, MethodRules] = {
    "single": MethodRules(_unfragmented, _single_settings),
    "ddp": MethodRules(_unfragmented),
    "diloco": MethodRules(_unfragmented),
    "noloco": MethodRules(_fragment_schedule, _noloco_settings),
    "streaming": MethodRules(_fragment_schedule),
    "sparseloco": MethodRules(_unfragmented, _sparseloco_settings),
}
METHODS = tuple(METHOD_RULES)
COMPRESSED_METHODS = ("sparseloco", "diloco", "streaming", "noloco")
"""the methods that take --compress topk:F[:BITS]"""
ROUTINGS = ("random", "fixed")
FRAGMENT_PATTERNS = ("strided", "sequential")
QUANT_FORMATS = ("none", "fp4", "int8", "fp8")
INNER_OPTIMIZERS = ("adamw", "muon")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
FAULTS, LOGGING = "reliability, elastic and faults", "logging"
"""--help groups of flags that belong to no one section (``opt(..., group=...)``)"""


def opt(default: Any, help: str, flag: str | None = None, **kw: Any) -> Any:
    """A dataclass field documented with its help text (and optional explicit flag name)."""
    meta = {"help": help, "flag": flag}
    meta.update(kw)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class ModelConfig:
    preset: str = opt("tiny", "model preset: tiny (~1M params), small (125M), medium, large")
    dropout: float = opt(0.0, "dropout probability inside the model")
    hf_model: str | None = opt(
        None, "train a Hugging Face causal LM from a local model directory or config.json "
        "instead of a preset (weights loaded when present, else initialised from --seed; "
        "--stages for Llama-family models)")


@dataclass(kw_only=True)
class DataConfig:
    data: str = opt(
        "builtin",
        "training text: 'builtin' (Python's standard library sources, offline), a text file "
        "or directory of text files, or hf:NAME[:CONFIG] (Hugging Face datasets, streaming)",
    )
    tokenizer: str = opt(
        "bytes", "'bytes' (byte-level, 256 tokens) or a local path to a Hugging Face tokenizer"
    )
    seq_len: int = opt(128, "tokens per training sequence")
    batch_size: int = opt(16, "sequences per inner step per replica")
    max_tokens: int = opt(
        50_000_000, "at most this many tokens are read from a corpus (hf streams are cut here)"
    )
    allow_binary: bool = opt(
        False, "train on files that are mostly not UTF-8 text (refused by default: more than "
        "2% invalid bytes usually means a binary file was picked up by mistake)")


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = opt(1e-3, "peak learning rate of the inner optimizer")
    inner_optimizer: str = opt(
        "adamw", "the inner optimizer: adamw, or muon (torch.optim.Muon for the matrices inside "
        "the transformer blocks, AdamW for embeddings, head and norms; as MuLoCo)",
        choices=INNER_OPTIMIZERS)
    warmup: int = opt(50, "linear warm-up steps (then cosine decay to lr/10)")
    weight_decay: float = opt(0.0, "AdamW weight decay of the inner optimizer")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    grad_clip: float = opt(1.0, "clip the gradient norm to this (0 disables)")
    grad_accum: int = opt(
        1, "gradient accumulation: each inner step averages the gradients of K microbatches of "
        "--batch-size sequences (a global batch K times larger in the same memory)")
    schedule_steps: int | None = opt(
        None, "inner steps the learning-rate schedule spans (warm-up, then cosine to lr/10); "
        "default --steps. Set it above --steps to train the first part of a longer run and "
        "continue it later with --resume, bit for bit as if it had never stopped")


@dataclass(kw_only=True)
class MethodConfig:
    method: str = opt("single", "training method: " + ", ".join(METHODS), choices=METHODS)
    replicas: int = opt(1, "data-parallel replicas N (worker processes = replicas x stages)")
    stages: int = opt(1, "pipeline stages P per replica")
    sync_every: int | None = opt(
        None, "H: inner steps between outer steps (default: noloco/streaming 50, diloco 100)"
    )
    outer_lr: float | None = opt(
        None, "outer learning rate (DiLoCo lr / NoLoCo beta; default 0.7)"
    )
    outer_momentum: float | None = opt(
        None, "outer momentum (DiLoCo mu, default 0.9 / NoLoCo alpha, default 0.5)"
    )
    nesterov: bool = opt(True, "DiLoCo/streaming outer SGD uses Nesterov momentum")
    group_size: int = opt(2, "NoLoCo: replicas averaged together at each outer step (n)")
    gamma: float | None = opt(None, "NoLoCo: pull towards the group's slow weights (default beta)")
    fragments: int = opt(1, "streaming: number of fragments the blocks are split into")
    fragment_pattern: str = opt("strided", "streaming: 'strided' (block k -> k mod P) or "
                                "'sequential' fragments", choices=FRAGMENT_PATTERNS)
    overlap_steps: int = opt(0, "streaming: tau, inner steps a fragment's sync overlaps with")
    merge_alpha: float = opt(
        0.5, "streaming: theta <- alpha*theta_local + (1-alpha)*theta_synced after the overlap"
    )
    quantize: str = opt("none", "format of exchanged outer gradients: " + ", ".join(QUANT_FORMATS),
        choices=QUANT_FORMATS)
    compress: str | None = opt(
        None, "sparseloco, diloco, streaming, noloco: send each replica's error-feedback "
        "buffer sparse, topk:FRACTION[:BITS] — the FRACTION largest entries of every chunk of "
        "4096, their values in BITS (2, 3, 4, 8 or 32; default 32) (sparseloco's default "
        "topk:0.02:2; the others: dense)")
    ef_decay: float | None = opt(
        None, "with --compress: the error feedback's decay (e <- decay*e + delta; sparseloco "
        "0.95, where it takes the place of outer momentum; the others 1.0)")
    routing: str = opt("random", "pipeline routing between stages in training: random or fixed",
                       choices=ROUTINGS)
    microbatches: int = opt(0, "pipeline microbatches per step (0: 2 x stages, at most the "
                            "batch size; see docs/pipeline.md)")
    comm_timeout: float = opt(
        120.0, "seconds a blocked collective or exchange waits before the run fails, naming the "
        "rank that stopped answering (one exchange of 1.5 GB at 100 Mbit/s fits; raise it for "
        "bigger models on slower links)", group=FAULTS)
    stall_warning: float = opt(
        30.0, "seconds blocked on a peer before a worker prints, once, which rank it is waiting "
        "for", group=FAULTS)
    elastic: bool = opt(
        False, "replicas are fault domains: one that dies or stalls is dropped after "
        "--peer-timeout and the others train on (noloco, diloco, streaming, sparseloco; "
        "with --stages: --routing fixed; docs/elastic.md)", group=FAULTS)
    update_guard: bool = opt(
        True, "noloco, diloco, streaming: check every update before it is used — a partner's "
        "(noloco) or this replica's own outer gradient (diloco, streaming) must be finite and "
        "within --guard-factor x the running median of recent update sizes; a rejected one is "
        "left out and listed in the summary (docs/security.md)", group=FAULTS)
    payload_mac: bool = opt(
        True, "elastic at a coordinator with a run secret: every payload replicas send each "
        "other (exchanges, quantised messages, join states) carries a MAC under a key from the "
        "secret; one that fails is dropped as if its sender were absent (docs/security.md)",
        group=FAULTS)
    guard_factor: float = opt(
        10.0, "the update guard's k: an update further than k x the running median of recent "
        "ones is rejected", group=FAULTS)
    peer_timeout: float = opt(
        10.0, "elastic: seconds a replica waits for a group member to arrive before going on "
        "without it, and silence after which a replica is dropped from the membership (the "
        "transfer itself, once everyone arrived, gets --comm-timeout)", group=FAULTS)
    max_lonely_outer_steps: int = opt(
        2, "elastic: outer steps a replica cut off from the run's store trains alone before "
        "it stops and waits for the link (up to --coordinator-timeout); bounds how far it "
        "runs ahead of the others, who meet it again when the link returns "
        "(docs/elastic.md)", group=FAULTS)


def default_out() -> str:
    """A new directory under runs/ for every local run; under torchrun, one name that every
    worker of the job derives alike (its run id), since their clocks and start times differ."""
    import os
    import time

    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and "RANK" in os.environ:
        return f"runs/torchrun-{run_id}"
    base = time.strftime("runs/%Y%m%d-%H%M%S")
    out, k = base, 2
    while os.path.exists(out):
        out, k = f"{base}-{k}", k + 1
    return out


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = opt(200, "inner steps per replica")
    eval_every: int = opt(50, "evaluate every K steps (and at the end)")
    eval_sequences: int = opt(
        128, "validation sequences per evaluation: the same fixed set whatever --batch-size, so "
        "runs with different batch sizes are scored on the same text")
    seed: int = opt(0, "random seed (model init, data order, NoLoCo groups)")
    out: str | None = opt(
        None, "run directory (default: a new runs/YYYYmmdd-HHMMSS; under torchrun "
        "runs/<its run id>)")
    threads: int | None = opt(
        None, "torch CPU threads per worker (default: this machine's cores divided by its "
        "workers, at least 1, and at most OMP_NUM_THREADS where that is set)")
    overwrite: bool = opt(False, "replace an existing run directory")
    checkpoint_every: str | None = opt(
        None, "save a checkpoint every K inner steps, or every DURATION (90s, 10min, 1h: the "
        "workers agree on the step), and at the end (default: every outer step (H) of "
        "diloco/noloco/streaming and every 100 steps of single/ddp for the tiny preset and "
        "--hf-model; every 10min for the bigger presets, whose saves cost seconds; 0 disables)")
    keep_checkpoints: int = opt(2, "keep the newest N complete checkpoints")
    max_restarts: int = opt(
        0, "restart the workers up to R times after one dies, from the newest checkpoint "
        "(local runs; under torchrun use torchrun's own --max-restarts)", group=FAULTS)
    coordinator: str | None = opt(
        None, "elastic across machines: HOST:PORT of a running `noloco coordinator`, or "
        "etcd://H1:P1,H2:P2,... of an etcd cluster that keeps the run's coordination; this "
        "machine runs the replicas of --replica-ids", group=FAULTS)
    replica_ids: str | None = opt(
        None, "elastic with --coordinator: the replicas this machine runs, e.g. 0-3 or 4,5 "
        "(default: all)", group=FAULTS)
    run_id: str | None = opt(
        None, "elastic: the run's name at its coordinator (letters, digits, '.', '_', '-'): "
        "runs that share a coordinator need different ones (default: derived from the run's "
        "settings, alike on every machine)", group=FAULTS)
    secret_file: str | None = opt(
        None, "elastic with --coordinator HOST:PORT: a file holding the run secret that the "
        "coordinator asks every machine to prove (NOLOCO_SECRET gives it instead; "
        "docs/security.md)", group=FAULTS)
    coordinator_timeout: float = opt(
        1800.0, "elastic: seconds a replica goes on while the run's store (the coordinator) "
        "does not answer (training alone for at most --max-lonely-outer-steps, then waiting); "
        "then it saves a checkpoint and stops", group=FAULTS)
    dashboard: int | None = opt(
        None, "elastic: serve a live view of the run (a page that refreshes itself: each "
        "replica's state, step and loss) on 127.0.0.1:PORT; `noloco status OUT` prints it",
        group=LOGGING)
    respawn: int = opt(
        0, "elastic: start a replica that died again, up to R times in all; it fetches the live "
        "state from a running replica and rejoins", group=FAULTS)
    inject_fault: str = opt(
        "", "testing tool: faults to inject, comma-separated: kill:REPLICA@STEP (SIGKILL), "
        "stall:REPLICA@STEP:SECONDS (SIGSTOP, then SIGCONT), hang:REPLICA@STEP[:SECONDS] (the "
        "training loop stops, the heartbeat goes on), crash:REPLICA@STEP (an error), "
        "corrupt:REPLICA@STEP:nan or corrupt:REPLICA@STEP:scale:F (its weights turn NaN or "
        "are multiplied by F), tamper:REPLICA@STEP (what it sends is altered on the wire), "
        "slow:REPLICA:FACTOR (its steps take FACTOR x as long), pace:REPLICA:SECONDS (its "
        "steps take at least SECONDS); REPLICA may be REPLICA.STAGE; all but slow and pace "
        "fire once, in the first attempt", group=FAULTS)
    device: str = opt("auto", "cpu, cuda or auto", choices=DEVICES)
    compile: bool = opt(
        False, "torch.compile the model (each pipeline stage): faster steps after a first one "
        "that compiles; where no compiler works it says so in one line and runs eagerly")
    precision: str = opt(
        "fp32", "fp32, or bf16: bf16 autocast for forward and backward (activations sent between "
        "pipeline stages in bf16); master weights, optimizer state, slow weights and all that "
        "replicas exchange stay fp32 (--quantize decides that)", choices=PRECISIONS)
    wandb: bool = opt(
        False, "also log every metric to Weights & Biases in offline mode under OUT/wandb/ "
        "(needs the 'wandb' extra; `wandb sync` uploads it later)", group=LOGGING)
    tensorboard: bool = opt(
        False, "also write every metric as TensorBoard events under OUT/tensorboard/ (needs "
        "the 'tb' extra)", group=LOGGING)
    log_every: int = opt(
        10, "print a progress line every this many steps when not on a terminal (0: never)",
        group=LOGGING)


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    # ---- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        cfg = cls()
        apply_overrides(cfg, d)
        return cfg

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    # ---- defaults that depend on the method -------------------------------------------
    def resolved(self) -> Config:
        """A copy with every method-dependent default filled in and everything validated."""
        cfg = Config.from_dict(self.to_dict())
        m = cfg.method
        if m.sync_every is None and m.method in ("diloco", "noloco", "streaming", "sparseloco"):
            m.sync_every = 100 if m.method == "diloco" else 50
        if m.outer_lr is None and m.method in ("diloco", "noloco", "streaming"):
            m.outer_lr = 0.7
        if m.method == "sparseloco":
            m.outer_lr = 1.0 if m.outer_lr is None else m.outer_lr
            m.compress = m.compress or "topk:0.02:2"
        if m.ef_decay is None and m.compress is not None:
            m.ef_decay = 0.95 if m.method == "sparseloco" else 1.0
        if m.outer_momentum is None and m.method in ("diloco", "noloco", "streaming"):
            # A sparse exchange's error feedback already carries what earlier rounds did not
            # send: an outer momentum on top re-applies each burst it releases, for about
            # 1/(1 − μ) outer steps (benchmarks/results/compress_momentum.json: +15% loss
            # over dense DiLoCo at μ 0.9, −11% at μ 0). docs/sparse.md.
            sparse_diloco = m.compress is not None and m.method != "noloco"
            m.outer_momentum = (0.5 if m.method == "noloco" else
                                0.0 if sparse_diloco else 0.9)
        if m.gamma is None and m.method == "noloco":
            m.gamma = m.outer_lr
        if cfg.optim.schedule_steps is None:
            cfg.optim.schedule_steps = cfg.train.steps
        if cfg.train.out is None:
            cfg.train.out = default_out()
        if cfg.train.checkpoint_every is None:
            # (an elastic pipeline's stages save alone: they need steps, see validate)
            if cfg.model.preset != "tiny" and cfg.model.hf_model is None and not (
                    m.elastic and m.stages > 1):
                # a save of `small` (1.7 GB with its optimizer) takes ~2.4 s to write: every
                # outer step cost ~10% of a GPU run's wall (docs/results.md, issue 34)
                cfg.train.checkpoint_every = DEFAULT_CHECKPOINT_INTERVAL
            else:
                cfg.train.checkpoint_every = str(m.sync_every if m.sync_every is not None
                                                 else 100)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """ConfigError for the first setting that cannot run, section by section."""
        self._validate_basics()
        what, n_layers = self._validate_model()
        self._validate_numbers()
        self._validate_method(what, n_layers)
        self._validate_train()
        self._validate_elastic(n_layers)
        self._validate_faults_and_device()

    def _validate_basics(self) -> None:
        """Names that must be known, counts that must be positive."""
        from noloco.model import PRESETS

        m, d, o, t = self.method, self.data, self.optim, self.train
        if self.model.preset not in PRESETS:
            raise ConfigError(
                f"unknown preset {self.model.preset!r} (choose from {', '.join(PRESETS)})"
            )
        if m.method not in METHODS:
            raise ConfigError(f"unknown method {m.method!r} (choose from {', '.join(METHODS)})")
        _positive("--replicas", m.replicas)
        _positive("--stages", m.stages)
        _positive("--steps", t.steps)
        if t.threads is not None:
            _positive("--threads", t.threads)
        _positive("--batch-size", d.batch_size)
        _positive("--grad-accum", o.grad_accum)
        if o.inner_optimizer not in INNER_OPTIMIZERS:
            raise ConfigError(f"unknown --inner-optimizer {o.inner_optimizer!r} (choose from "
                              f"{', '.join(INNER_OPTIMIZERS)})")
        if t.precision not in PRECISIONS:
            raise ConfigError(f"unknown --precision {t.precision!r} (choose from "
                              f"{', '.join(PRECISIONS)})")
        if o.grad_accum > 1 and m.stages > 1:
            raise ConfigError("--grad-accum with --stages > 1: a pipeline accumulates over its "
                              "--microbatches already (raise --batch-size and --microbatches)")
        _positive("--seq-len", d.seq_len)
        _positive("--eval-every", t.eval_every)
        _positive("--eval-sequences", t.eval_sequences)

    def _validate_model(self) -> tuple[str, int]:
        """The sequence and the stages the model can take; (how to name it, its blocks)."""
        from noloco.model import PRESETS

        m, d = self.method, self.data
        if self.model.hf_model is not None:
            from noloco import hf

            hf_cfg = hf.load_config(self.model.hf_model)
            what, max_len, n_layers = (f"--hf-model {self.model.hf_model}",
                                       hf.max_positions(hf_cfg), hf.n_layers(hf_cfg))
            if m.stages > 1:
                _check_hf_stages(hf_cfg, self.model.hf_model)
        else:
            what = f"preset {self.model.preset!r}"
            max_len = PRESETS[self.model.preset].max_seq_len
            n_layers = PRESETS[self.model.preset].n_layers
        if d.seq_len > max_len:
            raise ConfigError(f"--seq-len {d.seq_len} exceeds what {what} can take ({max_len})")
        if m.stages > n_layers:
            raise ConfigError(
                f"--stages {m.stages} is more than the {n_layers} blocks of {what}"
            )
        return what, n_layers

    def _validate_numbers(self) -> None:
        """Rates, momenta and probabilities in their ranges."""
        m, o, t = self.method, self.optim, self.train
        for name, v in (("--lr", o.lr), ("--outer-lr", m.outer_lr),
                        ("--outer-momentum", m.outer_momentum), ("--gamma", m.gamma),
                        ("--weight-decay", o.weight_decay), ("--grad-clip", o.grad_clip)):
            if v is not None and (v < 0 or not math.isfinite(v)):
                raise ConfigError(f"{name} must be a finite non-negative number, got {v}")
        for name, v, hi in (("--beta1", o.beta1, 1.0), ("--beta2", o.beta2, 1.0),
                            ("--dropout", self.model.dropout, 1.0),
                            ("--outer-momentum", m.outer_momentum, 1.0)):
            if v is not None and not 0.0 <= v < hi:
                raise ConfigError(f"{name} must lie in [0, {hi:g}), got {v}")
        if t.log_every < 0:
            raise ConfigError(f"--log-every must be >= 0, got {t.log_every}")
        if o.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {o.warmup}")

    def _validate_method(self, what: str, n_layers: int) -> None:
        """The method's own settings: encodings, groups, fragments, timeouts."""
        m, d = self.method, self.data
        if m.compress is not None:
            if m.method not in COMPRESSED_METHODS:
                raise ConfigError(f"--compress applies to --method "
                                  f"{', '.join(COMPRESSED_METHODS)}, not {m.method}")
            if m.quantize != "none":
                raise ConfigError(f"--compress and --quantize {m.quantize} are two encodings "
                                  f"of one exchange: choose one")
            from noloco.sparse import parse

            try:
                parse(m.compress)
            except ValueError as e:
                raise ConfigError(f"--compress {m.compress}: {e}") from None
        if m.ef_decay is not None and m.compress is None:
            raise ConfigError("--ef-decay applies to a sparse exchange: add --compress "
                              "topk:FRACTION[:BITS] (or use --method sparseloco)")
        if m.ef_decay is not None and not 0.0 <= m.ef_decay <= 1.0:
            raise ConfigError(f"--ef-decay must lie in [0, 1], got {m.ef_decay}")
        rules = METHOD_RULES[m.method]
        if rules.settings is not None:
            rules.settings(m)
        if m.sync_every is not None and m.sync_every < 1:
            raise ConfigError(f"--sync-every (H) must be >= 1, got {m.sync_every}")
        if m.routing not in ROUTINGS:
            raise ConfigError(f"unknown routing {m.routing!r} (choose from random, fixed)")
        if m.fragment_pattern not in FRAGMENT_PATTERNS:
            raise ConfigError(f"unknown fragment pattern {m.fragment_pattern!r} "
                              f"(choose from strided, sequential)")
        if m.quantize not in QUANT_FORMATS:
            raise ConfigError(f"unknown quantization format {m.quantize!r} "
                              f"(choose from {', '.join(QUANT_FORMATS)})")
        _positive("--fragments", m.fragments)
        if m.fragments > n_layers:
            raise ConfigError(f"--fragments {m.fragments} is more than the {n_layers} blocks "
                              f"of {what}")
        if not 0.0 <= m.merge_alpha <= 1.0:
            raise ConfigError(f"--merge-alpha must lie in [0, 1], got {m.merge_alpha}")
        if m.overlap_steps < 0:
            raise ConfigError(f"--overlap-steps must be >= 0, got {m.overlap_steps}")
        rules.fragments(m)
        if m.microbatches < 0:
            raise ConfigError(f"--microbatches must be >= 0, got {m.microbatches}")
        if m.microbatches > d.batch_size:
            raise ConfigError(f"--microbatches {m.microbatches} exceeds --batch-size "
                              f"{d.batch_size}")
        if not m.comm_timeout > 0:
            raise ConfigError("--comm-timeout must be > 0")
        if not m.guard_factor > 1:
            raise ConfigError(f"--guard-factor must be > 1, got {m.guard_factor:g}")
        if not m.stall_warning > 0:
            raise ConfigError("--stall-warning must be > 0")

    def _validate_train(self) -> None:
        """The schedule and the checkpoints."""
        m, o, t = self.method, self.optim, self.train
        if o.schedule_steps is not None:
            _positive("--schedule-steps", o.schedule_steps)
        if t.checkpoint_every is not None:
            _, seconds = checkpoint_cadence(t.checkpoint_every)
            if seconds is not None and m.elastic and m.stages > 1:
                raise ConfigError("--checkpoint-every DURATION with --elastic --stages: each "
                                  "stage saves alone, so give steps (every stage saves the "
                                  "same ones)")
        _positive("--keep-checkpoints", t.keep_checkpoints)

    def _validate_elastic(self, n_layers: int) -> None:
        """An elastic run's settings, and the flags that need one."""
        m, t = self.method, self.train
        if m.elastic and m.stages > 1 and m.fragments > 1:
            # A stage that holds no block of a fragment skips that fragment's operations; the
            # stages of an elastic replica count their operations alike (they share each
            # operation's snapshot, and compare their standing after each), so every stage
            # must hold a block of every fragment.
            from noloco.split import fragment_of_block, stage_blocks

            fewest = min(len(stage_blocks(n_layers, m.stages, st)) for st in range(m.stages))
            for stage in range(m.stages):
                held = {fragment_of_block(b, n_layers, m.fragments, m.fragment_pattern)
                        for b in stage_blocks(n_layers, m.stages, stage)}
                if len(held) < m.fragments:
                    missing = min(set(range(m.fragments)) - held)
                    raise ConfigError(
                        f"--elastic with --stages {m.stages} and --fragments {m.fragments}: "
                        f"stage {stage} holds no block of fragment {missing} "
                        f"(--fragment-pattern {m.fragment_pattern}); every stage must hold a "
                        f"block of every fragment (strided, at most {fewest} fragments here)")
        if m.elastic:
            if m.method not in ("noloco", "diloco", "streaming", "sparseloco"):
                raise ConfigError(f"--elastic applies to noloco, diloco, streaming and "
                                  f"sparseloco, not {m.method}")
            if m.stages > 1 and m.routing != "fixed":
                raise ConfigError("--elastic with --stages > 1 needs --routing fixed: with "
                                  "random routing activations cross replicas every step, so a "
                                  "replica is not a fault domain (docs/elastic.md)")
            if t.max_restarts:
                raise ConfigError("--elastic replaces --max-restarts (the other replicas go on; "
                                  "use --respawn to restart the dead one)")
            if not m.peer_timeout > 0:
                raise ConfigError("--peer-timeout must be > 0")
            if m.max_lonely_outer_steps < 0:
                raise ConfigError("--max-lonely-outer-steps must be >= 0 (0: a replica cut "
                                  "off waits for the link at once)")
        if (t.coordinator or t.replica_ids) and not m.elastic:
            raise ConfigError("--coordinator and --replica-ids need --elastic")
        if t.coordinator and t.coordinator.startswith(ETCD_SCHEME):
            try:
                parse_endpoints(t.coordinator)
            except ValueError as e:
                raise ConfigError(f"--coordinator {t.coordinator}: {e}") from None
        elif t.coordinator:
            parse_address(t.coordinator)
        if t.run_id is not None and not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", t.run_id):
            raise ConfigError(f"--run-id takes 1-64 letters, digits, '.', '_' or '-', got "
                              f"{t.run_id!r}")
        if t.secret_file is not None and (not t.coordinator
                                          or t.coordinator.startswith(ETCD_SCHEME)):
            raise ConfigError("--secret-file needs --coordinator HOST:PORT (an etcd cluster "
                              "uses etcd's own authentication: docs/security.md)")
        if (t.run_id is not None or t.coordinator_timeout != 1800.0
                or t.dashboard is not None) and not m.elastic:
            raise ConfigError("--run-id, --coordinator-timeout and --dashboard need --elastic")
        if t.dashboard is not None and not 0 <= t.dashboard < 65536:
            raise ConfigError(f"--dashboard takes a port (0-65535), got {t.dashboard}")
        if m.elastic and not t.coordinator_timeout > m.peer_timeout:
            raise ConfigError(f"--coordinator-timeout ({t.coordinator_timeout:g} s) must be "
                              f"longer than --peer-timeout ({m.peer_timeout:g} s)")
        local_replicas(t.replica_ids, m.replicas)
        if t.respawn < 0:
            raise ConfigError(f"--respawn must be >= 0, got {t.respawn}")
        if t.respawn and not m.elastic:
            raise ConfigError("--respawn needs --elastic")
        if t.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {t.max_restarts}")

    def _validate_faults_and_device(self) -> None:
        m, t = self.method, self.train
        from noloco.faults import parse_faults

        if any(f.kind == "tamper" for f in parse_faults(t.inject_fault, m.replicas, m.stages)) \
                and not m.elastic:
            raise ConfigError("--inject-fault tamper: applies to elastic runs (what their "
                              "replicas send each other is sealed; a static run's is gloo's)")
        if t.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"unknown device {t.device!r} (choose from auto, cpu, cuda)")

    @property
    def world_size(self) -> int:
        return self.method.replicas * self.method.stages

    def math_dict(self) -> dict[str, dict[str, Any]]:
        """The settings that decide the numbers a run computes: everything except
        :data:`RESUMABLE` (how long to train, how often to evaluate, log and save, timeouts,
        fault injection)."""
        d = self.to_dict()
        for key in RESUMABLE:
            sec, name = key.split(".")
            d[sec].pop(name, None)
        return d

    def run_id(self) -> str:
        """The run's name at its coordinator: ``--run-id``, or a hash of the settings that
        every machine of the run shares (not where its data lies, nor its device or
        threads) — so a machine's command run again finds its run."""
        if self.train.run_id:
            return self.train.run_id
        d = self.math_dict()
        d["data"].pop("data", None)
        for name in ("threads", "device", "compile"):
            d["train"].pop(name, None)
        return "r" + hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def math_hash(self) -> str:
        """A short hash of :meth:`math_dict`: a checkpoint only loads into a run of the same."""
        blob = json.dumps(self.math_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


RESUMABLE = ("train.steps", "train.eval_every", "train.log_every", "train.out", "train.tensorboard",
             "train.wandb", "train.overwrite", "train.checkpoint_every",
             "train.keep_checkpoints", "train.max_restarts", "train.inject_fault",
             "method.comm_timeout", "method.stall_warning", "method.elastic",
             "method.peer_timeout", "method.max_lonely_outer_steps", "method.payload_mac",
             "train.respawn", "train.coordinator",
             "train.replica_ids",
             "train.run_id", "train.coordinator_timeout", "train.dashboard",
             "train.secret_file")
"""Settings that may differ when a run is resumed: none of them changes the computed numbers
(weights, losses, bytes), only how long the run goes, what it logs and saves, and how long it
waits for peers."""


def _check_hf_stages(hf_cfg: Any, path: str) -> None:
    """--stages > 1 cuts Llama-family models only (:func:`noloco.hf.llama_like`)."""
    if getattr(hf_cfg, "tie_word_embeddings", False):
        raise ConfigError(f"--hf-model {path} with --stages > 1: its input and output embeddings "
                          f"are tied (set tie_word_embeddings false in its config.json)")
    if getattr(hf_cfg, "model_type", None) not in LLAMA_LIKE:
        raise ConfigError(f"--hf-model {path} with --stages > 1: pipeline stages are built for "
                          f"Llama-family models ({', '.join(LLAMA_LIKE)}), not "
                          f"{getattr(hf_cfg, 'model_type', '?')}")


LLAMA_LIKE = ("llama", "mistral", "qwen2")
"""Hugging Face model types laid out like Llama (embed_tokens, decoder layers taking rotary
position embeddings, norm, lm_head): the ones --stages can cut"""


def local_replicas(spec: str | None, replicas: int) -> list[int]:
    """``--replica-ids``: "0-3", "4,5" or "0-1,6" → replica numbers (default: all)."""
    if not spec:
        return list(range(replicas))
    out: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise ConfigError(f"--replica-ids must look like 0-3 or 4,5, got {spec!r}") from None
    if not out or len(set(out)) != len(out) or not all(0 <= r < replicas for r in out):
        raise ConfigError(f"--replica-ids {spec} must name distinct replicas in 0..{replicas - 1}")
    return sorted(out)


def _positive(flag: str, v: int) -> None:
    if v < 1:
        raise ConfigError(f"{flag} must be >= 1, got {v}")


SECTIONS = {f.name: f.type for f in fields(Config)}


def section_fields() -> list[tuple[str, dataclasses.Field]]:
    """(section name, field) for every leaf of the tree, in declaration order."""
    cfg = Config()
    out = []
    for sec in fields(Config):
        for f in fields(getattr(cfg, sec.name)):
            out.append((sec.name, f))
    return out


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


DEFAULT_CHECKPOINT_INTERVAL = "10min"
"""the checkpoint cadence of the presets above tiny"""

_UNITS = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def checkpoint_cadence(spec: str | int) -> tuple[int, float | None]:
    """``--checkpoint-every``: "50" → (50, None), every 50 steps; "10min" → (0, 600.0), every
    600 seconds; "0" → (0, None), never. A ConfigError names anything else."""
    text = str(spec).strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
    if m is not None and not m.group(2) and "." not in m.group(1):
        return int(m.group(1)), None
    if m is not None and m.group(2) in _UNITS and float(m.group(1)) > 0:
        return 0, float(m.group(1)) * _UNITS[m.group(2)]
    raise ConfigError(f"--checkpoint-every takes inner steps (50; 0: never) or a duration "
                      f"(90s, 10min, 1h), got {spec!r}")


def _leaf_index() -> dict[str, tuple[str, str]]:
    """Every accepted key (field name, with '-' or '_') → (section, field)."""
    idx = {}
    for sec, f in section_fields():
        idx[f.name] = (sec, f.name)
        idx[f.name.replace("_", "-")] = (sec, f.name)
    return idx


def apply_overrides(cfg: Config, values: dict[str, Any], origin: str = "config") -> None:
    """Apply nested ({"method": {"replicas": 4}}) or flat ({"replicas": 4}) values in place."""
    idx = _leaf_index()
    for key, val in values.items():
        if isinstance(val, dict) and key in SECTIONS:
            sub = getattr(cfg, key)
            names = {f.name for f in fields(sub)}
            for k2, v2 in val.items():
                k2n = k2.replace("-", "_")
                if k2n not in names:
                    raise ConfigError(f"unknown key {key}.{k2} in {origin}")
                setattr(sub, k2n, _coerce(sub, k2n, v2, origin))
        elif key in idx:
            sec, name = idx[key]
            sub = getattr(cfg, sec)
            setattr(sub, name, _coerce(sub, name, val, origin))
        else:
            raise ConfigError(f"unknown key {key!r} in {origin}")


def _coerce(obj: Any, name: str, val: Any, origin: str) -> Any:
    default = getattr(type(obj)(), name)
    ftype = {f.name: f.type for f in fields(obj)}[name]
    if val is None:
        return None
    try:
        if isinstance(default, bool) or ftype == "bool":
            if isinstance(val, str):
                return val.lower() in ("1", "true", "yes", "on")
            return bool(val)
        if "int" in str(ftype) and "float" not in str(ftype):
            if isinstance(val, float) and not val.is_integer():
                raise ValueError
            return int(val)
        if "float" in str(ftype):
            return float(val)
        return str(val)
    except (TypeError, ValueError):
        raise ConfigError(f"bad value {val!r} for {name} in {origin}") from None


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot parse config file {p}: {e}") from None
