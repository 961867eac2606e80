from __future__ import annotations

import json
import subprocess
import sys

import pytest

from noloco.cli import build_parser, config_from_args, main
from noloco.config import Config, ConfigError


def cfg_of(argv: list[str]) -> Config:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_flags_set_the_config_tree():
    cfg = cfg_of(["--method", "noloco", "--replicas", "4", "--steps", "7", "--lr", "0.01",
                  "--no-nesterov", "--seq-len", "32"])
    assert cfg.method.method == "noloco" and cfg.method.replicas == 4
    assert cfg.train.steps == 7 and cfg.optim.lr == 0.01 and cfg.method.nesterov is False
    assert cfg.data.seq_len == 32


def test_config_file_and_flag_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('steps = 11\n[method]\nmethod = "diloco"\nreplicas = 2\n'
                 '[optim]\nlr = 0.002\n[data]\nbatch-size = 3\n')
    cfg = cfg_of(["--config", str(f), "--replicas", "4"])
    assert cfg.train.steps == 11 and cfg.method.method == "diloco"
    assert cfg.method.replicas == 4  # the flag wins over the file
    assert cfg.optim.lr == 0.002 and cfg.data.batch_size == 3


def test_method_defaults_resolve_per_spec():
    r = cfg_of(["--method", "noloco", "--replicas", "2"]).resolved().method
    assert (r.sync_every, r.outer_lr, r.outer_momentum, r.gamma) == (50, 0.7, 0.5, 0.7)
    r = cfg_of(["--method", "diloco", "--replicas", "2"]).resolved().method
    assert (r.sync_every, r.outer_lr, r.outer_momentum, r.nesterov) == (100, 0.7, 0.9, True)
    r = cfg_of(["--method", "diloco", "--replicas", "2", "--sync-every", "10"]).resolved().method
    assert r.sync_every == 10
    # a sparse exchange's error feedback under an outer momentum trains badly (docs/sparse.md)
    for method in ("diloco", "streaming"):
        r = cfg_of(["--method", method, "--replicas", "2", "--compress", "topk:0.02:2"]
                   ).resolved().method
        assert r.outer_momentum == 0.0
    r = cfg_of(["--method", "noloco", "--replicas", "2", "--compress", "topk:0.02:2"]
               ).resolved().method
    assert r.outer_momentum == 0.5  # (NoLoCo's α is its own: sparse gossip keeps it)


def test_compress_under_outer_momentum_is_warned_about(tmp_path, capsys):
    from noloco.cli import warn_about

    warn_about(cfg_of(["--method", "diloco", "--replicas", "2", "--compress", "topk:0.02:2",
                       "--outer-momentum", "0.9"]).resolved())
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--outer-momentum 0.9" in err
    warn_about(cfg_of(["--method", "diloco", "--replicas", "2", "--compress", "topk:0.02:2"]
                      ).resolved())
    assert capsys.readouterr().err == ""


def test_config_round_trips_through_json():
    cfg = cfg_of(["--method", "noloco", "--replicas", "4", "--gamma", "0.6"]).resolved()
    again = Config.from_dict(json.loads(cfg.dumps()))
    assert again == cfg


def test_help_documents_every_flag(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--method", "--preset", "--steps", "--batch-size", "--seq-len", "--lr",
                 "--warmup", "--data", "--out", "--seed", "--eval-every", "--eval-sequences",
                 "--config", "--replicas", "--sync-every", "--outer-lr", "--outer-momentum",
                 "--nesterov", "--group-size", "--gamma", "--overwrite"):
        assert flag in out, flag



def help_sections(text: str) -> dict[str, str]:
    """--help's groups: heading → the text under it."""
    out, name = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            name = line[:-1]
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def test_help_groups_the_flags_and_shows_their_choices(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    groups = help_sections(out)
    assert list(groups)[-2:] == ["reliability, elastic and faults", "logging"]
    for flag in ("--elastic", "--peer-timeout", "--respawn", "--coordinator", "--secret-file",
                 "--max-restarts", "--inject-fault", "--update-guard", "--comm-timeout"):
        assert flag in groups["reliability, elastic and faults"], flag
        assert flag not in groups["method"] and flag not in groups["train"], flag
    for flag in ("--log-every", "--tensorboard", "--wandb", "--dashboard"):
        assert flag in groups["logging"], flag
    assert "--method {single,ddp,diloco,noloco,streaming,sparseloco}" in out
    assert "--device {auto,cpu,cuda}" in out and "--quantize {none,fp4,int8,fp8}" in out
    assert "sparseloco" in out.split("options:")[0]  # the description names every method


def test_version(capsys):
    from noloco import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"noloco {__version__}"


BAD = [
    (["--bogus-flag", "1"], "unrecognized arguments"),
    (["--preset", "huge"], "unknown preset"),
    (["--data", "/nonexistent/corpus.txt"], "not found"),
    (["--seq-len", "5000"], "exceeds"),
    (["--method", "noloco", "--replicas", "3"], "not divisible"),
    (["--method", "noloco", "--replicas", "2", "--group-size", "4"], "larger than"),
    (["--method", "diloco", "--replicas", "2", "--sync-every", "0"], "must be >= 1"),
    (["--method", "noloco", "--replicas", "2", "--outer-lr", "-0.5"], "non-negative"),
    (["--method", "diloco", "--replicas", "2", "--outer-momentum", "-1"], "non-negative"),
    (["--lr", "-1"], "non-negative"),
    (["--method", "ddp", "--replicas", "2", "--stages", "9"], "more than"),
    (["--method", "single", "--replicas", "2"], "one replica"),
    (["--method", "nonsense"], "unknown method"),
    (["--beta1", "1.5"], "--beta1 must lie in"),
    (["--dropout", "1"], "--dropout must lie in"),
    (["--method", "diloco", "--replicas", "2", "--outer-momentum", "1.2"], "must lie in"),
    (["--steps", "abc"], "invalid int"),
]


@pytest.mark.parametrize("argv,msg", BAD)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, argv, msg):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err, err
    assert not out.exists()


def test_empty_corpus_is_rejected(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    code = main(["train", "--data", str(tmp_path / "empty.txt"),
                       "--out", str(tmp_path / "run")])
    assert code == 2 and "empty corpus" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_bad_config_file(tmp_path, capsys):
    f = tmp_path / "c.toml"
    f.write_text("[method]\nnot_a_key = 1\n")
    assert main(["train", "--config", str(f), "--out", str(tmp_path / "r")]) == 2
    assert "unknown key" in capsys.readouterr().err
    f.write_text("steps = = 3")
    assert main(["train", "--config", str(f), "--out", str(tmp_path / "r")]) == 2
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert not (tmp_path / "r").exists()


def test_validate_rejects_in_python_too():
    cfg = Config()
    cfg.method.method = "noloco"
    cfg.method.replicas = 6
    cfg.method.group_size = 4
    with pytest.raises(ConfigError, match="not divisible"):
        cfg.resolved()


def test_each_methods_rules_run_where_no_method_is_imported():
    """The command line validates before it loads any method: each method's rules live on
    the config floor (noloco.config.METHOD_RULES), not in a table the methods fill in."""
    code = """
import sys
from noloco.config import Config, ConfigError, METHOD_RULES, METHODS
assert tuple(METHOD_RULES) == METHODS
for method, key, value, msg in [("noloco", "group_size", 1, "--group-size must be >= 2"),
                                 ("single", "replicas", 2, "runs one replica"),
                                 ("sparseloco", "outer_momentum", 0.5, "no --outer-momentum"),
                                 ("streaming", "fragments", 3, "divisible by --fragments"),
                                 ("diloco", "fragments", 2, "streaming or noloco only")]:
    cfg = Config()
    cfg.method.method, cfg.method.replicas = method, 2
    setattr(cfg.method, key, value)
    try:
        cfg.resolved()
        raise SystemExit(method + ": no error")
    except ConfigError as e:
        assert msg in str(e), (method, str(e))
assert "noloco.methods" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_too_little_data_for_the_replicas(tmp_path, capsys):
    (tmp_path / "small.txt").write_text("x" * 3000)
    code = main(["train", "--method", "ddp", "--replicas", "64", "--seq-len", "64",
                 "--data", str(tmp_path / "small.txt"), "--out", str(tmp_path / "run")])
    assert code == 2 and "too few for 64 replicas" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
