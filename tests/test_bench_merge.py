"""scripts/bench_step.py --merge: records of several commands merged into one table, with
known ratios against the fastest dense row and swiglu bf16, each row's commit and clocks; records
of different shapes refused unless told; older records (one precision per record, on its command
line) read too."""
import json
from pathlib import Path

import pytest

from scripts import bench_step

SHAPE = {"model": "7b", "n_layers": 8, "layers_cut_from": 32, "micro_batch": 2, "seq_len": 4096, "accum": 1,
         "world_size": 1, "strategy": "none"}


def merge(argv: list[str]) -> int:
    return bench_step.main(["--merge", *argv])


def row(ffn: str, float8: str, tok_s: float, commit: str, dirty: bool, mhz: float, **kw) -> dict:
    return {**SHAPE, "ffn": ffn, "float8": float8, "precision": "bf16" if float8 == "none" else float8,
            "tokens_per_s": tok_s, "step_ms": 16384 / tok_s * 1e3, "mfu": 0.5, "peak_mem_gib": 30.0,
            "estimated_peak_gib": 31.0, "commit": commit, "dirty": dirty, "gpu": "NVIDIA H200", "torch": "2.11.0",
            "triton": "3.6.0", "sm_clock_mhz": mhz, "power_w": 690.0, **kw}


def record(path: Path, rows: list[dict], **top) -> Path:
    path.write_text(json.dumps({"date": "2026-12-01T00:00:00+00:00", "argv": ["scripts/bench_step.py"],
                                "environment": {"git_sha": "f" * 40, "git_dirty": False}, "results": rows, **top}))
    return path


@pytest.fixture()
def records(tmp_path) -> list[Path]:
    a = record(tmp_path / "bf16.json", [row("swiglu", "none", 1000.0, "abc1234", False, 1600.0),
                                        row("srelu", "none", 1100.0, "abc1234", False, 1590.0),
                                        row("srelu24", "none", 1150.0, "abc1234", False, 1500.0)])
    b = record(tmp_path / "tensorwise.json", [row("swiglu", "tensorwise", 1300.0, "def5678", True, 1700.0),
                                              row("srelu", "tensorwise", 1250.0, "def5678", True, 1690.0),
                                              row("srelu24", "tensorwise", 1200.0, "def5678", True, 1650.0)])
    # an older record: no precision, commit or clocks of its own in the row; the recipe on its command line
    old = {k: v for k, v in row("swiglu", "rowwise", 1170.0, "", False, 0.0).items()
           if k not in ("float8", "precision", "commit", "dirty", "gpu", "torch", "triton", "sm_clock_mhz", "power_w")}
    old["clocks"] = {"samples": 20, "sm_clock_mhz": 1710.0, "power_w": 687.0}
    c = record(tmp_path / "old_rowwise.json", [old], argv=["scripts/bench_step.py", "+experiment=swiglu_7b",
                                                           "trainer.float8=rowwise"],
               environment={"git_sha": "0123456789abcdef", "git_dirty": True, "gpu": "NVIDIA H200",
                            "torch": "2.10.0", "triton": "3.5.0"})
    return [a, b, c]


def cells(lines: list[str], ffn: str, precision: str) -> list[str]:
    line = next(ln for ln in lines if ln.startswith(f"| {ffn} | {precision} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_three_records_in_one_table_with_known_ratios(records, tmp_path, capsys):
    out = tmp_path / "merged.md"
    assert merge([str(p) for p in records] + ["--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("7b, 8 of 32 layers, micro-batch 2 x 4096, accum 1, 1 rank(s), strategy none on "
                               "1 x NVIDIA H200; 7 rows from 3 record(s)")
    head = [c.strip() for c in lines[2].strip("|").split("|")]
    i_fast, i_swiglu, i_mhz, i_commit = (head.index(h) for h in ("vs fastest dense", "vs swiglu bf16", "SM MHz",
                                                                   "commit"))
    # the fastest dense row: swiglu tensorwise (1300); swiglu bf16: 1000
    s24 = cells(lines, "srelu24", "bf16")
    assert (s24[i_fast], s24[i_swiglu], s24[i_mhz], s24[i_commit]) == ("0.88x", "1.15x", "1500", "abc1234")
    tw = cells(lines, "swiglu", "tensorwise")
    assert (tw[i_fast], tw[i_swiglu], tw[i_commit], tw[-1]) == ("1.00x", "1.30x", "def5678+dirty", "tensorwise.json")
    old = cells(lines, "swiglu", "rowwise")  # precision from its command line, commit and clocks from the record
    assert (old[i_fast], old[i_swiglu], old[i_mhz], old[i_commit], old[-1]) == (
        "0.90x", "1.17x", "1710", "0123456+dirty", "old_rowwise.json")
    assert "fastest dense: swiglu tensorwise (1,300 tokens/s)" in out.read_text()
    assert "torch 2.10.0, triton 3.5.0 / torch 2.11.0, triton 3.6.0" in lines[0]
    assert out.read_text().strip() in capsys.readouterr().out


def test_the_merged_json_is_a_record_again(records, tmp_path):
    merged = tmp_path / "merged.json"
    assert merge([str(p) for p in records] + ["--out", str(merged)]) == 0
    _, once = bench_step.merge(records)
    _, twice = bench_step.merge([merged])
    assert once[2:] == twice[2:]  # the same rows, ratios, commits and record names


def test_records_of_another_shape_are_refused_unless_told(records, tmp_path, capsys):
    other = record(tmp_path / "1b.json", [{**row("swiglu", "none", 2000.0, "abc1234", False, 1600.0),
                                           "model": "1b", "n_layers": 16, "layers_cut_from": 20, "seq_len": 2048,
                                           "micro_batch": 8}])
    assert merge([str(records[0]), str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the records are of different shapes: 7b, 8 of 32 layers")
    assert "1b, 16 of 20 layers, micro-batch 8 x 2048" in err[0] and err[0].endswith("or pass --mixed-shapes")
    accum = record(tmp_path / "accum4.json", [{**row("srelu", "none", 900.0, "abc1234", False, 1600.0), "accum": 4}])
    assert merge([str(records[0]), str(accum)]) == 2
    assert "accum 4" in capsys.readouterr().err
    assert merge([str(records[0]), str(other), "--mixed-shapes"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("several shapes") and "| shape |" in out.splitlines()[2]


def test_bad_inputs_are_one_error_line(records, tmp_path, capsys):
    not_bench = tmp_path / "ffn.json"
    not_bench.write_text('{"fwbw": []}')
    for argv, want in [([str(tmp_path / "missing.json")], "missing.json: no such file"),
                       ([str(not_bench)], "ffn.json is not a bench_step.py record"),
                       ([str(records[0]), "--out", str(tmp_path / "t.txt")], "--out " + str(tmp_path / "t.txt"))]:
        assert merge(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and want in err[0], err
    assert bench_step.main(["+experiment=demo", "--merge", str(records[0])]) == 2  # nothing to benchmark
    assert capsys.readouterr().err.startswith("error: --merge takes bench_step.py records, not Hydra overrides")
