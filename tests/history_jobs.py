"""The job a recorded allocator history (data/snapshots/) was taken from, as its row in the committed
H200 files gives it, for the tests that regenerate a history (test_sequence, test_stream). The rows
are read once per process: 1.4 s of CPU on two cores."""
import glob
import os
from functools import lru_cache

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@lru_cache(maxsize=None)
def _rows():
    pd = pytest.importorskip("pandas")
    return pd.concat([pd.read_csv(p) for p in glob.glob(os.path.join(ROOT, "data", "h200-*.csv"))])


def job(history: str) -> dict:
    """`validate.rows.job_from_row` of the last row whose key is the history's (its name after the folder)."""
    from validate.rows import job_from_row
    rows = _rows()
    return job_from_row(rows[rows["key"] == history.split("/")[1]].iloc[-1].to_dict())
