"""Several processes on the CPU (gloo): torchrun with 2 processes, DDP and FSDP2, against one
process with the same global batch; stop and resume across the 2 processes (bitwise); a
checkpoint resumed by another world size; SIGTERM to one rank; the SLURM environment path; the
configs (every experiment with trainer.strategy=fsdp and hydra/launcher=slurm); activation
checkpointing. Every launch has a timeout: a hang fails the test with the ranks' Python stacks
(faulthandler, on SIGABRT) instead of blocking CI. See docs/DISTRIBUTED.md."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import BASE_ENV, EXPERIMENTS, ROOT, background, compose_config, run_train, tiny_overrides, with_cache

pytestmark = pytest.mark.slow

STEPS, STOP = 8, 4
LAUNCH_TIMEOUT = 150  # seconds for one launch; a normal one takes ~5 s on 2 cores
EXTRA = [f"trainer.max_steps={STEPS}", "trainer.ckpt_every=100", "trainer.eval_every=4", "trainer.dist_timeout_s=60"]


# ---------------------------------------------------------------- launching

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra) -> dict:
    return {**BASE_ENV, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0",
            "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **extra}


def children(pid: int) -> list[int]:
    """Direct children of pid (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def stop_hung(p: subprocess.Popen, log: Path) -> str:
    """SIGABRT every process of the launch (faulthandler prints each one's Python stack to the
    log), then SIGKILL; return the log's tail for the failure message."""
    for pid in children(p.pid) + [p.pid]:
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            pass
    time.sleep(3)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()
    return log.read_text()[-8000:]


def wait(p: subprocess.Popen, log: Path, timeout: int = LAUNCH_TIMEOUT) -> str:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"launch did not finish in {timeout} s (a hang?); stacks:\n{stop_hung(p, log)}")
    out = log.read_text()
    assert rc == 0, out[-5000:]
    return out


def start_torchrun(args: list[str], log: Path, nproc: int = 2, script: Path = ROOT / "train.py") -> subprocess.Popen:
    """torchrun on an explicit free port (c10d rendezvous), in its own process group."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0",
           str(script), *args]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def torchrun(args: list[str], log: Path) -> str:
    return wait(start_torchrun(args, log), log)


# ---------------------------------------------------------------- runs shared by the tests

def overrides(tmp: Path, corpus: Path, cache: Path, extra=()) -> list[str]:
    """tiny_overrides: global batch 8 = 2 micro-batches of 4 in one process, 1 per rank in two."""
    return with_cache(tiny_overrides(tmp, corpus, [*EXTRA, *extra]), cache)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> list[tuple]:
    """(step, loss, val_loss) per step; after a resume the last row of a step counts."""
    last = {r["step"]: r for r in rows(run)}
    return [(s, last[s]["loss"], last[s].get("val_loss")) for s in sorted(last)]


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def weights(path: Path) -> dict:
    from training.checkpoint import load_checkpoint

    return load_checkpoint(path)["model"]


STRATEGIES = ["ddp", "fsdp"]
BAD_VALUES = [("strategy", "[none, ddp, fsdp]"), ("activation_checkpointing", "[none, selective, full]")]


@background
def launches(ctx):
    """The module's launches (helpers.background): the runs several tests compare, and the checks
    of tests that only launch; each test waits for its own."""
    corpus, cache = ctx.corpus, ctx.cache

    def job(fn, name, *args):
        tmp = ctx.tmp(name)
        return lambda: fn(tmp, *args)

    jobs = {"test_fsdp2_with_compiled_blocks_and_loss_head": job(check_fsdp2_with_compiled_blocks_and_loss_head,
                                                                 "fsdp2"),
            "single": job(single_run, "single", corpus, cache),
            **{f"two[{strategy}]": job(two_runs, strategy, corpus, cache, strategy) for strategy in STRATEGIES},
            "test_sigterm_to_one_rank_stops_both_at_the_same_step": job(
                check_sigterm_to_one_rank_stops_both_at_the_same_step, "sigterm", corpus, cache),
            **{f"test_bad_distributed_value_lists_valid_values[{key}]": (
                lambda key=key, valid=valid: check_bad_distributed_value_lists_valid_values(key, valid))
               for key, valid in BAD_VALUES}}
    uses_two = ["test_two_processes_match_one_with_the_same_global_batch",
                "test_stop_and_resume_across_two_processes_is_exact", "test_checkpoint_of_two_processes_resumes_in_one"]
    needed_by = {"single": ["test_two_processes_match_one_with_the_same_global_batch",
                            "test_checkpoint_of_two_processes_resumes_in_one", "test_slurm_tasks_without_torchrun"],
                 **{f"two[{strategy}]": uses_two for strategy in STRATEGIES}}
    return jobs, needed_by


def single_run(tmp: Path, corpus: Path, cache: Path) -> Path:
    r = run_train(overrides(tmp, corpus, cache), timeout=LAUNCH_TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run"


@pytest.fixture(scope="module")
def single(launched):
    """The reference: one process (trainer.strategy=none), the same global batch."""
    return launched["single"].result()


@pytest.fixture(scope="module", params=STRATEGIES)
def two(request, launched):
    """One strategy, 2 processes: a straight run, and one stopped at step STOP then resumed."""
    return launched[f"two[{request.param}]"].result()


def two_runs(tmp: Path, corpus: Path, cache: Path, strategy: str) -> dict:
    straight = tmp / "straight"
    torchrun(overrides(straight, corpus, cache, [f"trainer.strategy={strategy}"]), tmp / "straight.log")
    split = tmp / "split"
    # the split run saves in the background (its own gloo group for the writer's collectives)
    args = overrides(split, corpus, cache, [f"trainer.strategy={strategy}", "trainer.async_checkpoint=true"])
    first = torchrun(args + [f"trainer.stop_at_step={STOP}"], tmp / "split_1.log")
    second = torchrun(args + ["trainer.resume=auto"], tmp / "split_2.log")
    return {"strategy": strategy, "straight": straight / "run", "split": split / "run", "logs": (first, second)}


# ---------------------------------------------------------------- 2 processes against 1

def test_fsdp2_with_compiled_blocks_and_loss_head(launched):
    """trainer.compile under FSDP2: compiled blocks and loss head give the eager model's loss,
    with no recompiles from FSDP2's parameter swapping (tests/fsdp_compiled_model.py)."""
    launched["test_fsdp2_with_compiled_blocks_and_loss_head"].result()


def check_fsdp2_with_compiled_blocks_and_loss_head(tmp_path):
    out = wait(start_torchrun([], tmp_path / "log", script=ROOT / "tests" / "fsdp_compiled_model.py"), tmp_path / "log")
    assert "rank 0: 4 passes equal to eager, 0 recompiles" in out
    assert "rank 1: 4 passes equal to eager, 0 recompiles" in out


def test_two_processes_match_one_with_the_same_global_batch(two, single):
    mine, ref = losses(two["straight"]), losses(single)
    assert [s for s, *_ in mine] == list(range(1, STEPS + 1))
    assert len(rows(two["straight"])) == STEPS  # one writer: rank 0
    # step 1: the same initial weights (the meta-device build initialises whole tensors from the
    # CPU RNG, then shards) on the same samples: the mean loss over ranks is bitwise the same
    assert mine[0] == ref[0]
    for (s, loss, val), (_, ref_loss, ref_val) in zip(mine, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5), s  # gradient sums in another order
        assert (val is None) == (ref_val is None)
        if val is not None:
            assert val == pytest.approx(ref_val, rel=1e-5, abs=1e-5), s
    info = json.loads((two["straight"] / "run_info.json").read_text())
    assert (info["world_size"], info["strategy"], info["grad_accum"]) == (2, two["strategy"], 1)


def test_stop_and_resume_across_two_processes_is_exact(two):
    first, second = two["logs"]
    assert f"stopped at step {STOP} (trainer.stop_at_step)" in first
    assert f"resumed from {ckpt(two['split'], STOP)} at step {STOP}" in second
    assert second.count("resumed from") == 1  # printed by rank 0 only
    saved = sorted(p.name for p in ckpt(two["split"], STOP).iterdir())
    assert {"rank_00000.pt", "rank_00001.pt", "train_state.json", "manifest.json", ".metadata"} <= set(saved)
    if two["strategy"] == "fsdp":  # each rank wrote its own shard
        assert {"__0_0.distcp", "__1_0.distcp"} <= set(saved)
    manifest = json.loads((ckpt(two["split"], STOP) / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and set(manifest["files"]) == set(saved) - {"manifest.json"}  # each rank's own
    assert losses(two["split"]) == losses(two["straight"])
    a, b = weights(ckpt(two["split"], STEPS)), weights(ckpt(two["straight"], STEPS))
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_checkpoint_of_two_processes_resumes_in_one(tmp_path, corpus, cache, two, single):
    """Another world size: DCP reshards model and optimizer, the loader continues at the same
    global sample. Not bitwise (another reduction order), but the same training."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt(two["split"], STOP), ckpt(run, STOP))
    r = run_train(overrides(tmp_path, corpus, cache, ["trainer.resume=auto"]), timeout=LAUNCH_TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "was written by 2 process(es), this run has 1" in r.stdout and f"at step {STOP}" in r.stdout
    mine, ref = losses(run), losses(single)
    assert [s for s, *_ in mine] == list(range(STOP + 1, STEPS + 1))
    for (s, loss, _), (_, ref_loss, _) in zip(mine, ref[STOP:]):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5), s


# ---------------------------------------------------------------- stop signals and SLURM

def test_sigterm_to_one_rank_stops_both_at_the_same_step(launched):
    """Only rank 1 gets the signal: the ranks agree at the next step, both checkpoint and exit 0."""
    launched["test_sigterm_to_one_rank_stops_both_at_the_same_step"].result()


def check_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path, corpus, cache):
    args = overrides(tmp_path, corpus, cache, ["trainer.strategy=ddp", "trainer.max_steps=2000",
                                               "trainer.eval_every=1000", "trainer.ckpt_every=1000"])
    log = tmp_path / "signal.log"
    p = start_torchrun(args, log)
    run = tmp_path / "run"
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while time.monotonic() < deadline and p.poll() is None:
        if (run / "metrics.jsonl").is_file() and len(rows(run)) >= 3:
            break
        time.sleep(0.05)
    assert p.poll() is None, log.read_text()[-3000:]
    rank1 = [c for c in children(p.pid) if b"RANK=1\0" in Path(f"/proc/{c}/environ").read_bytes()]
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGTERM)
    out = wait(p, log)
    assert out.count("stopped at step") == 1 and "(signal on another rank)" in out
    stopped = int(out.split("stopped at step ")[1].split()[0])
    from training.checkpoint import list_checkpoints, verify_checkpoint

    assert list_checkpoints(run) == [ckpt(run, stopped)]
    verify_checkpoint(ckpt(run, stopped))
    assert max(r["step"] for r in rows(run)) == stopped < 2000


def test_slurm_tasks_without_torchrun(tmp_path, corpus, cache, single):
    """Two tasks as srun starts them (SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS, the node list),
    no torchrun: the same training as one process with the same global batch."""
    args = overrides(tmp_path, corpus, cache, ["trainer.strategy=ddp"])
    job = {"SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "4242",
           "MASTER_PORT": str(free_port())}
    env = {k: v for k, v in child_env(**job).items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    procs, logs = [], []
    for rank in range(2):
        logs.append(tmp_path / f"task_{rank}.log")
        with open(logs[-1], "w") as f:
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, stdout=f,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}))
    for p, log in zip(procs, logs):
        wait(p, log)
    mine, ref = losses(tmp_path / "run"), losses(single)
    assert mine[0] == ref[0] and len(mine) == len(ref) == STEPS
    for (s, loss, _), (_, ref_loss, _) in zip(mine, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5), s
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert (info["world_size"], info["strategy"]) == (2, "ddp")


def test_usr2_checkpoints_then_reaches_the_handler_it_replaced(tmp_path, corpus, cache, monkeypatch):
    """submitit requeues a job from its SIGUSR2 handler (time limit, preemption). The trainer
    catches SIGUSR2 first: it checkpoints at the step boundary, then calls that handler."""
    from model.transformer import Transformer
    from training.loop import train

    calls, real = [], Transformer.forward

    def forward(self, *a, **k):
        if self.training and not calls and (tmp_path / "run" / "metrics.jsonl").is_file() \
                and len(rows(tmp_path / "run")) == 2:
            calls.append("sent")
            os.kill(os.getpid(), signal.SIGUSR2)  # during step 3
        return real(self, *a, **k)

    def requeue(signum, frame):  # stands in for submitit's handler
        calls.append((signal.Signals(signum).name, sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())))

    monkeypatch.setattr(Transformer, "forward", forward)
    old = signal.signal(signal.SIGUSR2, requeue)
    try:
        dcfg = compose_config([a for a in overrides(tmp_path, corpus, cache) if not a.startswith("hydra.")])
        (tmp_path / "run").mkdir()
        train(dcfg, tmp_path / "run", "usr2")
    finally:
        signal.signal(signal.SIGUSR2, old)
    assert calls == ["sent", ("SIGUSR2", ["step_00000003"])]  # checkpoint first, then the old handler
    assert max(r["step"] for r in rows(tmp_path / "run")) == 3


# ---------------------------------------------------------------- configs and start-up errors

@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_with_fsdp_and_the_slurm_launcher(experiment):
    from hydra import compose, initialize_config_dir
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    from training.config import ActivationCheckpointing, Strategy, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={experiment}", "trainer.strategy=fsdp",
                                           "trainer.activation_checkpointing=selective", "hydra/launcher=slurm"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert get_class(launcher._target_).__name__ == "SlurmLauncher"  # the plugin is installed
    assert launcher.tasks_per_node == launcher.gpus_per_node  # one task (process) per GPU
    t = OmegaConf.to_object(cfg.trainer)
    assert t.strategy == Strategy.fsdp and t.activation_checkpointing == ActivationCheckpointing.selective


@pytest.mark.parametrize("key,valid", BAD_VALUES)
def test_bad_distributed_value_lists_valid_values(launched, key, valid):
    launched[f"test_bad_distributed_value_lists_valid_values[{key}]"].result()


def check_bad_distributed_value_lists_valid_values(key, valid):
    r = run_train([f"trainer.{key}=zero3", "trainer.dry_run=true"])
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"trainer.{key}" in lines[0], r.stderr
    assert valid in lines[0]


def test_strategy_none_with_several_processes_is_refused(monkeypatch):
    from training.config import TrainerConfig
    from training.distributed import setup
    from training.errors import ConfigError

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"2 processes .*trainer.strategy=none.*ddp, fsdp"):
        setup(TrainerConfig())


def test_launch_environment():
    from training.distributed import Launch, _slurm_rendezvous, first_host, launch_env

    assert launch_env({}) is None
    assert launch_env({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None  # one task: one process
    torchrun = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}
    assert launch_env(torchrun) == Launch(3, 1, 4, "torchrun")  # torchrun inside a SLURM job wins
    slurm = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[007-008]",
             "SLURM_JOB_ID": "123456"}
    assert launch_env(slurm) == Launch(5, 1, 8, "slurm")
    assert launch_env(slurm, slurm=False) is None  # trainer.strategy=none: one process in any allocation
    _slurm_rendezvous(slurm)
    assert slurm["MASTER_ADDR"] == "gpu007" and slurm["MASTER_PORT"] == str(20000 + 123456 % 20000)
    assert [first_host(n) for n in ("node1", "a[01-04,09],b2", "gpu-a[3,5]", "x1,y2")] == ["node1", "a01", "gpu-a3",
                                                                                           "x1"]


def test_first_host_keeps_what_follows_a_range():
    """A suffix after the brackets and a second range belong to the host name (a hand-written
    parser gave 'node-01' and 'a1')."""
    from training.distributed import first_host
    from training.errors import ConfigError

    assert first_host("node-[01-02]-ib") == "node-01-ib"
    assert first_host("a[1-2]b[3-4]") == "a1b3"
    assert first_host("gpu[003-004,007],cpu1") == "gpu003"
    for bad in ("", "a[1-"):
        with pytest.raises(ConfigError, match="set MASTER_ADDR"):
            first_host(bad)


def test_ranks_use_rank_0s_run_dir_and_drop_their_own_hydra_only_dir(tmp_path, monkeypatch):
    """Without hydra.run.dir, ranks that start in different seconds get different ${now:} dirs."""
    import training.loop
    from training.distributed import Dist

    main, mine, used = tmp_path / "12-00-00", tmp_path / "12-00-01", tmp_path / "12-00-02"
    for d in (main, mine, used):
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "config.yaml").write_text("{}")
    (used / "metrics.jsonl").write_text("")  # not Hydra's: never deleted
    monkeypatch.setattr(training.loop, "broadcast_object", lambda obj, d: str(main))
    assert training.loop.shared_run_dir(mine, Dist(rank=1, world_size=2, enabled=True)) == main
    assert training.loop.shared_run_dir(used, Dist(rank=1, world_size=2, enabled=True)) == main
    assert main.is_dir() and not mine.exists() and (used / "metrics.jsonl").is_file()


# ---------------------------------------------------------------- activation checkpointing

@pytest.mark.parametrize("mode,recomputed", [("none", []), ("selective", [0, 2]), ("full", [0, 1, 2, 3])])
def test_activation_checkpointing_recomputes_the_chosen_blocks(mode, recomputed):
    """Counted by forward calls of each block's attention: a recomputed block runs twice per step.
    Gradients are the same as without checkpointing."""
    from model import FFNConfig, ModelConfig, Transformer
    from training.config import TrainerConfig
    from training.distributed import Dist, build_model

    mcfg = ModelConfig(name="t", dim=32, n_layers=4, n_heads=2, swiglu_hidden=64, max_seq_len=16)
    make = lambda: Transformer(mcfg, FFNConfig(), 50)  # noqa: E731
    x = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = {}
    for m in ("none", mode):
        model, _ = build_model(make, TrainerConfig(activation_checkpointing=m), Dist(), seed=0, bf16_params=False)
        calls = [0] * 4
        for i, block in enumerate(model.layers):
            block.attention.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        model(x, x).backward()
        grads[m] = {n: p.grad for n, p in model.named_parameters()}
        if m == mode:
            assert [i for i, c in enumerate(calls) if c == 2] == recomputed and set(calls) <= {1, 2}
    for n, g in grads["none"].items():
        assert torch.equal(g, grads[mode][n]), n


@pytest.mark.parametrize("kind", ["srelu", "swiglu"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_compiled_blocks_run_as_one_graph_each_also_after_a_statistics_step(monkeypatch, mode, kind):
    """trainer.compile: a step runs one compiled graph a block and one for the loss head, with any
    activation checkpointing, also after a step that collected the FFN statistics (which run outside
    graphs, so that step splits its blocks), and the gradients are those without checkpointing.
    Before: checkpointed blocks were never compiled (torch's checkpoint as the forward: no frame
    dynamo traces), and after the first statistics step every block stayed split in three."""
    from torch._dynamo.backends.debugging import aot_eager

    from model import FFNConfig, ModelConfig, Transformer
    from training.config import TrainerConfig
    from training.distributed import Dist, build_model

    calls = [0]

    def counting(gm, example_inputs):  # aot_eager, counting each call of a compiled graph
        run = aot_eager(gm, example_inputs)

        def counted(*args):
            calls[0] += 1
            return run(*args)
        return counted

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: compile_(fn, backend=counting))
    mcfg = ModelConfig(name="t", dim=32, n_layers=4, n_heads=2, swiglu_hidden=64, max_seq_len=16)
    x = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = {}
    for m in dict.fromkeys(("none", mode)):
        torch._dynamo.reset()
        model, _ = build_model(lambda: Transformer(mcfg, FFNConfig(kind=kind), 50),
                               TrainerConfig(activation_checkpointing=m, compile=True), Dist(), seed=0, bf16_params=False)
        per_step = []
        for stats in (True, False, False):  # a statistics step first, as the trainer's first logged step
            model.zero_grad()
            model.collect_ffn_stats(stats)
            before = calls[0]
            model(x, x).backward()
            model.collect_ffn_stats(False)
            per_step.append(calls[0] - before)
        assert per_step[1:] == [mcfg.n_layers + 1] * 2, (m, per_step)
        grads[m] = {n: p.grad for n, p in model.named_parameters()}
    for n, g in grads["none"].items():
        torch.testing.assert_close(grads[mode][n], g, rtol=0, atol=0, msg=n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["srelu", "srelu24"])
def test_checkpointed_compiled_blocks_train_as_without_on_the_gpu(kind):
    """As the trainer builds the model on a GPU (float8 tensorwise, Inductor, srelu24's kernels and
    step state through its switch to 2:4): with full checkpointing dynamo breaks no graph but at the
    FFN statistics (kept out of graphs on purpose; the first and the last step), and after four steps (two
    micro-batches each, SGD) the weights are as close to the compiled model's without checkpointing
    as the eager model's are (the recomputed forward is compiled into other kernels: not the same
    bits, but no further off than compiling itself moves them)."""
    from torch._dynamo.utils import counters

    from model import FFNConfig, ModelConfig, Transformer
    from training.config import Float8, TrainerConfig
    from training.distributed import Dist, build_model
    from training.step import StepParts, TrainState, train_step

    dev = torch.device("cuda")
    f8 = Float8.tensorwise if torch.cuda.get_device_capability(dev) >= (8, 9) else Float8.none
    B, L, V = 8, 256, 512

    def go(mode: str, compiled: bool = True):
        torch._dynamo.reset()
        counters.clear()
        t = TrainerConfig(compile=compiled, float8=f8, device="cuda", activation_checkpointing=mode)
        cfg = ModelConfig(dim=256, n_layers=2, n_heads=4, max_seq_len=L)
        m, _ = build_model(lambda: Transformer(cfg, FFNConfig(kind=kind, hidden_dim=1024), V, float8=f8.value),
                           t, Dist(device=dev), 0, False)
        parts = StepParts(model=m, train_module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), dist=Dist(device=dev),
                          accum=2, tokens_per_step=2 * B * L, lr_at=lambda s: 0.1, grad_clip=1.0,
                          sparse_from=2 if kind == "srelu24" else None,
                          autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        g = torch.Generator().manual_seed(3)
        toks = [torch.randint(0, V, (B, L + 1), generator=g) for _ in range(8)]
        data = iter([(x[:, :-1].contiguous().to(dev), x[:, 1:].contiguous().to(dev)) for x in toks])
        torch.manual_seed(11)
        state = TrainState()
        for i in range(4):
            train_step(parts, state, data.__next__, log=i in (0, 3), stats=i in (0, 3))
        graphs = counters["stats"]["unique_graphs"]
        return {n: p.detach().float() for n, p in m.named_parameters()}, dict(counters["graph_break"]), graphs

    plain, _, _ = go("none")
    eager, _, _ = go("none", compiled=False)
    ckpt, breaks, graphs = go("full")
    assert graphs >= 2, graphs  # the loss head's and the blocks' (eager checkpointed blocks: the head's only)
    assert all("torch.compiler.disable" in why for why in breaks), breaks
    off = {n: ((ckpt[n] - w).norm().item(), (eager[n] - w).norm().item()) for n, w in plain.items()}
    assert all(c <= 2 * e + 1e-6 for c, e in off.values()), off


def test_a_compiled_model_leaves_room_for_every_variant_of_its_blocks():
    """trainer.compile raises dynamo's recompile limit to BLOCK_RECOMPILE_LIMIT, above the variants a
    block compiles (phases, statistics, evaluation, srelu24's first and later micro-batches)."""
    from model import FFNConfig, ModelConfig, Transformer
    from training.config import TrainerConfig
    from training.distributed import BLOCK_RECOMPILE_LIMIT, Dist, build_model

    mcfg = ModelConfig(name="t", dim=32, n_layers=2, n_heads=2, swiglu_hidden=64, max_seq_len=16)
    with torch._dynamo.config.patch(recompile_limit=8):  # restored on exit (a monkeypatch would delete it)
        build_model(lambda: Transformer(mcfg, FFNConfig(), 50), TrainerConfig(compile=False), Dist(), 0, False)
        assert torch._dynamo.config.recompile_limit == 8
        build_model(lambda: Transformer(mcfg, FFNConfig(), 50), TrainerConfig(compile=True), Dist(), 0, False)
        assert torch._dynamo.config.recompile_limit == BLOCK_RECOMPILE_LIMIT > 8


def test_cuda_device_always_gets_an_index(monkeypatch):
    """set_device and NCCL need cuda:N, also for one process with strategy ddp/fsdp (a bare
    "cuda" crashed there); with several processes each takes cuda:LOCAL_RANK."""
    from training.distributed import pick_device
    from training.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("auto") == torch.device("cuda", 0)
    assert pick_device("cuda", local_rank=3, world_size=4) == torch.device("cuda", 1)
    assert pick_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="each process takes cuda:LOCAL_RANK"):
        pick_device("cuda:1", local_rank=0, world_size=2)


def test_a_manifest_without_a_ranks_state_is_incomplete(tmp_path):
    """verify refuses a checkpoint whose manifest misses a rank's state file (e.g. a stale listing
    on a network filesystem when it was written), naming it."""
    from training.checkpoint import CheckpointError, save_checkpoint, verify_checkpoint

    path = save_checkpoint(tmp_path, 3, {"model": {"w": torch.ones(2)}, "rank": {"x": 1}, "note": "n"})
    verify_checkpoint(path)
    m = json.loads((path / "manifest.json").read_text())
    m["world_size"] = 2  # as if written by 2 ranks and rank 1's file never listed
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"incomplete: its manifest lacks rank_00001\.pt"):
        verify_checkpoint(path)
