"""The ds_config file as DeepSpeed loads it (hjson with a duplicate-key check), and the fallback
when the hjson package is not installed: JSON with the comments and trailing commas real ds_configs
use, other Hjson refused with the package named. Errors name the key and the value."""
import sys

import pytest

from zerocalc import dsconfig

HJSON_TEXT = '{\n  // comment\n  "train_micro_batch_size_per_gpu": 1, # another\n  /* block */\n' \
             '  "zero_optimization": {"stage": 3, "overlap_comm": false,},\n}\n'
EXPECTED = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "overlap_comm": False}}


@pytest.fixture(params=["hjson", "fallback"])
def reader(request, monkeypatch):
    if request.param == "hjson":
        pytest.importorskip("hjson")
    else:
        monkeypatch.setitem(sys.modules, "hjson", None)    # import hjson raises ImportError
    return request.param


def test_comments_and_trailing_commas(reader):
    assert dsconfig.loads(HJSON_TEXT) == EXPECTED


def test_a_string_holding_comment_marks_is_kept(reader):
    assert dsconfig.loads('{"a": "x // y # z /* w */", "b": "q,}"}') == {"a": "x // y # z /* w */", "b": "q,}"}


@pytest.mark.parametrize("text, says", [
    ('{"zero_optimization": {"stage": 2, "stage": 3}}', "duplicate key 'stage'"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"a": 1} x', "not valid"),
    ("/*", "not valid"),                                      # hjson 3.1 raises IndexError here
    ('{"a": 1e400}', "not valid|too large"),                  # and OverflowError here
])
def test_refused_either_way(reader, text, says):
    with pytest.raises(dsconfig.DsConfigError, match=says):
        dsconfig.loads(text)


def test_the_fallback_names_hjson_for_the_rest(monkeypatch):
    monkeypatch.setitem(sys.modules, "hjson", None)
    with pytest.raises(dsconfig.DsConfigError, match="pip install hjson"):
        dsconfig.loads("{stage: 3}")                           # unquoted key: Hjson only
    with pytest.raises(dsconfig.DsConfigError, match="NaN is not a number DeepSpeed reads"):
        dsconfig.loads('{"reduce_bucket_size": NaN}')


@pytest.mark.parametrize("zero, says", [
    ({"stage": 4}, "zero_optimization.stage = 4: ZeRO stages are 0, 1, 2, 3"),
    ({"stage": "3", "overlap_comm": "maybe"}, 'zero_optimization.overlap_comm = "maybe": must be true or false'),
    ({"reduce_bucket_size": 1.5}, "zero_optimization.reduce_bucket_size = 1.5: must be a whole number"),
    ({"reduce_bucket_size": 1e19}, "too large"),
    ({"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}, "given twice"),
    ({"offload_optimizer": {"device": "CPU"}}, 'zero_optimization.offload_optimizer.device = "CPU"'),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "partial offloading needs ZeRO stage 3"),
    ({"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}, "cannot be given together"),
    ({"mics_shard_size": 2}, "removed in DeepSpeed 0.19.8"),
])
def test_zero_errors_name_key_and_value(zero, says):
    with pytest.raises(dsconfig.DsConfigError, match=None) as err:
        dsconfig.parse({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    assert says in str(err.value)


def test_pydantic_coercions_by_hand():
    """pydantic 2's lax mode as DeepSpeed's models use it: strings of digits for ints and the stage,
    yes/no/on/off/t/f/1/0 for booleans, an integral float for an int, the deprecated cpu_offload."""
    ds = dsconfig.parse({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": " 3 ", "overlap_comm": "off", "contiguous_gradients": "T", "reduce_bucket_size": "1_000",
        "stage3_max_live_parameters": 5e8, "cpu_offload": "yes", "sub_group_size": 0}})
    f = ds.fields
    assert (f["stage"], f["overlap_comm"], f["contiguous_gradients"]) == (3, False, True)
    assert (f["reduce_bucket_size"], f["max_live_parameters"]) == (1000, 500_000_000)
    assert f["offload_optimizer"] == "cpu"           # cpu_offload: true -> offload_optimizer cpu
    assert f["sub_group_size"] == 1                  # 0 and 1 both make one sub-group per parameter


def test_batch_follows_deepspeeds_rule():
    # train_batch_size 32 = micro 4 × gas 2 × 4 ranks; gas derived as 32 // 4 // 4 = 2
    assert dsconfig.resolve_batch(32, 4, None, 4) == (4, 2)
    # only train_batch_size: gas 1, micro = 32 // 8 = 4
    assert dsconfig.resolve_batch(32, None, None, 8) == (4, 1)
    with pytest.raises(dsconfig.DsConfigError, match="not divisible"):
        dsconfig.resolve_batch(10, 4, None, 8)        # 10 // 4 // 8 = 0 accumulation steps
    with pytest.raises(dsconfig.DsConfigError, match="neither train_batch_size"):
        dsconfig.resolve_batch(None, None, 2, 1, from_config=True)


def test_auto_under_one_spelling_and_a_value_under_the_other():
    """DeepSpeed drops "auto" values before pydantic reads the block, so the other spelling's value
    stands, and there is nothing left for Trainer's hidden-size fill (0.9 × 4096² = 15,099,494)."""
    ds = dsconfig.parse({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "prefetch_bucket_size": 1000, "stage3_prefetch_bucket_size": "auto"}}, hidden_size=4096)
    assert ds.fields["prefetch_bucket_size"] == 1000
    ds = dsconfig.parse({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "stage3_prefetch_bucket_size": "auto"}}, hidden_size=4096)
    assert ds.fields["prefetch_bucket_size"] == 15_099_494


def test_auto_is_dropped_inside_the_offload_blocks_too():
    """pydantic builds a nested model through its own __init__, which drops "auto" (DeepSpeed 0.19.8
    takes `offload_param.buffer_size: "auto"` as its default); a device left at "auto" is "none"."""
    ds = dsconfig.parse({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_size": "auto"},
        "offload_optimizer": {"device": "auto"}}})
    assert (ds.fields["offload_param"], ds.fields["offload_optimizer"]) == ("nvme", "none")
    assert ds.warnings == tuple(f'zero_optimization.{k} is "auto", which Trainer does not fill: DeepSpeed drops it '
                                "and uses its default" for k in ("offload_param.buffer_size", "offload_optimizer.device"))


def test_auto_in_a_key_without_effect_is_silent():
    # accelerate fills this one itself; either way it only decides what a checkpoint holds
    ds = dsconfig.parse({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto"}})
    assert ds.warnings == ()


def test_an_unknown_key_at_auto_is_dropped_before_it_is_checked():
    ds = dsconfig.parse({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "frobnicate": "auto"},
                         "compile": {"disable": "auto"}})
    assert ds.fields["stage"] == 2


@pytest.mark.parametrize("top, says", [
    # axolotl's torch_compile configs: DeepSpeed 0.19.8's CompileConfig has neither key
    ({"compile": {"disable": False, "backend": "inductor"}}, "compile.disable = false: DeepSpeed 0.19.8 has no such key"),
    ({"tensorboard": {"enabled": True, "outputpath": "tb"}}, "tensorboard.outputpath"),
    ({"timers": {"throughput": {"enabled": True, "sync": True}}}, "timers.throughput.sync"),
    ({"compile": None}, "compile = null: must be an object"),
])
def test_unknown_keys_of_deepspeeds_other_models_are_refused(top, says):
    with pytest.raises(dsconfig.DsConfigError) as err:
        dsconfig.parse({"train_micro_batch_size_per_gpu": 1, **top})
    assert says in str(err.value)


def test_bfloat16_auto_is_not_filled_by_trainer():
    """Trainer fills bf16.enabled, never the old name's: DeepSpeed drops the "auto" and bf16 is off."""
    ds = dsconfig.parse({"train_micro_batch_size_per_gpu": 1, "bfloat16": {"enabled": "auto"}})
    assert (ds.fields["dtype"], ds.dtype_auto) == ("fp32", ())
    assert ds.warnings == ('bfloat16.enabled is "auto", which Trainer does not fill (it fills bf16.enabled): '
                           'DeepSpeed drops it and leaves bf16 off; name the block "bf16" for Trainer to fill it',)
    assert dsconfig.parse({"train_micro_batch_size_per_gpu": 1, "bfloat16": {"enabled": True}}).fields["dtype"] == "bf16"


def test_trainer_fills_only_the_stage3_spellings():
    """Trainer looks up zero_optimization.stage3_prefetch_bucket_size and ...stage3_param_persistence_threshold;
    "auto" under the bare names is left for DeepSpeed to drop, which takes its defaults."""
    ds = dsconfig.parse({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "prefetch_bucket_size": "auto", "param_persistence_threshold": "auto"}}, hidden_size=4096)
    assert "prefetch_bucket_size" not in ds.fields and "param_persistence_threshold" not in ds.fields
    assert ds.warnings == (
        'zero_optimization.prefetch_bucket_size is "auto" and Trainer fills only its spelling '
        "stage3_prefetch_bucket_size: DeepSpeed's default 50,000,000 is used",
        'zero_optimization.param_persistence_threshold is "auto" and Trainer fills only its spelling '
        "stage3_param_persistence_threshold: DeepSpeed's default 100,000 is used")


def test_of_several_faults_the_one_deepspeed_reads_first_is_named():
    # DeepSpeed reads communication_data_type before zero_optimization, and that before the bf16 block
    cfg = {"train_micro_batch_size_per_gpu": 1, "communication_data_type": "bfp16",
           "zero_optimization": {"stage": 5}, "bfloat16": {"enabled": True, "loss_scale": 1.0}}
    for key in ("communication_data_type", "zero_optimization", "bfloat16"):
        with pytest.raises(dsconfig.DsConfigError, match=f"^{key}"):
            dsconfig.parse(cfg)
        cfg.pop(key)
