"""zerocalc never imports torch or DeepSpeed (it must answer on any laptop in milliseconds)."""
import os
import subprocess
import sys


def test_estimate_path_imports_neither_torch_nor_deepspeed():
    code = ("import sys; from zerocalc import cli, estimate, arch, peak, comm, stage3_trace; "
            "from click.testing import CliRunner; "
            "r = CliRunner().invoke(cli.main, ['estimate', '--params', '7e9', '--dp', '8', '--format', 'json']); "
            "assert r.exit_code == 0; "
            "print(sorted(m for m in ('torch', 'deepspeed', 'pandas', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_the_ds_config_reader_is_imported_only_for_a_ds_config():
    """Every command pays for what it imports (docs/speed.md): the ds_config parser and DeepSpeed's
    key table load only where a ds_config is given."""
    code = ("import sys; from zerocalc import cli; from click.testing import CliRunner; "
            "r = CliRunner().invoke(cli.main, ['estimate', '--params', '7e9', '--dp', '8']); assert r.exit_code == 0; "
            "print(sorted(m for m in ('zerocalc.dsconfig', 'zerocalc.dskeys') if m in sys.modules)); "
            "r = CliRunner().invoke(cli.main, ['estimate', '--params', '7e9', '--dp', '8', '--micro-batch', '1', "
            "'--ds-config', sys.argv[1]]); "
            "assert r.exit_code == 0, r.output; print('zerocalc.dsconfig' in sys.modules)")
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ds-configs", "qwen",
                          "ds_config_zero2.json")
    out = subprocess.run([sys.executable, "-c", code, config], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "True"]


def test_zerocalc_never_imports_its_validator():
    """Layers point one way: `validate` runs and judges jobs with `zerocalc`, never the reverse (the
    torch models both use live in zerocalc.hf.families, behind the trace extra)."""
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "zerocalc"
    upward = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            upward += [f"{path.relative_to(root.parent)}:{node.lineno}" for n in names if n.split(".")[0] == "validate"]
    assert upward == []


# The import graph of zerocalc, read with ast: `python tests/test_imports.py` prints it with its cycles.
ZEROCALC = __import__("pathlib").Path(__file__).resolve().parents[1] / "zerocalc"


def import_graph():
    """{module: (imported at module level, imported inside functions)}, zerocalc's modules only, each
    edge to the module a name resolves to (`from zerocalc import states` is an edge to zerocalc.states)."""
    import ast
    root = ZEROCALC.parent
    paths = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in ZEROCALC.rglob("*.py")}

    def targets(module, node, package):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = module.split(".")[:len(module.split(".")) - node.level + package] if node.level else []
            origin = ".".join(base + [node.module] if node.module else base)
            names = [f"{origin}.{a.name}" for a in node.names] + [origin]
        for name in names:
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):   # not its own packages
                yield name

    graph = {}
    for module, path in paths.items():
        top, inner = set(), set()

        def walk(node, depth):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    (inner if depth else top).update(targets(module, child, path.name == "__init__.py"))
                walk(child, depth + isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))
        walk(ast.parse(path.read_text(encoding="utf-8")), 0)
        graph[module] = (top, inner - top)
    return graph


def cycles(edges):
    """Every elementary cycle of {module: set of modules}, each once, from its smallest module."""
    found = []

    def follow(start, path):
        for nxt in sorted(edges.get(path[-1], ())):
            if nxt == start:
                found.append(path)
            elif nxt > start and nxt not in path:
                follow(start, path + [nxt])
    for start in sorted(edges):
        follow(start, [start])
    return found


def test_zerocalc_modules_import_each_other_without_a_cycle_at_module_level():
    graph = import_graph()
    assert cycles({m: top for m, (top, _) in graph.items()}) == []
    # Inside functions only the tracer's three modules import each other: trace.py runs memtrace's and
    # optrace's recordings, which build the model with trace.py's helpers (lazily imported, torch's side).
    loops = cycles({m: top | inner for m, (top, inner) in graph.items()})
    assert {m for loop in loops for m in loop} <= {"zerocalc.hf.trace", "zerocalc.hf.memtrace", "zerocalc.hf.optrace"}


if __name__ == "__main__":
    graph = import_graph()
    for module, (top, inner) in sorted(graph.items()):
        print(f"{module}: {', '.join(sorted(top)) or '-'}" + (f"  | in functions: {', '.join(sorted(inner))}" if inner else ""))
    for kind, edges in (("module-level", {m: t for m, (t, _) in graph.items()}),
                        ("with function-level", {m: t | i for m, (t, i) in graph.items()})):
        print(f"cycles, {kind}:", [" -> ".join(c + [c[0]]) for c in cycles(edges)] or "none")
