"""The shape of the tree: which top-level package may import which, and what scripts/ holds.

- no import cycle between the top-level packages (model, srelu24_kernels, data, training, scripts, lab);
- srelu24_kernels/ imports neither model/ nor training/ (model builds on srelu24_kernels, not the reverse);
- nothing outside lab/ imports lab/ (the product never depends on the lab);
- scripts/ holds only the user tools (and the small helpers they import).
Imports are read with `ast`, so lazy imports inside functions count too."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("model", "srelu24_kernels", "data", "training", "scripts", "lab")
SCRIPTS = {"prepare_data.py", "compare.py", "sample.py", "export_hf.py", "bench_ffn.py", "bench_step.py",
           "ffn_inputs.py"}  # ffn_inputs: the synthetic FFN inputs bench_ffn (and the lab) use


def imported_packages(path: Path) -> set[str]:
    """The top-level packages of PACKAGES that the file imports (absolute imports; a relative
    import stays inside its own package)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out |= {n.split(".")[0] for n in names} & set(PACKAGES)
    return out


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the files that import it (self-imports left out)."""
    graph: dict[str, dict[str, list[str]]] = {p: {} for p in PACKAGES}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for dep in imported_packages(f) - {pkg}:
                graph[pkg].setdefault(dep, []).append(str(f.relative_to(ROOT)))
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]):
    """One cycle of the package graph as a list of packages, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(p):
        state[p] = 1
        path.append(p)
        for q in graph.get(p, {}):
            if state.get(q) == 1:
                return path[path.index(q):] + [q]
            if q not in state and (c := visit(q)):
                return c
        state[p] = 2
        path.pop()
        return None

    for p in graph:
        if p not in state and (c := visit(p)):
            return c
    return None


def test_imports_are_parsed():  # the graph below is not empty by accident
    assert [p for p in PACKAGES if not (ROOT / p).is_dir()] == []  # a renamed package would leave it vacuous
    g = package_graph()
    assert "srelu24_kernels" in g["model"] and "model" in g["training"]


def test_no_import_cycle_between_top_level_packages():
    g = package_graph()
    cycle = find_cycle(g)
    assert cycle is None, " -> ".join(cycle) + ": " + "; ".join(
        f"{a} imports {b} in {', '.join(g[a][b])}" for a, b in zip(cycle, cycle[1:]))


def test_srelu24_kernels_import_neither_model_nor_training():
    g = package_graph()
    assert not {k: v for k, v in g["srelu24_kernels"].items() if k in ("model", "training")}


def test_only_the_lab_imports_the_lab():
    g = package_graph()
    assert not {p: g[p]["lab"] for p in PACKAGES if p != "lab" and "lab" in g[p]}
    others = [f for f in sorted((ROOT / "tests").rglob("*.py")) if f.name != "test_lab_imports.py"]
    others += [ROOT / "train.py"]
    assert not [str(f.relative_to(ROOT)) for f in others if "lab" in imported_packages(f)]


def test_scripts_holds_only_the_user_tools():
    assert {p.name for p in (ROOT / "scripts").glob("*.py")} <= SCRIPTS
    assert not [p.name for p in (ROOT / "scripts").iterdir() if p.is_dir() and p.name != "__pycache__"]
