"""Which jobs ran before a measured row in the validator's process (`validate.report.earlier_jobs`)."""
import pytest

pd = pytest.importorskip("pandas")

from validate.report import earlier_jobs  # noqa: E402

WS = 64 * 2**20          # cuBLAS's two workspaces: what a later job of a process starts with


def test_a_process_starts_at_a_job_with_nothing_allocated_and_ends_at_a_failed_one():
    df = pd.DataFrame({
        "key": ["a", "b", "c", "d", "e", "x"],
        "source": ["f.csv"] * 5 + ["g.csv"],
        "outcome": ["ok", "ok", "error", "ok", "ok", "ok"],
        "measured_base_allocated_bytes": [0, WS, float("nan"), WS, 0, WS],
    })
    before = {k: (None if v is None else [r["key"] for r in v]) for k, v in
              zip(df["key"], (earlier_jobs(df)[i] for i in df.index))}
    assert before["a"] == [] and before["b"] == ["a"]
    assert before["c"] == ["a", "b"]          # it ran after them, though it failed
    assert before["d"] is None                # after a failed job the process's state is not known
    assert before["e"] == []                  # a fresh process again
    assert before["x"] is None                # another file; its process's first job is not there


def test_rows_without_a_source_are_one_file():
    df = pd.DataFrame({"key": ["a", "b"], "outcome": ["ok", "ok"], "measured_base_allocated_bytes": [0, WS]})
    assert [r["key"] for r in earlier_jobs(df)[1]] == ["a"]
