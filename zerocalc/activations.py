"""Activations kept for backward, from the architecture and the batch shape.

Units: bytes, per token (B·s tokens per micro-batch) and per layer, in units of the training dtype's
b, for each family: seed-gpt counted by hand (10h + 2f + a·s), hf-llama's MLP by hand and its
attention and RMSNorm part fitted on the H200 runs (`zerocalc/calibration/h200.json`), hf-gpt2 as
the seed without the a·s term; activation checkpointing keeps b·h per layer per token and recomputes
one layer at a time. The loss path on `logits.float()` is counted apart: 12·V·T bytes at the loss,
freed before the first layer's backward.

Each term, and the measurements behind it (`data/h200-n1-gpt.csv`, `data/snapshots/`), is in
docs/how-it-works.md, "Activations and the allocator".
"""
from dataclasses import dataclass

from zerocalc import calibration
from zerocalc.model import ModelSpec
from zerocalc.training import Setup


@dataclass(frozen=True)
class Activations:
    layers_bytes: int             # kept by the layers for backward (with checkpointing: their inputs)
    logprobs_bytes: int           # the fp32 log-softmax output, kept from the loss to its backward (for a
                                  # traced model with the head's kept tensors, `traced_layers_bytes`)
    loss_forward_bytes: int       # extra at the loss, end of forward
    loss_backward_bytes: int      # extra at the start of backward
    recompute_bytes: int          # one layer's activations rebuilt in backward (checkpointing)

    @property
    def kept_bytes(self) -> int:
        return self.layers_bytes + self.logprobs_bytes

    @property
    def forward_peak_bytes(self) -> int:
        return self.kept_bytes + self.loss_forward_bytes

    @property
    def loss_backward_peak_bytes(self) -> int:
        """At the loss's backward: everything kept and the fp32 gradients of the loss path."""
        return self.kept_bytes + self.loss_backward_bytes

    @property
    def first_layer_backward_bytes(self) -> int:
        """At the last layer's backward: the loss path is gone; the layers' activations (and with
        checkpointing the layer rebuilt) are all still alive."""
        return self.layers_bytes + self.recompute_bytes

    @property
    def backward_peak_bytes(self) -> int:
        return max(self.loss_backward_peak_bytes, self.first_layer_backward_bytes)


NONE = Activations(0, 0, 0, 0, 0)


def layer_units_per_token(arch, setup: Setup, coef: dict) -> float:
    """Elements of the training dtype one layer keeps per token (no checkpointing)."""
    h, f, a = arch.hidden_size, arch.ffn_hidden_size, arch.num_heads
    kv = arch.num_kv_heads * arch.head_dim
    units = coef["h"] * h + coef["f"] * f + coef.get("kv", 0.0) * kv
    if setup.attention == "eager" or arch.family == "seed-gpt":
        units += coef.get("attn", 1.0) * a * setup.seq_len
    return units


def traced_activations(model: ModelSpec, setup: Setup) -> dict | None:
    """The profile's traced activations under the setup's attention (`profile.traced_under`)."""
    from zerocalc.profile import traced_under
    p = model.profile
    return traced_under(p, setup.attention)[0] if p is not None and getattr(p, "activations", None) else None


def traced_layers_bytes(model: ModelSpec, setup: Setup) -> float | None:
    """The layers' kept bytes read from the model's code (`zerocalc.hf.memtrace.layer_activations`:
    a·T + c·B·s², traced in bf16 with SDPA as the model's config chooses); None where its description
    holds none (a family's: the calibrated formula) or the dtype is not 2 bytes. Mixture-of-experts models too:
    transformers 5 runs fused experts as `grouped_mm` over the k·T routed rows, whatever the routing,
    so the fake tensors' kept bytes are a real batch's (the H200 rows of the 2-layer Mixtral)."""
    acts = traced_activations(model, setup)
    if not acts or setup.param_bytes != 2:
        return None
    b, s = setup.micro_batch, setup.seq_len
    return acts["bytes_per_token"] * b * s + acts["bytes_per_sequence_squared"] * b * s * s


def frozen_delta_bytes(model: ModelSpec, setup: Setup) -> int:
    """What the layers keep beyond a full fine-tune where weights are frozen or LoRA adapts them
    (`adapters.kept_delta_bytes_per_token`: frozen linears and norms keep less, LoRA's targets keep
    their adapters' inputs and outputs); 0 for a model that trains every weight or has no profile."""
    if not model.frozen or model.profile is None:
        return 0
    from zerocalc import adapters
    from zerocalc.states import wide_stage3_elements
    from zerocalc.training import Stage
    wide = wide_stage3_elements(model, setup) != (0, 0)      # PEFT's fp32 adapters kept fp32 under zero.Init
    zero_init = setup.zero_init and setup.stage == Stage.PARAMETERS
    per_token = adapters.kept_delta_bytes_per_token(model.profile, model.trainable, setup.param_bytes,
                                                    4 if wide else setup.param_bytes, zero_init)
    return per_token * setup.micro_batch * setup.seq_len


def breakdown(model: ModelSpec, setup: Setup, cal: dict | None = None) -> Activations | None:
    arch = model.architecture
    if arch is None or setup.seq_len is None:
        return None
    coef = (cal or calibration.default())["activations"][arch.family]
    b, tokens, v = setup.param_bytes, setup.micro_batch * setup.seq_len, arch.vocab_size
    traced = traced_layers_bytes(model, setup)
    head = 0
    if traced is not None:
        layer = traced / arch.num_layers
        # The head's kept tensors (final norm, soft-capping's tanh over the vocabulary): kept, like the
        # log-probabilities, until the loss path's backward, gone before the last layer's.
        head = int(traced_activations(model, setup).get("head_bytes_per_token", 0) * tokens)
    elif arch.num_heads is None:     # a model without attention heads (Mamba's): no formula to fall back on
        if setup.param_bytes != 2:
            raise ValueError(f"{model.name}: its activations are read from its code in bf16/fp16 only, and a model "
                             f"without attention heads has no formula for {setup.dtype}: train in bf16 or fp16")
        why = ((model.profile.source if model.profile else {}).get("untraced") or {}).get("activations", "")
        raise ValueError(f"{model.name}: its activations could not be read from its code"
                         + (f" ({why})" if why else "") + ", and a model without attention heads has no formula "
                         "to stand in; it is not modelled")
    else:
        layer = b * tokens * layer_units_per_token(arch, setup, coef)
    layer += frozen_delta_bytes(model, setup) / arch.num_layers
    if setup.activation_checkpointing:
        kept_layers = arch.num_layers * b * tokens * coef.get("checkpoint_h", 1.0) * arch.hidden_size
        recompute = layer
    else:
        kept_layers, recompute = arch.num_layers * layer, 0
    return Activations(int(kept_layers), 4 * tokens * v + head, 6 * tokens * v, 8 * tokens * v, int(recompute))
