"""Config composition and the start-up errors a user sees for bad settings."""
import re
from pathlib import Path

import pytest

from helpers import BASE_ENV, EXPERIMENTS, ROOT, background, compose_config, run_train, to_object
from model.config import ffn_hidden_dim

BAD_RUN_INPUT = [("trainer.batch_size=0", "trainer.batch_size=0 is out of range"),
                 ("trainer.batch_size=-16", "trainer.batch_size=-16 is out of range"),
                 ("optim.lr=-1", "optim.lr=-1.0 is out of range: valid is >= 0"),
                 ("model.n_layers=0", "model.n_layers=0 is out of range")]


def torchrun_with_a_config_error(run_dir: Path):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0",
                           str(ROOT / "train.py"), "trainer.batch_size=0", f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**BASE_ENV,
                                                                                      "WANDB_MODE": "disabled"})


@background
def launches(ctx):
    """The command-line tests' train.py launches (helpers.background); each test checks its own.
    Those given a run directory return (result, run directory)."""
    def run_in(name: str, args: list[str]):
        d = ctx.tmp(name) / "run"
        return lambda: (run_train([*args, f"hydra.run.dir={d}"]), d)

    jobs = {
        "test_cfg_job_prints_composed_config": lambda: run_train(["+experiment=sparse_7b", "--cfg", "job"]),
        "test_dry_run_prints_sizes_without_allocating": run_in("dry_run", ["+experiment=sparse_7b", "trainer.dry_run=true",
                                                                           "model.vocab_size=32000"]),
        "test_unknown_ffn_lists_valid_options": lambda: run_train(["ffn=gelu", "trainer.dry_run=true"]),
        "test_misspelt_key_fails_at_start": lambda: run_train(["trainer.seq_lenn=128", "trainer.dry_run=true"]),
        "test_wrong_type_fails_at_start": lambda: run_train(["trainer.seq_len=long", "trainer.dry_run=true"]),
        "test_bad_ffn_kind_lists_valid_kinds": lambda: run_train(["ffn.kind=gelu", "trainer.dry_run=true"]),
        "test_unknown_experiment_lists_experiments": lambda: run_train(["+experiment=srelu24_13b"]),
        "test_srelu24_hidden_size_it_cannot_take": run_in("hidden", ["ffn=srelu24", "ffn.hidden_dim=1000",
                                                                     "trainer.dry_run=true"]),
        "test_batch_not_divisible_by_micro_batch": run_in("batch", ["trainer.batch_size=10", "trainer.micro_batch_size=4",
                                                                    "trainer.dry_run=true"]),
        **{f"test_bad_input_in_a_real_run_is_one_line_exit_2_and_writes_nothing[{o}]": run_in("bad", [o])
           for o, _ in BAD_RUN_INPUT},
        "test_config_error_under_torchrun_is_printed_by_rank_0_only":
            (lambda d=ctx.tmp("torchrun") / "run": torchrun_with_a_config_error(d)),
        "test_hydra_shell_completion_passes_the_pre_compose[install]": lambda: run_train(["-sc", "install=bash"]),
        "test_hydra_shell_completion_passes_the_pre_compose[query]":  # what bash asks on <tab>
            lambda: run_train(["-sc", "query=bash"], env={"COMP_LINE": "python train.py ffn="}),
        "test_a_bad_wandb_mode_variable_is_one_line_naming_it[loud]":
            lambda: run_train(["trainer.dry_run=true"], env={"WANDB_MODE": "loud"}),
        "test_a_bad_wandb_mode_variable_is_one_line_naming_it[setting]":
            lambda: run_train(["trainer.dry_run=true", "logging.wandb.mode=disabled"], env={"WANDB_MODE": "loud"}),
    }
    return jobs


# the experiments' former names: each file only points to its new one
FORMER_NAMES = {f"srelu24_{s}": f"sparse_{s}" for s in ("125m", "1b", "7b")}


def test_experiment_list_is_complete():
    want = {"demo"} | {f"{v}_{s}" for v in ("swiglu", "srelu", "sparse") for s in ("125m", "1b", "7b")}
    assert want <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    cfg = to_object(compose_config([f"+experiment={experiment}"]))
    assert cfg.name == FORMER_NAMES.get(experiment, experiment)
    if experiment != "demo" and not experiment.startswith("study_"):
        variant, scale = experiment.split("_")
        assert cfg.ffn.kind == {"swiglu": "swiglu", "srelu": "srelu", "sparse": "srelu24", "srelu24": "srelu24"}[variant]
        assert cfg.model.name == scale
        # each experiment states its budget, batch, sequence length and learning rate
        assert cfg.trainer.total_tokens > 0 and cfg.trainer.batch_size > 0 and cfg.optim.lr > 0
        assert cfg.trainer.batch_size % cfg.trainer.micro_batch_size == 0


@pytest.mark.parametrize("ffn", ["swiglu", "srelu", "srelu24"])
def test_command_line_ffn_wins_over_demo(ffn):
    cfg = to_object(compose_config([f"ffn={ffn}", "+experiment=demo"]))
    assert cfg.ffn.kind == ffn


def test_sparse_7b_is_llama2_7b_shaped_srelu24():
    cfg = to_object(compose_config(["+experiment=sparse_7b"]))
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads) == (4096, 32, 32)
    assert cfg.ffn.kind == "srelu24" and ffn_hidden_dim(cfg.model, cfg.ffn) == 16512
    assert cfg.ffn.dense_feature_fraction == 0.05 and cfg.ffn.token_permutation and cfg.ffn.reuse_forward_mask


@pytest.mark.parametrize("former,name", FORMER_NAMES.items())
def test_a_former_name_composes_the_same_config_from_a_two_line_pointer(former, name):
    from helpers import ROOT

    assert compose_config([f"+experiment={former}"]) == compose_config([f"+experiment={name}"])
    lines = (ROOT / "configs" / "experiment" / f"{former}.yaml").read_text().splitlines()
    assert lines[0] == "# @package _global_" and lines[1].startswith(f"defaults: [{name}]") and len(lines) == 2


def test_recipe_switches_are_settable():
    cfg = to_object(compose_config(["+experiment=sparse_125m", "ffn.token_permutation=false",
                                    "ffn.reuse_forward_mask=false", "ffn.dense_warmup_steps=0",
                                    "ffn.dense_feature_fraction=0.1"]))
    f = cfg.ffn
    assert (f.token_permutation, f.reuse_forward_mask, f.dense_warmup_steps, f.dense_feature_fraction) == (
        False, False, 0, 0.1)


STUDY_VARIANTS = {  # variant -> (ffn kind, token_permutation, reuse_forward_mask, dense warmup)
    "swiglu": ("swiglu", True, True, 300),
    "srelu": ("srelu", True, True, 300),
    "srelu24": ("srelu24", True, True, 300),
    "srelu24_no_permutation": ("srelu24", False, True, 300),
    "srelu24_no_mask_reuse": ("srelu24", True, False, 300),
    "srelu24_no_dense_warmup": ("srelu24", True, True, 0),
}


def test_study_sweeps_six_variants_with_one_seed_and_budget():
    """`python train.py -m +experiment=study_small` runs exactly these six, differing only in the FFN."""
    from hydra import compose, initialize_config_dir

    from helpers import ROOT
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        dcfg = compose("config", overrides=["+experiment=study_small"], return_hydra_config=True)
    assert dcfg.hydra.sweeper.params.variant.split(",") == list(STUDY_VARIANTS)
    common = None
    for variant, (kind, perm, reuse, warmup) in STUDY_VARIANTS.items():
        cfg = to_object(compose_config(["+experiment=study_small", f"variant={variant}"]))
        f = cfg.ffn
        assert (f.kind, f.token_permutation, f.reuse_forward_mask, f.dense_warmup_steps) == (kind, perm, reuse, warmup)
        rest = (cfg.model, cfg.data, cfg.optim, cfg.trainer)
        assert common is None or rest == common  # same shapes, data, seed, schedule and budget
        common = rest


def test_cfg_job_prints_composed_config(launched):
    r = launched["test_cfg_job_prints_composed_config"].result()
    assert r.returncode == 0, r.stderr
    assert "kind: srelu24" in r.stdout and "dim: 4096" in r.stdout


def test_dry_run_prints_sizes_without_allocating(launched):
    r, _ = launched["test_dry_run_prints_sizes_without_allocating"].result()
    assert r.returncode == 0, r.stderr
    assert "6,476,271,616" in r.stdout  # non-embedding parameters of Llama-2-7B shapes (srelu hidden 16512)
    assert "6,738,415,616" in r.stdout  # total with a 32000 vocabulary
    assert "FLOPs per token" in r.stdout


# Bad input: one clear line, non-zero exit.
def one_error_line(r) -> str:
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_unknown_ffn_lists_valid_options(launched):
    line = one_error_line(launched["test_unknown_ffn_lists_valid_options"].result())
    assert "ffn/gelu" in line and "swiglu, srelu" in line.replace("srelu, srelu24, swiglu", "swiglu, srelu")


def test_misspelt_key_fails_at_start(launched):
    line = one_error_line(launched["test_misspelt_key_fails_at_start"].result())
    assert "seq_lenn" in line and "TrainerConfig" in line


def test_wrong_type_fails_at_start(launched):
    line = one_error_line(launched["test_wrong_type_fails_at_start"].result())
    assert "trainer.seq_len" in line and "Integer" in line


def test_bad_ffn_kind_lists_valid_kinds(launched):
    line = one_error_line(launched["test_bad_ffn_kind_lists_valid_kinds"].result())
    assert "[swiglu, srelu, srelu24]" in line


def test_ffn_yaml_with_an_unknown_kind_fails_with_one_line(tmp_path, capsys):
    """A configs/ffn/*.yaml whose kind no class registered: one line at start-up, naming the kinds."""
    import shutil

    from helpers import ROOT
    from training.cli import check_overrides
    from training.config import register_configs

    register_configs()
    configs = tmp_path / "configs"
    shutil.copytree(ROOT / "configs", configs)
    (configs / "ffn" / "gelu.yaml").write_text("kind: gelu\n")
    with pytest.raises(SystemExit) as e:
        check_overrides(configs, ["ffn=gelu", "trainer.dry_run=true"])
    assert e.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "ffn.kind=gelu" in lines[0] and "[swiglu, srelu, srelu24]" in lines[0], lines


def test_unknown_experiment_lists_experiments(launched):
    line = one_error_line(launched["test_unknown_experiment_lists_experiments"].result())
    assert "sparse_7b" in line and "demo" in line


def test_srelu24_hidden_size_it_cannot_take(launched):
    r, _ = launched["test_srelu24_hidden_size_it_cannot_take"].result()
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [lines[-1]] and "ffn.hidden_dim" in lines[-1] and "multiple of 64" in lines[-1]
    assert "960" in lines[-1] and "1024" in lines[-1]


def test_batch_not_divisible_by_micro_batch(launched):
    r, _ = launched["test_batch_not_divisible_by_micro_batch"].result()
    assert r.returncode == 2 and "trainer.batch_size=10" in r.stderr


# ---------------------------------------------------------------- every numeric setting's range

def _invalid(key: str):
    """A value just outside the range RANGES gives `key`, of the field's type."""
    from training.config_checks import RANGES

    r, is_int = RANGES[key], _field_type(key) is int
    if r.lo != float("-inf"):
        v = r.lo if r.lo_open else r.lo - (1 if is_int else 0.5)
    else:
        v = r.hi if r.hi_open else r.hi + 1
    assert v not in r.also
    return int(v) if is_int else float(v)


def _field_type(key: str):
    from dataclasses import fields
    from typing import Optional, get_args

    from training.config import Config

    node = Config
    *groups, name = key.split(".")
    for g in groups:
        node = next(f for f in fields(node) if f.name == g).default_factory
    t = next(f for f in fields(node) if f.name == name).type
    return int if t in (int, Optional[int]) else float if t in (float, Optional[float]) else get_args(t)


def test_every_numeric_setting_of_every_schema_has_a_range():
    """A numeric field added to a schema without a range in training/config_checks.RANGES fails here."""
    from training.config_checks import RANGES, numeric_fields

    fields_ = numeric_fields()
    assert len(fields_) > 40 and {"model.dim", "data.val_fraction", "optim.lr", "trainer.batch_size"} <= set(fields_)
    assert sorted(fields_) == sorted(RANGES)


def _numeric_keys():
    from training.config_checks import numeric_fields

    return numeric_fields()


@pytest.mark.parametrize("key", _numeric_keys())
def test_out_of_range_setting_is_one_line_and_exit_2(key, tmp_path, capsys):
    """The path train.py takes (training.loop.train inside cli.one_line_errors), in this process."""
    from training.cli import one_line_errors
    from training.config_checks import RANGES
    from training.errors import ConfigError
    from training.loop import train

    value = _invalid(key)
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)  # what Hydra leaves before the job runs
    (run_dir / "train.log").write_text("")
    with pytest.raises(SystemExit) as e, one_line_errors(run_dir, (ConfigError,)):
        train(compose_config([f"{key}={value}", "logging.wandb.mode=disabled"]), run_dir, "t")
    assert e.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == [f"error: {key}={value} is out of range: valid is {RANGES[key]}"]
    assert not run_dir.exists()  # a rejected run leaves no run directory


@pytest.mark.parametrize("override, named", [("trainer.nonfinite=maybe", "trainer.nonfinite=maybe"),
                                             ("trainer.precision=fp16", "trainer.precision=fp16"),
                                             ("trainer.device=gpu", "trainer.device=gpu"),
                                             ("trainer.resume_overrides=[trainer.eval_every]", "trainer.eval_every"),
                                             ("trainer.ffn_stats_every=15",
                                              "trainer.ffn_stats_every=15 must be 0 or a multiple of "
                                              "trainer.log_every=10 (statistics are logged with a step's row); "
                                              "set 10 or 20"),
                                             ("trainer.ffn_stats_every=5", "set 0 (every logged step) or 10")])
def test_bad_string_settings_are_one_line(override, named):
    from training.config_checks import check_config
    from training.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        check_config(to_object(compose_config([override])))
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("override, named", BAD_RUN_INPUT)
def test_bad_input_in_a_real_run_is_one_line_exit_2_and_writes_nothing(override, named, launched):
    r, run_dir = launched[f"test_bad_input_in_a_real_run_is_one_line_exit_2_and_writes_nothing[{override}]"].result()
    line = one_error_line(r)
    assert line.startswith("error: ") and named in line, line
    assert not run_dir.exists()


def test_config_error_under_torchrun_is_printed_by_rank_0_only(launched):
    r = launched["test_config_error_under_torchrun_is_printed_by_rank_0_only"].result()
    assert r.returncode != 0
    assert (r.stdout + r.stderr).count("error: trainer.batch_size=0 is out of range") == 1, r.stderr[-3000:]


def test_rank_other_than_0_exits_2_silently(monkeypatch, capsys):
    import training.cli
    from training.cli import fail

    monkeypatch.setattr(training.cli, "RANK_EXIT_DELAY_S", 0.0)
    for rank, printed in (("1", ""), ("0", "error: x\n")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            fail("x")
        assert e.value.code == 2 and capsys.readouterr().err == printed


def test_only_rank_0_removes_a_rejected_runs_directory(monkeypatch, tmp_path, capsys):
    """The ranks share the run directory: one that removed it under another still setting up its
    log file there made that one fail with a traceback instead of the one line."""
    import training.cli
    from training.cli import one_line_errors

    monkeypatch.setattr(training.cli, "RANK_EXIT_DELAY_S", 0.0)
    for rank, removed in (("1", False), ("0", True)):
        run_dir = tmp_path / rank
        (run_dir / ".hydra").mkdir(parents=True)
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e, one_line_errors(run_dir, (ValueError,)):
            raise ValueError("bad")
        assert e.value.code == 2 and run_dir.exists() != removed
    assert capsys.readouterr().err == "error: bad\n"


def test_srelu24_whose_warmup_outlasts_the_run_is_warned_about(caplog):
    from training.config_checks import check_config

    check_config(to_object(compose_config(["ffn=srelu24", "trainer.max_steps=300", "ffn.dense_warmup_steps=300"])))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "ffn.dense_warmup_steps=300" in warned[0] and "never turns on" in warned[0]
    caplog.clear()
    check_config(to_object(compose_config(["ffn=srelu24", "trainer.max_steps=300", "ffn.dense_warmup_steps=299"])))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_no_experiment_has_a_start_up_warning(experiment):
    from training.config_checks import check_config, startup_warnings

    cfg = to_object(compose_config([f"+experiment={experiment}"]))
    check_config(cfg)
    assert startup_warnings(cfg) == []


def test_run_name_leaves_out_resume_and_stop_settings():
    from training.cli import run_name

    task = ["ffn=srelu24", "trainer.stop_at_step=4", "trainer.resume=auto", "trainer.resume_overrides=[optim.lr]",
            "+experiment=demo", "optim.lr=1e-3"]
    assert run_name(task, "demo") == "ffn=srelu24,optim.lr=1e-3"
    assert run_name(["trainer.resume=auto", "+experiment=demo"], "demo") == "demo"


def test_hydra_shell_completion_passes_the_pre_compose(launched):
    r = launched["test_hydra_shell_completion_passes_the_pre_compose[install]"].result()
    assert r.returncode == 0, r.stderr
    assert "hydra_bash_completion" in r.stdout
    r = launched["test_hydra_shell_completion_passes_the_pre_compose[query]"].result()  # what bash asks on <tab>
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ffn=srelu", "ffn=srelu24", "ffn=swiglu"]


@pytest.mark.parametrize("dim,heads,kv,setting", [(130, 4, None, "model.n_heads=4"), (12, 4, None, "must be even for RoPE"),
                                                  (128, 4, 3, "model.n_kv_heads=3")])
def test_attention_shapes_fail_alike_in_the_model_and_at_start_up(dim, heads, kv, setting):
    """One message for each impossible attention shape: the model's ValueError is the trainer's ConfigError."""
    from model import FFNConfig, ModelConfig, Transformer
    from model.config import attention_shape_problem

    cfg = ModelConfig(dim=dim, n_heads=heads, n_kv_heads=kv)
    problem = attention_shape_problem(cfg)
    assert problem and setting in problem
    with pytest.raises(ValueError, match=re.escape(problem)):
        Transformer(cfg, FFNConfig(), vocab_size=300)
    assert attention_shape_problem(ModelConfig(dim=128, n_heads=4, n_kv_heads=2)) is None


# ---------------------------------------------------------------- WANDB_MODE

@pytest.mark.parametrize("env, mode", [(None, "offline"), ("online", "online"), ("offline", "offline"),
                                       ("disabled", "disabled"), ("dryrun", "offline"), ("run", "online")])
def test_wandb_mode_follows_the_wandb_mode_variable(monkeypatch, env, mode):
    if env is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env)
    assert to_object(compose_config([])).logging.wandb.mode.value == mode
    # a setting on the command line wins over the variable
    assert to_object(compose_config(["logging.wandb.mode=disabled"])).logging.wandb.mode.value == "disabled"


def test_a_bad_wandb_mode_variable_is_one_line_naming_it(launched):
    line = one_error_line(launched["test_a_bad_wandb_mode_variable_is_one_line_naming_it[loud]"].result())
    assert line == ("error: WANDB_MODE=loud in the environment: valid values are online, offline, disabled (wandb's "
                    "dryrun and run mean offline and online), or set logging.wandb.mode")
    r = launched["test_a_bad_wandb_mode_variable_is_one_line_naming_it[setting]"].result()
    assert r.returncode == 0, r.stderr


def test_resume_may_change_the_implementation_settings_but_not_the_recipe():
    """ffn.kernels and ffn.sparse_gemm_alg choose how the same function is computed: a resume may
    change them (to rule out a kernel, say); the recipe's settings stop it."""
    from training.config_checks import check_resume
    from training.errors import ConfigError

    saved = {"ffn": {"kind": "srelu24", "kernels": True, "sparse_gemm_alg": None, "dense_warmup_steps": 75}}
    now = {"ffn": {"kind": "srelu24", "kernels": False, "sparse_gemm_alg": 0, "dense_warmup_steps": 75}}
    assert check_resume(Path("ck"), saved, now, []) == []
    with pytest.raises(ConfigError, match="ffn.dense_warmup_steps 75 -> 38"):
        check_resume(Path("ck"), saved, {"ffn": {**now["ffn"], "dense_warmup_steps": 38}}, [])
