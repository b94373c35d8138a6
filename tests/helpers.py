"""Shared test helpers: run train.py in a subprocess, compose configs, tiny corpora."""
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))


def compose_config(overrides: list[str]):
    from training.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("config", overrides=overrides)


def to_object(dcfg):
    return OmegaConf.to_object(dcfg)


# The session's environment, for the subprocesses the tests start: a variable a test sets for
# itself (monkeypatch.setenv RANK, say) does not reach a launch running beside it (see `background`).
BASE_ENV = dict(os.environ)


def run_train(args: list[str], cwd: Path = ROOT, timeout: int = 600, env: dict = None) -> subprocess.CompletedProcess:
    env = {**BASE_ENV, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- launches in the background
#
# Most of the suite's time on a small CI machine is subprocesses: train.py, the scripts and torchrun,
# each mostly its single-threaded imports and a tiny run on one thread. A test module lists that
# work in a function marked @background; conftest.py starts every collected module's list when the
# session starts, WORKERS jobs at a time in threads, in module order, while the main thread runs
# the in-process tests. A test reads its job's Future from the `launched` fixture and asserts on
# its result, or calls .result() on a job that made the checks itself (its exception then fails
# the test). Jobs only launch processes and read their files: the main thread's monkeypatches and
# environment variables stay the main thread's (BASE_ENV).

WORKERS = 2  # CI's cores
_PROVIDERS: dict[str, Callable] = {}  # test module name -> its @background function
_STARTED: dict[str, dict[str, Future]] = {}  # test module name -> its jobs, started
_DATA: dict[tuple[str, str], Path] = {}  # (test module name, "corpus" | "cache") -> path


def background(provider: Callable) -> Callable:
    """Marks a test module's function `provider(ctx: Launches) -> jobs` or `-> (jobs, needed_by)`.

    jobs: name -> a callable of no arguments. A job is keyed by the test or the module's fixture
    that reads it (its name, or its name and a parameter as `name[param]`), or by any name with the
    tests or fixtures that read it in needed_by (a run several tests compare with); only the jobs
    collected tests need start, in the order given, into ctx.futures: a job may wait there for one
    given before it."""
    _PROVIDERS[provider.__module__] = provider
    return provider


def module_data(module: str, tmp_path_factory, what: str) -> Path:
    """The module's corpus (write_corpus) or its shard cache prepared from it (prepare_shared_cache):
    conftest.py's `corpus` and `cache`, made once per module, also for its background jobs."""
    if (module, "corpus") not in _DATA:
        _DATA[module, "corpus"] = write_corpus(tmp_path_factory.mktemp("corpus"))
    if what == "cache" and (module, "cache") not in _DATA:
        _DATA[module, "cache"] = prepare_shared_cache(tmp_path_factory, _DATA[module, "corpus"])
    return _DATA[module, what]


class Launches:
    """What a module's @background function is given: temporary directories, the module's corpus
    and shard cache (made here, in the main thread, before any job starts), and the futures."""

    def __init__(self, module: str, tmp_path_factory):
        self.module, self.factory, self.futures = module, tmp_path_factory, {}

    def tmp(self, name: str) -> Path:
        return self.factory.mktemp(name)

    @property
    def corpus(self) -> Path:
        return module_data(self.module, self.factory, "corpus")

    @property
    def cache(self) -> Path:
        return module_data(self.module, self.factory, "cache")


@contextmanager
def background_session(session, tmp_path_factory) -> Iterator[None]:
    """Starts the collected modules' @background jobs (conftest.py, at the session's start); on
    exit every started job has ended."""
    tests: dict[str, set] = {}  # module -> its collected tests' names and the fixtures they use
    for item in session.items:
        module = getattr(getattr(item, "module", None), "__name__", None)
        tests.setdefault(module, set()).update([getattr(item, "originalname", item.name),
                                                *getattr(item, "fixturenames", ())])
    pool = ThreadPoolExecutor(WORKERS)
    try:
        for module, names in tests.items():
            if module not in _PROVIDERS:
                continue
            ctx = Launches(module, tmp_path_factory)
            jobs = _PROVIDERS[module](ctx)
            jobs, needed_by = jobs if isinstance(jobs, tuple) else (jobs, {})
            _STARTED[module] = ctx.futures
            for name, job in jobs.items():
                if name.split("[")[0] in names or names.intersection(needed_by.get(name, ())):
                    ctx.futures[name] = pool.submit(job)
        yield
    except BaseException:  # an interrupted session: the jobs not yet started never start
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def launched(module: str) -> dict[str, Future]:
    """The started jobs of a test module (conftest.py's `launched` fixture)."""
    return _STARTED.get(module, {})


def write_corpus(root: Path, n_files: int = 40) -> Path:
    """A small Python-like corpus: enough text for a 512-token BPE and a few hundred windows."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        body = "\n".join(
            f"def function_{i}_{j}(value, other={j}):\n"
            f"    \"\"\"Return value plus {j} times other, for file {i}.\"\"\"\n"
            f"    result = value + {j} * other\n"
            f"    if result > {i * j}:\n        return result - {i}\n    return result\n"
            for j in range(30))
        (root / f"module_{i:03d}.py").write_text(f"import os\n\n{body}\n")
    return root


def tiny_overrides(tmp: Path, corpus: Path, extra: list[str] = ()) -> list[str]:
    """A fast CPU run: micro model, stdlib source limited to `corpus`, shards under tmp."""
    return [f"hydra.run.dir={tmp / 'run'}", "data.include_stdlib=false", f"data.roots=[{corpus}]",
            "data.vocab_size=512", f"data.cache_dir={tmp / 'cache'}", "data.val_fraction=0.1",
            "model.dim=64", "model.n_layers=2", "model.n_heads=2", "model.swiglu_hidden=128",
            "model.max_seq_len=64", "trainer.seq_len=32", "trainer.batch_size=8", "trainer.micro_batch_size=4",
            "trainer.max_steps=8", "trainer.eval_every=4", "trainer.eval_batches=2", "trainer.log_every=1",
            "trainer.ckpt_every=4", "trainer.progress=false", "trainer.num_threads=1",
            "optim.warmup_steps=2", "optim.lr=3e-3", "logging.wandb.mode=disabled", *extra]


def with_cache(args: list[str], cache: Path) -> list[str]:
    """The same overrides with the shard cache moved to `cache`."""
    return [a if not a.startswith("data.cache_dir=") else f"data.cache_dir={cache}" for a in args]


def to_config(args: list[str]):
    """The composed config object of train.py overrides (hydra.* ones dropped)."""
    return OmegaConf.to_object(compose_config([a for a in args if not a.startswith("hydra.")]))


def prepare_shared_cache(tmp_path_factory, corpus: Path) -> Path:
    """A shard cache for a whole test module, prepared in this process before any run, so that
    no launch races to prepare it and no test depends on another."""
    from data.shards import prepare

    d = tmp_path_factory.mktemp("shared")
    prepare(to_config(with_cache(tiny_overrides(tmp_path_factory.mktemp("prep"), corpus), d)).data, ROOT,
            progress=False)
    return d


_CPU_SCALED_MM: dict = {}


def cpu_scaled_mm_runs(recipe: str) -> bool:
    """torch's CPU _scaled_mm runs this float8 recipe's GEMMs (forward and gradient): torch 2.13 does;
    2.11's CPU backend takes per-tensor scales only (the GPU machines' torch runs the CPU tests too)."""
    if recipe not in _CPU_SCALED_MM:
        import torch

        from srelu24_kernels.float8 import gemm as fp8_gemm

        major, minor = (int(v) for v in torch.__version__.split(".")[:2])
        if (major, minor) >= (2, 13):  # it does: a failure there is the code's, and must fail the tests
            _CPU_SCALED_MM[recipe] = True
            return True
        a, b = torch.randn(16, 32).bfloat16(), torch.randn(32, 16).bfloat16()
        try:
            fp8_gemm.mm(a, b, recipe), fp8_gemm.mm(a, b, recipe, grad=True)
            _CPU_SCALED_MM[recipe] = True
        except RuntimeError:
            _CPU_SCALED_MM[recipe] = False
    return _CPU_SCALED_MM[recipe]


def kernel_ffn(x, w1, w2, recipe, stats=None, float8: str = "none", sparse_float8: bool = True):
    """srelu24_kernels.srelu24.op.ffn, its options spelled out (the tests' shorthand)."""
    from srelu24_kernels.srelu24.op import OpOptions, ffn

    return ffn(x, w1, w2, OpOptions(recipe, float8, sparse_float8), stats)


def forward_args(x, w1, w2, collect_stats: bool, options, defer_unscaling: bool = False) -> tuple:
    """srelu24::ffn_forward's arguments for a call without a step's state."""
    from srelu24_kernels.srelu24.op import keeps_a24

    return (x, w1, w2, [], None, None, [], collect_stats, keeps_a24(x, w1, options.recipe.reuse_forward_mask),
            *options.flags(), defer_unscaling, 0)


def output_args(out, w2, options, defer_unscaling: bool = False) -> tuple:
    """srelu24::ffn_output's arguments for srelu24::ffn_forward's outputs `out` (its A24 and h, as
    leaves that want gradients where those did: opcheck differentiates the op more than once, which
    through ffn_forward's backward would fail), without a step's state."""
    a24, h = (t.detach().requires_grad_(t.requires_grad) for t in out[:2])
    return (a24, h, w2, [], options.float8, options.sparse_float8, defer_unscaling)


def backward_args(dy, x, w1, w2, out, options, defer_unscaling: bool = False) -> tuple:
    """srelu24::ffn_backward's arguments for srelu24::ffn_forward's outputs `out` (what it keeps: A24
    or Z, and the counts; detached, the backward op having no gradient of its own), without a
    step's state."""
    from srelu24_kernels.srelu24.op import keeps_a24

    keep = keeps_a24(x, w1, options.recipe.reuse_forward_mask)
    saved, counts = (out[0] if keep else out[2]).detach(), out[3]
    return (dy, x, w1, w2, saved, counts, keep, [], None, None, [], None, None, None, *options.flags(),
            defer_unscaling, 0)


def cpu_op_inputs(tokens: int, seed: int) -> tuple:
    """(x [tokens, 64] bf16, w1 [128, 64] and w2 [64, 128] fp32 as the model keeps them, all
    requiring gradients; dy [tokens, 64] bf16): the srelu24 op's inputs on its CPU path."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g).bfloat16().requires_grad_()
    w1 = (torch.randn(128, 64, generator=g) / 8).requires_grad_()
    w2 = (torch.randn(64, 128, generator=g) / 11).requires_grad_()
    return x, w1, w2, torch.randn(tokens, 64, generator=g).bfloat16()


def wide_op_inputs(seed: int, weights_dtype, device: str = "cuda") -> tuple:
    """(x [1024, 2048] bf16 and w1 [8448, 2048], w2 [2048, 8448] in weights_dtype, all requiring
    gradients; dy [1024, 2048] bf16): the srelu24 op's inputs at the 1B FFN's width, drawn after
    torch.manual_seed(seed), for the GPU tests of its e4m3 path."""
    import torch

    torch.manual_seed(seed)
    T, d, f = 1024, 2048, 8448
    x = torch.randn(T, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(f, d, device=device) * d ** -0.5).to(weights_dtype).requires_grad_()
    w2 = (torch.randn(d, f, device=device) * f ** -0.5).to(weights_dtype).requires_grad_()
    return x, w1, w2, torch.randn(T, d, device=device, dtype=torch.bfloat16)
