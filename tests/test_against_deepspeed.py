"""Real DeepSpeed 0.19.8 jobs on CPU (gloo ranks through DeepSpeed's own launcher): every persistent
tensor and every logged collective must equal zerocalc's prediction to the byte. The named residual
is the scalars of <= 8 bytes (grad norm, overflow flag), reported apart by the validator.

This is the test that keeps every formula honest. It takes a few minutes on two cores, most of it
starting DeepSpeed on every rank of each launch (and, once per machine, building DeepSpeed's CPU ops:
its shared-memory all-reduce, FusedAdam and CPUAdam), so each rank count is one launch of many
configurations; the jobs run only the steps the bytes need (VALIDATE_FEW_STEPS: no timing on CPU)."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pandas as pd
import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("torch")
pytest.importorskip("transformers")
if shutil.which("deepspeed") is None:
    pytest.skip("DeepSpeed's launcher is not on PATH", allow_module_level=True)

from validate.report import repredict  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def validate_run(out, *args) -> str:
    """`python -m validate run --backend cpu ARGS --out OUT`, bytes-only steps; what it logged. A job may
    take 20 minutes: the first on a fresh machine builds DeepSpeed's three CPU ops (about 6 CPU minutes)
    while the other pytest worker runs the other tests."""
    proc = subprocess.run([sys.executable, "-m", "validate", "run", "--backend", "cpu", *args, "--timeout", "1200",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=2400,
                          env=dict(os.environ, VALIDATE_FEW_STEPS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def read_ok(out):
    df = pd.read_csv(out)
    assert (df["outcome"] == "ok").all(), df.loc[df["outcome"] != "ok", ["key", "error"]].to_string()
    return df


def run_validate(tmp_path, *args):
    out = tmp_path / "rows.csv"
    validate_run(out, *args)
    return read_ok(out)


# The contract command's shape flags, and its model as `validate run` builds it from them (max_positions:
# the longest sequence + 1; the rest at the matrix defaults). The contract test checks the two give the same jobs.
CONTRACT = ["--nproc", "2", "--stages", "0,1,2,3", "--dtype", "bf16", "--hidden-size", "48", "--num-layers", "2",
            "--num-heads", "4", "--vocab-size", "997", "--seq-len", "16", "--micro-batch", "2"]
CONTRACT_ARCH = {"family": "seed-gpt", "vocab_size": 997, "hidden_size": 48, "num_layers": 2, "num_heads": 4,
                 "max_positions": 17}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank launch for the 33 configurations of cpu-exact.json and the contract command's four:
    a launch's start-up (every rank importing torch, DeepSpeed and torch.compile's machinery) is most
    of its cost on two cores. Returns the rows file and the shared-memory buffers in /dev/shm that
    carry the master port of one of its launches (the runner logs each port) after it ended: other
    DeepSpeed launches on the machine may hold their own meanwhile."""
    folder = tmp_path_factory.mktemp("two_ranks")
    with open(os.path.join(ROOT, "validate", "matrices", "cpu-exact.json")) as f:
        spec = json.load(f)
    spec["jobs"] += [{"arch": CONTRACT_ARCH, "stage": s, "dtype": "bf16", "seq_len": 16, "micro_batch": 2}
                     for s in (0, 1, 2, 3)]
    matrix, out = folder / "matrix.json", folder / "rows.csv"
    matrix.write_text(json.dumps(spec))
    log = validate_run(out, "--nproc", "2", "--matrix", str(matrix))
    ports = re.findall(r"master port (\d+)", log)
    assert ports, log[-2000:]
    return out, [p for port in ports for p in glob.glob(f"/dev/shm/deepspeed_*_{port}_*")]


def assert_exact(df):
    # the prediction written at run time, and the current one, both to the byte
    now = repredict(df)
    for col_pred, col_meas in (("predicted_state_bytes", "measured_state_bytes"),
                               ("predicted_comm_bytes", "measured_comm_bytes"),
                               ("now_state_bytes", "measured_state_bytes"),
                               ("now_comm_bytes", "measured_comm_bytes")):
        bad = now[now[col_pred] != now[col_meas]]
        assert bad.empty, bad[["key", col_pred, col_meas]].to_string()
    assert (now["measured_scalar_bytes"] <= 13).all()   # grad norm (4 or 8) + overflow buf (4) + nan flag (1)


@pytest.mark.xdist_group("committed")   # the 2-rank launch's tests: on the other worker than the 4 launches below
def test_contract_command_all_stages_bf16(two_ranks, tmp_path):
    """The issue's contract: stages 0-3, bf16, 2 ranks, a model given by its shape. Its four jobs ran in
    the module's 2-rank launch: the command, run on a copy of those rows, finds all four of its jobs
    there (a job's key hashes every field of it) and launches nothing. The launch left no shared-memory
    buffers behind (DeepSpeed's CPU all-reduce does not unlink its own)."""
    out, left_in_shm = two_ranks
    mine = tmp_path / "rows.csv"
    shutil.copy(out, mine)
    log = validate_run(mine, *CONTRACT)
    assert "4 of 4 jobs already in" in log and "running the other 0" in log, log[-2000:]
    df = read_ok(mine)
    df = df[df["hidden_size"] == 48]
    assert sorted(df["stage"]) == [0, 1, 2, 3] and (df["dtype"] == "bf16").all() and (df["nproc"] == 2).all()
    for col in ("stage", "dtype", "nproc", "outcome", "predicted_state_bytes", "measured_state_bytes",
                "predicted_comm_bytes", "measured_comm_bytes"):
        assert col in df.columns
    assert_exact(df)
    assert left_in_shm == []


@pytest.mark.xdist_group("committed")
def test_matrix_two_ranks(two_ranks):
    """Odd sizes (padding), fp32 and bf16, GAS 1 and 2, bucket sizes, the stage-3 knobs, BF16_Optimizer,
    SGD with momentum, zero.Init, CPU offload of optimizer and parameters (on the CPU backend the
    device is the host: offloaded and device bytes are checked as one total), GPT-2 and Llama."""
    df = read_ok(two_ranks[0])
    df = df[df["hidden_size"] != 48]      # the contract's four are checked above
    assert len(df) == 33
    assert_exact(df)


@pytest.mark.xdist_group("committed")
def test_a_fake_rank_0_of_two_holds_and_sends_what_a_real_one_does(two_ranks, tmp_path):
    """`validate run --fake-world`: one process as rank 0 of N (torch's fake process group). On the
    2-rank launch's 33 configurations it holds every tensor and logs every collective byte that the
    real launch's busiest rank did (which is rank 0 in each), configuration by configuration."""
    from validate.rows import CONFIG_COLUMNS
    real = read_ok(two_ranks[0])
    real = real[real["hidden_size"] != 48]
    fake = run_validate(tmp_path, "--nproc", "2", "--fake-world", "--matrix", "validate/matrices/cpu-exact.json")
    assert (fake["world"] == "fake").all() and len(fake) == len(real) == 33
    assert not set(fake["key"]) & set(real["key"])      # a fake row never stands for a real one on resume
    on = [c for c in CONFIG_COLUMNS if c != "key" and c in real and c in fake]
    both = real.merge(fake, on=on, suffixes=("_real", "_fake"))
    assert len(both) == 33
    for col in ("measured_state_bytes", "measured_comm_bytes", "measured_comm_by_op", "measured_state_detail"):
        bad = both[both[col + "_real"] != both[col + "_fake"]]
        assert bad.empty, bad[["key_real", col + "_real", col + "_fake"]].to_string()


def test_a_fake_rank_0_of_64(tmp_path):
    """Rank 0 of 64 in one process: state and communication bytes exact against zerocalc at stages 1-3,
    with zero.Init, gradient accumulation, tied embeddings and zero weights made without the initialisers."""
    out = tmp_path / "rows.csv"
    validate_run(out, "--nproc", "64", "--fake-world", "--matrix", "validate/matrices/cpu-fake.json")
    df = pd.read_csv(out)
    assert (df["world"] == "fake").all() and (df["nproc"] == 64).all() and len(df) == 6
    import torch
    if not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        # DeepSpeed's CPU accelerator trains fp16 only where oneDNN has fp16 kernels (an Intel CPU with
        # AVX512-FP16 or AMX, not an AMD EPYC): there the fp16 job ends in an error row naming the dtype.
        fp16 = df["dtype"] == "fp16"
        assert fp16.sum() == 1 and df.loc[fp16, "error"].str.contains("Type fp16 is not supported").all()
        df = df[~fp16]
    assert (df["outcome"] == "ok").all(), df.loc[df["outcome"] != "ok", ["key", "error"]].to_string()
    assert_exact(df)


def test_one_rank(tmp_path):
    df = run_validate(tmp_path, "--nproc", "1", "--stages", "0,1,2,3", "--dtype", "bf16,fp32", "--hidden-size", "33",
                      "--num-layers", "2", "--num-heads", "3", "--vocab-size", "1001")
    assert_exact(df)


@pytest.mark.parametrize("nproc", [4, 8])
def test_four_and_eight_ranks(tmp_path, nproc):
    """Padding to multiples of 2N (stages 1/2) and N (stage 3) shows at N = 4 and 8. N = 4 runs the
    seven configurations of cpu-exact-n4.json; N = 8 the two that partition differently there (stage 2's
    flat partition, stage 3's per-parameter partitions with a persistence threshold below the parameter
    sizes): eight ranks on two cores cost mostly their start-up, whatever the jobs."""
    df = run_validate(tmp_path, "--nproc", str(nproc), "--matrix", f"validate/matrices/cpu-exact-n{nproc}.json")
    assert_exact(df)


def test_stage3_trace_matches_deepspeed(tmp_path):
    """The module order zerocalc replays (forward, backward, and backward with checkpointing, which
    runs each layer forward again inside backward) against the trace DeepSpeed records, for the three
    families: the all-gather volume and what stays gathered follow from this order."""
    import json

    from validate.runner import _free_port, remove_shm_buffers
    from zerocalc import arch as A
    out = tmp_path / "trace.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    port = _free_port()
    try:
        proc = subprocess.run(["deepspeed", "--master_port", str(port), "--num_gpus", "2", "tests/scripts/ds_trace.py",
                               str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        remove_shm_buffers(port)   # DeepSpeed's CPU all-reduce leaves them in /dev/shm
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = json.loads(out.read_text())
    assert len(cases) == 6
    for case in cases:
        a = A.Architecture(**case["arch"])
        expected = [list(m) for m in A.trace(a) + A.backward_trace(a, case["checkpointing"])]
        assert case["trace"] == expected, (a.family, case["checkpointing"])
