"""The vectorized sweep agrees with `estimate` (the scalar model) on P-only models."""
import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("pandas")

from zerocalc.estimate import estimate  # noqa: E402
from zerocalc.model import from_params  # noqa: E402
from zerocalc.sweep import evaluate, grid, sweep  # noqa: E402
from zerocalc.training import Setup, Stage  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(st.integers(10**8, 2 * 10**11), st.sampled_from([1, 2, 3, 8, 16, 64, 512]), st.sampled_from([0, 1, 2, 3]),
       st.sampled_from([2, 4]), st.sampled_from([1, 4]))
def test_sweep_matches_estimate(p, n, stage, b, gas):
    out = evaluate(grid(num_params=[p], dp=[n], stage=[stage], param_bytes=[b], gas=[gas]))
    e = estimate(from_params(p), Setup(stage=Stage(stage), dp=n, dtype="bf16" if b == 2 else "fp32", gas=gas))
    assert out["resident_bytes"][0] == pytest.approx(e.states.resident_bytes, rel=1e-2)
    assert out["peak_bytes"][0] == pytest.approx(e.peak_bytes, rel=1e-2)
    assert out["comm_bytes"][0] == pytest.approx(e.comm_bytes, rel=1e-2)
    assert out["wire_bytes"][0] == pytest.approx(e.comm_wire_bytes, rel=1e-2, abs=64)


def test_sweep_returns_one_row_per_grid_point():
    df = sweep(num_params=[1e9, 7e9], dp=[1, 8, 64], stage=[0, 1, 2, 3])
    assert len(df) == 2 * 3 * 4
    assert list(df.columns[:5]) == ["num_params", "dp", "stage", "param_bytes", "gas"]
    seven_b_stage2 = df[(df.num_params == 7e9) & (df.dp == 8) & (df.stage == 2)].iloc[0]
    # 2·P bf16 params + 12·P/8 fp32 master and Adam
    assert seven_b_stage2.resident_bytes == 2 * 7e9 + 12 * 7e9 / 8


def test_unknown_axis_is_refused():
    with pytest.raises(ValueError, match="unknown sweep axes"):
        grid(num_param=[1e9])


def test_sweep_cli_writes_csv(tmp_path):
    from click.testing import CliRunner
    from zerocalc.cli import main
    out = tmp_path / "s.csv"
    r = CliRunner().invoke(main, ["sweep", "--params", "1e9,7B", "--dp", "1,8", "--stage", "2,3", "--dtype", "bf16,fp32",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    lines = out.read_text().splitlines()
    assert lines[0].startswith("num_params,dp,stage,param_bytes,gas,resident_bytes")
    assert len(lines) == 1 + 2 * 2 * 2 * 2
    bad = CliRunner().invoke(main, ["sweep", "--params", "1e9", "--stage", "5"])
    assert bad.exit_code == 2 and "stages are 0-3" in bad.output
    bad = CliRunner().invoke(main, ["sweep", "--params", "lots"])
    assert bad.exit_code == 2 and "comma-separated" in bad.output


def test_sweep_cli_takes_fp16_as_the_two_byte_rows_bf16_gives(tmp_path):
    from click.testing import CliRunner
    from zerocalc.cli import main
    out = tmp_path / "s.csv"
    r = CliRunner().invoke(main, ["sweep", "--params", "1e9", "--dp", "8", "--stage", "0", "--dtype", "fp16,bf16,fp32",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    header, *rows = [ln.split(",") for ln in out.read_text().splitlines()]
    # fp16 and bf16 are one param_bytes = 2 row (the same bytes), fp32 the other
    assert [row[header.index("param_bytes")] for row in rows] == ["2", "4"]
    # stage 0, mixed precision: 2 B params + 4 B fp32 master + 8 B Adam per parameter = 14e9 bytes
    assert float(rows[0][header.index("resident_bytes")]) == 14e9
    # the gradient all-reduce: 2 B per parameter (no 4-byte fp32 norm in mixed precision)
    assert float(rows[0][header.index("comm_bytes")]) == 2e9
    bad = CliRunner().invoke(main, ["sweep", "--params", "1e9", "--dtype", "fp8"])
    assert bad.exit_code == 2 and "fp8: give bf16, fp16 or fp32" in bad.output


def test_sweep_cli_writes_byte_counts_as_whole_numbers():
    from click.testing import CliRunner
    from zerocalc.cli import main
    r = CliRunner().invoke(main, ["sweep", "--params", "7e9", "--dp", "3", "--stage", "0"])
    assert r.exit_code == 0, r.output
    header, row = [ln.split(",") for ln in r.output.splitlines()]
    # 2 B params + 4 B master + 8 B Adam per parameter, written as an integer (not 98000000000.0)
    assert row[header.index("resident_bytes")] == "98000000000"
    # the ring all-reduce of 2 B gradients: 2·(N-1)/N · 2·P = 18,666,666,666.67, rounded to the byte
    assert row[header.index("wire_bytes")] == "18666666667"


def test_grid_by_its_axes_equals_the_same_points_one_by_one():
    """Broadcasting over the grid's axes gives, byte for byte, what the formulas give on the flat
    list of its points (every quantity on every point, `np.select` over the stages)."""
    import numpy as np
    from zerocalc.sweep import AXES
    g = grid(num_params=[1e7, 3.3e9, 7e9, 175e9], dp=[1, 2, 3, 64], stage=[3, 0, 2, 1, 3], param_bytes=[4, 2],
             gas=[1, 2, 7])
    assert g.shape == (4, 4, 5, 2, 3)
    flat = {k: g[k] for k in AXES}
    assert len(flat["gas"]) == 4 * 4 * 5 * 2 * 3
    assert list(flat["stage"][:12]) == [3] * 6 + [0] * 6       # C order: gas, then param_bytes fastest
    for options in ({}, {"optimizer_state_bytes": 0, "reduce_bucket_size": 3e7, "sub_group_size": 1e8}):
        by_axes, by_point = evaluate(g, **options), evaluate(flat, **options)
        assert list(by_axes) == list(by_point)
        for k in by_axes:
            assert by_axes[k].dtype == by_point[k].dtype and by_axes[k].tobytes() == by_point[k].tobytes(), k


def test_peak_phase_is_categorical_by_name():
    from zerocalc.sweep import PHASES, table
    df = sweep(num_params=[1e9], dp=[1, 8], stage=[0, 3])
    assert str(df.peak_phase.dtype) == "category" and list(df.peak_phase.cat.categories) == list(PHASES)
    g = grid(num_params=[1e9], dp=[1, 8], stage=[0, 3])
    out = evaluate(g)
    assert out["peak_phase"].dtype.kind == "i"
    assert list(table(g, out)["peak_phase"]) == list(df.peak_phase)
    # stage 0, bf16, N = 1: the step's 2P gradients + 8P fp32 copies beat the 4P dummy-step gradients at init
    assert df.peak_phase[0] == "step"


def test_one_walk_per_class_of_sizes_gives_each_size_its_own_walk():
    """The sweep walks the stage-3 coordinator once per class of P-only sizes whose walks are the same
    (`sweep._walk_class`); each size's fractions must be what walking that size itself gives. Sizes
    on both sides of the limits the walk compares against: tensors of 1e5 (persistence), batches of
    5e7 (prefetch bucket), 1e9 (live parameters and reuse distance), and some in between."""
    import random
    from zerocalc import stage3_trace, sweep as sw
    random.seed(7)
    sizes = [10**7, 10**7 + 99, 10**7 + 100, 5 * 10**9 - 1, 5 * 10**9, 5 * 10**9 + 100, 10**11, 10**11 + 100,
             2 * 10**11, 150, 10**6] + [random.randint(10**6, 3 * 10**11) for _ in range(40)]
    for p in sizes:
        it = stage3_trace.simulate(from_params(p), Setup(stage=Stage.PARAMETERS, dp=2))
        own = (it.kept_after_forward_elements / p, (it.forward_gather_elements + it.backward_gather_elements) * 2 / p)
        assert sw._kept_and_gathered(p) == own, p
