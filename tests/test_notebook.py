"""The notebook runs headless on the committed data and writes its figures."""
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")
pytest.importorskip("pandas")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_predicted_vs_measured_notebook_runs():
    nb = nbformat.read(os.path.join(ROOT, "notebooks", "predicted_vs_measured.ipynb"), as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}}).execute()
    for name in ("predicted_vs_measured.png", "error_per_configuration.png", "phase_breakdown.png", "step_time.png",
                 "allocator_replay.png", "generated_sequence.png"):
        assert os.path.getsize(os.path.join(ROOT, "docs", "figures", name)) > 10_000
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "case study, stage 3, N = 2: predicted" in outputs
