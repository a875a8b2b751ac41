"""Shared fixtures. The committed H200 rows are re-predicted once per session (about a minute on two
cores) for every test that checks them (`test_committed_data.py`, `test_docs.py`)."""
import glob
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# HF-config rows (data/h200-hf-*.csv) are judged apart (validate.report.hf_section, tests/test_hf_validate.py),
# and so are the fake-world and emulated-card rows (tests/test_fake_world.py).
COMMITTED = sorted(p for p in glob.glob(os.path.join(ROOT, "data", "h200-*.csv"))
                   if not any(f"/h200-{kind}-" in p for kind in ("hf", "fake", "cards")))


def pytest_configure(config):
    """The traced profiles of the committed rows' HF configs (data/hf-traces/) into the trace cache, so
    that a session on a fresh machine does not trace them again (`tests/hf_traces.py` says when not)."""
    import hf_traces
    hf_traces.seed_cache()
    build_deepspeeds_ops_unoptimized(config)
    write_bytecode()


def write_bytecode():
    """The test command installs without byte-compiling (`pip install --no-compile`: compiling all of
    torch and transformers took 106 of the install's 143 s on two cores), so that Python compiles only
    what is imported, once, where the first process to import it writes the bytecode. Under
    PYTHONDONTWRITEBYTECODE nothing would be written, and every process of every DeepSpeed launch would
    compile torch and DeepSpeed from source again (the launches took twice as long): the test run
    writes it, in this process and those it starts."""
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def build_deepspeeds_ops_unoptimized(config):
    """The first DeepSpeed launch on a machine JIT-builds its three CPU ops (shared-memory all-reduce,
    FusedAdam, CPUAdam: six sources, each including torch/extension.h). The tests build theirs at -O0
    (`tests/scripts/cxx_unoptimized`: about 280 s of CPU instead of 520; what a job holds and sends does
    not depend on it), in this checkout's pytest cache, so that they never replace the optimised builds
    in ~/.cache/torch_extensions that the user's own jobs load. Set once, by the first process (xdist's
    workers inherit it)."""
    if "ZEROCALC_TESTS_REAL_CXX" in os.environ:
        return
    os.environ["ZEROCALC_TESTS_REAL_CXX"] = os.environ.get("CXX", "c++")
    os.environ["CXX"] = os.path.join(ROOT, "tests", "scripts", "cxx_unoptimized")
    cache = getattr(config, "cache", None)
    os.environ["TORCH_EXTENSIONS_DIR"] = (str(cache.mkdir("torch_extensions")) if cache is not None else
                                          os.path.join(os.path.expanduser("~"), ".cache", "zerocalc",
                                                       "test-torch-extensions"))


@pytest.fixture(scope="session")
def committed_rows():
    """Every ok row of data/h200-*.csv with the current zerocalc's predictions (`report.committed_rows`)."""
    pytest.importorskip("pandas")
    from validate.report import committed_rows as repredicted
    return repredicted(COMMITTED)


@pytest.fixture(scope="session")
def committed_crossval():
    """`fit.cross_validate_time` on the committed rows: (timed rows with cv_step_s, one section per fold)."""
    pytest.importorskip("pandas")
    from validate.fit import cross_validate_time
    return cross_validate_time(COMMITTED)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`, setup.cfg), the tests of one module that launch
    DeepSpeed run on one worker, one launch at a time, unless the module groups them itself:
    test_against_deepspeed.py's four launches of their own on one worker, and its 2-rank launch (with
    the two tests that read it) first on the other, the worker of the committed rows' readers (whichever
    launch comes first builds DeepSpeed's CPU ops; a launch that needs one being built waits for it).
    The single launches of other modules run wherever a worker is free when their turn comes (xdist
    hands out the larger groups first, each in file order, then the rest in file order). The
    tests that read the committed rows share one worker, so that the session fixture re-predicting them
    is computed once. First of the hooks: xdist's own (a worker's) reads the groups from the markers."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue                                   # grouped in its module
        if item.get_closest_marker("deepspeed"):
            item.add_marker(pytest.mark.xdist_group(f"deepspeed-{item.module.__name__}"))
        elif {"committed_rows", "committed_crossval"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("committed"))
