"""Which of zerocalc/arch.py's hand-written transcriptions a zerocalc command runs.

`python tests/arch_path.py estimate --model gpt2 --dp 2` runs the command in this process (click's
CliRunner; `--python CODE` runs CODE instead) under `sys.setprofile` and prints one JSON line: the exit code, whether `zerocalc.arch` was
imported, and every arch.py function called, with its call count. `ran(args)` does the same in a fresh
interpreter (no cache left by an earlier command) and returns the dict. `HAND` names the functions
that are hand transcriptions of a model (tensor lists, call trees, presets, config readers), as
opposed to the walkers every description shares (`_forward`, `_backward`, `uniform_params`).
"""
import json
import os
import subprocess
import sys

HAND = frozenset({"_seed_gpt_layer", "_gpt2_layer", "_llama_modules", "_llama_layer", "layer_numels",
                  "param_numels", "calls", "trace", "backward_trace", "recomputed", "buffer_numels",
                  "num_params", "preset", "preset_derived", "from_hf_config", "generic"})
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ran(args: list[str]) -> dict:
    """{"exit", "arch_imported", "ran": {function: calls}} of `zerocalc ARGS` in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                         env=env, cwd=ROOT, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _main(args: list[str]) -> None:
    import threading
    calls = {}
    arch_py = os.path.join("zerocalc", "arch.py")

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith(arch_py):
            calls[frame.f_code.co_name] = calls.get(frame.f_code.co_name, 0) + 1
    sys.setprofile(profile)
    threading.setprofile(profile)
    if args[:1] == ["--python"]:      # the recorder's own check: code that calls arch.py
        exec(args[1], {})
        code = 0
    else:
        from click.testing import CliRunner
        from zerocalc.cli import main
        code = CliRunner().invoke(main, args).exit_code
    sys.setprofile(None)
    print(json.dumps({"exit": code, "arch_imported": "zerocalc.arch" in sys.modules,
                      "ran": dict(sorted(calls.items()))}))


if __name__ == "__main__":
    _main(sys.argv[1:])
