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
