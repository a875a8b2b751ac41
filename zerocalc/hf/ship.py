"""Regenerate the shipped profiles: `python -m zerocalc.hf.ship [name ...]`.

Each `zerocalc/hf/configs/<name>.json` holds the published config.json values of one model (the
Hugging Face hub's file, the fields that shape the model); it is traced (`zerocalc.hf.trace`) and
written to `zerocalc/profiles/<name>.json`, which `--model <name>` reads without torch.
"""
import json
import os
import sys
import time

from zerocalc import profile as P
from zerocalc.hf import trace as T

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def configs() -> dict[str, str]:
    return {f[:-5]: os.path.join(CONFIGS, f) for f in sorted(os.listdir(CONFIGS)) if f.endswith(".json")}


def main(names=None) -> None:
    os.makedirs(P.SHIPPED_DIR, exist_ok=True)
    todo = configs()
    for name in names or todo:
        t0 = time.perf_counter()
        with open(todo[name]) as f:
            d = json.load(f)
        p = T.trace(d, name)
        P.save(p, os.path.join(P.SHIPPED_DIR, name + ".json"))
        print(f"{name:20s} {p.model_type:12s} {p.num_params:>16,} {time.perf_counter() - t0:6.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
