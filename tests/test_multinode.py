"""`validate run --hostfile`: a job's ranks over nodes, each node running its own `validate run` (DeepSpeed's
launcher without ssh). Two "nodes" on this host, one gloo rank each, beside the same jobs on one node:
each rank holds and sends the same bytes, and node 0's rows say the job spanned two nodes."""
import csv
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = ["--backend", "cpu", "--nproc", "2", "--stages", "1,3", "--dtype", "bf16", "--hidden-size", "48",
        "--num-layers", "2", "--num-heads", "4", "--vocab-size", "997", "--seq-len", "16", "--micro-batch", "2"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(path) -> dict:
    """{the configuration (the key without its digest and node count): row}."""
    with open(path) as f:
        return {r["key"].rsplit("-", 1)[0].replace("-nodes2", ""): r for r in csv.DictReader(f)}


@pytest.mark.slow
@pytest.mark.deepspeed
def test_a_job_over_two_nodes_holds_and_sends_what_it_does_on_one(tmp_path):
    pytest.importorskip("deepspeed")
    if shutil.which("deepspeed") is None:
        pytest.skip("DeepSpeed's launcher is not on PATH")
    hosts = tmp_path / "hostfile"
    hosts.write_text("node0 slots=1\nnode1 slots=1\n")
    run = [sys.executable, "-m", "validate", "run", *JOBS, "--timeout", "600"]
    across = ["--hostfile", str(hosts), "--master-addr", "127.0.0.1", "--master-port", str(_port())]
    env = dict(os.environ, VALIDATE_FEW_STEPS="1")
    commands = [run + across + ["--node-rank", str(r), "--out", str(tmp_path / f"node{r}.csv")] for r in (0, 1)]
    commands.append(run + ["--out", str(tmp_path / "one.csv")])
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in commands]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(log[-2000:] for log in logs)
    assert not (tmp_path / "node1.csv").exists() and "node 0 writes the rows" in logs[1]
    two, one = _rows(tmp_path / "node0.csv"), _rows(tmp_path / "one.csv")
    assert sorted(two) == sorted(one) and len(one) == 2
    for conf, r in two.items():
        assert r["outcome"] == one[conf]["outcome"] == "ok", (r["error"], one[conf]["error"])
        assert r["nodes"] == "2" and "nodes" not in one[conf]
        for col in ("measured_state_bytes", "measured_state_min_bytes", "measured_comm_bytes"):
            assert int(r[col]) == int(one[conf][col]), (conf, col)
        assert json.loads(r["measured_comm_by_op"]) == json.loads(one[conf]["measured_comm_by_op"])
        assert int(r["measured_state_bytes"]) == int(r["predicted_state_bytes"])
        assert int(r["measured_comm_bytes"]) == int(r["predicted_comm_bytes"])


@pytest.mark.parametrize("extra, says", [
    (["--node-rank", "0"], "--hostfile needs --node-rank"),
    (["--node-rank", "2", "--master-addr", "h"], "--node-rank 2: "),
    (["--node-rank", "0", "--master-addr", "h", "--fake-world"], "leave out --fake-world"),
    (["--node-rank", "0", "--master-addr", "h", "--nproc", "3"], "slots add up to 2"),
])
def test_hostfile_flags_that_do_not_go_together_exit_2(tmp_path, extra, says):
    from validate.cli import main
    hosts = tmp_path / "hostfile"
    hosts.write_text("# two nodes\nnode0 slots=1\nnode1 slots=1  # the second\n")
    args = ["run", "--backend", "cpu", "--nproc", "2", "--hostfile", str(hosts), "--out", str(tmp_path / "r.csv")]
    r = CliRunner().invoke(main, args + extra)
    assert r.exit_code == 2 and says in r.output, r.output


@pytest.mark.parametrize("text, says", [("node0 slots=2\nnode0 slots=2\n", ":2:"), ("node0 2\n", ":1:"), ("\n", "no `")])
def test_a_hostfile_deepspeed_would_refuse_is_refused_by_line(tmp_path, text, says):
    from validate.runner import SetupError, read_hostfile
    (tmp_path / "h").write_text(text)
    with pytest.raises(SetupError, match=says):
        read_hostfile(str(tmp_path / "h"))


def test_the_launch_on_each_node_is_deepspeeds_without_ssh():
    from validate.runner import Nodes, launch_command
    cmd = launch_command("cpu", 4, "jobs.json", "out", None, 29500, Nodes("hosts", 1, "10.0.0.1", 29500, (2, 2)))
    assert cmd[cmd.index("--hostfile"):cmd.index("--module")] == \
        ["--hostfile", "hosts", "--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1"]
    assert "--num_gpus" not in cmd and cmd[cmd.index("--master_port") + 1] == "29500"


def test_a_row_over_nodes_is_its_own_configuration_and_predicted_across_the_network():
    """The job's key and configuration carry its nodes; zerocalc reads the row's ranks as split over them,
    so its collectives run at the network's bandwidth (timing.inter_node)."""
    from validate import jobs as J
    from validate.rows import job_from_row
    from zerocalc import arch, measured
    from zerocalc.hardware import gpu
    from zerocalc.timing import inter_node
    job = J.make_job(arch.Architecture("seed-gpt", 997, 48, 2, 4, 4, 192, False, 17), 16, stage=2, seq_len=16)
    two = J.with_nodes(job, 2)
    assert two["key"] != job["key"] and "-n16-nodes2-" in two["key"] and J.with_nodes(job, 1) is job
    row = {"key": two["key"], "nproc": "16", "stage": "2", "optimizer": "adamw", "nodes": "2", "family": "seed-gpt",
           "vocab_size": "997", "hidden_size": "48", "num_layers": "2", "num_heads": "4", "seq_len": "16",
           "measured_step_s": "0.1", "_where": "rows.csv:2"}
    assert job_from_row(row)["nodes"] == 2
    m = measured.measured(row, gpu("h200"), ".")
    assert m.hardware.gpus_per_node == 8 and inter_node(m.setup, m.hardware)
    m = measured.measured({**row, "nproc": "4"}, gpu("h200"), ".")            # 2 ranks on each of 2 nodes
    assert m.hardware.gpus_per_node == 2 and inter_node(m.setup, m.hardware)
    m = measured.measured({**row, "nproc": "8", "nodes": ""}, gpu("h200"), ".")   # one node of 8
    assert not inter_node(m.setup, m.hardware)


def test_the_validators_report_and_fit_read_a_rows_nodes():
    """`validate report` and `fit` predict a row over nodes as `zerocalc estimate --nodes` would: 4 ranks
    over 2 nodes is 2 GPUs a node, so the gradients' all-reduce crosses the network."""
    import pandas as pd

    from validate.fit import time_features
    from validate.report import repredict
    from zerocalc.estimate import estimate
    from zerocalc.hardware import gpu
    from zerocalc.model import from_architecture
    from zerocalc.arch import Architecture
    from zerocalc.training import Setup, Stage
    base = {"key": "k", "nproc": 4, "stage": 2, "optimizer": "adamw", "dtype": "bf16", "family": "seed-gpt",
            "vocab_size": 997, "hidden_size": 48, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4,
            "ffn_hidden_size": 192, "tie_embeddings": False,
            "seq_len": 16, "micro_batch": 1, "backend": "cuda", "outcome": "ok", "measured_step_s": 0.1}
    rows = pd.DataFrame([{**base, "nodes": 2}, {**base, "nodes": 1}])
    now = repredict(rows)["now_step_s"].tolist()
    spec = from_architecture(Architecture("seed-gpt", 997, 48, 2, 4, 4, 192, False, 2048))
    setup = Setup(stage=Stage(2), dp=4, seq_len=16, micro_batch=1)
    over_two = estimate(spec, setup, hardware=gpu("h200", gpus_per_node=2)).time.step_s
    on_one = estimate(spec, setup, hardware=gpu("h200")).time.step_s
    assert over_two > on_one and now == pytest.approx([over_two, on_one], rel=1e-12)
    assert [f["inter_node"] for f in time_features(rows)] == [1, 0]
