"""The notebook runs headless on the committed data, draws its figures, and shows what the README and
docs/accuracy.md show: it is committed with its outputs (figures inline), and those outputs are what
running it now gives."""
import importlib.util
import os

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")
pytest.importorskip("pandas")

pytestmark = pytest.mark.slow   # runs the notebook: about a minute on two cores with the session's re-predicted rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "predicted_vs_measured.ipynb")
FIGURES = ("predicted_vs_measured.png", "error_per_configuration.png", "phase_breakdown.png", "step_time.png",
           "step_time_crossval.png", "allocator_replay.png", "generated_sequence.png", "scale.png")


def make_notebook():
    spec = importlib.util.spec_from_file_location("make_notebook", os.path.join(ROOT, "notebooks", "make_notebook.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def texts(nb):
    """Every text output of the code cells (printed lines and displayed markdown), in order. A cell's
    consecutive printed lines are one text: the kernel splits a stream into outputs as its flushes fall."""
    out = []
    for cell in nb.cells:
        printed = None
        for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if "text" in o:
                printed = (printed or "") + o["text"]
                continue
            if printed is not None:
                out.append(printed)
                printed = None
            if "text/markdown" in o.get("data", {}):
                out.append(o["data"]["text/markdown"])
        if printed is not None:
            out.append(printed)
    return out


def images(nb):
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


@pytest.fixture(scope="module")
def executed(committed_rows, committed_crossval, tmp_path_factory):
    # the kernel reads the session's re-predicted rows and cross-validation instead of computing them again
    folder = tmp_path_factory.mktemp("committed")
    committed_rows.to_pickle(folder / "rows.pkl")
    committed_crossval[0].to_pickle(folder / "crossval.pkl")
    handed = {"ZEROCALC_COMMITTED_ROWS": str(folder / "rows.pkl"), "ZEROCALC_COMMITTED_CROSSVAL": str(folder / "crossval.pkl")}
    os.environ.update(handed)
    try:
        return make_notebook().execute(make_notebook().build())
    finally:
        for name in handed:
            del os.environ[name]


def test_the_committed_notebook_is_what_make_notebook_writes_with_its_outputs(executed):
    committed = nbformat.read(NOTEBOOK, as_version=4)
    assert [c.source for c in committed.cells] == [c.source for c in make_notebook().build().cells]
    assert images(committed) == len(FIGURES), "figures inline: python notebooks/make_notebook.py --execute"
    assert texts(committed) == texts(executed), "stale outputs: python notebooks/make_notebook.py --execute"


def test_it_draws_every_figure(executed):
    assert images(executed) == len(FIGURES)
    for name in FIGURES:
        assert os.path.getsize(os.path.join(ROOT, "docs", "figures", name)) > 10_000


def test_its_tables_are_the_readmes_and_the_docs(executed, committed_rows):
    from validate import docs
    from validate.report import device_rows, markdown_anchors, markdown_summary
    shown = texts(executed)
    summary = markdown_summary(committed_rows)
    assert shown[0] == summary
    readme = dict(m.group("name", "body") for m in docs.BLOCK.finditer(open(os.path.join(ROOT, "README.md")).read()))
    assert readme["accuracy:summary"] == summary + "\n"
    anchors = markdown_anchors(device_rows(committed_rows))
    assert shown[1] == anchors
    accuracy = open(os.path.join(ROOT, "docs", "accuracy.md")).read()
    assert anchors in accuracy


def test_the_case_study_line_compares_like_with_like(executed):
    # the prediction for the case study's fp16 2x1024 configuration beside the jobs that ran exactly that
    # (four of them, 19.55-19.61 GiB), not beside another batch shape or dtype
    line = [ln for t in texts(executed) for ln in t.splitlines() if ln.startswith("case study")][0]
    predicted, measured = line.split("predicted ")[1].split(" GiB, measured ")
    low, high = (float(x) for x in measured.split(" GiB")[0].split("-"))
    assert low <= high and abs(float(predicted) / low - 1) < 0.01 and "in 4 jobs" in line
