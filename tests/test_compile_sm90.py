"""The project's GPU code compiles for sm90 (Hopper) on a machine without a GPU.

The Triton kernels, on any machine, as the product launches them: tests/compile_sm90.py calls the kernels' wrappers with compilation in place of launches
(triton.compile down to a cubin, with the ptxas in Triton's wheel). The interpreter runs the
kernels' Python, not their lowering; this catches what only the GPU compiler would reject, and a
block that would need more shared memory than sm90 has. In subprocesses, because the test
session runs Triton in interpreter mode (tests/conftest.py).

The CUDA C++ kernels (`make kernels`), where nvcc is installed: built for sm80 and sm90 into a
temporary folder and loaded, their source's ABI version being the one srelu24_kernels/srelu24/native.py
expects."""
import ctypes
import re
import shutil
import subprocess
import sys

import pytest

from helpers import BASE_ENV, ROOT, background

SHARDS = 2  # the compile script's cases, split between two processes


@background
def launches(ctx):
    """The compiling processes, launched with the session (helpers.background)."""
    env = {k: v for k, v in BASE_ENV.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(ctx.tmp("triton") / "triton_cache")
    env["PYTHONPATH"] = str(ROOT)

    def compile_shard(shard: int):
        return lambda: subprocess.run([sys.executable, str(ROOT / "tests" / "compile_sm90.py"), str(shard), str(SHARDS)],
                                      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)

    return {f"test_kernels_compile_for_sm90[{shard}]": compile_shard(shard) for shard in range(SHARDS)}


def test_kernels_compile_for_sm90(launched):
    runs = [launched[f"test_kernels_compile_for_sm90[{shard}]"].result() for shard in range(SHARDS)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    out = "".join(r.stdout for r in runs)
    builds = re.findall(r"^compiled (\S+) shared=\d+ (\S+)$", out, re.M)
    compiled = {name for name, _ in builds}
    defined = set(re.findall(r"^kernel (\S+)$", out, re.M))
    assert len(defined) >= 14, out  # the package's kernels were found
    assert defined <= compiled, f"kernels that no case of tests/compile_sm90.py launches: {sorted(defined - compiled)}"
    # paired.py's casts, compiled as the tensorwise conversions launch them (weights, dY)
    paired = [consts.split(",") for name, consts in builds if name == "srelu24_kernels.float8.paired._cast_kernel"]
    assert any("OWN_E5M2=True" in c for c in paired), paired  # dY's pair: e5m2 for dA
    assert any("OWN_E5M2=False" in c and "TRANS_E5M2=False" in c for c in paired), paired  # the weights'


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_cuda_kernels_build(tmp_path):
    from srelu24_kernels.srelu24.native import KERNELS
    lib = tmp_path / KERNELS.filename
    r = subprocess.run(["make", "-s", "kernels", f"KERNELS_LIB={lib}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert getattr(ctypes.CDLL(str(lib)), KERNELS.abi_symbol)() == KERNELS.abi_version
