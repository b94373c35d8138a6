"""training/step.py: the one definition of a training step (the loop and bench_step run it)."""
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
    assert seen == ["data", "forward", "backward"] * 2 + ["optimizer"]
