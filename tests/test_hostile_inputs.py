"""Mistaken and hostile input to `estimate`, `plan` and `sweep`: each answers with exit code 2 and one
line naming what to fix, or with the reading DeepSpeed 0.19.8 itself gives the input. One table, one
row per case; files are written into a temporary folder first."""
import errno
import json
import os

import pytest
from click.testing import CliRunner

from zerocalc.cli import main

LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 2,
         "num_attention_heads": 32, "intermediate_size": 11008}
FILES = {
    "infinity.json": '{"train_micro_batch_size_per_gpu": 1,\n "zero_optimization": {"reduce_bucket_size": Infinity\n}}',
    "nan.json": '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {\n"reduce_bucket_size": NaN\n}}',
    "deep.json": "[" * 100_000 + "]" * 100_000,
    "opt_params.json": '{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": "lr=1e-4"}}',
    "no_ffn.json": json.dumps({k: v for k, v in LLAMA.items() if k != "intermediate_size"}),
    "hidden_str.json": json.dumps({**LLAMA, "hidden_size": "4096"}),
    "vocab_null.json": json.dumps({**LLAMA, "vocab_size": None}),
    "layers_huge.json": json.dumps({**LLAMA, "num_hidden_layers": 200_000}),
    "list.json": "[1, 2]",
    "llama_widths.json": json.dumps({**LLAMA, "intermediate_size": [11008, 11008]}),
    "gemma3n_widths.json": json.dumps({"model_type": "gemma3n_text", "intermediate_size": [16384, 16384.5]}),
    "cal_time_only.json": '{"time": {}}',
    "fp16_false.json": '{"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": "false"}}',
    "fp16_bf16.json": '{"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": true}, "bf16": {"enabled": true}}',
    "micro0.json": '{"train_micro_batch_size_per_gpu": 0}',
    "gas0.json": '{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 0}',
    "tbs0.json": '{"train_batch_size": 0}',
    "dup_stage.json": '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "stage": 3}}',
    "negative.json": '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, '
                     '"stage3_max_live_parameters": -1}}',
    "zero_bucket.json": '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"reduce_bucket_size": 0}}',
    "unknown_zero.json": '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "stagee": 1}}',
    "stage4.json": '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 4}}',
    "hjson.json": '{\n  // HF-style comments\n  "train_micro_batch_size_per_gpu": 1, # and shell ones\n'
                  '  "zero_optimization": {"stage": "3", "overlap_comm": "yes",},\n  /* block */\n}\n',
    "stage2_no_overlap.json": '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, '
                              '"overlap_comm": "no"}}',
    "no_batch.json": '{"zero_optimization": {"stage": 2}}',
    "trainer_auto.json": json.dumps({"train_micro_batch_size_per_gpu": "auto", "fp16": {"enabled": "auto"},
                                     "bf16": {"enabled": "auto"}, "zero_optimization": {
                                         "stage": 3, "reduce_bucket_size": "auto",
                                         "stage3_prefetch_bucket_size": "auto"}}),
}


@pytest.fixture
def files(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "latin1.json").write_bytes('{"zero_optimization": {"stage": "drei\xdf"}}'.encode("latin-1"))
    return tmp_path


def invoke(args, folder):
    args = [a.replace("@", str(folder) + os.sep) for a in args]
    return CliRunner().invoke(main, args)


E = ["estimate", "--params", "1e9"]
EG = ["estimate", "--model", "gpt2", "--gpu", "h100", "--seq-len", "512"]
P = ["plan", "--gpu", "h100", "--seq-len", "4096", "--global-batch", "1024"]

CASES = [
    # numbers at the edge
    (["estimate", "--params", "1e400"], 2, "'1e400' is far too large for a parameter count"),
    (["estimate", "--params", "1e30"], 2, "above zerocalc's limit of 1,000,000,000,000,000"),
    (["estimate", "--params", "nan"], 2, "cannot read 'nan' as a parameter count"),
    (P + ["--params", "1e15"], 2, "has 1,720 layers, above zerocalc's limit of 256"),
    (P + ["--params", "1e30"], 2, "above zerocalc's limit of 1,000,000,000,000,000"),
    (["estimate", "--model", "gpt2", "--num-layers", "200000"], 2, "--num-layers = 200,000 is above zerocalc's limit"),
    (["estimate", "--hf-config", "@layers_huge.json"], 2, "num_hidden_layers = 200,000 is above zerocalc's limit"),
    (E + ["--gpu-memory", "80"], 2, "'80' has no unit: write 80GiB (2^30 bytes) or 80GB (1e9 bytes)"),
    (E + ["--dp", "3", "--nodes", "2", "--gpus-per-node", "8"], 2, "--dp 3 contradicts --nodes 2 × --gpus-per-node 8"),
    (E + ["--dp", "0"], 2, "must be at least 1"),
    (EG + ["--host-launch-us", "nan"], 2, "--host-launch-us must be a finite number, got nan"),
    (EG + ["--peak-tflops", "nan"], 2, "--peak-tflops must be a finite number, got nan"),
    (EG + ["--peak-tflops", "inf"], 2, "--peak-tflops must be a finite number, got inf"),
    (E + ["--micro-batch", "0"], 2, "must be at least 1"),
    (E + ["--gas", "0"], 2, "must be at least 1"),
    (["sweep", "--params", ""], 2, "give at least one value"),
    (["sweep", "--params", "1e19"], 2, "above zerocalc's limit of 1,000,000,000,000,000"),
    (["sweep", "--params", "1e9", "--out", "@missing/dir/out.csv"], 2, "does not exist"),
    (["sweep", "--params", "99"], 2, "needs at least 100 parameters"),     # 100 equal tensors: P = 99 gave NaN
    (["sweep", "--params", "1e9", "--dp", "1,2,3,4,5,6,7,8,9,10", "--gas", ",".join(map(str, range(1, 1001))),
      "--stage", "0,1,2,3", "--dtype", "bf16,fp32"] + ["--params", ",".join(str(10**9 + i) for i in range(300))],
     2, "a sweep writes at most"),
    # files
    (E + ["--ds-config", "@infinity.json"], 2, 'infinity.json: zero_optimization.reduce_bucket_size = "Infinity"'),
    (E + ["--ds-config", "@nan.json"], 2, 'nan.json: zero_optimization.reduce_bucket_size = "NaN"'),
    (E + ["--ds-config", "@deep.json"], 2, "deep.json: nested too deeply"),
    (E + ["--ds-config", "@opt_params.json"], 2, 'optimizer.params = "lr=1e-4": must be an object'),
    (E + ["--ds-config", "@list.json"], 2, "list.json: a ds_config is a JSON object"),
    (E + ["--ds-config", "@latin1.json"], 2, "latin1.json: not UTF-8 text (byte 0xdf"),
    (E + ["--ds-config", "@nothere.json"], 2, "cannot read ds_config"),
    (["estimate", "--hf-config", "@no_ffn.json"], 2, 'no_ffn.json: no "intermediate_size" key'),
    (["estimate", "--hf-config", "@hidden_str.json"], 2, 'hidden_str.json: hidden_size = "4096": must be a whole number'),
    (["estimate", "--hf-config", "@vocab_null.json"], 2, "vocab_null.json: vocab_size = null: must be a whole number"),
    (["estimate", "--hf-config", "@list.json"], 2, "list.json: a Hugging Face config.json is a JSON object"),
    # a width per layer: a model type of its own code may have them (Gemma 3n's), each a whole number; a
    # family read by hand (Llama's) has one
    (["estimate", "--hf-config", "@llama_widths.json"], 2, "intermediate_size = [11008, 11008]: must be a whole number"),
    (["estimate", "--hf-config", "@gemma3n_widths.json"], 2,
     "intermediate_size = [16384, 16384.5]: must be whole numbers (JSON integers)"),
    (["estimate", "--hf-config", "@latin1.json"], 2, "latin1.json: not UTF-8 text"),
    (EG + ["--calibration", "@cal_time_only.json"], 2, 'no "activations" section'),
    (EG + ["--calibration", "@list.json"], 2, "list.json: a calibration is a JSON object"),
    (EG + ["--calibration", "h100"], 2, "no shipped calibration 'h100'"),
    # ds_config as DeepSpeed reads it
    (E + ["--ds-config", "@fp16_bf16.json"], 2, "fp16.enabled and bf16.enabled are both true"),
    (E + ["--ds-config", "@micro0.json"], 2, "train_micro_batch_size_per_gpu = 0: must be at least 1"),
    (E + ["--ds-config", "@gas0.json"], 2, "gradient_accumulation_steps = 0: must be at least 1"),
    (E + ["--ds-config", "@tbs0.json"], 2, "train_batch_size = 0: must be at least 1"),
    (E + ["--ds-config", "@dup_stage.json"], 2, "dup_stage.json: duplicate key 'stage'"),
    (E + ["--ds-config", "@negative.json"], 2, "zero_optimization.stage3_max_live_parameters = -1: must be at least 0"),
    (E + ["--ds-config", "@zero_bucket.json"], 2, "zero_optimization.reduce_bucket_size = 0: must be greater than 0"),
    (E + ["--ds-config", "@unknown_zero.json"], 2, "zero_optimization.stagee = 1: DeepSpeed 0.19.8 has no such key"),
    (E + ["--ds-config", "@stage4.json"], 2, "stage4.json: zero_optimization.stage = 4: ZeRO stages are 0, 1, 2, 3"),
    (E + ["--ds-config", "@no_batch.json"], 2, "neither train_batch_size nor train_micro_batch_size_per_gpu"),
    (E + ["--ds-config", "@no_batch.json", "--micro-batch", "2"], 0, "N = 1"),
    (E + ["--ds-config", "@hjson.json"], 0, "zero.Init: off"),
]


@pytest.mark.parametrize("args, code, says", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_hostile_input(files, args, code, says):
    r = invoke(args, files)
    assert r.exit_code == code, r.output
    assert says in r.output
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    if code == 2:
        errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
        assert len(errors) == 1 and says in errors[0]


def estimate_json(files, *args):
    r = invoke(["estimate", "--params", "1e9", "--format", "json", *args], files)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_deepspeed_coercions_are_deepspeeds(files):
    """hjson comments and trailing commas, "stage": "3", "overlap_comm": "yes"/"no" and
    "enabled": "false" read as DeepSpeed's pydantic models read them (checked against DeepSpeed
    itself in test_dsconfig_deepspeed.py)."""
    doc = estimate_json(files, "--ds-config", "@hjson.json")
    assert [e["stage"] for e in doc["estimates"]] == [3] and doc["inputs"]["overlap_comm"] is True
    doc = estimate_json(files, "--ds-config", "@stage2_no_overlap.json")
    assert [e["stage"] for e in doc["estimates"]] == [2] and doc["inputs"]["overlap_comm"] is False
    # "false" is false: neither fp16 nor bf16 is enabled, so DeepSpeed trains in fp32
    assert estimate_json(files, "--ds-config", "@fp16_false.json")["inputs"]["dtype"] == "fp32"


def test_trainer_config_takes_zero_init_and_says_which_dtype(files):
    """A ds_config with "auto" values is HF Trainer's: stage 3 is built under zero.Init unless
    --no-zero-init; fp16 and bf16 both "auto" is one dtype, named with the reason."""
    args = ["--model", "llama-2-7b", "--dp", "8", "--micro-batch", "1", "--ds-config", "@trainer_auto.json"]
    doc = json.loads(invoke(["estimate", *args, "--format", "json"], files).stdout)
    assert doc["inputs"]["zero_init"] is True and doc["inputs"]["dtype"] == "bf16"
    assert doc["inputs"]["reduce_bucket_size"] == 4096 * 4096                 # Trainer's h²
    off = json.loads(invoke(["estimate", *args, "--no-zero-init", "--format", "json"], files).stdout)
    assert off["inputs"]["zero_init"] is False
    # zero.Init removes the whole-tensor copy at init: the init phase is lower with it
    assert doc["estimates"][0]["peak_bytes"] <= off["estimates"][0]["peak_bytes"]
    table = invoke(["estimate", *args], files).output
    assert "taken as bf16" in table and "taken as enabled" not in table
    assert "zero.Init: on (default for a ds_config with HF Trainer \"auto\" values" in table
    fp16 = invoke(["estimate", *args, "--dtype", "fp16"], files).output
    assert "taken as fp16 (--dtype)" in fp16


def test_zero_init_default_is_stated_in_help_and_output():
    for cmd in ("estimate", "plan"):
        h = CliRunner().invoke(main, [cmd, "--help"]).output
        assert "--zero-init / --no-zero-init" in h and "[default:" in h.split("--zero-init / --no-zero-init")[1][:400]
    r = CliRunner().invoke(main, ["estimate", "--params", "1e9", "--stage", "3", "--dp", "2"])
    assert "zero.Init: off (default" in r.output
    r = CliRunner().invoke(main, ["plan", "--model", "gpt2", "--gpu", "h100", "--seq-len", "512", "--global-batch", "8",
                                  "--max-gpus", "2", "--zero-init", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert all(c["zero_init"] for c in json.loads(r.stdout)["ranked"])


def test_a_full_disk_leaves_no_half_written_sweep(tmp_path, monkeypatch):
    import csv
    real = csv.writer

    class Full:
        def __init__(self, f, **kw):
            self.w = real(f, **kw)

        def writerow(self, row):
            self.w.writerow(row)

        def writerows(self, rows):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(csv, "writer", Full)
    out = tmp_path / "sweep.csv"
    r = CliRunner().invoke(main, ["sweep", "--params", "1e9", "--out", str(out)])
    assert r.exit_code == 2 and "cannot write" in r.output and "No space left on device" in r.output
    assert os.listdir(tmp_path) == []          # neither the target nor the temporary file


def test_reserved_is_never_below_allocated_at_a_million_tokens():
    """7B Llama, 1M tokens, stage 2: the replayed allocation sequence allocates 2.5% less than the
    closed-form peak there; reserved follows the larger."""
    r = CliRunner().invoke(main, ["estimate", "--model", "llama-2-7b", "--dp", "8", "--stage", "2", "--seq-len",
                                  "1048576", "--format", "json"])
    e = json.loads(r.stdout)["estimates"][0]
    assert e["peak_reserved_bytes"] >= e["peak_bytes"]
    assert e["peak_reserved_worst_bytes"] >= e["peak_reserved_bytes"]


@pytest.mark.parametrize("command", ["report", "fit", "crossval", "host"])
def test_validate_without_pandas_says_how_to_get_it(tmp_path, command):
    """pandas comes with the validate extra, not with zerocalc: without it, one line and exit 2."""
    import subprocess
    import sys
    rows = tmp_path / "rows.csv"
    rows.write_text("key,outcome\nk,ok\n")
    code = ("import sys; sys.modules['pandas'] = None; from validate.cli import main; "
            f"main([{command!r}, {str(rows)!r}])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"Error: `python -m validate {command}` needs pandas: pip install "
                                "'zerocalc[validate]' (or pip install pandas)")


def test_report_on_one_row_prints_only_the_tables_it_has_rows_for(tmp_path):
    """A fake-world row has state, comm and peaks but no step time: no empty step-time tables."""
    from validate.report import report
    one = tmp_path / "one.csv"
    with open("data/h200-fake-a-n256.csv") as f:
        one.write_text("".join(f.readlines()[:2]))
    text, _ = report([str(one)])
    assert "Resident state bytes" in text and "Step time on the fitted hosts" not in text
    for i, line in enumerate(text.splitlines()):
        if line.startswith("stage  rows"):
            assert text.splitlines()[i + 1][:5].strip().isdigit(), line   # a header is followed by a row


def test_a_width_per_layer_of_whole_numbers_is_read_for_a_model_of_its_own_code():
    """Gemma 3n's text config gives `intermediate_size` per layer: accepted where the model is read from
    its code (its trace builds what the list says), each entry range-checked."""
    from zerocalc.inputs import InputError, check_hf_config
    d = {"model_type": "gemma3n_text", "intermediate_size": [16384] * 35}
    assert check_hf_config(d) is d
    with pytest.raises(InputError, match="intermediate_size"):
        check_hf_config({"model_type": "gemma3n_text", "intermediate_size": [16384, 0]})
