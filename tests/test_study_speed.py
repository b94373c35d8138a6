"""The speed studies (`python train.py -m +experiment=study_speed`, `+experiment=study_speed_7b`):
each sweep point composed in-process as Hydra composes the job, checked to share the seed, data,
shapes, schedule and validation, and to differ only in the FFN and float8 recipe (and the seed of
the seed-2 arms); each job directory names its FFN and precision, and compare.py labels them so."""
import importlib.util
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from helpers import ROOT, compose_config, to_object

GRIDS = {  # experiment -> its arms: (ffn, trainer.float8, seed)
    "study_speed": {"swiglu_tensorwise": ("swiglu", "tensorwise", 1337), "srelu_tensorwise": ("srelu", "tensorwise", 1337),
                    "srelu24_tensorwise": ("srelu24", "tensorwise", 1337),
                    "srelu24_tensorwise_seed2": ("srelu24", "tensorwise", 2)},
    "study_speed_7b": {"swiglu_bf16": ("swiglu", "none", 1337), "swiglu_rowwise": ("swiglu", "rowwise", 1337),
                       "swiglu_tensorwise": ("swiglu", "tensorwise", 1337),
                       "srelu_tensorwise": ("srelu", "tensorwise", 1337),
                       "srelu24_tensorwise": ("srelu24", "tensorwise", 1337),
                       "srelu24_rowwise": ("srelu24", "rowwise", 1337),
                       "srelu24_tensorwise_seed2": ("srelu24", "tensorwise", 2),
                       "srelu_tensorwise_seed2": ("srelu", "tensorwise", 2),
                       "swiglu_tensorwise_seed2": ("swiglu", "tensorwise", 2)},
}
SHAPES = {"study_speed": ("1b", 2048, 20), "study_speed_7b": ("7b", 4096, 8)}  # model, dim, layers
STEPS = {"study_speed": 500, "study_speed_7b": 500}


def sweep(experiment: str):
    from training.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        dcfg = compose("config", overrides=[f"+experiment={experiment}"], return_hydra_config=True)
    return dcfg.hydra


@pytest.mark.parametrize("experiment", list(GRIDS))
def test_every_arm_differs_only_in_ffn_and_precision(experiment):
    hydra = sweep(experiment)
    arms = GRIDS[experiment]
    assert hydra.sweeper.params.variant.split(",") == list(arms)
    subdir = OmegaConf.to_container(hydra.sweep)["subdir"]  # unresolved: a job's values are set at launch
    assert subdir == "${hydra.job.num}_${hydra:runtime.choices.variant}"  # e.g. 4_srelu24_tensorwise
    common = None
    for arm, (ffn, float8, seed) in arms.items():
        cfg = to_object(compose_config([f"+experiment={experiment}", f"variant={arm}"]))
        t = cfg.trainer
        assert (cfg.ffn.kind, t.float8.value, t.seed) == (ffn, float8, seed), arm
        label = "bf16" if float8 == "none" else float8
        assert arm in (f"{ffn}_{label}", f"{ffn}_{label}_seed2")  # the job directory says both
        assert cfg.name == experiment and cfg.data.name == "python_sources"
        assert cfg.logging.wandb.mode.value == "offline" and cfg.logging.wandb.group is None  # group: the name
        assert t.compile and t.max_steps == STEPS[experiment]
        assert t.max_steps % t.eval_every == 0 and t.eval_every % t.log_every == 0 and t.eval_every <= 25
        assert 0.13 <= cfg.ffn.dense_warmup_steps / t.max_steps <= 0.17  # 2:4 from ~15% of the steps
        assert (cfg.model.name, cfg.model.dim, cfg.model.n_layers) == SHAPES[experiment]
        assert t.batch_size % t.micro_batch_size == 0 and t.ckpt_every >= t.max_steps
        # everything else the same: the FFN's kind is the arm's, its recipe settings are shared
        rest = (cfg.model, replace(cfg.ffn, kind="swiglu"), cfg.data, cfg.optim,
                replace(t, float8=None, seed=None), cfg.logging)
        assert common is None or rest == common, arm
        common = rest


def test_compare_labels_the_jobs_by_ffn_precision_and_seed(tmp_path):
    spec = importlib.util.spec_from_file_location("compare", ROOT / "scripts" / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    rows = [{"run": f"{i}_{arm}", "variant": ffn, "precision": "bf16" if f8 == "none" else f8, "seed": seed,
             "_dir": tmp_path / f"{i}_{arm}"} for i, (arm, (ffn, f8, seed)) in enumerate(GRIDS["study_speed_7b"].items())]
    compare.label_runs(rows)
    assert [r["label"] for r in rows] == ["swiglu bf16", "swiglu rowwise", "swiglu tensorwise seed 1337",
                                          "srelu tensorwise seed 1337", "srelu24 tensorwise seed 1337", "srelu24 rowwise",
                                          "srelu24 tensorwise seed 2", "srelu tensorwise seed 2",
                                          "swiglu tensorwise seed 2"]
