"""training/step.py: the one definition of a training step (the loop and bench_step run it)."""
import math

import pytest
import torch

from model import FFNConfig, ModelConfig, Transformer
from training.distributed import Dist
from training.errors import TrainingError
from training.step import StepParts, TrainState, train_step

VOCAB, S = 64, 16


def tiny(kind: str = "srelu"):
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=2, swiglu_hidden=64, max_seq_len=S)
    return Transformer(cfg, FFNConfig(kind=kind), VOCAB)


def parts_for(model, accum=1, micro=4, sgd=False, grad_clip=1.0, **kw):
    # SGD where gradients are compared through the weights: AdamW's first step is lr * sign(g),
    # which turns rounding noise in a near-zero gradient into a full step
    opt = (torch.optim.SGD if sgd else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    return StepParts(model=model, train_module=model, optimizer=opt, dist=Dist(), accum=accum,
                     tokens_per_step=accum * micro * S, lr_at=lambda step: 1e-2, grad_clip=grad_clip, **kw)


def batches(n, micro, seed=1):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, VOCAB, (n * micro, S + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in toks.split(micro)]


def test_accumulation_equals_one_large_micro_batch():
    """Two micro-batches of 4 accumulate to the gradient of one of 8 (the mean loss): the same
    weights after the step (SGD, no clipping: a wrong scale would show), and the counters advance
    by one step of 8 sequences."""
    a, b = tiny(), tiny()
    b.load_state_dict(a.state_dict())
    two = batches(2, 4)
    one = [(torch.cat([x for x, _ in two]), torch.cat([y for _, y in two]))]
    sa, sb = TrainState(), TrainState()
    train_step(parts_for(a, accum=2, sgd=True, grad_clip=0.0), sa, iter(two).__next__)
    train_step(parts_for(b, accum=1, micro=8, sgd=True, grad_clip=0.0), sb, iter(one).__next__)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=name)
    assert (sa.step, sa.tokens) == (sb.step, sb.tokens) == (1, 8 * S)


def test_a_non_finite_gradient_is_skipped_or_stops_the_run():
    model = tiny()
    with torch.no_grad():
        model.output.weight[0, 0] = float("nan")  # every logit of token 0: the loss and gradients are NaN
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state, data = TrainState(), iter(batches(2, 4)).__next__
    out = train_step(parts_for(model), state, data, log=True)
    assert not out.applied and state.skipped_steps == 1 and state.step == 1
    for k, v in model.state_dict().items():  # the optimizer did not step: nothing moved
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, equal_nan=True, msg=k)
    with pytest.raises(TrainingError, match="non-finite gradient .* trainer.nonfinite=stop"):
        train_step(parts_for(model, nonfinite="stop"), TrainState(), data)


def test_statistics_and_loss_only_on_logged_steps():
    model = tiny("srelu")
    p = parts_for(model)
    data = iter(batches(2, 4)).__next__
    quiet = train_step(p, TrainState(), data, log=False)
    assert quiet.loss is None and quiet.stats is None and quiet.applied
    logged = train_step(p, TrainState(), data, log=True)
    assert logged.loss > 0 and logged.grad_norm > 0
    assert logged.stats.shape[0] == 2 and logged.stats.sum() > 0  # one row of sums per layer, collected
    assert all(not ffn.collect_stats for ffn in (b.feed_forward for b in model.layers))  # switched off again


def test_the_2to4_phase_starts_at_sparse_from():
    model = tiny("srelu24")
    p = parts_for(model, sparse_from=1)
    state, data = TrainState(), iter(batches(2, 4)).__next__
    ffns = [b.feed_forward for b in model.layers]
    assert not train_step(p, state, data).sparse_on and not any(f.sparse for f in ffns)
    assert train_step(p, state, data).sparse_on and all(f.sparse for f in ffns)  # the reference on CPU
    assert state.step == 2


def test_marks_name_every_phase_per_micro_batch():
    seen = []
    train_step(parts_for(tiny(), accum=2), TrainState(), iter(batches(2, 4)).__next__, mark=seen.append)
    assert seen == ["optimizer"] + ["data", "forward", "backward"] * 2 + ["optimizer"]


# ---------------------------------------------------------------- the non-finite skip on the device

class NaNAt(torch.nn.Module):
    """The model, with a NaN loss (so NaN gradients) on the given forward calls (1-based)."""

    def __init__(self, model, calls):
        super().__init__()
        self.model, self.calls, self.n = model, set(calls), 0

    def forward(self, x, y):
        self.n += 1
        loss = self.model(x, y)
        return loss * float("nan") if self.n in self.calls else loss


def fused_parts(model, nan_calls=(), **kw):
    """One process, fused AdamW (CPU has one too), nonfinite=skip: the device path."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    return StepParts(model=model, train_module=NaNAt(model, nan_calls), optimizer=opt, dist=Dist(), accum=1,
                     tokens_per_step=4 * S, lr_at=lambda step: 1e-2 * (step + 1), grad_clip=1.0, **kw)


def snapshot(p: StepParts) -> dict:
    out = {f"w.{k}": v.clone() for k, v in p.model.state_dict().items()}
    for i, q in enumerate(p.params):
        out.update({f"opt.{i}.{k}": v.clone() for k, v in p.optimizer.state[q].items()})
    return out


def assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_which_steps_skip_on_the_device():
    model = tiny()
    assert fused_parts(model).skip_on_device
    assert not fused_parts(model, nonfinite="stop").skip_on_device  # it names the step and tensor
    assert not parts_for(model).skip_on_device  # an unfused AdamW
    assert not parts_for(model, sgd=True).skip_on_device
    several = fused_parts(model)
    several.dist = Dist(world_size=2)  # every rank must agree every step
    assert not several.skip_on_device


def test_a_non_finite_step_is_skipped_on_the_device(caplog):
    """Weights and AdamW state (step included) bitwise unchanged by a skipped step; the count is
    settled (with one warning for the range) on the next logged step, or by settle_skipped."""
    p, state = fused_parts(tiny(), nan_calls=(2, 3, 6)), TrainState()
    data = iter(batches(8, 4)).__next__
    assert train_step(p, state, data).applied is None  # not logged: not known
    before = snapshot(p)
    train_step(p, state, data)
    train_step(p, state, data)
    assert_bitwise(snapshot(p), before)  # steps 2 and 3 skipped: nothing moved
    assert state.skipped_steps == 0 and state.pending_skips is not None  # not read back yet
    out = train_step(p, state, data, log=True)
    assert out.applied and state.skipped_steps == 2 and state.pending_skips is None
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["steps 1-4: 2 non-finite gradient steps skipped (2 so far)"]  # since the last report
    assert not snapshot(p)["opt.0.step"].isnan() and snapshot(p)["opt.0.step"].item() == 2  # steps 1 and 4

    out = train_step(p, state, data)
    assert out.applied is None
    state.settle_skipped()  # step 5 was finite: no warning
    assert state.skipped_steps == 2 and len(caplog.records) == 1
    out = train_step(p, state, data, log=True)  # step 6: NaN, logged
    assert out.applied is False and math.isnan(out.grad_norm) and state.skipped_steps == 3
    assert caplog.records[-1].getMessage() == "step 6: non-finite gradient, step skipped (3 so far)"
    assert all(torch.isfinite(w).all() for w in p.model.state_dict().values())
    state.settle_skipped()  # nothing pending
    assert state.skipped_steps == 3 and len(caplog.records) == 2


def test_the_device_skip_equals_the_synchronous_one_bitwise(monkeypatch):
    """Finite or not, the device path gives bitwise the weights and optimizer state of the
    synchronous path (the same fused AdamW, the skip decided on the host)."""
    def run(nan_calls, sync):
        p, state = fused_parts(tiny(), nan_calls=nan_calls), TrainState()
        data = iter(batches(6, 4)).__next__
        with monkeypatch.context() as m:
            if sync:
                m.setattr(StepParts, "skip_on_device", property(lambda self: False))
            for i in range(6):
                train_step(p, state, data, log=i == 3)
        state.settle_skipped()
        return snapshot(p), state.skipped_steps

    for nan_calls in ((), (2, 5)):
        (dev, dev_skipped), (sync, sync_skipped) = run(nan_calls, sync=False), run(nan_calls, sync=True)
        assert_bitwise(dev, sync)
        assert dev_skipped == sync_skipped == len(nan_calls)


def test_a_device_step_that_is_not_logged_reads_nothing_back(monkeypatch):
    """No agree, no .item() / .tolist() / bool() of a tensor: nothing waits for the device."""
    import training.step

    p, state = fused_parts(tiny(), nan_calls=(3,)), TrainState()
    data = iter(batches(4, 4)).__next__
    train_step(p, state, data)  # the optimizer's state is created on the first step
    reads = []

    def agree(*a, **k):
        raise AssertionError("agree on the device path")

    monkeypatch.setattr(training.step, "agree", agree)
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name: reads.append(_name) or _real(self, *a))
    stops = []
    for _ in range(2):  # a finite step, then a NaN one
        train_step(p, state, data, stop_requested=lambda: stops.append(1) or False)
    assert reads == [] and len(stops) == 2
    monkeypatch.undo()
    state.settle_skipped()
    assert state.skipped_steps == 1


def test_nonfinite_stop_with_a_fused_optimizer_names_step_and_tensor():
    p = fused_parts(tiny(), nan_calls=(2,), nonfinite="stop")
    state, data = TrainState(), iter(batches(2, 4)).__next__
    train_step(p, state, data)
    with pytest.raises(TrainingError, match=r"step 2: non-finite gradient \(loss nan\) first in \S+ "
                                            r".*trainer.nonfinite=stop"):
        train_step(p, state, data)
