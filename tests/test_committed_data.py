"""The committed H200 rows against the current zerocalc: what the README claims, checked in CI
(the GPU jobs never run here; their data do)."""
import glob
import os

import pytest

pytest.importorskip("pandas")

from validate.report import load, own_peak_allocated, report, repredict, started_clean  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = sorted(glob.glob(os.path.join(ROOT, "data", "h200-*.csv")))


@pytest.fixture(scope="module")
def rows():
    df = load(PATHS)
    failed = df[df["outcome"] != "ok"]
    # A job that failed on the GPU stays in data/ with its error (e.g. a torch SystemError under the
    # allocator-history recorder); only measured rows are compared.
    assert failed["error"].notna().all() and len(failed) <= 2
    return repredict(df[df["outcome"] == "ok"])


def test_at_least_40_gpu_configurations_with_provenance(rows):
    assert len(rows) >= 40
    for col in ("gpu", "driver", "torch", "deepspeed", "date", "command"):
        assert rows[col].notna().all(), col
    assert set(rows["deepspeed"]) == {"0.19.8"} and all("H200" in g for g in rows["gpu"])
    assert set(rows["nproc"]) >= {1, 2}
    assert (rows["nproc"] >= 2).sum() >= 20 and rows.loc[rows["nproc"] >= 2, "num_params"].max() > 6e9


def test_state_and_communication_are_exact_on_every_gpu_row(rows):
    assert (rows["now_state_bytes"] == rows["measured_state_bytes"].astype("int64")).all()
    assert (rows["now_comm_bytes"] == rows["measured_comm_bytes"].astype("int64")).all()


def test_peak_allocated_within_the_stated_error(rows):
    own = own_peak_allocated(rows)
    err = ((rows["now_peak_allocated_bytes"] - own) / own).abs()
    # README: mean 0.4%, worst 4.2%: every row within the 5%
    assert err.mean() < 0.01
    assert err.max() < 0.05


def test_reserved_within_the_stated_error(rows):
    clean = rows[started_clean(rows)]
    err = ((clean["now_peak_reserved_bytes"] - clean["measured_peak_reserved_bytes"])
           / clean["measured_peak_reserved_bytes"]).abs()
    # README: mean 6%, 39 of 47 within 10%, worst 23% (issue 4's 10% on every row: not met)
    assert err.mean() < 0.07 and err.max() < 0.25
    assert (err <= 0.10).mean() >= 0.8


def test_report_prints_every_table():
    text, exact = report(PATHS)
    assert exact
    for title in ("Resident state bytes", "Logged communication bytes", "Peak allocated", "held-out rows",
                  "Peak reserved", "Step time"):
        assert title in text


def test_step_time_within_the_stated_error(rows):
    err = ((rows["now_step_s"] - rows["measured_step_s"]) / rows["measured_step_s"]).abs()
    # README: mean 11%, 52 of 72 within 15%, worst 41% (issue 5's 15% on every row: not met)
    assert err.mean() < 0.12
    assert (err <= 0.15).mean() >= 0.7
    assert err.max() < 0.45
