"""zerocalc never imports torch or DeepSpeed (it must answer on any laptop in milliseconds)."""
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
