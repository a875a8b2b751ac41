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
