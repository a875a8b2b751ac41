"""What is trained: `Architecture`, a family the validator trains and its sizes; the walkers that turn
a model's module calls into the hook order DeepSpeed sees (`Call`, `_forward`, `_backward`).

DeepSpeed pads and partitions per parameter tensor (stage 3) or per flat group (stages 1/2), and
keeps small tensors whole at stage 3, so an exact answer needs the tensor list, not only P. Every
command reads it from a profile (`zerocalc.profile`, `zerocalc.family`: the families traced from
`zerocalc/hf/families.py`). The hand-written lists below (`param_numels`, `calls`, `PRESETS`, ...),
in `module.parameters()` order, are the oracle those traces are held to (`tests/test_family.py`;
`tests/test_validate_models.py` checks them against torch, tensor by tensor); no command runs them
(`tests/test_arch_path.py`).
"""
from dataclasses import dataclass, replace
from typing import NamedTuple

FAMILIES = ("seed-gpt", "hf-gpt2", "hf-llama")


@dataclass(frozen=True)
class Architecture:
    family: str                # seed-gpt | hf-gpt2 | hf-llama
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int          # = num_heads without grouped-query attention
    ffn_hidden_size: int
    tie_embeddings: bool
    max_positions: int = 2048  # GPT-2's learned position table; unused by the other families
    attention_bias: bool = False   # hf-llama: q, k, v and o projections with biases (config.attention_bias)
    mlp_bias: bool = False         # hf-llama: gate, up and down projections with biases (config.mlp_bias)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def validate_architecture(arch: Architecture) -> None:
    """Raise ValueError naming the field to fix."""
    if arch.family not in FAMILIES:
        raise ValueError(f"unknown model family {arch.family!r}; choose one of {', '.join(FAMILIES)}")
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size"):
        if not isinstance(getattr(arch, name), int) or getattr(arch, name) < 1:   # None: a model without one (Mamba's heads)
            raise ValueError(f"{name.replace('_', '-')} must be a positive integer, got {getattr(arch, name)}")
    if arch.hidden_size % arch.num_heads:
        raise ValueError(f"hidden-size {arch.hidden_size} is not divisible by num-heads {arch.num_heads}")
    if arch.num_heads % arch.num_kv_heads:
        raise ValueError(f"num-heads {arch.num_heads} is not divisible by num-kv-heads {arch.num_kv_heads}")
    if arch.family != "hf-llama" and (arch.attention_bias or arch.mlp_bias):
        raise ValueError("attention and MLP bias flags are Llama's (config attention_bias, mlp_bias)")
    if arch.family == "seed-gpt" and arch.num_kv_heads != arch.num_heads:
        raise ValueError("seed-gpt uses nn.MultiheadAttention, which has no grouped-query attention")


def _seed_gpt_layer(h: int, f: int) -> list[int]:
    # LayerNorm(h): weight, bias; nn.MultiheadAttention: in_proj_weight (3h, h), in_proj_bias 3h,
    # out_proj weight (h, h), bias h; LayerNorm(h); Linear(h, f) weight, bias; Linear(f, h) weight, bias.
    return [h, h, 3 * h * h, 3 * h, h * h, h, h, h, f * h, f, h * f, h]


def _gpt2_layer(h: int, f: int) -> list[int]:
    # ln_1 w, b; c_attn Conv1D (h, 3h) w, b; c_proj (h, h) w, b; ln_2 w, b; c_fc (h, f) w, b; c_proj (f, h) w, b.
    return [h, h, h * 3 * h, 3 * h, h * h, h, h, h, h * f, f, f * h, h]


def _llama_modules(h: int, f: int, kv: int, attention_bias: bool = False, mlp_bias: bool = False) -> list[list[int]]:
    """One Llama layer's parameter tensors by module, in `parameters()` order: q_proj (h, h), k_proj and
    v_proj (kv, h), o_proj (h, h), each with a bias when attention_bias; gate and up (f, h), down (h, f),
    each with a bias when mlp_bias; the two RMSNorm weights of h."""
    a, m = int(attention_bias), int(mlp_bias)
    return [[h * h] + [h] * a, [kv * h] + [kv] * a, [kv * h] + [kv] * a, [h * h] + [h] * a,
            [f * h] + [f] * m, [f * h] + [f] * m, [h * f] + [h] * m, [h], [h]]


def _llama_layer(h: int, f: int, kv: int, attention_bias: bool = False, mlp_bias: bool = False) -> list[int]:
    return [n for module in _llama_modules(h, f, kv, attention_bias, mlp_bias) for n in module]


def layer_numels(arch: Architecture) -> list[int]:
    """Element count of each parameter tensor of one transformer layer, in `module.parameters()` order."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    if arch.family == "seed-gpt":
        return _seed_gpt_layer(h, f)
    if arch.family == "hf-gpt2":
        return _gpt2_layer(h, f)
    return _llama_layer(h, f, arch.num_kv_heads * arch.head_dim, arch.attention_bias, arch.mlp_bias)


def param_numels(arch: Architecture) -> tuple[int, ...]:
    """Element count of every parameter tensor, in `module.parameters()` order (tied weights once)."""
    v, h, n = arch.vocab_size, arch.hidden_size, arch.num_layers
    head = [] if arch.tie_embeddings else [v * h]
    if arch.family == "seed-gpt":
        return tuple([v * h] + layer_numels(arch) * n + [h, h] + head)
    if arch.family == "hf-gpt2":
        return tuple([v * h, arch.max_positions * h] + layer_numels(arch) * n + [h, h] + head)
    return tuple([v * h] + layer_numels(arch) * n + [h] + head)


class Call(NamedTuple):
    """One module call in forward: its own parameters (indices into `param_numels`), the calls it
    makes, whether its output requires grad (else no backward hook fires for it) and whether it is a
    transformer layer (the unit activation checkpointing recomputes)."""
    params: tuple[int, ...] = ()
    children: tuple["Call", ...] = ()
    grad: bool = True
    layer: bool = False
    saves: bool = False    # keeps a tensor for backward without parameters (a dropout's mask at p > 0)
    leaf: bool = False     # a stage-3 leaf (`set_z3_leaf_modules`): `params` are every one under it, fetched
    own: tuple[int, ...] = ()   # together; `own` its own (recurse=False) alone


def calls(arch: Architecture) -> Call:
    """The module calls of one forward, as DeepSpeed's hooks see them: containers and parameter-less
    modules included, since each is a step of the stage-3 trace and a prefetch opportunity.
    Checked against the trace DeepSpeed 0.19.8 records (`tests/test_against_deepspeed.py`)."""
    n, leaf = arch.num_layers, lambda *p: Call(tuple(p))
    if arch.family == "seed-gpt":
        # root: embed; per block: ln1 three times (the seed calls it for q, k and v), attn (in_proj and
        # out_proj), ln2, mlp = Sequential(Linear, GELU, Linear); then ln_f and the head.
        blocks = []
        for i in range(n):
            b = 1 + 12 * i
            ln1 = leaf(b, b + 1)
            mlp = Call((), (leaf(b + 8, b + 9), leaf(), leaf(b + 10, b + 11)))
            blocks.append(Call((), (ln1, ln1, ln1, leaf(b + 2, b + 3, b + 4, b + 5), leaf(b + 6, b + 7), mlp), layer=True))
        end = 1 + 12 * n
        head = leaf(0) if arch.tie_embeddings else leaf(end + 2)
        return Call((), (leaf(0), *blocks, leaf(end, end + 1), head))
    if arch.family == "hf-gpt2":
        # wrapper > GPT2LMHeadModel > (GPT2Model > wte, wpe, drop, blocks, ln_f), lm_head (wte when tied);
        # block: ln_1, attn (c_attn, c_proj, resid_dropout), ln_2, mlp (c_fc, act, c_proj, dropout).
        blocks = []
        for i in range(n):
            b = 2 + 12 * i
            attn = Call((), (leaf(b + 2, b + 3), leaf(b + 4, b + 5), leaf()))
            mlp = Call((), (leaf(b + 8, b + 9), leaf(), leaf(b + 10, b + 11), leaf()))
            blocks.append(Call((), (leaf(b, b + 1), attn, leaf(b + 6, b + 7), mlp), layer=True))
        end = 2 + 12 * n
        body = Call((), (leaf(0), leaf(1), leaf(), *blocks, leaf(end, end + 1)))
        head = leaf(0) if arch.tie_embeddings else leaf(end + 2)
        return Call((), (Call((), (body, head)),))
    # wrapper > LlamaForCausalLM > (LlamaModel > embed_tokens, rotary_emb, layers, norm), lm_head
    # (embed_tokens when tied); layer: input_layernorm, self_attn (q, k, v, o), post_attention_layernorm,
    # mlp (gate, act_fn, up, down). rotary_emb's output needs no grad: it has no backward hook.
    sizes = [len(m) for m in _llama_modules(1, 1, 1, arch.attention_bias, arch.mlp_bias)]
    per_layer = sum(sizes)
    layers = []
    for i in range(n):
        starts = [1 + per_layer * i + sum(sizes[:k]) for k in range(len(sizes))]
        q, k, v, o, gate, up, down, n1, n2 = (leaf(*range(s, s + z)) for s, z in zip(starts, sizes))
        attn = Call((), (q, k, v, o))
        mlp = Call((), (gate, leaf(), up, down))
        layers.append(Call((), (n1, attn, n2, mlp), layer=True))
    end = 1 + per_layer * n
    body = Call((), (leaf(0), Call(grad=False), *layers, leaf(end)))
    head = leaf(0) if arch.tie_embeddings else leaf(end + 1)
    return Call((), (Call((), (body, head)),))


def _forward(c: Call):
    """Forward pre-hook order: a call, then the calls it makes."""
    return (call.params for call in _forward_calls(c))


def _backward(c: Call, checkpointing: bool = False, recompute_container: bool = False):
    """Backward pre-hook order: the reverse of the order calls finish in forward (a container's hook
    fires when the gradient reaches its output, before its children's). With activation
    checkpointing a layer is run forward again right after the hook of its first module that saved
    tensors (walking backward, the first with parameters or a dropout at p > 0: `Call.saves`), up to
    its last module that saves any, and its remaining hooks follow: the order DeepSpeed's hooks ran in
    on GPT-2 with its dropout, logged module by module (data/README.md, "GPT-2 with its dropout")."""
    return (call.params for call, _ in _backward_steps(c, checkpointing, recompute_container))


def _recomputed(c: Call, recompute_container: bool = False) -> tuple[bool, ...]:
    """Per step of the checkpointed `_backward`: whether it is a forward re-entry of a checkpointed
    layer (its hooks run as forward's, inside backward)."""
    return tuple(again for _, again in _backward_steps(c, True, recompute_container))


def _scan(calls) -> tuple:
    """Per step, what DeepSpeed's reuse rule reads of the module (`__params_to_release`, 0.19.8): its own
    parameters (recurse=False; a leaf's own, not those under it) when the released module is not a
    stage-3 leaf, every parameter under it when it is; and whether the step is a leaf."""
    under = {}

    def subtree(c: Call) -> frozenset:
        if id(c) not in under:
            under[id(c)] = frozenset(c.params).union(*(subtree(x) for x in c.children))
        return under[id(c)]
    return tuple((c.own if c.leaf else c.params, tuple(sorted(subtree(c))), c.leaf) for c in calls)


def leaf_scans(c: Call, recompute_container: bool = False) -> tuple | None:
    """`_scan` of forward, backward and checkpointed backward, in their steps' order; None where no
    call is a stage-3 leaf (then a step's own parameters are its trace's and no release reads deeper)."""
    if not any(call.leaf for call in _forward_calls(c)):
        return None
    return (_scan(_forward_calls(c)), _scan(call for call, _ in _backward_steps(c, False, recompute_container)),
            _scan(call for call, _ in _backward_steps(c, True, recompute_container)))


def _backward_steps(c: Call, checkpointing: bool, recompute_container: bool):
    """`_backward`'s steps as (call, whether the step is a recomputation's forward call)."""
    if not c.grad:
        return
    if checkpointing and c.layer:
        plain = [call for call, _ in _backward_steps(c, False, recompute_container)]
        first = next(i for i, call in enumerate(plain) if call.params or call.saves)
        rebuilt = list(_forward_calls(c))[0 if recompute_container else 1:]
        # PyTorch stops a recomputation once the last tensor backward needs is rebuilt: the modules
        # after the layer's last one that saves any (GPT-2's dropout at p = 0) are not re-entered.
        last = max(i for i, call in enumerate(rebuilt) if call.params or call.saves)
        yield from ([(call, False) for call in plain[:first + 1]] +
                    [(call, True) for call in rebuilt[:last + 1]] +
                    [(call, False) for call in plain[first + 1:]])
        return
    stack = [c]     # walked with a stack, not recursion: every step passed up through each level costs
    while stack:    # (`plan` walks a 70B model's thousands of steps)
        call = stack.pop()
        if not call.grad:
            continue
        if checkpointing and call.layer:
            yield from _backward_steps(call, checkpointing, recompute_container)
            continue
        yield call, False
        stack.extend(call.children)      # popped last first: the children in reverse


def _forward_calls(c: Call):
    """The calls in `_forward`'s order."""
    stack = [c]
    while stack:
        call = stack.pop()
        yield call
        stack.extend(reversed(call.children))


def trace(arch: Architecture) -> tuple[tuple[int, ...], ...]:
    """Forward's modules in hook order, as indices into `param_numels`."""
    return tuple(_forward(calls(arch)))


def backward_trace(arch: Architecture, checkpointing: bool = False) -> tuple[tuple[int, ...], ...]:
    """Backward's modules in hook order, recomputed layers included when checkpointing. The seed's
    `checkpoint(block, x)` calls the block itself again; Hugging Face's checkpointing layers re-enter
    below the layer's own hooks, so there the layer container is not called again."""
    return tuple(_backward(calls(arch), checkpointing, recompute_container=arch.family == "seed-gpt"))


def recomputed(arch: Architecture) -> tuple[bool, ...]:
    """Per step of `backward_trace(arch, checkpointing=True)`: a recomputation's forward call."""
    return _recomputed(calls(arch), recompute_container=arch.family == "seed-gpt")


def uniform_params(num_params: int, count: int = 100) -> tuple[int, ...]:
    """A model known only by P: `count` equal tensors, one module each (the last takes the remainder).
    Per-tensor padding then differs from an architecture's by fewer than `count`·N elements, and the
    stage-3 release rule sees the model at 1% granularity."""
    count = max(1, min(count, num_params))
    size = num_params // count
    return tuple(size for _ in range(count - 1)) + (num_params - size * (count - 1),)


def buffer_numels(arch: Architecture) -> tuple[int, ...]:
    """Module buffers (not parameters): Llama's rotary `inv_freq` and `original_inv_freq`, head_dim/2 each."""
    if arch.family == "hf-llama":
        return (arch.head_dim // 2, arch.head_dim // 2)
    return ()


def num_params(arch: Architecture) -> int:
    return sum(param_numels(arch))


# The sizes of the shipped profiles of these names (published config.json, ffn = intermediate_size; the
# seed's GPT as its case study builds it), for the tests that hold the profiles to the hand lists.
PRESETS = {
    "seed-gpt": Architecture("seed-gpt", 50257, 2048, 24, 16, 16, 8192, False),
    "gpt2": Architecture("hf-gpt2", 50257, 768, 12, 12, 12, 3072, True, 1024),
    "gpt2-medium": Architecture("hf-gpt2", 50257, 1024, 24, 16, 16, 4096, True, 1024),
    "gpt2-large": Architecture("hf-gpt2", 50257, 1280, 36, 20, 20, 5120, True, 1024),
    "gpt2-xl": Architecture("hf-gpt2", 50257, 1600, 48, 25, 25, 6400, True, 1024),
    "llama-2-7b": Architecture("hf-llama", 32000, 4096, 32, 32, 32, 11008, False, 4096),
    "llama-2-13b": Architecture("hf-llama", 32000, 5120, 40, 40, 40, 13824, False, 4096),
    "llama-2-70b": Architecture("hf-llama", 32000, 8192, 80, 64, 8, 28672, False, 4096),
    "llama-3-8b": Architecture("hf-llama", 128256, 4096, 32, 32, 8, 14336, False, 8192),
    "llama-3-70b": Architecture("hf-llama", 128256, 8192, 80, 64, 8, 28672, False, 8192),
    "mistral-7b": Architecture("hf-llama", 32000, 4096, 32, 32, 8, 14336, False, 32768),
}


def preset(name: str, **overrides) -> Architecture:
    return preset_derived(name, **overrides)[0]


def preset_derived(name: str, **overrides) -> tuple[Architecture, dict]:
    """A preset with overrides, and what was re-derived from them: a new hidden size without a new
    FFN width keeps the preset's FFN/hidden ratio (the seed's GPT has FFN 4·hidden at every width)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    base = PRESETS[name]
    given = {k: v for k, v in overrides.items() if v is not None}
    derived = {}
    if "hidden_size" in given and "ffn_hidden_size" not in given:
        ratio = base.ffn_hidden_size / base.hidden_size
        derived["ffn_hidden_size"] = int(round(given["hidden_size"] * ratio))
    return replace(base, **given, **derived), derived


HF_MODEL_TYPES = ("gpt2", "llama", "mistral")   # the config.json model_types `from_hf_config` reads


def from_hf_config(cfg: dict) -> Architecture:
    """An Architecture from a Hugging Face config.json (GPT-2 or Llama-style: Llama, Mistral, Qwen2 without
    biases). No hub access: the caller reads the local file."""
    kind = cfg.get("model_type", "")
    if kind == "gpt2":
        h = cfg.get("n_embd", 768)
        return Architecture("hf-gpt2", cfg.get("vocab_size", 50257), h, cfg.get("n_layer", 12), cfg.get("n_head", 12),
                            cfg.get("n_head", 12), cfg.get("n_inner") or 4 * h, cfg.get("tie_word_embeddings", True),
                            cfg.get("n_positions", 1024))
    if kind in ("llama", "mistral"):
        heads = cfg["num_attention_heads"]
        return Architecture("hf-llama", cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], heads,
                            cfg.get("num_key_value_heads") or heads, cfg["intermediate_size"],
                            cfg.get("tie_word_embeddings", False), cfg.get("max_position_embeddings", 2048),
                            kind == "llama" and bool(cfg.get("attention_bias")),   # Mistral has no bias flags
                            kind == "llama" and bool(cfg.get("mlp_bias")))
    raise ValueError(f"config.json has model_type {kind!r}; zerocalc reads gpt2, llama and mistral configs")


def generic(num_params: int, vocab_size: int = 32000) -> Architecture:
    """The oracle of `family.generic`. A Llama-shaped decoder of at most `num_params`, short of it by fewer than 3·L·h (the tensors of
    one FFN unit per layer), for what needs a shape when only P is known: activations and step time.
    Shapes follow the GPT-3/Llama habit h ≈ 128·L (12·L·h² = 196608·L³ ≈ P), h a multiple of 128,
    heads of 128; the vocabulary is `vocab_size`, or less where its embeddings (2·V·h) would pass a
    quarter of P; the FFN width takes what the layers' attention and norms leave (8/3·h, Llama's,
    at 7-70B, less in small models). Raises ValueError below ~0.2M parameters, too few for a layer."""
    layers = max(2, round((num_params / 196608) ** (1 / 3)))
    hidden = max(128, 128 * round((num_params / (12 * layers)) ** 0.5 / 128))
    heads = max(1, hidden // 128)
    vocab = max(1, min(vocab_size, num_params // (8 * hidden)))
    # P = embed V·h + L·(4h² + 3h·f + 2h) + norm h + head V·h: solved for f
    ffn = (num_params - 2 * vocab * hidden - hidden - layers * (4 * hidden**2 + 2 * hidden)) // (3 * layers * hidden)
    if ffn < 1:
        raise ValueError(f"{num_params:,} parameters are too few to give a transformer shape; "
                         "give the architecture (--model or --hidden-size/--num-layers/...)")
    return Architecture("hf-llama", vocab, hidden, layers, heads, heads, ffn, False)
