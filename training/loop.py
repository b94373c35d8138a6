"""The training loop: set up, resume, then per step `training.step.train_step` (the one
definition of a step) -> log / eval / checkpoint."""
import json
import logging
import math
import shutil
import signal
import statistics
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from torch.distributed.checkpoint.state_dict import get_state_dict

from data.errors import DataError
from data.loader import TokenLoader
from data.shards import prepare
from model import Transformer, ffn_hidden_dim, model_size
from kernels.ffn_stats import derive

from .checkpoint import (Checkpointer, check_model_shape, find_resume_checkpoint, load_into, load_rank_state,
                         model_shape, rng_state, set_rng_state)
from .cli import hydra_only
from .config import Config, Strategy
from .distributed import Dist, agree, broadcast_object, build_model, launch_env, local, setup, shutdown
from .errors import TrainingError
from .logger import RunLogger, end_summary, environment, startup_summary
from .memory import dry_run_rows, use_bf16, world_size_of_launch
from .preflight import check_memory, dry_run_capacity
from .preflight import dry_run_rows as fit_rows
from .gpu_clocks import ClockSampler
from .metrics import Throughput, peak_info
from .optim import build_optimizer, lr_at
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
    t, device = cfg.trainer, d.device
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

    # rank 0 prepares missing shards (hours, for a large corpus) while the others wait without a
    # timeout; any failure there reaches every rank, then every rank finds the shards cached
    err = None
    if d.is_main:
        try:
            prepare(cfg.data, REPO_ROOT, progress=t.progress)
        except DataError as e:
            err = str(e)
        except Exception as e:  # noqa: BLE001 - told to the other ranks, then raised here as it was
            broadcast_object(f"data preparation failed on rank 0: {type(e).__name__}: {e}", d, slow=True)
            raise
    err = broadcast_object(err, d, slow=True)
    if err:
        raise DataError(err)
    shard_dir, manifest = prepare(cfg.data, REPO_ROOT, progress=False)
    vocab_size = resolve_vocab_size(cfg.model, manifest.vocab_size)
    bf16 = use_bf16(t.precision, device)
    fsdp_bf16 = t.strategy == Strategy.fsdp and bf16 and device.type == "cuda"  # FSDP's mixed precision, not autocast
    model, train_module = build_model(lambda: Transformer(cfg.model, cfg.ffn, vocab_size, eot_id=manifest.eot_id,
                                                          float8=t.float8.value), t, d,
                                      t.seed, fsdp_bf16)
    size = model_size(model, t.seq_len)
    optimizer = build_optimizer(model, cfg.optim, device)
    accum = t.batch_size // (t.micro_batch_size * d.world_size)
    loader = TokenLoader(shard_dir, manifest, "train", t.seq_len, t.micro_batch_size, t.seed, d.rank, d.world_size)
    val_batches = TokenLoader(shard_dir, manifest, "val", t.seq_len, t.micro_batch_size, t.seed).fixed_batches(t.eval_batches)

    state = TrainState(loader=loader)
    if resumed is not None:
        path, saved = resumed
        check_model_shape(path, saved, model)
        changes = check_resume(path, saved.get("config"), resolved, t.resume_overrides)
        check_same_data(path, saved, manifest)
        load_into(path, model, optimizer)
        mine = load_rank_state(path, d.rank, d.world_size)
        loader.load_state_dict(mine["loader"])
        set_rng_state(mine["rng"])
        state.step, state.elapsed_s = saved["step"], saved.get("elapsed_s", 0.0)
        state.skipped_steps, state.tokens = saved.get("skipped_steps", 0), saved["step"] * tokens_per_step
        if saved.get("world_size") != d.world_size and d.is_main:
            log.info(f"note: {path} was written by {saved.get('world_size')} process(es), this run has {d.world_size}: "
                  "weights and optimizer state are resharded, the data continues at the same sample; the "
                  "result is not bitwise what the original world size would give")
        if d.is_main:
            log.info(f"resumed from {path} at step {state.step}" +
                     "".join(f"; {c} (trainer.resume_overrides)" for c in changes))
    ckpt = Checkpointer.for_run(run_dir, t, device)
    if t.check_space:
        ckpt.check_space(model, state.step, steps, t.ckpt_every, t.stop_at_step)

    info = {"vocab_size": vocab_size, "ffn_hidden": ffn_hidden_dim(cfg.model, cfg.ffn), "total_steps": steps,
            "grad_accum": accum, "tokens_per_step": tokens_per_step, "device": str(device),
            "strategy": t.strategy.value, "world_size": d.world_size,
            "params": asdict(size), "flops_per_token": size.flops_per_token, "mfu_peak": peak_info(device),
            "shard_dir": str(shard_dir),
            "environment": environment()}
    err, logger = None, None
    try:  # rank 0 writes files and starts wandb; a failure there must stop every rank, not strand them
        if d.is_main:
            (run_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(resolved))
            (run_dir / "run_info.json").write_text(json.dumps(info, indent=2))
        logger = RunLogger(run_dir, cfg.logging.wandb, name=run_name, group=cfg.name, job_type=cfg.ffn.kind,
                           config={**resolved, "run_info": info}, resumed=state.step > 0, rank=d.rank)
    except Exception as e:  # noqa: BLE001 - shared below, then raised on every rank
        err = f"could not start the run's logs in {run_dir}: {type(e).__name__}: {e}"
    err = broadcast_object(err, d)  # rank 0's (only rank 0 writes or logs)
    if err:
        if logger is not None:
            logger.close()
        raise TrainingError(err)
    if d.is_main:
        log.info(startup_summary(run_dir, cfg, info, state.step))

    is_sparse = cfg.ffn.kind == "srelu24"
    parts = StepParts(model=model, train_module=train_module, optimizer=optimizer, dist=d, accum=accum,
                      tokens_per_step=tokens_per_step, lr_at=lambda step: lr_at(step, steps, cfg.optim),
                      grad_clip=cfg.optim.grad_clip, sparse_from=cfg.ffn.dense_warmup_steps if is_sparse else None,
                      autocast=autocast_for(t.precision, t.strategy, device), nonfinite=t.nonfinite)

    def next_batch():
        x, y = loader.next_batch()  # this rank's part of the global batch
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def checkpoint(done: int) -> None:
        state.settle_skipped()  # the exact count into the checkpoint
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(local(p)).all()]
        if agree([bool(bad)], d)[0]:  # never write a broken model over good checkpoints
            where = f"{bad[0]}, {len(bad)} tensor(s)" if bad else "on another rank"
            raise TrainingError(f"step {done}: refusing to checkpoint a model with non-finite weights ({where}); "
                                f"the checkpoints in {run_dir / 'checkpoints'} are intact")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        ckpt.save(done, state={
            "model": model_sd, "optimizer": optim_sd, "rank": {"loader": state.loader.state_dict(), "rng": rng_state()},
            "model_shape": model_shape(model), "config": resolved, "strategy": t.strategy.value,
            "elapsed_s": meter.elapsed(), "skipped_steps": state.skipped_steps,
            "data": {"tokenizer_sha256": manifest.tokenizer_sha256, "vocab_size": manifest.vocab_size,
                     "eot_id": manifest.eot_id}})

    def evaluate() -> float:
        model.eval()  # every rank runs the same fixed batches (FSDP needs all ranks in each forward)
        with torch.no_grad(), parts.autocast():
            losses = [model(x.to(device), y.to(device)) for x, y in val_batches]
        model.train()
        return torch.stack(losses).mean().item()

    clocks = ClockSampler(device, interval_ms=500).start() if cfg.logging.gpu_clocks and device.type == "cuda" else None
    meter = Throughput(device, size.flops_per_token, tokens_per_step, d.world_size, elapsed_offset=state.elapsed_s,
                       clocks=clocks)
    val_loss = train_loss = float("nan")
    speeds, last_row = [], {}
    stop = StopSignal()  # SIGTERM / SIGUSR1 / SIGUSR2 (preemption): checkpoint at the next step boundary, exit 0
    try:
        bar = tqdm(total=steps, initial=state.step, disable=not (t.progress and d.is_main),
                   desc=f"{cfg.name}/{cfg.ffn.kind}", unit="step", dynamic_ncols=True)
        while state.step < steps:
            done = state.step + 1
            log_now = done % t.log_every == 0 or done == steps
            out = train_step(parts, state, next_batch, log=log_now, stop_requested=lambda: stop.requested is not None)
            if ckpt.wants_prepare:  # the optimizer has its state now: background saves' host copy, allocated meanwhile
                ckpt.prepare(dict(zip(("model", "optimizer"), get_state_dict(model, optimizer))))
            stop_now = out.stop
            meter.data_time(out.data_s)
            meter.step()
            bar.update(1)

            row = {}
            if log_now:  # the step read back the loss and statistics of all ranks
                train_loss = out.loss
                row.update(loss=train_loss, lr=out.lr, grad_norm=out.grad_norm, **meter.read(),
                           mode_2to4=int(out.sparse_on), skipped_steps=state.skipped_steps)
                row["layers"] = derive(out.stats, is_sparse)
                row["act_sparsity_mean"] = sum(row["layers"]["act_sparsity"]) / cfg.model.n_layers
                bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}")
            if done % t.eval_every == 0 or done == steps:
                meter.pause()
                val_loss = row["val_loss"] = evaluate()
                if d.is_main:
                    log.info(f"step {done}: val_loss {val_loss:.4f}")
                meter.resume()
            if row:
                logger.log({"step": done, "tokens": state.tokens, **row})
                if "tokens_per_s" in row:
                    speeds.append(row["tokens_per_s"])
                    last_row = row
            if done % t.ckpt_every == 0 or done == steps or done == t.stop_at_step or stop_now:
                meter.pause()
                checkpoint(done)
                meter.resume()
            if done == t.stop_at_step or stop_now:
                bar.close()
                why = f"signal {stop.requested or 'on another rank'}" if stop_now else "trainer.stop_at_step"
                if d.is_main:
                    log.info(f"stopped at step {done} ({why}), checkpoint saved; continue (or requeue) with the same "
                          f"command plus trainer.resume=auto hydra.run.dir={run_dir}")
                break
        bar.close()
        state.settle_skipped()  # steps skipped on the device since the last logged step, warned
    except BaseException:
        ckpt.close(raise_errors=False)  # a save in flight completes (or is logged as failed)
        logger.close()  # metrics.jsonl closed and the wandb run finished, even on errors
        raise
    finally:  # also on errors: leave the process as it was
        stop.restore()
        if clocks is not None:
            clocks.stop()
    summary = {"final_train_loss": train_loss, "final_val_loss": val_loss, "steps": steps,
               "tokens": steps * tokens_per_step, "ln_vocab": math.log(vocab_size),
               "params_total": size.total, "params_non_embedding": size.non_embedding}
    if speeds:
        summary["tokens_per_s_median"] = statistics.median(speeds[1:] or speeds)  # the first interval warms up
    for key in ("mfu", "mem_allocated_gib", "act_sparsity_mean"):
        if key in last_row:
            summary[f"final_{key}"] = last_row[key]
    ckpt.close()  # the last save is complete before the run reports its end
    logger.summary(summary)
    logger.close()
    if d.is_main:
        log.info(end_summary(run_dir, summary))
    stop.forward()
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
