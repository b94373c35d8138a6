"""Config composition and the start-up errors a user sees for bad settings."""
import pytest

from helpers import EXPERIMENTS, compose_config, run_train, to_object
from model.config import ffn_hidden_dim


def test_experiment_list_is_complete():
    want = {"demo"} | {f"{v}_{s}" for v in ("swiglu", "srelu", "srelu24") for s in ("125m", "1b", "7b")}
    assert want <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    cfg = to_object(compose_config([f"+experiment={experiment}"]))
    assert cfg.name == experiment
    if experiment != "demo" and not experiment.startswith("study_"):
        variant, scale = experiment.split("_")
        assert cfg.ffn.kind == {"swiglu": "swiglu", "srelu": "srelu", "srelu24": "srelu24"}[variant]
        assert cfg.model.name == scale
        # each experiment states its budget, batch, sequence length and learning rate
        assert cfg.trainer.total_tokens > 0 and cfg.trainer.batch_size > 0 and cfg.optim.lr > 0
        assert cfg.trainer.batch_size % cfg.trainer.micro_batch_size == 0


@pytest.mark.parametrize("ffn", ["swiglu", "srelu", "srelu24"])
def test_command_line_ffn_wins_over_demo(ffn):
    cfg = to_object(compose_config([f"ffn={ffn}", "+experiment=demo"]))
    assert cfg.ffn.kind == ffn


def test_srelu24_7b_is_llama2_7b_shaped_srelu24():
    cfg = to_object(compose_config(["+experiment=srelu24_7b"]))
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads) == (4096, 32, 32)
    assert cfg.ffn.kind == "srelu24" and ffn_hidden_dim(cfg.model, cfg.ffn) == 16512
    assert cfg.ffn.dense_feature_fraction == 0.05 and cfg.ffn.token_permutation and cfg.ffn.reuse_forward_mask


def test_recipe_switches_are_settable():
    cfg = to_object(compose_config(["+experiment=srelu24_125m", "ffn.token_permutation=false",
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


def test_cfg_job_prints_composed_config():
    r = run_train(["+experiment=srelu24_7b", "--cfg", "job"])
    assert r.returncode == 0, r.stderr
    assert "kind: srelu24" in r.stdout and "dim: 4096" in r.stdout


def test_dry_run_prints_sizes_without_allocating(tmp_path):
    r = run_train(["+experiment=srelu24_7b", "trainer.dry_run=true", "model.vocab_size=32000",
                   f"hydra.run.dir={tmp_path}"])
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


def test_unknown_ffn_lists_valid_options():
    line = one_error_line(run_train(["ffn=gelu", "trainer.dry_run=true"]))
    assert "ffn/gelu" in line and "swiglu, srelu" in line.replace("srelu, srelu24, swiglu", "swiglu, srelu")


def test_misspelt_key_fails_at_start():
    line = one_error_line(run_train(["trainer.seq_lenn=128", "trainer.dry_run=true"]))
    assert "seq_lenn" in line and "TrainerConfig" in line


def test_wrong_type_fails_at_start():
    line = one_error_line(run_train(["trainer.seq_len=long", "trainer.dry_run=true"]))
    assert "trainer.seq_len" in line and "Integer" in line


def test_bad_ffn_kind_lists_valid_kinds():
    line = one_error_line(run_train(["ffn.kind=gelu", "trainer.dry_run=true"]))
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


def test_unknown_experiment_lists_experiments():
    line = one_error_line(run_train(["+experiment=srelu24_13b"]))
    assert "srelu24_7b" in line and "demo" in line


def test_srelu24_hidden_size_it_cannot_take(tmp_path):
    r = run_train(["ffn=srelu24", "ffn.hidden_dim=1000", "trainer.dry_run=true", f"hydra.run.dir={tmp_path}"])
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [lines[-1]] and "ffn.hidden_dim" in lines[-1] and "multiple of 64" in lines[-1]
    assert "960" in lines[-1] and "1024" in lines[-1]


def test_batch_not_divisible_by_micro_batch(tmp_path):
    r = run_train(["trainer.batch_size=10", "trainer.micro_batch_size=4", "trainer.dry_run=true",
                   f"hydra.run.dir={tmp_path}"])
    assert r.returncode == 2 and "trainer.batch_size=10" in r.stderr
