"""The tracer (`zerocalc.hf.trace`, the `trace` extra) against torch: for each model type a tiny
config is built for real on the CPU and on fake tensors; the traced parameter tensors (names, shapes,
`parameters()` order, tied once) and each module's own tensors equal the real model's, and the
recorded forward calls use every parameter. Tiny configs (hidden 32, 2 layers, 96 tokens of
vocabulary): about a second per model type on a loaded core, so all but four are marked slow."""
import functools
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from zerocalc import profile as P  # noqa: E402
from zerocalc.hf import trace as T  # noqa: E402
from zerocalc.model import from_profile  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, head_dim=8, moe_intermediate_size=16, num_experts=4, num_local_experts=4,
             n_routed_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=16, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, n_shared_experts=1, n_group=1, topk_group=1,
             n_embd=32, n_layer=2, n_head=4, n_inner=48, n_positions=64)
FAST = ["llama", "gpt2", "mixtral", "qwen2"]
SLOW = ["mistral", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "phimoe",
        "olmo", "olmo2", "olmoe", "gpt_neox", "gpt_bigcode", "bloom", "opt", "starcoder2", "stablelm", "cohere",
        "cohere2", "granite", "granitemoe", "granitemoeshared", "glm", "glm4", "glm4_moe", "helium", "smollm3",
        "exaone4", "ernie4_5", "ernie4_5_moe", "arcee", "apertus", "bitnet", "nemotron", "persimmon", "seed_oss",
        "hunyuan_v1_dense", "hunyuan_v1_moe", "dots1", "gpt_oss", "llama4_text", "ministral", "lfm2", "minimax"]


def _check(model_type):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    cfg = CONFIG_MAPPING[model_type](**SMALL)
    real = AutoModelForCausalLM.from_config(cfg)
    p = T.trace(cfg.to_dict(), activations=False, steps=False)   # the tensors and calls only (the activations
    # and allocation stream: tests/test_memtrace.py, test_stream.py; the step counts: test_optrace.py)
    assert [(t.name, t.shape) for t in p.params] == [(n, tuple(x.shape)) for n, x in real.named_parameters()]
    index = {id(x): i for i, (_, x) in enumerate(real.named_parameters())}
    own = {name: tuple(sorted(index[id(x)] for _, x in m.named_parameters(recurse=False)))
           for name, m in real.named_modules()}
    assert {m.name: m.params for m in p.modules} == own
    spec = from_profile(p)
    assert {i for step in spec.trace for i in step} == set(range(len(p.params)))
    assert P.from_json(P.to_json(p)) == p


@pytest.mark.parametrize("model_type", FAST)
def test_traced_tensors_equal_torchs(model_type):
    _check(model_type)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SLOW)
def test_traced_tensors_equal_torchs_for_every_family(model_type):
    _check(model_type)


def test_a_buffer_keeps_its_dtype_under_zero_init_where_deepspeed_leaves_it():
    """Each buffer's dtype as built and, where it is not the training dtype, under DeepSpeed's zero.Init
    (`trace.zero_init_kept`): Llama's default rotary `inv_freq` is an `arange` in float, which zero.Init's
    constructors make bf16; Llama 3's is computed from an integer `arange` after them and stays fp32;
    DeepSeek-V3's `e_score_correction_bias` is listed in `_keep_in_fp32_modules_strict`, which DeepSpeed
    keeps fp32; GPTBigCode's causal mask is bool, untouched."""
    def dtypes(cfg):
        p = T.trace(cfg.to_dict(), activations=False, steps=False)
        assert P.from_json(P.to_json(p)).buffers == p.buffers
        return {b.name.rsplit(".", 1)[-1]: (b.dtype, b.zero_init_dtype) for b in p.buffers}
    small = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
    assert dtypes(transformers.LlamaConfig(**small)) == {"inv_freq": ("float32", ""), "original_inv_freq": ("float32", "")}
    llama3 = transformers.LlamaConfig(**small, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    assert dtypes(llama3) == {"inv_freq": ("float32", "float32"), "original_inv_freq": ("float32", "float32")}
    deepseek = transformers.DeepseekV3Config(**small, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                             n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                                             kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    assert dtypes(deepseek)["e_score_correction_bias"] == ("float32", "float32")
    bigcode = transformers.GPTBigCodeConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            bos_token_id=0, eos_token_id=0)
    assert dtypes(bigcode) == {"bias": ("bool", "")}


def _phimoe_longrope(**rope):
    """A tiny Phi-3.5-MoE with LongRoPE as its Hub file has it: factors per rotary frequency (head 8: 4),
    the scale picked by the positions (`short_mscale` up to `original_max_position_embeddings`)."""
    return transformers.PhimoeConfig(**{**SMALL, "max_position_embeddings": 64, "original_max_position_embeddings": 32,
                                        "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3],
                                                         "long_factor": [1.5, 2.0, 3.0, 4.0], "short_mscale": 1.2,
                                                         "long_mscale": 1.3, **rope}}).to_dict()


@pytest.mark.slow
def test_a_rotary_embedding_that_branches_on_its_positions_is_traced(monkeypatch):
    """Phi-3.5-MoE's rotary embedding picks its LongRoPE scale in Python from `torch.max(position_ids) + 1`:
    a fake tensor holds no value to branch on, so the trace hands each rotary embedding position ids
    whose values it knows (`trace.known_positions`, 0 … s − 1). Without that the forward cannot run."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    p = T.trace(_phimoe_longrope())
    assert "untraced" not in p.source and p.stream and p.steps and p.activations
    monkeypatch.setattr(T, "known_positions", lambda model: None)
    with pytest.raises(DataDependentOutputException):
        T.trace(_phimoe_longrope(), activations=False, steps=False)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["llama", "phi3"])
def test_known_positions_add_no_operator_and_no_byte(config, monkeypatch):
    """Where the code does not branch on the positions (Llama's rotary embedding; Phi-3's LongRoPE, which
    picks its factors with `torch.where`), the profile is the same with and without known positions:
    the same tensor is marked known, nothing is allocated or dispatched for it."""
    d = (transformers.LlamaConfig(**SMALL) if config == "llama" else transformers.Phi3Config(**{
        **SMALL, "max_position_embeddings": 64, "original_max_position_embeddings": 32,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [1.5, 2.0, 3.0, 4.0]}
    })).to_dict()
    known = P.to_json(T.trace(d))
    monkeypatch.setattr(T, "known_positions", lambda model: None)
    assert known == P.to_json(T.trace(d))


@pytest.mark.slow
def test_a_multimodal_model_is_traced_as_its_text_model_beside_a_vision_tower():
    """Gemma 3's Hub files above 1B are the text model (`text_config`) and a SigLIP vision tower, whose
    encoder layers are `GradientCheckpointingLayer`s too. A batch of tokens runs the text model only: its
    3 decoder layers are the profile's layers (`trace.decoder_layer`), the shallow copies cut its
    `text_config` (`memtrace.stack`, `_shallow`), and the kept bytes, stream and operators are traced, the
    kept bytes those of the text model alone; the tower's and projector's tensors are the parameters added."""
    from zerocalc.hf import memtrace
    text = {**{k: SMALL[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                     "intermediate_size", "head_dim", "pad_token_id", "bos_token_id", "eos_token_id")},
            "num_hidden_layers": 3, "max_position_embeddings": 64, "sliding_window": 16}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    d = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4).to_dict()
    assert memtrace.stack(d) == (3, 0) and memtrace._shallow(d, 2)["text_config"]["num_hidden_layers"] == 2
    both, alone = T.trace(d), T.trace({**text, "model_type": "gemma3_text"})
    assert "untraced" not in both.source and both.stream and both.steps
    assert sum(m.layer for m in both.modules) == 3
    assert both.activations == alone.activations
    added = {t.name for t in both.params} - {"model.language_model." + t.name.removeprefix("model.") for t in alone.params}
    assert added and all(n.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for n in added)


@pytest.mark.slow
def test_the_trace_prints_only_zerocalcs_own_lines(tmp_path):
    """What transformers warns of while a config is traced (LongRoPE's `short_mscale`, a token id past a
    tiny vocabulary) and torch's logged traceback of an operator the fake tensors could not run (CodeGen's
    rotary width past its head width) stay off the terminal: an estimate prints its notes, a failure one
    Error line."""
    def run(d):
        f = tmp_path / "config.json"
        f.write_text(json.dumps(d))
        return subprocess.run([sys.executable, "-m", "zerocalc.cli", "estimate", "--hf-config", str(f), "--dp", "8"],
                              capture_output=True, text=True, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "c")})
    ok = run(_phimoe_longrope())
    assert ok.returncode == 0 and "[transformers]" not in ok.stderr
    assert all(line.startswith("note: ") for line in ok.stderr.splitlines())
    bad = run(transformers.CodeGenConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                         rotary_dim=64).to_dict())
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "[transformers]" not in bad.stderr
    assert [line for line in bad.stderr.splitlines() if line.startswith("Error: ")] and "fake_tensor.py" not in bad.stderr


def test_a_module_cast_while_the_model_is_built_is_cast_in_place():
    """DeepSeek-V4 builds its attention's norms as `RMSNorm(...).to(torch.float32)`. Torch swaps a fake
    parameter for its cast, which the fake tensor's weak reference forbids ("Couldn't swap"); the build
    casts it in place instead (`trace._casts_in_place`), as a real module's is: the same parameter, fp32."""
    cfg = transformers.DeepseekV4Config(vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
                                        num_attention_heads=4, head_dim=16, q_lora_rank=16, n_routed_experts=4,
                                        num_experts_per_tok=2, o_groups=2, o_lora_rank=16, index_n_heads=2,
                                        index_head_dim=16, index_topk=8, sliding_window=8, max_position_embeddings=64,
                                        num_nextn_predict_layers=0)
    model, _ = T.build(cfg)
    norm = model.model.layers[0].self_attn.q_a_norm.weight
    assert norm.dtype == torch.float32 and model.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert T.trace(cfg.to_dict(), activations=False, steps=False).num_params == sum(p.numel() for p in model.parameters())
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(), pytest.raises(RuntimeError, match="Couldn't swap"):
        torch.nn.Linear(4, 4, dtype=torch.bfloat16).to(torch.float32)
    with FakeTensorMode(), T._casts_in_place():
        linear = torch.nn.Linear(4, 4, dtype=torch.bfloat16)
        weight = linear.weight
        assert linear.to(torch.float32).weight is weight and weight.dtype == torch.float32


@pytest.mark.slow
def test_a_model_without_attention_heads_is_estimated_from_its_trace(tmp_path, monkeypatch):
    """Falcon-Mamba has no attention heads: its architecture's heads are None, so no Llama formula
    applies, and its kept activations come from its trace, which is read in bf16/fp16; in fp32 the
    estimate says so and exits 2 (the formulas need the heads), never a traceback."""
    from click.testing import CliRunner
    from zerocalc.cli import main
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    f = tmp_path / "config.json"
    f.write_text(json.dumps(transformers.FalconMambaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                                           state_size=4, expand=2, conv_kernel=4).to_dict()))
    args = ("estimate", "--hf-config", str(f), "--dp", "8", "--stage", "2,3", "--seq-len", "64")
    ok = CliRunner().invoke(main, args)
    assert ok.exit_code == 0 and "activations: the layers' and the head's kept tensors traced" in ok.stderr
    fp32 = CliRunner().invoke(main, (*args, "--dtype", "fp32"))
    assert fp32.exit_code == 2 and "without attention heads has no formula for fp32" in fp32.output
    assert "Traceback" not in fp32.output
    # where its code's kept tensors could not be read at all (xLSTM's), that is what is said, and why
    from dataclasses import replace
    from zerocalc import activations
    from zerocalc.training import Setup
    p = T.cached_trace(json.loads(f.read_text()))
    unread = replace(p, activations=None, source={**p.source, "untraced": {"activations": "RuntimeError: x"}})
    with pytest.raises(ValueError, match=r"could not be read from its code \(RuntimeError: x\), and a model without"):
        activations.breakdown(from_profile(unread), Setup(seq_len=64))


def test_a_module_the_model_makes_while_it_runs_is_not_a_call():
    """BigBird, asked for block-sparse attention over a sequence too short for it, makes a full-attention
    module during its forward and calls it: not one of the model's modules, so DeepSpeed hooks none;
    the calls under it stand in its place, and the profile holds only the model's own modules."""
    cfg = transformers.BigBirdConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=128, attention_type="block_sparse",
                                     block_size=4, num_random_blocks=2)
    p = T.trace(cfg.to_dict(), activations=False, steps=False)

    def modules(node):
        yield node.module
        for c in node.children:
            yield from modules(c)
    assert all(isinstance(i, int) for i in modules(p.calls))
    assert P.from_json(P.to_json(p)) == p and from_profile(p).num_params == p.num_params


@pytest.mark.slow
def test_a_model_whose_layers_differ_is_traced_with_its_configs_global_values():
    """Gemma 4's full-attention layers have their own head width and key/value heads (`global_head_dim`,
    `num_global_key_value_heads`: transformers' `per_layer_config`), and its config refuses a global read
    of such a value. The dimensions read the global one (the sliding layers', most of them); the
    parameters are torch's; the stream, whose layers are not alike, is left out with the reason."""
    d = {"model_type": "gemma4_text", "hidden_size": 32, "num_hidden_layers": 6, "intermediate_size": 48,
         "num_attention_heads": 4, "head_dim": 8, "global_head_dim": 16, "vocab_size": 96, "num_key_value_heads": 2,
         "num_global_key_value_heads": 1, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
         "sliding_window": 16, "max_position_embeddings": 64, "attention_k_eq_v": True, "tie_word_embeddings": True,
         "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    p = T.trace(d)
    assert (p.dims["head_dim"], p.dims["num_kv_heads"], p.dims["num_layers"]) == (8, 2, 6)
    real = transformers.AutoModelForCausalLM.from_config(T.hf_config(d))
    assert p.num_params == sum(x.numel() for x in real.parameters())
    assert p.activations and p.steps and p.source["untraced"]["stream"].startswith("it does not play")


def test_tied_weights_are_listed_once_and_owned_by_both_modules():
    """GPT-2 ties lm_head.weight to transformer.wte.weight: one tensor, the embedding's name, and the
    head's call fetches it (the transcribed trace's leaf(0))."""
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=4, n_positions=16)
    p = T.trace(cfg.to_dict(), activations=False, steps=False)
    assert p.params[0].name == "transformer.wte.weight" and "lm_head.weight" not in [t.name for t in p.params]
    head = next(m for m in p.modules if m.name == "lm_head")
    assert head.params == (0,)


def test_the_cache_is_keyed_by_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # the tensors and calls are what the cache must keep apart; the stream and step counts (seconds
    # each) are traced by the tests that check them
    monkeypatch.setattr(T, "trace", functools.partial(T.trace, activations=False, steps=False))
    d = transformers.LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                 intermediate_size=48).to_dict()
    a = T.cached_trace(d)
    files = list((tmp_path / "zerocalc" / "profiles").iterdir())
    assert len(files) == 1
    assert T.cached_trace(d) == a                                    # read back
    T.cached_trace({**d, "intermediate_size": 64})
    assert len(list((tmp_path / "zerocalc" / "profiles").iterdir())) == 2


@pytest.mark.parametrize("attention_bias,mlp_bias", [(True, False), (False, True), (True, True)])
def test_a_biased_llama_traced_equals_the_transcribed(attention_bias, mlp_bias):
    from zerocalc import arch as A
    from zerocalc import family
    from hand_spec import hand_spec
    d = transformers.LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                 attention_bias=attention_bias, mlp_bias=mlp_bias).to_dict()
    spec = from_profile(T.trace(d, activations=False, steps=False))
    want = hand_spec(A.Architecture("hf-llama", 96, 32, 2, 4, 2, 48, False, 64, attention_bias, mlp_bias))
    assert family.FAMILY in spec.profile.source
    assert (spec.param_numels, spec.trace, spec.backward_trace, spec.checkpointed_backward_trace, spec.buffer_numels) == \
        (want.param_numels, want.trace, want.backward_trace, want.checkpointed_backward_trace, want.buffer_numels)


def test_a_function_that_kernels_made_a_module_is_not_a_call():
    """With `kernels` installed (transformers 5.25 requires it), `apply_rotary_pos_emb` is a module that
    is nobody's child, and an attention calls it through a private copy: a hub layer (`kernel_layer_name`)
    outside the model. The recorded calls are the model's own (`trace.module_calls`), the rotary's
    operators belong to the attention; another module outside the model is still a call. Built by hand,
    so that it runs without `kernels` too."""
    class Rotary(torch.nn.Module):       # what `kernels.use_kernel_forward_from_hub` makes of a function
        kernel_layer_name = "rotary_pos_emb"

        def __init__(self, inner=None):
            super().__init__()
            self.__dict__["inner"] = inner   # the private copy, not a child (`use_kernelized_func`)

        def forward(self, x):
            return self.inner(x) if self.inner is not None else 2 * x

    rotary, other = Rotary(Rotary()), torch.nn.Identity()

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return other(rotary(self.proj(x)))

    model, calls = Attention(), []
    with T.module_calls(model, lambda m, args: calls.append(("pre", m)),
                        lambda m, args, out: calls.append(("post", m))):
        model(torch.zeros(1, 4))
    assert calls == [("pre", model), ("pre", model.proj), ("post", model.proj), ("pre", other), ("post", other),
                     ("post", model)]


def test_a_cached_profile_is_read_without_importing_torch(tmp_path):
    d = transformers.LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                 intermediate_size=40).to_dict()
    env = {"XDG_CACHE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", os.getcwd())
    code = ("import json, sys; from zerocalc.hf import trace; d = json.loads(sys.argv[1]); "
            "p = trace.cached_trace(d); print(p.num_params, 'torch' in sys.modules)")
    cached = tmp_path / "zerocalc" / "profiles" / (T.cache_key(d) + ".json")
    cached.parent.mkdir(parents=True)
    traced = T.trace(d, activations=False, steps=False)
    P.save(traced, str(cached))                                        # as cached_trace writes it
    out = subprocess.run([sys.executable, "-c", code, json.dumps(d)], env=env, check=True, capture_output=True,
                         text=True).stdout.split()
    assert out == [str(traced.num_params), "False"]


def test_the_committed_hf_traces_are_current(monkeypatch):
    """data/hf-traces/ (tests/hf_traces.py: what a test session reads instead of tracing each HF config
    of the committed rows again) holds one trace per config of data/h200-hf-*.csv and nothing else,
    each of its config (digest) at this TRACE_VERSION and named by its cache key under the versions
    recorded in tracer.json, traced by the tracer code of this checkout (its digest in tracer.json).
    Fails after a change to the tracer or to the rows: `python tests/hf_traces.py` regenerates them."""
    pytest.importorskip("pandas")
    import hf_traces
    made = hf_traces.manifest()
    assert made.get("tracer_sha256") == hf_traces.tracer_digest(), \
        "the tracer changed since data/hf-traces/ was traced: run python tests/hf_traces.py"
    configs = hf_traces.committed_hf_configs()
    assert len(configs) >= 11
    monkeypatch.setattr(T, "_versions", lambda: (made["torch"], made["transformers"]))
    names = {os.path.basename(p)[:-5]: p for p in hf_traces.traces()}
    assert set(names) == {T.cache_key(cfg) for _, cfg in configs.values()}, \
        "data/hf-traces/ is not the rows' configs: run python tests/hf_traces.py"
    for key, path in names.items():
        with open(path) as f:
            source = json.load(f)["source"]
        assert source["trace_version"] == T.TRACE_VERSION and source["config_sha256"] in configs
        assert made["torch"].split("+")[0] == source["torch"] and made["transformers"] == source["transformers"]


def test_a_trace_is_the_same_whatever_the_hash_seed():
    """Gemma 3 makes its sliding and full rotary tables `for layer_type in set(config.layer_types)`: in the
    order of the strings' hashes, which PYTHONHASHSEED picks. Traced under two seeds that order the two
    strings differently, a 4-layer Gemma 3 gives the same allocation stream (`trace._sets_in_order`)."""
    def run(seed: int, code: str, *args) -> str:
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        return subprocess.run([sys.executable, "-c", code, *args], env=env, check=True, capture_output=True,
                              text=True).stdout.strip()
    first = {seed: run(seed, "print(list({'sliding_attention', 'full_attention'})[0])") for seed in range(16)}
    seeds = [next(s for s, f in first.items() if f == kind) for kind in ("full_attention", "sliding_attention")]
    d = {"model_type": "gemma3_text", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2, "max_position_embeddings": 64}
    code = ("import json, sys; from zerocalc import profile as P; from zerocalc.hf import trace as T\n"
            "print(json.dumps(P.to_json(T.trace(json.loads(sys.argv[1]), steps=False))['stream'], sort_keys=True))")
    streams = [run(seed, code, json.dumps(d)) for seed in seeds]
    assert streams[0] == streams[1] and len(streams[0]) > 1000
