"""The committed H200 rows against the current zerocalc: what the README claims, checked in CI
(the GPU jobs never run here; their data do)."""
import glob
import os

import pytest

pytest.importorskip("pandas")

from validate.report import (concurrent, load, own_peak_allocated, report, started_clean,  # noqa: E402
                             timed_whole_steps)
from validate.rows import measured_host_launch_s  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# HF-config rows (data/h200-hf-*.csv) are judged apart (validate.report.hf_section, tests/test_hf_validate.py),
# and so are the fake-world and emulated-card rows (data/h200-fake-*.csv, h200-cards-*.csv; tests/test_fake_world.py).
from conftest import COMMITTED as PATHS  # noqa: E402


pytestmark = pytest.mark.slow   # re-predicts every committed row (about a minute on two cores, once per session)


@pytest.fixture(scope="module")
def rows(committed_rows):
    df = load(PATHS)
    failed = df[df["outcome"] != "ok"]
    # A job that failed on the GPU stays in data/ with its error; only measured rows are compared. Every
    # failure so far is the torch SystemError that recording the allocator history with python stacks
    # raises in stage-3 checkpointed jobs (data/README.md).
    assert failed["error"].str.startswith("SystemError").all() and len(failed) <= 3
    assert len(committed_rows) == int((df["outcome"] == "ok").sum())
    return committed_rows


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


# The host-memory rows (data/h200-host-*.csv, `protocol` concurrent: four jobs at once on one GPU, 1×512
# micro-batches) are judged on state and communication (exact) and on host memory (tests/test_host.py),
# not by the device-peak guards below: on 8 of their 24 rows the device's peak allocated came out
# 7-19% over the prediction (stage 3 with optimizer offload only, backward; the 774M GPT-2 at stage 1)
# and reserved up to 20% (data/README.md). Open: not explained by running concurrently as far as known.
def _device_rows(rows):
    return rows[~concurrent(rows)]


def test_peak_allocated_within_the_stated_error(rows):
    rows = _device_rows(rows)
    own = own_peak_allocated(rows)
    err = ((rows["now_peak_allocated_bytes"] - own) / own).abs()
    # README: mean 0.6%, worst 4.2%: every row within the 5% (GAS 2 included since the peak model
    # counts what later micro-steps carry)
    assert err.mean() < 0.01
    assert err.max() < 0.05


def test_reserved_within_the_stated_error(rows):
    from validate.report import expandable_rows
    rows = _device_rows(rows)
    expandable = expandable_rows(rows)
    clean = rows[started_clean(rows) & ~expandable]
    err = ((clean["now_peak_reserved_bytes"] - clean["measured_peak_reserved_bytes"])
           / clean["measured_peak_reserved_bytes"]).abs()
    # README: mean 0.24%, every row within issue 4's 10% (worst 7.0%, rank 1 of an offload job). It was
    # 186 of 187 before a later job's new segments were laid in the address ranges the jobs before it
    # returned (the miss: +14%), 157 of 170 (mean 2.3%) with stage 3 and offload on a ratio, 110 of 142
    # (6.5%) with one ratio.
    assert err.mean() < 0.004 and err.max() < 0.10
    # Simulated (the generated allocation sequence through the allocator): all but one row (stage 3
    # with parameter offload at N = 2).
    sim = clean["now_reserved_source"] == "simulated"
    assert sim.sum() >= 185 and err[sim].mean() < 0.005
    s3 = sim & (clean["stage"] == 3)
    assert s3.sum() >= 45 and (err[s3] <= 0.10).all()
    offload = clean["offload_optimizer"] != "none"
    assert offload.sum() >= 20 and (err[offload] <= 0.10).all()
    # With expandable_segments (8 rows; simulated, or the ratio times the measured factor): 8 of 8, worst 3.4%.
    exp = rows[started_clean(rows) & expandable]
    err = ((exp["now_peak_reserved_bytes"] - exp["measured_peak_reserved_bytes"])
           / exp["measured_peak_reserved_bytes"]).abs()
    assert len(exp) >= 8 and err.max() < 0.05


def test_reserved_repeats_to_the_percent(rows):
    """One configuration run in five separate jobs (no allocator recording) reserves the same to 0.1%:
    the reserved misses are the model's, not the measurement's."""
    clean = rows[started_clean(rows) & (rows["num_params"] == 1414455296) & (rows["stage"] == 0)
                 & (rows["micro_batch"] == 2) & (rows["seq_len"] == 1024) & (rows["dtype"] == "fp16")]
    reserved = clean["measured_peak_reserved_bytes"].astype(float)
    assert len(reserved) >= 5 and (reserved.max() - reserved.min()) / reserved.mean() < 0.003


def test_report_prints_every_table(rows):
    text, exact = report(PATHS, rows)
    assert exact
    for title in ("Resident state bytes", "Logged communication bytes", "Peak allocated", "held-out rows",
                  "Peak reserved", "Step time", "held-out configurations"):
        assert title in text


def test_step_time_within_the_stated_error(rows):
    timed = rows[timed_whole_steps(rows)]
    err = ((timed["now_step_s"] - timed["measured_step_s"]) / timed["measured_step_s"]).abs()
    # README: rows timed as training runs (304), each on its own host's speed where probed before every
    # timed step (157 rows): mean 9.7%, 234 within 15%, worst 52% (issue 5's 15% on every row: not met, nor
    # can be: the jobs of 22 configurations spread wider than any one prediction covers within 15%; the
    # medians of one configuration's jobs differ by 15%, median over 100 configurations). History: 202/257
    # = 0.786; with the t8/t9 jobs 214/278, with the host's per-operator cost 223/278 = 0.802. The t10 third
    # jobs (25 rows, for the 25 configurations whose two jobs differed by more than 15%, not chosen by
    # error) and the last t8 re-timing came out 17/26 within 15% on that calibration, and the level fell to
    # 240/304; refitted on them, 238/304 = 0.783; refitted on the held-out split by configuration (by key,
    # 23 configurations had jobs on both sides), 229/304 = 0.753; with the recomputation charged to the host
    # as a forward pass, 234/304 = 0.770. The t11 blind rows (14: 1.35-6.7B, device-bound at stages 0-2,
    # stage 3 at N = 2 still host-bound; not chosen by error) and a refit on them: 244/318 = 0.767.
    assert len(timed) >= 90
    assert err.mean() < 0.10
    assert (err <= 0.15).mean() >= 0.76                                     # 244/318 = 0.767
    assert err.max() < 0.55
    probed = [measured_host_launch_s(r.to_dict()) is not None for _, r in timed.iterrows()]
    # 133/171 on their own host's speed (126/157 before t11, whose 14 rows came out 11/14 within 15% after
    # the refit, the misses three of the seven stage-3 N = 2 ones; 110/131 before t10; 68/77 before the t8
    # re-timing added N = 2 stage 3 and offload, whose jobs differ by more than the host's launch cost
    # explains: data/README.md)
    assert sum(probed) >= 171 and (err[probed] <= 0.15).mean() >= 0.77     # 0.778


def test_cross_validated_step_time(committed_crossval):
    """`python -m validate crossval`: each quarter of the configurations predicted by the time constants
    fitted on the other three. README: 233/318 rows and 98/114 configurations within 15%; every fold's
    efficiency at or under its matmul ceiling (0.77-0.80). History: 229/304 and 86/100 before the t11 rows."""
    from validate.fit import FOLDS, cross_validation_report
    timed, sections = committed_crossval
    err = (timed["cv_step_s"] / timed["measured_step_s"] - 1).abs()
    assert len(sections) == FOLDS and timed["cv_step_s"].notna().all()
    assert (err <= 0.15).mean() >= 0.73                                   # 233/318 = 0.733
    assert all(s["efficiency"] <= s["efficiency_max"] + 1e-4 for s in sections)
    text = cross_validation_report(timed, sections)
    within, of = text.split("configurations (the median of their jobs): ")[1].split(" within")[0].split(" of ")
    assert int(within) / int(of) >= 0.83                                 # 98/114 = 0.860 (86/100 before t11)


def test_the_users_regime_predicted_before_it_ran(rows):
    """The t11 blind rows (data/h200-t11-blind-*predictions.txt, committed before each run): 14 jobs of
    1.35-6.7B models at 8k-16k tokens per micro-step. Stages 0-2 are device-bound there and come out
    within 13% on the current calibration (6 rows: -6.8% to +12.5%; within 8%, -7.4% to +7.0%, before the
    optimizer step's cost per parameter tensor: the 2.7B GPT at stage 2 on two GPUs, 390 tensors, went
    from +7.0% to +12.5%); stage 3 at N = 2 is still host-bound and
    three of its seven rows miss (+17%, +27%, +32% on their own host speed). Every row's state and comm
    bytes exact, peak allocated within 2%."""
    blind = rows[rows["source"].str.contains("h200-t11-blind-")]
    assert len(blind) == 14
    assert (blind["now_state_bytes"] == blind["measured_state_bytes"].astype("int64")).all()
    assert (blind["now_comm_bytes"] == blind["measured_comm_bytes"].astype("int64")).all()
    peak = (blind["now_peak_allocated_bytes"] / blind["measured_peak_allocated_bytes"] - 1).abs()
    assert peak.max() < 0.02
    step = blind["now_step_s"] / blind["measured_step_s"] - 1
    assert step[blind["stage"] < 3].abs().max() < 0.13
    s3n2 = step[(blind["stage"] == 3) & (blind["nproc"] == 2)]
    assert len(s3n2) == 7 and (s3n2.abs() <= 0.15).sum() >= 4 and (s3n2 > 0).all()   # over-predicted, all

def test_configurations_predicted_before_they_ran(rows):
    """Six stage 0-2 configurations never measured before were predicted first
    (data/h200-t4-blind-predictions.txt, committed before the run), then run each as the first job of
    its own process: the reserved peak came out within 0.2% of the prediction on all six."""
    blind = rows[rows["source"].str.contains("h200-t4-blind-")]
    err = ((blind["now_peak_reserved_bytes"] - blind["measured_peak_reserved_bytes"])
           / blind["measured_peak_reserved_bytes"]).abs()
    assert len(blind) == 6 and (blind["now_reserved_source"] == "simulated").all()
    assert err.max() < 0.01


def test_first_jobs_of_a_process_are_simulated_to_the_fraction_of_a_percent(rows):
    """What a user runs is a fresh process: the rows measured as the first job of the validator's
    process (nothing allocated before, not even cuBLAS's workspaces) are predicted within 0.3% at
    stages 0-2 with one micro-step per step (45 rows, mean 0.04%; 0.2% but the 160M GPT with
    overlap_comm, -0.27%) and at stage 3 with N = 1 (the two
    blind ones included); stage 3 at N = 2 within 3% up to 1.4B (the histories, which end after the second
    step, to 0.1%; the four t5 blind ones within 0.3%), within 5% at 2.8-6.7B (t11). With gradient accumulation (GAS 2, 4 rows) all four
    within 0.1% (README). With optimizer offload at N = 2 the 1.4B GPT at stage 2's rank 0 is simulated
    to its history's 0.02% (`snapshots/t6-offload-hist/`), but the row holds the busier rank 1's peak,
    7.5% above it, in both jobs of that configuration (not modelled)."""
    rows = _device_rows(rows)
    first = rows[started_clean(rows) & (rows["now_reserved_source"] == "simulated")
                 & (rows["measured_base_allocated_bytes"] < 32 * 2**20)]
    err = ((first["now_peak_reserved_bytes"] - first["measured_peak_reserved_bytes"])
           / first["measured_peak_reserved_bytes"]).abs()
    offload = first["offload_optimizer"] != "none"
    one = (first["gas"].astype(int) == 1) & ~offload
    s3 = first["stage"].astype(int) == 3
    n1 = first["nproc"].astype(int) == 1
    assert (one & ~s3).sum() >= 45 and err[one & ~s3].max() < 0.003 and (err[one & ~s3] > 0.002).sum() <= 1
    # stage 3, N = 1: all within 0.3% but one. The 162M GPT fp16 4x1024 re-timed in t8 reserved 10.82 GB
    # where its t4 job reserved 10.03 (simulated 9.99), with every allocated peak identical to the byte:
    # the same allocations, 0.79 GB more cached by the first forward (not chased; data/README.md).
    s3n1 = err[one & s3 & n1]
    assert len(s3n1) >= 18 and (s3n1 < 0.003).sum() >= len(s3n1) - 1 and s3n1.max() < 0.08
    # stage 3, N = 2: within 3% up to 1.4B; the t11 blind rows of 2.8-6.7B (six first jobs) -3.1% to +4.4%
    # (the 7B at 1x4096 over, at 2x4096 and 4x2048 under by 2.8-2.9%: not chased)
    assert (one & s3 & ~n1).sum() >= 24 and err[one & s3 & ~n1].max() < 0.05
    assert (err[one & s3 & ~n1] > 0.03).sum() <= 2
    # optimizer offload (20 first jobs): 13 within 0.2%, the 1.4B GPT at stage 3 with both offloads -2.8%
    # (2x1024, first job in t2) and -3.6% (the other key of that shape, first job in t8; its t3 row, a
    # later job, -3.2%: the same 11.61 GB reserved both times); the GPT at stage 2, N = 2 (two jobs),
    # -7.0%: rank 1 reserves more than the rank 0 simulated
    n2_stage2 = offload & (first["nproc"].astype(int) == 2) & (first["stage"].astype(int) == 2)
    assert offload.sum() >= 20 and (err[offload] < 0.002).sum() >= 13 and err[offload & ~n2_stage2].max() < 0.04
    assert n2_stage2.sum() == 2 and err[n2_stage2].max() < 0.08
    gas = first["gas"].astype(int) > 1
    assert gas.sum() == 4 and err[gas].max() < 0.001


def test_crossval_on_files_without_timed_rows_is_a_usage_error():
    """data/h200-n2.csv predates the whole-step timing: nothing to cross-validate, exit 2 and why."""
    from click.testing import CliRunner

    from validate.cli import main
    result = CliRunner().invoke(main, ["crossval", os.path.join(ROOT, "data", "h200-n2.csv")])
    assert result.exit_code == 2 and "0 GPU rows timed as training runs" in result.output


# The one HF row outside the targets: Falcon-7B ran transformers 5.17, whose Falcon hands SDPA one key/value head without enable_gqa and a
# materialised mask, which torch 2.11 runs on the math path (its first step cudaMallocs 4.19 GiB more);
# a later transformers repeats the head and runs cuDNN: reserved -14%. Traced under 5.17 it is exact
# (docs/hf-validation.md, data/README.md), so the row is open only under another transformers. Run again under
# 5.25 (h100-hf-types-falcon-7b-t525.csv, another key), its three jobs are within 0.3% allocated, reserved exact.
OPEN_HF = {"auto-falcon-h4544-l4-s2-bf16-n1-b2x1024-gas1-1cf67b3294"}
# Open (data/README.md, "405B and Mixtral at scale"): reserved of three runs of Mixtral-8x7B at stage 3, N = 256
# (allocated exact on all eight). Its warm-up history (data/snapshots/fake-moe/) reserves 17.72 GiB, as the
# allocator simulation over its own allocations does; two runs stayed there, three grew to 19.47-20.13 GiB in a
# later step, where a gathered expert weight's block came back after the next gather had asked for one (the
# run's timing: `fits.late_frees`). Alone on the GPU it reserved 17.72 GiB in three launches of three
# (h200-hf-fake6-mixtral-8x7b-alone-n256.csv, within 8% here). By (file, key): one key ran in several files.
OPEN_HF_STAGE3 = {("h200-hf-fake4-mixtral-8x7b-n256.csv", "auto-mixtral-h4096-l32-s3-bf16-n256fake-b1x4096-gas1-11914a3414"),
                  ("h200-hf-fake4-mixtral-8x7b-random-n256.csv", "auto-mixtral-h4096-l32-s3-bf16-n256fake-b1x4096-gas1-7cd9959c72"),
                  ("h200-hf-fake5-mixtral-8x7b-warmup-n256.csv", "auto-mixtral-h4096-l32-s3-bf16-n256fake-b1x4096-gas1-11914a3414")}


def test_hf_rows_peaks_within_3_and_8_percent():
    """Every H200 row of an HF config (data/h200-hf-*.csv, the step-time file's several-model process
    too) against what `zerocalc estimate --hf-config` predicts from the config alone (the config
    traced, its allocation stream simulated through the allocator beside DeepSpeed's side; a later job
    of a process after the jobs before it): peak allocated within 3% and reserved within 8% on every
    row but the `OPEN_HF` and `OPEN_HF_STAGE3` ones. Traces each config once (cached in the user's cache directory: minutes the first time)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from validate.docs import hf_peak_errors
    ok, err_a, err_r = hf_peak_errors()
    assert len(ok) >= 140 and err_a.notna().all() and err_r.notna().all()
    pd = pytest.importorskip("pandas")
    at = pd.Series(list(zip(ok["source"].map(os.path.basename), ok["key"])), index=ok.index)
    open_s3 = at.isin(OPEN_HF_STAGE3)
    open_ = (ok["key"].isin(OPEN_HF) & (not transformers.__version__.startswith("5.17"))) | open_s3
    assert (err_a[~open_] <= 0.03).all(), ok.loc[~open_ & (err_a > 0.03), ["hf_name", "stage", "path"]].to_string()
    assert (err_r[~open_] <= 0.08).all(), ok.loc[~open_ & (err_r > 0.08), ["hf_name", "stage", "path"]].to_string()
    assert ((err_a > 0.03) | (err_r > 0.08))[open_].all(), "now within target, drop from OPEN_HF"
    assert open_s3.sum() == 3 and (err_a[open_s3] <= 0.001).all()
    # State from the trace alone equals the measured on every row: the buffers by their dtypes (GPTBigCode's
    # bool causal mask; under zero.Init the YaRN inv_freq and DeepSeek's e_score_correction_bias fp32).
    # But Falcon-7B at stage 3 under transformers 5.25 on the GPU (h100-hf-types-falcon-7b-t525.csv): its two
    # rotary buffers (32 elements each) stayed fp32 under zero.Init (+128 B; the validator's own prediction
    # from the recorded tensors has them so), where 5.17 made them bf16 and the trace here makes them bf16.
    state_open = ok["key"] == "auto-falcon-h4544-l4-s3-bf16-n1-b2x1024-gas1-d4ed3d8560"
    assert (ok["measured_state_bytes"].astype(float) - ok["pred_state_bytes"])[state_open].tolist() == [128]
    assert (ok["pred_state_bytes"] == ok["measured_state_bytes"].astype(float))[~state_open].all()
    # And communication, stage 3's all-gathers included (DeepSpeed's hook order around dropouts, the reuse
    # rule around stage-3 leaves: tests/test_stage3_order.py).
    assert (ok["pred_comm_bytes"] == ok["measured_comm_bytes"].astype(float)).all()
    # The misses of the model types new to the rows (h200-hf-types-*.csv) that the CUDA kernels' rules
    # closed (`zerocalc.hf.cudaops`; data/README.md): attention dropout inside cuDNN's kernel and
    # dropout's bool mask (StarCoderBase-1B +24.2% allocated, Granite-MoE +22.5%, StarCoder2-3B +16.3%
    # reserved, Granite through Trainer +40.3%), Gemma-2B's own traced stream (one key/value head, -8.4%
    # reserved by the ratio), DeepSeek-V3's latent attention and leading dense layer (+2.2%): each
    # within 0.1% (allocated of the Trainer row, a later job of its process, 0.37%: its own peak leaves
    # out the cuBLAS workspaces an earlier job made, which the prediction of the job alone makes).
    closed = ok["key"].isin(["auto-gpt_bigcode-h2048-l24-s2-bf16-n1-b2x1024-gas1-2d279fcd9e",
                             "auto-granitemoe-h1024-l6-s2-bf16-n1-b2x1024-gas1-369940e7f2",
                             "auto-starcoder2-h3072-l10-s2-bf16-n1-b2x1024-gas1-bf7e1b6a82",
                             "auto-granite-trainer-h2048-l12-s2-bf16-n1-b2x1024-gas1-ac9403b896",
                             "auto-gemma-h2048-l8-s2-bf16-n1-b2x1024-gas1-ff3456483e",
                             "auto-deepseek_v3-h7168-l3-s2-bf16-n1-b2x1024-gas1-57c545c6ce"])
    assert closed.sum() == 6 and (err_a[closed] <= 0.004).all() and (err_r[closed] <= 0.001).all()
    # Qwen3-Next without checkpointing (a 16-layer shape, 2 x 2048, stages 2 and 3): -16.1% and -24.8% allocated
    # while its kept bytes were read within one of its gated delta rule's 64-token chunks; read past one
    # chunk (`memtrace.at_length`, data/README.md "Why the Qwen3-Next trace missed"), each within 2%.
    qwen3_next = ok["key"].isin(["auto-qwen3_next-h2048-l16-s2-bf16-n1-b2x2048-gas1-4901129540",
                                 "auto-qwen3_next-h2048-l16-s3-bf16-n8fake-b2x2048-gas1-e9e86c241d"])
    assert qwen3_next.sum() == 2 and (err_a[qwen3_next] <= 0.02).all() and (err_r[qwen3_next] <= 0.02).all()
    # Phi-2 at stage 2 with 4 x 2048 tokens: reserved was -10.6% (allocated exact) while dropout's output
    # was traced before its bool mask; CUDA's kernel allocates the mask first (`cudaops.ALLOCATION_ORDER`),
    # and with that order the row is within 0.1% (data/README.md, "Dropout's mask first").
    phi2 = ok["key"] == "auto-phi-h2560-l10-s2-bf16-n1-b4x2048-gas1-f6c9794420"
    assert phi2.sum() == 1 and (err_a[phi2] <= 0.001).all() and (err_r[phi2] <= 0.001).all()
    # The rows these once missed (data/README.md, "HF configs"), each now within 0.1%: Gemma-2 at stage 0
    # as a first job (was +15.5%: the tied embedding's gradients summed out of place), Gemma-2 with SDPA
    # (allocated was +3.2%: traced eager) and the StableLM-2 Trainer job after it in the step-time
    # process of h200-hf-time-a.csv (was +16.5%: simulated as a fresh process, the SDPA Gemma-2 job
    # before it not generated; that process's every row now within 0.1%),
    # and every stage-3 Trainer row at GAS 1 (was +0.8% to +3.9%: its one-weight buckets reduced as views;
    # at GAS 2, h200-hf-time-d.csv, reserved is -3.9%, within the target but not examined).
    gemma_s0 = ok["key"].isin(["auto-gemma2-h2304-l8-s0-bf16-n1-b2x1024-gas1-12cb35c5cd",
                               "auto-gemma2-h2304-l8-s0-bf16-n1-b2x1024-gas1-e85c5cf904"])
    sdpa_gemma = (ok["hf_model_type"] == "gemma2") & (ok["attention"] == "sdpa")
    time_file = ok["source"].str.contains("h200-hf-time-a")
    trainer_s3 = ((ok["path"] == "trainer") & (ok["stage"].astype(int) == 3) & (ok["gas"].astype(int) == 1)
                  & ~ok["source"].str.contains("h200-hf-types"))   # gpt_bigcode's, new, is -0.2%
    assert gemma_s0.sum() == 2 and sdpa_gemma.sum() == 4 and trainer_s3.sum() >= 12
    assert (err_r[gemma_s0 | time_file | trainer_s3] <= 0.001).all()
    assert (err_a[sdpa_gemma] <= 0.005).all() and (err_r[sdpa_gemma] <= 0.001).all()
