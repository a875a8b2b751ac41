"""The course chapter's example (7B, fp16, DP = 8, 32 GB cards), worked by hand; docs/seed-example.md."""
import json

from click.testing import CliRunner

from zerocalc.cli import main

P, N = 7 * 10**9, 8
S = P // N                      # 875e6: the shard; P is a multiple of 2N, so no padding


def estimates():
    r = CliRunner().invoke(main, ["estimate", "--params", "7e9", "--dp", "8", "--dtype", "fp16",
                                  "--gpu-memory", "32GB", "--format", "json"])
    assert r.exit_code == 0, r.output
    return {e["stage"]: e for e in json.loads(r.output)["estimates"]}


def test_resident_states():
    e = estimates()
    assert e[0]["resident_state_bytes"] == 2 * P + 4 * P + 8 * P            # fp16 params, fp32 master, Adam
    assert e[1]["resident_state_bytes"] == 2 * P + 4 * S + 8 * S            # 24.5e9
    assert e[2]["resident_state_bytes"] == e[1]["resident_state_bytes"]
    # stage 3: (2 + 4 + 8 + 2) bytes per shard element + the 5e8-element fp16 reduce bucket
    assert e[3]["resident_state_bytes"] == 16 * S + 2 * 500_000_000


def test_paper_figures_beside_them():
    e = estimates()
    assert [e[s]["paper"]["model_states_bytes"] for s in range(4)] == [16 * P, 4 * P + 12 * P / N,
                                                                        2 * P + 14 * P / N, 16 * P / N]


def test_peaks():
    e = estimates()
    assert e[0]["peak_bytes"] == 24 * P                                   # 14P + 2P grads + 8P fp32 copies
    # stage 2 step: 24.5e9 + partition gradients of the 13 whole 7e7 tensors a shard touches
    # (9.1e8 × 2 B) + flatten 2S + fp32 cast 4S
    assert e[2]["peak_bytes"] == 2 * P + 12 * S + 2 * 13 * 70_000_000 + 2 * S + 4 * S
    assert e[2]["peak_phase"] == "step"
    # stage 3 step: the shard is one sub-group (875e6 < sub_group_size 1e9): flatten 2S + cast 4S
    assert e[3]["peak_bytes"] == 16 * S + 10**9 + 6 * S


def test_stage_2_does_not_fit_32gb_stage_3_does():
    e = estimates()
    assert [e[s]["fits"] for s in range(4)] == [False, False, False, True]


def test_communication():
    e = estimates()
    # stages 1/2: all-reduce 2P + all-gather 2S + 4 B norm + 1 B overflow flag
    assert e[2]["comm"]["bytes_per_rank_per_step"] == 2 * P + 2 * S + 5
    assert round(e[2]["comm"]["volume_over_params"], 3) == 2.625                  # 3 (N - 1) / N
