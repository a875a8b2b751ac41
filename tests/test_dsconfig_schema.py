"""Every key DeepSpeed 0.19.8's config reads is classified in `zerocalc.dskeys.KEYS`: the top-level keys
found by recording what `DeepSpeedConfig` looks up, the keys of the blocks it reads by hand the same way,
and every field and alias of its pydantic models, recursively. A key DeepSpeed adds fails here by name.
Then, by hand: a not-modelled key at a non-default value warns by name, a no-effect key is silent."""
import typing

import pytest

from zerocalc import dsconfig, dskeys


class Recording(dict):
    """A dict that notes every key looked up in it (`in`, [], get, `in d.keys()`) into `seen`."""

    def __init__(self, prefix, seen, items=()):
        super().__init__(items)
        self.prefix, self.seen = prefix, seen

    def __contains__(self, key):
        self.seen.add(self.prefix + str(key))
        return super().__contains__(key)

    def __getitem__(self, key):
        self.seen.add(self.prefix + str(key))
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(self.prefix + str(key))
        return super().get(key, default)

    def keys(self):
        outer = self

        class Keys:
            def __contains__(self, key):
                return outer.__contains__(key)

            def __iter__(self):
                return iter(dict.keys(outer))
        return Keys()

    def __copy__(self):   # DeepSpeedConfig reads a copy.copy of the dict
        return Recording(self.prefix, self.seen, self)


# Blocks read only once something is in them: the recording block starts with these.
SEEDS = {"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupLR"}, "expert_parallel": {"enabled": False}}


def looked_up(block=None):
    from deepspeed.runtime.config import DeepSpeedConfig
    seen = set()
    cfg = {"train_micro_batch_size_per_gpu": 1}
    if block:
        cfg[block] = Recording(block + ".", seen, SEEDS.get(block, {}))
    DeepSpeedConfig(Recording("", seen, cfg))
    return seen


def pydantic_blocks():
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.inference.config import WeightQuantConfig
    from deepspeed.monitor import config as monitor
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig
    return {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config,
            "bfloat16": DeepSpeedBF16Config, "comms_logger": CommsLoggerConfig, "compile": CompileConfig,
            "tensorboard": monitor.TensorBoardConfig, "wandb": monitor.WandbConfig, "csv_monitor": monitor.CSVConfig,
            "comet": monitor.CometConfig, "hybrid_engine": HybridEngineConfig, "tensor_parallel": TPTrainingConfig,
            "timers.throughput": DeepSpeedThroughputTimerConfig, "weight_quantization": WeightQuantConfig}


def fields(model, prefix):
    """Every field name and alias of a pydantic model, and of the models nested in it."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel
    for name, f in model.model_fields.items():
        for key in {name, f.alias or name}:
            yield prefix + key
            for sub in typing.get_args(f.annotation) or (f.annotation,):
                if isinstance(sub, type) and issubclass(sub, DeepSpeedConfigModel):
                    yield from fields(sub, prefix + key + ".")


def every_deepspeed_key():
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS
    top = looked_up() | {"sequence_parallel_size"}   # read only once torch.distributed is up
    keys = set(top)
    blocks = pydantic_blocks()
    for block, model in blocks.items():
        keys |= {block} | set(fields(model, block + "."))
    for block in sorted(top - set(blocks) - set(_REMOVED_TOP_LEVEL_CONFIG_KEYS)):
        try:
            keys |= looked_up(block)
        except (TypeError, AttributeError, ValueError):
            pass   # a scalar key (train_batch_size, ...): not a block to look into
    return keys


@pytest.mark.slow
def test_every_key_deepspeed_reads_is_classified():
    pytest.importorskip("deepspeed")
    keys = every_deepspeed_key()
    assert len(keys) > 250                     # the walk found the schema, not an empty dict
    assert "zero_optimization.stage3_prefetch_bucket_size" in keys and "activation_checkpointing.profile" in keys
    unclassified = sorted(k for k in keys if dskeys.lookup(k) is None)
    assert not unclassified, f"add to zerocalc/dskeys.py KEYS: {unclassified}"


@pytest.mark.slow
def test_refused_keys_are_deepspeeds_removed_ones():
    config = pytest.importorskip("deepspeed.runtime.config")
    removed = {k for k, (kind, default, _) in dskeys.KEYS.items() if kind == "refused" and default is None}
    assert removed == set(config._REMOVED_TOP_LEVEL_CONFIG_KEYS) | {
        f"zero_optimization.{k}" for k in config._REMOVED_ZERO_CONFIG_KEYS}


@pytest.mark.slow
def test_strict_blocks_are_deepspeeds_models():
    """zerocalc refuses an unknown key in each block DeepSpeed validates with a pydantic model: the
    ZeRO and precision blocks field by field (tests/test_dsconfig_deepspeed.py), the others here."""
    pytest.importorskip("deepspeed")
    blocks = pydantic_blocks()
    assert set(blocks) == set(dsconfig.STRICT_BLOCKS) | {"zero_optimization", "fp16", "bf16", "bfloat16"}
    for path, names in dsconfig.STRICT_BLOCKS.items():
        fields = blocks[path].model_fields
        assert set(names) == {key for n, f in fields.items() for key in (n, f.alias or n)}, path


def test_the_table_by_hand():
    assert dskeys.lookup("zero_optimization.stage3_max_live_parameters")[0] == "modelled"
    assert dskeys.lookup("flops_profiler.top_modules")[0] == "no_effect"          # under "flops_profiler.*"
    assert dskeys.lookup("data_efficiency.data_routing.random_ltd.enabled")[0] == "not_modelled"
    assert dskeys.lookup("data_efficiency.data_routing.random_ltd.layer_num")[0] == "no_effect"
    assert dskeys.lookup("zero_optimization.frobnicate") is None


def parse(**top):
    return dsconfig.parse({"train_micro_batch_size_per_gpu": 1, **top})


@pytest.mark.parametrize("top, named", [
    ({"zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": True}},
     "zero_optimization.stage3_use_all_reduce_for_fetch_params = true"),
    ({"zero_optimization": {"stage": 2, "reduce_scatter": False}}, "zero_optimization.reduce_scatter = false"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "zero_optimization.offload_optimizer.ratio = 0.3"),
    ({"data_types": {"param_dtype": "bf16"}}, 'data_types.param_dtype = "bf16"'),
    ({"compile": {"deepcompile": True}}, "compile.deepcompile = true"),
    ({"sequence_parallel_size": 4}, "sequence_parallel_size = 4"),
    ({"data_efficiency": {"data_routing": {"random_ltd": {"enabled": True}}}},
     "data_efficiency.data_routing.random_ltd.enabled = true"),
])
def test_a_not_modelled_key_off_its_default_is_named(top, named):
    assert f"{named} is not modelled: the answer is DeepSpeed's default's" in parse(**top).warnings


@pytest.mark.parametrize("top", [
    # the not-modelled keys above at DeepSpeed's defaults: nothing to say
    {"zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": False, "reduce_scatter": True}},
    {"compile": {"deepcompile": False, "offload_opt_states": True}},   # DeepCompile's passes, DeepCompile off
    {"sequence_parallel_size": 1, "data_types": {"param_dtype": None}},
    # no effect on memory or traffic
    {"gradient_clipping": 1.0, "steps_per_print": 10, "wall_clock_breakdown": True},
    {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}},
    {"tensorboard": {"enabled": True, "output_path": "tb"}, "flops_profiler": {"enabled": True}},
    {"activation_checkpointing": {"number_checkpoints": 4, "profile": True}},
    {"aio": {"block_size": 262144, "queue_depth": 32}},
])
def test_keys_at_default_or_without_effect_are_silent(top):
    assert parse(**top).warnings == ()


def test_an_unknown_key_in_a_hand_read_block_is_named():
    # DeepSpeed reads activation_checkpointing by hand and ignores a misspelt key in it
    assert parse(activation_checkpointing={"partition_activation": True}).warnings == (
        "unknown key activation_checkpointing.partition_activation ignored (DeepSpeed ignores it too)",)


def test_legacy_stage1_true_is_refused():
    with pytest.raises(dsconfig.DsConfigError, match="zero_optimization.legacy_stage1 = true"):
        parse(zero_optimization={"stage": 1, "legacy_stage1": True})
    assert parse(zero_optimization={"stage": 1, "legacy_stage1": False}).warnings == ()
