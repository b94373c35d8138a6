"""The training loop, in phases: the pre-flight (training/preflight.py), set up (data, model,
optimizer, loaders), resume, the outputs (checkpointer, files, logs), the loop (per step
`training.step.train_step`, the one definition of a step, then log / eval / checkpoint) and the
teardown (summary, closing)."""
import json
import logging
import math
import shutil
import signal
import statistics
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from torch.distributed.checkpoint.state_dict import get_state_dict

from data.errors import DataError
from data.loader import TokenLoader, batch_to_device
from data.shards import prepare
from model import Transformer, ffn_hidden_dim, model_size
from srelu24_kernels.ffn_stats import derive

from .checkpoint import (Checkpointer, check_model_shape, find_resume_checkpoint, load_into, load_rank_state,
                         model_shape, rng_state, set_rng_state)
from .cli import hydra_only
from .config import Config, Strategy, TrainerConfig
from .distributed import Dist, agree, broadcast_object, build_model, launch_env, local, setup, shutdown
from .errors import TrainingError
from .logger import RunLogger, end_summary, environment, startup_summary
from .memory import dry_run_rows, use_bf16, world_size_of_launch
from .preflight import check_memory, dry_run_capacity
from .preflight import dry_run_rows as fit_rows
from .gpu_clocks import ClockSampler
from .metrics import Throughput, peak_info
from .optim import build_optimizer, lr_at
from .cuda_graph import MicroBatchGraphs
from .step import StepParts, TrainState, train_step
from .config_checks import check_config, check_resume, resolve_vocab_size, total_steps

REPO_ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger(__name__)


def train(dcfg: DictConfig, run_dir: Path, run_name: str) -> dict:
    cfg: Config = OmegaConf.to_object(dcfg)
    launch = launch_env(slurm=cfg.trainer.strategy != Strategy.none)
    check_config(cfg, world_size=launch.world_size if launch else 1, rank=launch.rank if launch else 0)
    if cfg.trainer.dry_run:
        return dry_run(cfg)
    d = setup(cfg.trainer)  # every rank; a process group unless trainer.strategy=none
    try:
        return _train(cfg, dcfg, run_dir, run_name, d)
    finally:
        shutdown(d)


def _train(cfg: Config, dcfg: DictConfig, run_dir: Path, run_name: str, d: Dist) -> dict:
    """The phases of a run: the pre-flight, set up, resume, the outputs, the loop, teardown."""
    t = cfg.trainer
    if t.num_threads > 0:
        torch.set_num_threads(t.num_threads)
    check_memory(cfg, d)  # before anything large is allocated: a run that cannot fit ends here
    run_dir = shared_run_dir(run_dir, d)
    steps, tokens_per_step = total_steps(t), t.batch_size * t.seq_len
    resolved = OmegaConf.to_container(dcfg, resolve=True, enum_to_str=True)
    resumed = find_resume_checkpoint(t.resume, run_dir)
    if resumed is not None and resumed[1]["step"] >= steps:  # other settings are refused as in any resume
        check_resume(resumed[0], resumed[1].get("config"), resolved, t.resume_overrides)
        return complete_run(resumed[0], resumed[1]["step"], steps, tokens_per_step, d)
    run = set_up(cfg, d, run_dir, resolved)
    if resumed is not None:
        resume(run, *resumed)
    start_outputs(run, run_name)
    return teardown(run, run_loop(run))


@dataclass
class Run:
    """What the phases of one run share: made by set_up, completed by start_outputs."""
    cfg: Config
    d: Dist
    run_dir: Path
    resolved: dict          # the config as a checkpoint saves it
    shard_dir: Path
    manifest: object        # the token shards' (data.shards)
    vocab_size: int
    model: torch.nn.Module
    train_module: torch.nn.Module  # what a step calls: DDP's wrapper, or the model
    optimizer: torch.optim.Optimizer
    size: object            # model.model_size: parameters and FLOPs per token
    loader: TokenLoader
    val_batches: list
    state: TrainState
    ckpt: Optional[Checkpointer] = None
    logger: Optional[RunLogger] = None

    @property
    def steps(self) -> int:
        return total_steps(self.cfg.trainer)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.trainer.batch_size * self.cfg.trainer.seq_len

    @property
    def accum(self) -> int:
        return self.cfg.trainer.batch_size // (self.cfg.trainer.micro_batch_size * self.d.world_size)


def prepare_data(cfg: Config, d: Dist):
    """The token shards: rank 0 prepares missing ones (hours, for a large corpus) while the others
    wait without a timeout; any failure there reaches every rank, then every rank finds them cached."""
    err = None
    if d.is_main:
        try:
            prepare(cfg.data, REPO_ROOT, progress=cfg.trainer.progress)
        except DataError as e:
            err = str(e)
        except Exception as e:  # noqa: BLE001 - told to the other ranks, then raised here as it was
            broadcast_object(f"data preparation failed on rank 0: {type(e).__name__}: {e}", d, slow=True)
            raise
    err = broadcast_object(err, d, slow=True)
    if err:
        raise DataError(err)
    return prepare(cfg.data, REPO_ROOT, progress=False)


def set_up(cfg: Config, d: Dist, run_dir: Path, resolved: dict) -> Run:
    """The data, the model (training.distributed.build_model), its optimizer and the loaders."""
    t, device = cfg.trainer, d.device
    shard_dir, manifest = prepare_data(cfg, d)
    vocab_size = resolve_vocab_size(cfg.model, manifest.vocab_size)
    bf16 = use_bf16(t.precision, device)
    fsdp_bf16 = t.strategy == Strategy.fsdp and bf16 and device.type == "cuda"  # FSDP's mixed precision, not autocast
    model, train_module = build_model(lambda: Transformer(cfg.model, cfg.ffn, vocab_size, eot_id=manifest.eot_id,
                                                          float8=t.float8.value), t, d,
                                      t.seed, fsdp_bf16)
    size = model_size(model, t.seq_len)
    optimizer = build_optimizer(model, cfg.optim, device)
    loader = TokenLoader(shard_dir, manifest, "train", t.seq_len, t.micro_batch_size, t.seed, d.rank, d.world_size)
    val_batches = TokenLoader(shard_dir, manifest, "val", t.seq_len, t.micro_batch_size, t.seed).fixed_batches(t.eval_batches)
    return Run(cfg, d, run_dir, resolved, shard_dir, manifest, vocab_size, model, train_module, optimizer, size,
               loader, val_batches, TrainState(loader=loader))


def resume(run: Run, path: Path, saved: dict) -> None:
    """Check the checkpoint against this run (model shape, guarded settings, data), then load the
    model, optimizer, this rank's loader and RNG state, and the counters."""
    d, t, state = run.d, run.cfg.trainer, run.state
    check_model_shape(path, saved, run.model)
    changes = check_resume(path, saved.get("config"), run.resolved, t.resume_overrides)
    check_same_data(path, saved, run.manifest)
    load_into(path, run.model, run.optimizer)
    mine = load_rank_state(path, d.rank, d.world_size)
    run.loader.load_state_dict(mine["loader"])
    set_rng_state(mine["rng"])
    state.step, state.elapsed_s = saved["step"], saved.get("elapsed_s", 0.0)
    state.skipped_steps, state.tokens = saved.get("skipped_steps", 0), saved["step"] * run.tokens_per_step
    if saved.get("world_size") != d.world_size and d.is_main:
        log.info(f"note: {path} was written by {saved.get('world_size')} process(es), this run has {d.world_size}: "
                 "weights and optimizer state are resharded, the data continues at the same sample; the "
                 "result is not bitwise what the original world size would give")
    if d.is_main:
        log.info(f"resumed from {path} at step {state.step}" +
                 "".join(f"; {c} (trainer.resume_overrides)" for c in changes))


def start_outputs(run: Run, run_name: str) -> None:
    """The checkpointer (and its disk space check), config_resolved.yaml, run_info.json, the
    metrics logger and the start-up line."""
    cfg, d, t, run_dir = run.cfg, run.d, run.cfg.trainer, run.run_dir
    run.ckpt = Checkpointer.for_run(run_dir, t, d.device)
    if t.check_space:
        run.ckpt.check_space(run.model, run.state.step, run.steps, t.ckpt_every, t.stop_at_step)
    info = {"vocab_size": run.vocab_size, "ffn_hidden": ffn_hidden_dim(cfg.model, cfg.ffn), "total_steps": run.steps,
            "grad_accum": run.accum, "tokens_per_step": run.tokens_per_step, "device": str(d.device),
            "strategy": t.strategy.value, "world_size": d.world_size,
            "params": asdict(run.size), "flops_per_token": run.size.flops_per_token, "mfu_peak": peak_info(d.device),
            "shard_dir": str(run.shard_dir),
            "environment": environment()}
    err = None
    try:  # rank 0 writes files and starts wandb; a failure there must stop every rank, not strand them
        if d.is_main:
            (run_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(run.resolved))
            (run_dir / "run_info.json").write_text(json.dumps(info, indent=2))
        run.logger = RunLogger(run_dir, cfg.logging.wandb, name=run_name, group=cfg.name, job_type=cfg.ffn.kind,
                               config={**run.resolved, "run_info": info}, resumed=run.state.step > 0, rank=d.rank)
    except Exception as e:  # noqa: BLE001 - shared below, then raised on every rank
        err = f"could not start the run's logs in {run_dir}: {type(e).__name__}: {e}"
    err = broadcast_object(err, d)  # rank 0's (only rank 0 writes or logs)
    if err:
        if run.logger is not None:
            run.logger.close()
        raise TrainingError(err)
    if d.is_main:
        log.info(startup_summary(run_dir, cfg, info, run.state.step))


@dataclass
class Progress:
    """What the loop hands to the teardown."""
    stop: "StopSignal"
    train_loss: float = math.nan
    val_loss: float = math.nan
    speeds: list = field(default_factory=list)   # tokens/s of each logged interval
    last_row: dict = field(default_factory=dict)  # the last logged row with a speed
    act_sparsity_mean: Optional[float] = None     # of the last step with FFN statistics


def run_loop(run: Run) -> Progress:
    """Steps until the last one, trainer.stop_at_step or a signal (SIGTERM / SIGUSR1 / SIGUSR2:
    preemption; a checkpoint at the next step boundary, exit 0). On any error the save in flight
    completes and the logs are closed; signal handlers and the clock sampler are restored always."""
    cfg, d, t, state, device = run.cfg, run.d, run.cfg.trainer, run.state, run.d.device
    parts = step_parts(run)
    clocks = ClockSampler(device, interval_ms=500).start() if cfg.logging.gpu_clocks and device.type == "cuda" else None
    meter = Throughput(device, run.size.flops_per_token, run.tokens_per_step, d.world_size,
                       elapsed_offset=state.elapsed_s, clocks=clocks)
    progress = Progress(stop=StopSignal())
    try:
        bar = tqdm(total=run.steps, initial=state.step, disable=not (t.progress and d.is_main),
                   desc=f"{cfg.name}/{cfg.ffn.kind}", unit="step", dynamic_ncols=True)
        while state.step < run.steps:
            done, signalled = one_step(run, parts, meter, bar, progress)
            if done == t.stop_at_step or signalled:
                bar.close()
                why = f"signal {progress.stop.requested or 'on another rank'}" if signalled else "trainer.stop_at_step"
                run.ckpt.wait()  # written (or its error raised) before the line that says so
                if d.is_main:
                    log.info(f"stopped at step {done} ({why}), checkpoint saved; continue (or requeue) with the same "
                             f"command plus trainer.resume=auto hydra.run.dir={run.run_dir}")
                break
        bar.close()
        state.settle_skipped()  # steps skipped on the device since the last logged step, warned
    except BaseException:
        run.ckpt.close(raise_errors=False)  # a save in flight completes (or is logged as failed)
        run.logger.close()  # metrics.jsonl closed and the wandb run finished, even on errors
        raise
    finally:  # also on errors: leave the process as it was
        progress.stop.restore()
        if clocks is not None:
            clocks.stop()
        if parts.graphs is not None:  # its pool and the model's token-order buffer (after a CUDA error, may raise)
            parts.graphs.close()
    return progress


def step_parts(run: Run) -> StepParts:
    """What every step of this run needs (training/step.py)."""
    cfg, t, steps = run.cfg, run.cfg.trainer, run.steps
    parts = StepParts(model=run.model, train_module=run.train_module, optimizer=run.optimizer, dist=run.d,
                      accum=run.accum, tokens_per_step=run.tokens_per_step,
                      lr_at=lambda step: lr_at(step, steps, cfg.optim), grad_clip=cfg.optim.grad_clip,
                      sparse_from=cfg.ffn.dense_warmup_steps if cfg.ffn.kind == "srelu24" else None,
                      autocast=autocast_for(t.precision, t.strategy, run.d.device), nonfinite=t.nonfinite)
    if t.cuda_graph:
        parts.graphs = MicroBatchGraphs.for_step(parts, t.micro_batch_size, t.seq_len)
    return parts


def logged(t: TrainerConfig, done: int, last: bool = False) -> tuple[bool, bool]:
    """Whether step `done` (1-based) logs its row, and whether it collects the FFN statistics
    (trainer.ffn_stats_every; a graphed step that does runs eagerly). The last step does both."""
    log = done % t.log_every == 0 or last
    return log, log and (t.ffn_stats_every == 0 or done % t.ffn_stats_every == 0 or last)


def one_step(run: Run, parts: StepParts, meter: Throughput, bar, progress: Progress) -> tuple[int, bool]:
    """One optimizer step, then its log row, evaluation and checkpoint as due. Returns the step
    and whether a signal asks to stop (on any rank)."""
    cfg, t, state, device = run.cfg, run.cfg.trainer, run.state, run.d.device
    done = state.step + 1
    log_now, stats_now = logged(t, done, last=done == run.steps)

    def next_batch():
        return batch_to_device(*run.loader.next_batch(), device)  # this rank's part of the global batch

    out = train_step(parts, state, next_batch, log=log_now, stats=stats_now, stop_requested=lambda: progress.stop.requested is not None)
    if run.ckpt.wants_prepare:  # the optimizer has its state now: background saves' host copy, allocated meanwhile
        run.ckpt.prepare(dict(zip(("model", "optimizer"), get_state_dict(run.model, run.optimizer))))
    meter.data_time(out.data_s)
    meter.step()
    bar.update(1)
    row = {}
    if log_now:  # the step read back the loss and statistics of all ranks
        progress.train_loss = out.loss
        row.update(loss=out.loss, lr=out.lr, grad_norm=out.grad_norm, **meter.read(),
                   mode_2to4=int(out.sparse_on), skipped_steps=state.skipped_steps)
        if out.stats is not None:
            row["layers"] = derive(out.stats, cfg.ffn.kind == "srelu24")
            row["act_sparsity_mean"] = sum(row["layers"]["act_sparsity"]) / cfg.model.n_layers
            progress.act_sparsity_mean = row["act_sparsity_mean"]
        bar.set_postfix(loss=f"{out.loss:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}")
    if done % t.eval_every == 0 or done == run.steps:
        meter.pause()
        progress.val_loss = row["val_loss"] = evaluate(run, parts)
        if run.d.is_main:
            log.info(f"step {done}: val_loss {progress.val_loss:.4f}")
        meter.resume()
    if row:
        run.logger.log({"step": done, "tokens": state.tokens, **row})
        if "tokens_per_s" in row:
            progress.speeds.append(row["tokens_per_s"])
            progress.last_row = row
    if done % t.ckpt_every == 0 or done == run.steps or done == t.stop_at_step or out.stop:
        meter.pause()
        save(run, done, meter)
        meter.resume()
    return done, out.stop


def evaluate(run: Run, parts: StepParts) -> float:
    """The mean loss over the fixed validation batches; every rank runs the same batches (FSDP
    needs all ranks in each forward)."""
    model, device = run.model, run.d.device
    model.eval()
    with torch.no_grad(), parts.autocast():
        losses = [model(x.to(device), y.to(device)) for x, y in run.val_batches]
    model.train()
    return torch.stack(losses).mean().item()


def save(run: Run, done: int, meter: Throughput) -> None:
    """Checkpoint step `done`: never from non-finite weights (checked on every rank), so a broken
    model is not written over good checkpoints."""
    model, state = run.model, run.state
    state.settle_skipped()  # the exact count into the checkpoint
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(local(p)).all()]
    if agree([bool(bad)], run.d)[0]:
        where = f"{bad[0]}, {len(bad)} tensor(s)" if bad else "on another rank"
        raise TrainingError(f"step {done}: refusing to checkpoint a model with non-finite weights ({where}); "
                            f"the checkpoints in {run.run_dir / 'checkpoints'} are intact")
    model_sd, optim_sd = get_state_dict(model, run.optimizer)
    manifest = run.manifest
    run.ckpt.save(done, state={
        "model": model_sd, "optimizer": optim_sd, "rank": {"loader": state.loader.state_dict(), "rng": rng_state()},
        "model_shape": model_shape(model), "config": run.resolved, "strategy": run.cfg.trainer.strategy.value,
        "elapsed_s": meter.elapsed(), "skipped_steps": state.skipped_steps,
        "data": {"tokenizer_sha256": manifest.tokenizer_sha256, "vocab_size": manifest.vocab_size,
                 "eot_id": manifest.eot_id}})


def teardown(run: Run, progress: Progress) -> dict:
    """The summary (wandb's and the last line), once the last save is complete; then the signal
    that stopped the run goes on to the handler it replaced."""
    summary = {"final_train_loss": progress.train_loss, "final_val_loss": progress.val_loss, "steps": run.steps,
               "tokens": run.steps * run.tokens_per_step, "ln_vocab": math.log(run.vocab_size),
               "params_total": run.size.total, "params_non_embedding": run.size.non_embedding}
    if progress.speeds:
        summary["tokens_per_s_median"] = statistics.median(progress.speeds[1:] or progress.speeds)  # the first interval warms up
    for key in ("mfu", "mem_allocated_gib"):
        if key in progress.last_row:
            summary[f"final_{key}"] = progress.last_row[key]
    if progress.act_sparsity_mean is not None:  # a stop between trainer.ffn_stats_every steps logs none
        summary["final_act_sparsity_mean"] = progress.act_sparsity_mean
    try:
        run.ckpt.close()  # the last save is complete before the run reports its end
    except BaseException:  # it failed (a full disk): its error is the run's end, the logs still closed
        run.logger.close()
        raise
    run.logger.summary(summary)
    run.logger.close()
    if run.d.is_main:
        log.info(end_summary(run.run_dir, summary))
    progress.stop.forward()
    return summary


def complete_run(path: Path, step: int, steps: int, tokens_per_step: int, d: Dist) -> dict:
    """A resume of a run that already reached its last step: nothing is built or written."""
    if d.is_main:
        log.info(f"run complete at step {step} ({path}); nothing to do. To train on, raise trainer.max_steps "
                 f"and allow it: trainer.resume_overrides=[trainer.max_steps]")
    return {"steps": steps, "tokens": step * tokens_per_step, "complete_at_step": step}


class StopSignal:
    """Records SIGTERM / SIGUSR1 / SIGUSR2 (preemption, a time limit) instead of dying mid-step.
    After the checkpoint, `forward` hands the signal to the handler it replaced, if that was
    Python code: under submitit (SIGUSR2) that requeues the job."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self):
        self.requested = None
        self._old = {}
        for sig in self.SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def forward(self) -> None:
        old = self._old.get(signal.Signals[self.requested]) if self.requested else None
        if callable(old):
            old(signal.Signals[self.requested].value, None)


def shared_run_dir(run_dir: Path, d: Dist) -> Path:
    """Rank 0's run directory on every rank: ranks that started in another second got another
    `${now:}` directory from Hydra; it holds only Hydra's files, and is removed."""
    main = Path(broadcast_object(str(run_dir), d))
    if main != run_dir and hydra_only(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)
    return main


def check_same_data(path: Path, state: dict, manifest) -> None:
    from .errors import CheckpointError

    have = state.get("data", {})
    if have.get("tokenizer_sha256") != manifest.tokenizer_sha256 or have.get("vocab_size") != manifest.vocab_size:
        raise CheckpointError(
            f"checkpoint {path} was trained on tokenizer {str(have.get('tokenizer_sha256'))[:12]} "
            f"(vocab {have.get('vocab_size')}) but the data uses tokenizer {manifest.tokenizer_sha256[:12]} "
            f"(vocab {manifest.vocab_size}); point data.* at the checkpoint's shards")


def autocast_for(precision: str, strategy: Strategy, device: torch.device):
    """bf16 autocast, except under FSDP on a GPU, whose mixed precision keeps bf16 parameters
    itself (build_model's bf16_params); a factory, since one context object is not re-entrant."""
    if use_bf16(precision, device) and not (strategy == Strategy.fsdp and device.type == "cuda"):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext


def dry_run(cfg: Config) -> dict:
    """Build on the meta device (nothing allocated) and print the sizes, FLOPs, memory and whether
    it fits (training/preflight.py)."""
    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.ffn, vocab)
    s = model_size(model, cfg.trainer.seq_len)
    steps = total_steps(cfg.trainer)
    tokens = steps * cfg.trainer.batch_size * cfg.trainer.seq_len
    rows = [("model", f"{cfg.model.name}, ffn={cfg.ffn.kind} (hidden {ffn_hidden_dim(cfg.model, cfg.ffn)})"),
            ("vocabulary", f"{vocab}" + ("" if cfg.model.vocab_size else " (data.vocab_size)")),
            ("parameters, total", f"{s.total:,}"),
            ("parameters, non-embedding", f"{s.non_embedding:,}"),
            ("parameters, embedding / LM head", f"{s.embedding:,} / {s.output:,}"),
            ("FLOPs per token, training (6N + 12LdS)", f"{s.flops_per_token:.4g}"),
            ("FLOPs per token, forward", f"{s.forward_flops_per_token:.4g}"),
            ("steps x tokens per step", f"{steps:,} x {cfg.trainer.batch_size * cfg.trainer.seq_len:,}"),
            ("training FLOPs for the budget", f"{s.flops_per_token * tokens:.4g}")]
    capacity, bf16 = dry_run_capacity(cfg)
    rows += dry_run_rows(cfg, vocab, bf16) + fit_rows(cfg, vocab, capacity, bf16, world_size_of_launch(cfg.trainer))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return {"params_total": s.total, "params_non_embedding": s.non_embedding, "flops_per_token": s.flops_per_token}
