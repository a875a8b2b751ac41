"""The allocator-history reader on a hand-made trace (the GPU writes real ones)."""
import pickle

from validate.snapshot import replay, summarize

DS = [{"filename": "/x/site-packages/deepspeed/runtime/zero/stage_1_and_2.py", "line": 3266, "name": "setup_buckets"}]
TORCH = [{"filename": "/x/site-packages/torch/nn/modules/linear.py", "line": 134, "name": "forward"}]
TRACE = [
    {"action": "segment_alloc", "addr": 0, "size": 1000},
    {"action": "alloc", "addr": 1, "size": 400, "frames": TORCH},      # +400
    {"action": "alloc", "addr": 2, "size": 300, "frames": DS},         # +700: the peak
    {"action": "free_requested", "addr": 1, "size": 400},              # +300
    {"action": "free_completed", "addr": 1, "size": 400},              # no change in allocated
    {"action": "free_requested", "addr": 99, "size": 100},             # a block from before the step: +200
    {"action": "alloc", "addr": 3, "size": 450, "frames": TORCH},      # +650
]


def test_replay_finds_the_peak_and_what_was_alive():
    peak, at, live = replay(TRACE)
    assert (peak, at) == (700, 2)
    assert sorted(e["size"] for e in live.values()) == [300, 400]


def test_summary_names_the_lines(tmp_path):
    path = tmp_path / "s.pickle"
    with open(path, "wb") as f:
        pickle.dump({"device_traces": [TRACE], "zerocalc_base_allocated": 2**30, "zerocalc_base_reserved": 2**31}, f)
    text = summarize(str(path))
    assert "peak 1.000 GiB (+0.000) at event 2" in text
    assert "deepspeed/runtime/zero/stage_1_and_2.py:3266:setup_buckets" in text
    assert "torch/nn/modules/linear.py:134:forward" in text


def test_a_file_that_is_not_a_snapshot_is_a_usage_error(tmp_path):
    from click.testing import CliRunner

    from validate.cli import main
    bad = tmp_path / "x.pickle"
    bad.write_text("not a pickle")
    result = CliRunner().invoke(main, ["snapshot", str(bad)])
    assert result.exit_code == 2 and "not a torch memory snapshot" in result.output


def test_a_compacted_history_reads_back_and_its_totals_and_actions_without_the_trace(tmp_path):
    import gzip
    import json

    from validate.snapshot import compact, load, totals_and_actions
    snap = {"device_traces": [TRACE], "zerocalc_base_allocated": 2**30, "zerocalc_base_reserved": 2**31}
    path = tmp_path / "s.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(compact(snap), f)
    back = load(str(path))
    assert [(e["action"], e["addr"], e["size"]) for e in back["device_traces"][0]] == \
        [(e["action"], e["addr"], e["size"]) for e in TRACE]
    totals, actions = totals_and_actions(str(path))
    assert totals == {"zerocalc_base_allocated": 2**30, "zerocalc_base_reserved": 2**31}
    assert actions == {"segment_alloc", "alloc", "free_requested", "free_completed"}
