"""The CLI under random input: hypothesis draws a command (estimate, plan, sweep) and values for every
one of its options (read from the click command itself, so options added later are fuzzed too),
ordinary and hostile alike, and writes the ds_config, Hugging Face config and calibration files it
names. Whatever comes, zerocalc exits 0 or 2 (plan also 1 when nothing fits, as documented), prints
no traceback, writes valid JSON (no NaN or Infinity) with --format json, and answers within a
bound. About 10-20 s on two cores."""
import json
import os
import signal
import tempfile

import click
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerocalc.cli import main

NUMBERS = ["0", "1", "2", "3", "8", "-1", "7e9", "1e9", "125M", "1e400", "1e30", "1e15", "1e19", "nan", "inf",
           "-inf", "", "abc", "1.5", "9223372036854775808", "1e-3", " 4 ", "0x10", "1_000", "4096", "200000"]
SIZES = ["80GiB", "32GB", "80", "1e400GB", "0GiB", "nanGiB", "1.5TiB", "81920", "85899345920", "-1GiB", "1B"]
STAGES = ["0", "3", "2,3", "all", "4", "", "1,1", "x", "0,1,2,3"]
LISTS = ["1,8", "1e9,7e9", "", ",", "1e19", "0", "-1", "1,2,3", "nan", "1e9," * 3, "bf16", "fp16,fp32", "fp8"]
PATH_OPTIONS = {"ds_config": "ds.json", "hf_config": "config.json", "calibration_name": "cal.json", "out_path": "out.csv"}
BOOLISH = [True, False, "false", "yes", "auto", 1, 2, None, "x"]
INTISH = [0, 1, -1, 5e8, 500_000_000, "auto", "5e8", float("inf"), 2**70, 1.5, None, "3"]


def scalar(values):
    return st.sampled_from(values)


ds_config = st.fixed_dictionaries({}, optional={
    "train_micro_batch_size_per_gpu": scalar([1, 2, 0, "auto", -1, 2.5, "4", True]),
    "train_batch_size": scalar([8, 16, 0, "auto", 3, None]),
    "gradient_accumulation_steps": scalar([1, 2, 0, "auto"]),
    "fp16": st.fixed_dictionaries({}, optional={"enabled": scalar(BOOLISH), "loss_scale": scalar([0, -1, "x"])}),
    "bf16": st.one_of(st.none(), st.fixed_dictionaries({}, optional={"enabled": scalar(BOOLISH)})),
    "zero_optimization": st.one_of(scalar([True, 3, "x", None]), st.fixed_dictionaries({}, optional={
        "stage": scalar([0, 1, 2, 3, "3", 4, -1, "auto", 3.5]),
        "overlap_comm": scalar(BOOLISH), "contiguous_gradients": scalar(BOOLISH),
        "reduce_bucket_size": scalar(INTISH), "stage3_prefetch_bucket_size": scalar(INTISH),
        "stage3_param_persistence_threshold": scalar(INTISH), "stage3_max_live_parameters": scalar(INTISH),
        "stage3_max_reuse_distance": scalar(INTISH), "sub_group_size": scalar(INTISH),
        "offload_optimizer": scalar([None, {"device": "cpu"}, {"device": "nvme"}, {"device": "gpu"}, "cpu", {}]),
        "offload_param": scalar([None, {"device": "cpu"}, {"device": 1}]), "bogus": scalar([1])})),
    "optimizer": scalar([{"type": "AdamW"}, {"type": "SGD", "params": {"momentum": 0.9}}, {"type": 3},
                         {"type": "AdamW", "params": "lr=1e-4"}, [], "adam"]),
    "communication_data_type": scalar(["fp16", "bf16", "fp8", 1, None]),
    "data_types": scalar([{"grad_accum_dtype": "fp32"}, {"grad_accum_dtype": "int4"}, [], "x"]),
})
# model types the transcribed families read (others are traced with torch: zerocalc.hf, tested there)
hf_config = st.fixed_dictionaries({"model_type": scalar(["llama", "gpt2", "mistral", 7, "", None])}, optional={
    "vocab_size": scalar([32000, 50257, 0, -1, "32000", None, 1.5, 2**40]),
    "hidden_size": scalar([64, 4096, "4096", 0, None, 2**30]), "n_embd": scalar([64, "64", None]),
    "num_hidden_layers": scalar([2, 200000, 0, "2"]), "n_layer": scalar([2, -1, 10**6]),
    "num_attention_heads": scalar([4, 32, 0, 3]), "n_head": scalar([4, 3]),
    "num_key_value_heads": scalar([4, None, 0, 3]), "intermediate_size": scalar([256, 11008, None, "x"]),
    "tie_word_embeddings": scalar([True, False, "no", None]),
})


def file_text(kind):
    """Text for a file option: generated JSON, or a hostile file (a list, bytes, deep nesting, Hjson)."""
    hostile = scalar(["[1, 2]", "", "{", "[" * 5000 + "]" * 5000, '{"a": 1, "a": 2}', "null", "\udcff",
                      '{"time": {}}', '{\n // c\n "train_micro_batch_size_per_gpu": 1,\n}'])
    if kind == "ds.json":
        return st.one_of(ds_config.map(json.dumps), hostile)
    if kind == "config.json":
        return st.one_of(hf_config.map(json.dumps), hostile)
    if kind == "cal.json":
        return st.one_of(scalar(["shipped", "shipped-nan", "shipped-str"]), hostile)
    return st.none()


def option_values(opt: click.Option):
    """Values to draw for one option of a click command."""
    if opt.name in PATH_OPTIONS:
        return st.one_of(scalar(["@" + PATH_OPTIONS[opt.name], "@missing.json", "@"]),
                         scalar(["h200"] if opt.name == "calibration_name" else ["@" + PATH_OPTIONS[opt.name]]))
    if opt.is_flag or opt.secondary_opts:
        return scalar(["flag", "secondary"] if opt.secondary_opts else ["flag"])
    if isinstance(opt.type, click.Choice):
        return scalar(list(opt.type.choices) + ["bogus"])
    name = getattr(opt.type, "name", "")
    if name == "SIZE":
        return scalar(SIZES + NUMBERS[:6])
    if opt.name in ("stage_text",):
        return scalar(STAGES)
    if opt.name.endswith("_list"):
        return scalar(LISTS)
    return scalar(NUMBERS)


def command(name):
    cmd = main.commands[name]
    opts = [p for p in cmd.params if isinstance(p, click.Option) and p.name != "help"]
    # the model is named most of the time (else nearly every draw ends at "say what is trained")
    what = st.sampled_from([["--params", "1e9"], ["--model", "gpt2"], ["--model", "llama-2-7b"], ["--params", "7e9"],
                            []]) if name != "sweep" else st.just([])
    base = {"plan": ["--gpu", "h100", "--seq-len", "512", "--global-batch", "16"], "estimate": [], "sweep": []}[name]
    picks = st.lists(st.sampled_from(opts), max_size=6, unique_by=lambda o: o.name)

    def build(chosen):
        return st.tuples(*[option_values(o).map(lambda v, o=o: (o, v)) for o in chosen]) if chosen else st.just(())
    return st.tuples(st.just(name), what, st.just(base), picks.flatmap(build))


def argv(name, what, base, pairs):
    args = [name, *what, *base]
    for opt, value in pairs:
        if value == "flag":
            args.append(opt.opts[0])
        elif value == "secondary":
            args.append(opt.secondary_opts[0])
        else:
            args += [opt.opts[0], value]
    return args


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


LIMIT_S = 60    # an answer or a refusal takes ~0.1-5 s; this bounds a hang on a loaded two-core machine


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(command=st.sampled_from(["estimate", "estimate", "plan", "sweep"]).flatmap(command),
       files=st.fixed_dictionaries({k: file_text(k) for k in ("ds.json", "config.json", "cal.json")}))
def test_cli_never_crashes(command, files):
    from zerocalc import calibration
    with tempfile.TemporaryDirectory() as folder:
        for name, text in files.items():
            if text is None:
                continue
            if text.startswith("shipped"):
                cal = json.loads(json.dumps(calibration.default()))
                if text == "shipped-nan":
                    cal["time"]["efficiency"] = float("nan")
                elif text == "shipped-str":
                    cal["activations"] = "x"
                text = json.dumps(cal)
            with open(os.path.join(folder, name), "wb") as f:
                f.write(text.encode("utf-8", "surrogateescape"))
        args = [a.replace("@", folder + os.sep) if isinstance(a, str) else a for a in argv(*command)]
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(LIMIT_S)
        try:
            r = CliRunner().invoke(main, args)
        except Timeout:
            pytest.fail(f"no answer within {LIMIT_S} s: zerocalc {' '.join(args)}")
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    if isinstance(r.exception, Timeout):
        pytest.fail(f"no answer within {LIMIT_S} s: zerocalc {' '.join(args)}")
    shown = f"zerocalc {' '.join(map(str, args))}\n{r.output}"
    assert r.exception is None or isinstance(r.exception, SystemExit), shown + repr(r.exception)
    assert "Traceback" not in r.output, shown
    allowed = (0, 2, 1) if args[0] == "plan" else (0, 2)
    assert r.exit_code in allowed, shown
    if r.exit_code == 2:
        assert sum(ln.startswith("Error:") for ln in r.output.splitlines()) == 1, shown
    if r.exit_code == 0 and "json" in args and args[args.index("json") - 1] == "--format":
        json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"{c} in JSON: {shown}"))
