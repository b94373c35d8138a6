"""The training loop. One step, top to bottom: sparsity switch -> LR -> micro-batches
(forward, backward) -> clip -> AdamW -> log / eval / checkpoint."""
import json
import math
import signal
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from data.loader import TokenLoader
from data.shards import prepare
from model import FFNKind, Transformer, ffn_hidden_dim, model_size
from model.stats import derive

from .checkpoint import (check_model_shape, find_resume_checkpoint, model_shape, rng_state, save_checkpoint,
                         set_rng_state)
from .config import Config
from .errors import ConfigError, TrainingError
from .logger import RunLogger, environment
from .metrics import Throughput
from .optim import build_optimizer, lr_at
from .validate import resolve_vocab_size, total_steps, validate

REPO_ROOT = Path(__file__).resolve().parent.parent


def train(dcfg: DictConfig, run_dir: Path, run_name: str) -> dict:
    cfg: Config = OmegaConf.to_object(dcfg)
    validate(cfg)
    if cfg.trainer.dry_run:
        return dry_run(cfg)
    t, device = cfg.trainer, pick_device(cfg.trainer.device)
    torch.manual_seed(t.seed)
    if t.num_threads > 0:
        torch.set_num_threads(t.num_threads)

    shard_dir, manifest = prepare(cfg.data, REPO_ROOT, progress=t.progress)
    vocab_size = resolve_vocab_size(cfg.model, manifest.vocab_size)
    model = Transformer(cfg.model, cfg.ffn, vocab_size).to(device)
    size = model_size(model, t.seq_len)
    optimizer = build_optimizer(model, cfg.optim, device)
    accum = t.batch_size // t.micro_batch_size
    steps = total_steps(t)
    tokens_per_step = t.batch_size * t.seq_len
    loader = TokenLoader(shard_dir, manifest, "train", t.seq_len, t.micro_batch_size, t.seed)
    val_batches = TokenLoader(shard_dir, manifest, "val", t.seq_len, t.micro_batch_size, t.seed).fixed_batches(t.eval_batches)

    start, elapsed0, skipped0 = 0, 0.0, 0
    resumed = find_resume_checkpoint(t.resume, run_dir)
    if resumed is not None:
        path, state = resumed
        check_model_shape(path, state, model)
        check_same_data(path, state, manifest)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        start, elapsed0, skipped0 = state["step"], state.get("elapsed_s", 0.0), state.get("skipped_steps", 0)
        print(f"resumed from {path} at step {start}")

    resolved = OmegaConf.to_container(dcfg, resolve=True, enum_to_str=True)
    info = {"vocab_size": vocab_size, "ffn_hidden": ffn_hidden_dim(cfg.model, cfg.ffn), "total_steps": steps,
            "grad_accum": accum, "tokens_per_step": tokens_per_step, "device": str(device),
            "params": asdict(size), "flops_per_token": size.flops_per_token, "shard_dir": str(shard_dir),
            "environment": environment()}
    (run_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(resolved))
    (run_dir / "run_info.json").write_text(json.dumps(info, indent=2))
    logger = RunLogger(run_dir, cfg.logging.wandb, name=run_name, group=cfg.name, job_type=cfg.ffn.kind.value,
                       config={**resolved, "run_info": info}, resumed=start > 0)

    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16(t.precision, device)
                else nullcontext())
    forward = torch.compile(model) if t.compile else model
    is_sparse = cfg.ffn.kind == FFNKind.srelu24

    def checkpoint(done: int) -> None:
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        if bad:  # never write a broken model over good checkpoints
            raise TrainingError(f"step {done}: refusing to checkpoint a model with non-finite weights ({bad[0]}, "
                                f"{len(bad)} tensor(s)); the checkpoints in {run_dir / 'checkpoints'} are intact")
        save_checkpoint(run_dir, done, keep_last=t.keep_last, state={
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader.state_dict(),
            "rng": rng_state(), "model_shape": model_shape(model), "config": resolved,
            "elapsed_s": meter.elapsed(), "skipped_steps": skipped,
            "data": {"tokenizer_sha256": manifest.tokenizer_sha256, "vocab_size": manifest.vocab_size}})

    def evaluate() -> float:
        model.eval()
        with torch.no_grad(), autocast:
            losses = [forward(x.to(device), y.to(device)) for x, y in val_batches]
        model.train()
        return torch.stack(losses).mean().item()

    meter = Throughput(device, size.flops_per_token, tokens_per_step, elapsed_offset=elapsed0)
    val_loss = train_loss = float("nan")
    speeds, last_row, skipped = [], {}, skipped0
    stop = StopSignal()  # SIGTERM / SIGUSR1 (preemption): checkpoint at the next step boundary, exit 0
    try:
        bar = tqdm(total=steps, initial=start, disable=not t.progress, desc=f"{cfg.name}/{cfg.ffn.kind.value}",
                   unit="step", dynamic_ncols=True)
        for step in range(start, steps):
            done = step + 1
            sparse_on = is_sparse and step >= cfg.ffn.dense_warmup_steps
            model.set_sparse24(sparse_on)
            log_now = done % t.log_every == 0 or done == steps
            model.collect_ffn_stats(log_now)  # statistics of the logged step only: free on the others
            lr = lr_at(step, steps, cfg.optim)
            for group in optimizer.param_groups:
                group["lr"] = lr

            loss_sum = torch.zeros((), device=device)
            for _ in range(accum):
                t_data = time.perf_counter()
                x, y = loader.next_batch()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                meter.data_time(time.perf_counter() - t_data)
                with autocast:
                    loss = forward(x, y)
                (loss / accum).backward()
                loss_sum += loss.detach()
            clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if torch.isfinite(grad_norm).item():  # one bool per step: a NaN never reaches the weights
                optimizer.step()
            elif t.nonfinite == "stop":
                raise TrainingError(nonfinite_report(step + 1, loss_sum / accum, model))
            else:
                skipped += 1
                print(f"step {step + 1}: non-finite gradient, step skipped ({skipped} so far)", file=sys.stderr)
            optimizer.zero_grad(set_to_none=True)
            meter.step()
            bar.update(1)

            row = {}
            if log_now:
                model.collect_ffn_stats(False)
                train_loss = (loss_sum / accum).item()  # the one host sync, every log_every steps
                row.update(loss=train_loss, lr=lr, grad_norm=grad_norm.item(), **meter.read(), sparse24=int(sparse_on),
                           skipped_steps=skipped)
                row["layers"] = derive(model.pop_ffn_stats().cpu(), is_sparse)
                row["act_sparsity_mean"] = sum(row["layers"]["act_sparsity"]) / cfg.model.n_layers
                bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}")
            if done % t.eval_every == 0 or done == steps:
                meter.pause()
                val_loss = row["val_loss"] = evaluate()
                meter.resume()
            if row:
                logger.log({"step": done, "tokens": done * tokens_per_step, **row})
                if "tokens_per_s" in row:
                    speeds.append(row["tokens_per_s"])
                    last_row = row
            if done % t.ckpt_every == 0 or done == steps or done == t.stop_at_step or stop.requested:
                meter.pause()
                checkpoint(done)
                meter.resume()
            if done == t.stop_at_step or stop.requested:
                bar.close()
                why = f"signal {stop.requested}" if stop.requested else "trainer.stop_at_step"
                print(f"stopped at step {done} ({why}), checkpoint saved; continue (or requeue) with the same command "
                      f"plus trainer.resume=auto hydra.run.dir={run_dir}")
                break
        bar.close()
    except BaseException:
        logger.close()  # metrics.jsonl closed and the wandb run finished, even on errors
        raise
    finally:  # also on errors: leave the process as it was
        stop.restore()
    summary = {"final_train_loss": train_loss, "final_val_loss": val_loss, "steps": steps,
               "tokens": steps * tokens_per_step, "ln_vocab": math.log(vocab_size),
               "params_total": size.total, "params_non_embedding": size.non_embedding}
    if speeds:
        summary["tokens_per_s_median"] = statistics.median(speeds[1:] or speeds)  # the first interval warms up
    for key in ("mfu", "mem_allocated_gib", "act_sparsity_mean"):
        if key in last_row:
            summary[f"final_{key}"] = last_row[key]
    logger.summary(summary)
    logger.close()
    return summary


class StopSignal:
    """Records SIGTERM / SIGUSR1 (SLURM preemption) instead of dying mid-step."""

    def __init__(self):
        self.requested = None
        self._old = {}
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def nonfinite_report(step: int, loss: torch.Tensor, model: torch.nn.Module) -> str:
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    return (f"step {step}: non-finite gradient (loss {loss.item():.4g}) first in {bad[0] if bad else '?'} "
            f"({len(bad)} tensor(s)); trainer.nonfinite=stop, nothing was checkpointed after the last good step")


def check_same_data(path: Path, state: dict, manifest) -> None:
    from .errors import CheckpointError

    have = state.get("data", {})
    if have.get("tokenizer_sha256") != manifest.tokenizer_sha256 or have.get("vocab_size") != manifest.vocab_size:
        raise CheckpointError(
            f"checkpoint {path} was trained on tokenizer {str(have.get('tokenizer_sha256'))[:12]} "
            f"(vocab {have.get('vocab_size')}) but the data uses tokenizer {manifest.tokenizer_sha256[:12]} "
            f"(vocab {manifest.vocab_size}); point data.* at the checkpoint's shards")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={name} but CUDA is not available; use trainer.device=cpu or auto")
    return device


def use_bf16(precision: str, device: torch.device) -> bool:
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def dry_run(cfg: Config) -> dict:
    """Build on the meta device (nothing allocated) and print the sizes and FLOPs."""
    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.ffn, vocab)
    s = model_size(model, cfg.trainer.seq_len)
    steps = total_steps(cfg.trainer)
    tokens = steps * cfg.trainer.batch_size * cfg.trainer.seq_len
    rows = [("model", f"{cfg.model.name}, ffn={cfg.ffn.kind.value} (hidden {ffn_hidden_dim(cfg.model, cfg.ffn)})"),
            ("vocabulary", f"{vocab}" + ("" if cfg.model.vocab_size else " (data.vocab_size)")),
            ("parameters, total", f"{s.total:,}"),
            ("parameters, non-embedding", f"{s.non_embedding:,}"),
            ("parameters, embedding / LM head", f"{s.embedding:,} / {s.output:,}"),
            ("FLOPs per token, training (6N + 12LdS)", f"{s.flops_per_token:.4g}"),
            ("FLOPs per token, forward", f"{s.forward_flops_per_token:.4g}"),
            ("steps x tokens per step", f"{steps:,} x {cfg.trainer.batch_size * cfg.trainer.seq_len:,}"),
            ("training FLOPs for the budget", f"{s.flops_per_token * tokens:.4g}")]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return {"params_total": s.total, "params_non_embedding": s.non_embedding, "flops_per_token": s.flops_per_token}
