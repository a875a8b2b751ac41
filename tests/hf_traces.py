"""The traced profiles of the HF configs the committed rows ran (data/h200-hf-*.csv), kept in
`data/hf-traces/` under their trace-cache names (`zerocalc.hf.trace.cache_key`: the config, the torch
and transformers versions and `TRACE_VERSION`), so that a test session on a fresh machine reads them
instead of tracing each config again (about 20 CPU-s a config; the HF-row guard needs eleven).

`seed_cache()` copies them into the user's trace cache only while the tracer's source files are
those that traced them (`tracer.json`: their SHA-256, `tracer_digest`), and under the name a trace
would be cached by: a config traced under other torch or transformers versions or another
`TRACE_VERSION` has another name, is not found, and is traced again, as is every config once the
tracer's code changed. So the tests judge what the tracer of the checkout gives, as if traced afresh.
`test_committed_data.py::test_the_committed_hf_traces_are_current` fails when they are not (a row's
config missing, or the tracer changed since): regenerate with `python tests/hf_traces.py` (about
four minutes on two cores).
"""
import glob
import json
import os
import re
import shutil
import sys

from zerocalc.hf.trace import TRACER_SOURCES, code_digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, "data", "hf-traces")
MANIFEST = os.path.join(FOLDER, "tracer.json")
KEY = re.compile(r"[0-9a-f]{32}\.json$")     # a trace's file: its cache key
# What `zerocalc.hf.trace.trace` runs of zerocalc: a change to any of them may change a trace.
TRACER_FILES = tuple("zerocalc/" + rel for rel in TRACER_SOURCES)


def tracer_digest() -> str:
    """SHA-256 of the tracer's source files (`zerocalc.hf.trace.code_digest`, which keys failed traces too)."""
    return code_digest()


def manifest() -> dict:
    """tracer.json: {"tracer_sha256": ..., "files": [...], "torch": ..., "transformers": ...} (the versions
    the cache keys were made with); {} if there is none."""
    try:
        with open(MANIFEST) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def committed_hf_configs() -> dict[str, tuple[str, dict]]:
    """{config digest: (hf name, config)} of every HF-config row of data/h200-hf-*.csv (and an H100's,
    data/h100-hf-*.csv), failed ones too (`report.hf_process_replays` traces a process's every job), and
    of the emulated cards' files (`report.card_verdicts` judges a published config on its trace)."""
    from validate.docs import committed_paths
    from validate.report import hf_rows, load
    from validate.rows import job_from_row
    from zerocalc.hf.trace import config_digest
    df = load(sorted(glob.glob(os.path.join(ROOT, "data", "h[0-9]*-hf-*.csv"))) + committed_paths("cards"))
    out = {}
    for r in df[hf_rows(df)].to_dict("records"):
        hf = job_from_row(r)["hf"]
        out.setdefault(config_digest(hf["config"]), (hf.get("name") or "", hf["config"]))
    return out


def traces() -> list[str]:
    """The committed trace files."""
    return sorted(p for p in glob.glob(os.path.join(FOLDER, "*.json")) if KEY.match(os.path.basename(p)))


def seed_cache() -> list[str]:
    """Copy each committed trace into the user's trace cache, where it is not there yet, if the tracer's
    code is what traced them; the keys copied. (A file whose name is not a current cache key is never read.)"""
    from zerocalc.hf import trace
    if manifest().get("tracer_sha256") != tracer_digest():
        return []
    try:
        dest = trace.cache_dir()
        os.makedirs(dest, exist_ok=True)
    except OSError:
        return []
    copied = []
    for path in traces():
        key = os.path.basename(path)
        target = os.path.join(dest, key)
        if not os.path.exists(target):
            tmp = f"{target}.{os.getpid()}.tmp"
            shutil.copyfile(path, tmp)
            os.replace(tmp, target)
            copied.append(key[:-5])
    return copied


def main() -> None:
    """Trace every committed HF config afresh (not from the cache) into data/hf-traces/, removing the
    files of keys no longer there."""
    from zerocalc import profile as P
    from zerocalc.hf import trace
    configs = {trace.cache_key(cfg): (name, cfg) for name, cfg in committed_hf_configs().values()}
    os.makedirs(FOLDER, exist_ok=True)
    for path in traces():
        if os.path.basename(path)[:-5] not in configs:
            os.remove(path)
    digest = tracer_digest()
    for key, (name, cfg) in sorted(configs.items(), key=lambda kv: kv[1][0]):
        P.save(trace.trace(cfg, name), os.path.join(FOLDER, key + ".json"))
        print(key, name, flush=True)
    torch_version, transformers_version = trace._versions()
    with open(MANIFEST, "w") as f:
        json.dump({"tracer_sha256": digest, "files": list(TRACER_FILES), "torch": torch_version,
                   "transformers": transformers_version}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
