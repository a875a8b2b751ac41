"""The committed fake-world and emulated-card H200 rows against the current zerocalc (data/README.md):
rank 0 of a world of N in one process (`validate run --fake-world`) and smaller cards emulated with a
capped caching allocator (`allocator_capacity_bytes`). The GPU jobs never run here; their data do."""
import pytest

pytest.importorskip("pandas")

import pandas as pd  # noqa: E402

from validate.docs import committed_paths  # noqa: E402
from validate.report import committed_rows, load  # noqa: E402
from validate.rows import CONFIG_COLUMNS  # noqa: E402

pytestmark = pytest.mark.slow   # re-predicts every fake-world row (70B and 405B ones among them)


@pytest.fixture(scope="module")
def fake():
    return committed_rows(committed_paths("fake"))


def _err(pred, meas):
    return pred.astype(float) / meas.astype(float) - 1


def test_a_fake_rank_0_of_two_is_the_real_rank_0():
    """The same ten N = 2 configurations (h200-t2-n2-a: the case study's GPT at stages 0-3 in bf16 and fp16,
    the 1.1B Llama) run by real ranks and as rank 0 of a fake world of 2 on the same kind of GPU: state and
    communication bytes identical, peak allocated within 0.01%, reserved within 0.2% (the one 0.14% apart
    is the first job of its process in the real run and a later one in the fake run)."""
    real = load(["data/h200-t2-n2-a.csv"])
    fake = load(["data/h200-fake-t2-n2-a.csv"])
    real, fake = real[real["outcome"] == "ok"], fake[fake["outcome"] == "ok"]
    assert (fake["world"] == "fake").all() and "world" not in real
    on = [c for c in CONFIG_COLUMNS if c != "key" and c in real and c in fake]
    both = real.astype({c: str for c in on}).merge(fake.astype({c: str for c in on}), on=on, suffixes=("_r", "_f"))
    assert len(both) == 10
    for col in ("measured_state_bytes", "measured_comm_bytes", "measured_comm_by_op", "measured_state_detail"):
        assert (both[col + "_r"] == both[col + "_f"]).all(), col
    alloc = _err(both["measured_peak_allocated_bytes_f"], both["measured_peak_allocated_bytes_r"]).abs()
    reserved = _err(both["measured_peak_reserved_bytes_f"], both["measured_peak_reserved_bytes_r"]).abs()
    assert alloc.max() < 1e-4 and reserved.max() < 0.002


def _at_scale(rows):
    """The fake-world rows at N >= 8 (the capped runs are the card files', judged below)."""
    return rows[rows["nproc"].astype(int) >= 8]


def test_rows_at_scale_state_and_communication_exact(fake):
    rows = _at_scale(fake)
    assert (rows["now_state_bytes"] == rows["measured_state_bytes"].astype("int64")).all()
    assert (rows["now_comm_bytes"] == rows["measured_comm_bytes"].astype("int64")).all()
    assert set(rows["nproc"].astype(int)) >= {8, 16, 64, 256, 1024}
    assert rows["num_params"].astype(float).max() > 60e9


# The rows outside 3% allocated / 8% reserved, not yet explained (docs/scale.md, "Open"), each with the
# bound it stays within: Llama-2-70B at stage 3, checkpointed, 1x4096, N = 256 (allocated -3.4%); a
# Llama-3-8B at stage 2, N = 16, 1x2048 (reserved +9.6%: the replay's second step makes new segments
# the job's does not); a 1.5B Llama at stage 2, N = 8, GAS 2, a later job of its process (+10.2%).
OPEN = {"hf-llama-h8192-l80-s3-bf16-n256fake-b1x4096-gas1-3600880dbc": (0.035, 0.08),
        "hf-llama-h4096-l32-s2-bf16-n16fake-b1x2048-gas1-630bf11735": (0.03, 0.10),
        "hf-llama-h2048-l16-s2-bf16-n8fake-b2x2048-gas2-35464a3151": (0.03, 0.105)}


def test_rows_at_scale_peaks_within_3_and_8_percent(fake):
    """Every fake-world row at N >= 8: peak allocated within 3%, reserved within 8%, but the three
    `OPEN` rows, within the bounds given there."""
    rows = _at_scale(fake)
    alloc = _err(rows["now_peak_allocated_bytes"], rows["measured_peak_allocated_bytes"]).abs()
    reserved = _err(rows["now_peak_reserved_bytes"], rows["measured_peak_reserved_bytes"]).abs()
    bounds = rows["key"].map(lambda k: OPEN.get(k, (0.03, 0.08)))
    worst = rows.assign(alloc=alloc, reserved=reserved)[(alloc > bounds.str[0]) | (reserved > bounds.str[1])]
    assert worst.empty, worst[["key", "alloc", "reserved"]].to_string()
    assert len(rows) >= 27 and ((alloc <= 0.03) & (reserved <= 0.08)).sum() >= len(rows) - len(OPEN)


def test_the_verdict_on_an_emulated_card_is_the_allocator_s():
    """Cards of 24, 40, 48, 80 and 94 GB emulated on the H200 (the caching allocator capped at the card
    less the CUDA context), each configuration chosen within 2-10% of zerocalc's boundary for its card
    before it ran (validate/matrices/h200-cards-chosen.json; 25 of its 40 ran in the call's time): the
    verdict fits / NO (GPU) agrees with whether the job raised OutOfMemoryError on every one; none that
    zerocalc says fits ran out, eight of those only thanks to the allocator's retries."""
    from validate.report import card_verdicts
    rows = load(committed_paths("cards"))
    verdicts = card_verdicts(rows)
    assert len(verdicts) >= 25 and set(verdicts["card_gib"]) == {24, 40, 48, 80, 94}
    assert verdicts["predicted_fits"].sum() >= 10 and (~verdicts["predicted_fits"]).sum() >= 10
    retried = pd.to_numeric(verdicts["retries"], errors="coerce").fillna(0) > 0
    assert (retried & verdicts["predicted_fits"]).sum() >= 5
    assert (verdicts["fits_source"] == "allocator").all()
    wrong = verdicts[~verdicts["agrees"]]
    assert wrong.empty, wrong.to_string()
