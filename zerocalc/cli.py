"""`zerocalc` on the command line: parse, call the model, print. No arithmetic here."""
import json
import sys
from dataclasses import replace

import click

from zerocalc import __version__, DEEPSPEED_VERSION
from zerocalc import arch as _arch
from zerocalc import calibration, family, hardware, inputs, render, resolve
from zerocalc.estimate import estimate
from zerocalc.model import from_architecture, from_params, shaped
from zerocalc.training import OPTIMIZERS, Setup, Stage, validate_setup
from zerocalc.inputs import DsConfigError, InputError, check_float, check_int
from zerocalc.units import parse_bytes, parse_count


class InputFailure(click.ClickException):
    """A refused input: `Error: <what to fix>` on one line, exit code 2 (click's usage-error code)."""
    exit_code = 2


class _Group(click.Group):
    """Turns zerocalc's own input errors (`zerocalc.inputs.InputError`) into exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as err:
            raise InputFailure(str(err))


class _ModelName(click.ParamType):
    """--model: a shipped name in any case or a Hugging Face Hub id (`resolve.canonical_name`); a near
    miss is answered with the nearest names and how to pass a config.json."""
    name = "NAME"

    def convert(self, value, param, ctx):
        found = resolve.canonical_name(str(value))
        if found is None:
            self.fail(resolve.unknown_model(str(value)), param, ctx)
        return found


class _Parsed(click.ParamType):
    """A click type from one of zerocalc.units' parsers, then a range check from zerocalc.inputs;
    a ValueError becomes a usage error naming the option."""

    def __init__(self, name, parse, check=None):
        self.name, self.parse, self.check = name, parse, check

    def convert(self, value, param, ctx):
        try:
            out = self.parse(value) if isinstance(value, str) else value
            label = "/".join(param.opts) if param is not None else None
            return self.check(out, label) if self.check else out
        except ValueError as err:
            self.fail(str(err), param, ctx)


def _int(limit):
    """A whole number within inputs.LIMITS[limit]."""
    def parse(text):
        try:
            return int(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not a whole number")
    return _Parsed("INTEGER", parse, lambda v, label: check_int(limit, v, label))


def _float(limit):
    """A finite number within inputs.LIMITS[limit] (NaN and inf refused)."""
    def parse(text):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number")
    return _Parsed("FLOAT", parse, lambda v, label: check_float(limit, v, label))


def _elements(minimum):
    """An element count (bucket sizes, thresholds) as DeepSpeed takes it: 0 allowed where DeepSpeed allows it."""
    def parse(text):
        if minimum == 0 and text.strip() in ("0", "0.0"):
            return 0
        return parse_count(text, "an element count")
    return _Parsed("COUNT", parse, lambda v, label: check_int("elements", v, label))


COUNT = _Parsed("COUNT", parse_count, lambda v, label: check_int("params", v, label))
SIZE = _Parsed("SIZE", parse_bytes, lambda v, label: check_int("gpu_memory", v, label))
ELEMENTS, ELEMENTS0 = _elements(1), _elements(0)


def _stages(text):
    if text in (None, "all"):
        return None
    try:
        stages = [int(s) for s in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"{text!r}: give 0, 1, 2, 3, a list like 2,3, or all", param_hint="--stage")
    for s in stages:
        if s not in (0, 1, 2, 3):
            raise click.BadParameter(f"stage {s} does not exist; ZeRO stages are 0, 1, 2 and 3", param_hint="--stage")
    return stages


def _model(params, model, hf_config, overrides):
    chosen = [x for x in (params, model, hf_config) if x is not None]
    if len(chosen) > 1:
        raise click.UsageError("give one of --params, --model or --hf-config")
    arch_flags = {k: v for k, v in overrides.items() if v is not None}
    if params is not None:
        if arch_flags:
            raise click.UsageError("--params takes no architecture flags; use --model or --hf-config with them")
        return from_params(params)
    try:
        spec = None
        if model is not None:
            spec = resolve.preset_spec(model, arch_flags)
        elif hf_config is not None:
            spec, said = resolve.hf_config_spec(hf_config, arch_flags)
            if said:
                click.echo(f"note: {said}", err=True)
        elif all(arch_flags.get(k) for k in ("vocab_size", "hidden_size", "num_layers", "num_heads")):
            h = arch_flags["hidden_size"]
            a = _arch.Architecture(
                arch_flags.pop("family", "hf-llama"), arch_flags["vocab_size"], h, arch_flags["num_layers"],
                arch_flags["num_heads"], arch_flags.get("num_kv_heads") or arch_flags["num_heads"],
                arch_flags.get("ffn_hidden_size") or 4 * h, arch_flags.get("tie_embeddings", False))
            _arch.validate_architecture(a)
            spec = from_architecture(a)
            inputs.check_model_size(a.num_layers, spec.num_params, "the model")
        if spec is not None:
            layers = spec.architecture.num_layers if spec.architecture else None
            inputs.check_model_size(layers, spec.num_params, spec.name)
            return spec
    except InputError:
        raise
    except ValueError as err:
        named = hf_config is not None and str(hf_config) not in str(err)
        raise click.UsageError(f"{hf_config}: {err}" if named else str(err))
    raise click.UsageError("say what is trained: --params 7e9, --model llama-2-7b, --hf-config config.json, "
                           "or --vocab-size/--hidden-size/--num-layers/--num-heads")


def _setups(opts, ds, stages, hidden_size):
    """One Setup per stage asked for; command-line flags win over the ds_config."""
    fields = dict(ds.fields) if ds else {}
    if ds is not None and ds.from_trainer and opts.get("zero_init") is None:
        fields["zero_init"] = True   # HF Trainer builds stage-3 models under deepspeed.zero.Init
    if ds is not None and ds.from_trainer:
        fields["hf_trainer"] = True  # and runs each step through its own loop (timing: the Trainer's host work)
    for key in ("dtype", "optimizer", "grad_accum_dtype", "communication_data_type", "reduce_bucket_size",
                "overlap_comm", "contiguous_gradients", "prefetch_bucket_size", "max_live_parameters",
                "param_persistence_threshold", "max_reuse_distance", "sub_group_size", "offload_optimizer",
                "offload_param", "seq_len", "activation_checkpointing", "attention", "zero_init", "expandable_segments"):
        if opts.get(key) is not None:
            fields[key] = opts[key]
    dp = opts["dp"] if opts["dp"] is not None else opts["nodes"] * opts["gpus_per_node"]
    if ds is None:    # the flags', else 1 (`dsconfig.resolve_batch` without a train_batch_size)
        micro, gas = opts["micro_batch"] or 1, opts["gas"] or 1
    else:
        from zerocalc import dsconfig
        micro, gas = dsconfig.resolve_batch(ds.train_batch_size, opts["micro_batch"] or ds.micro_batch,
                                            opts["gas"] or ds.gas, dp, from_config=True)
    if fields.get("sub_group_size") == 0:
        fields["sub_group_size"] = 1   # each parameter its own sub-group either way (DeepSpeed's _create_fp16_sub_groups)
    if "optimizer" in fields:
        fields["optimizer"] = OPTIMIZERS[fields["optimizer"]]
    if stages is None:
        stages = [fields.pop("stage")] if "stage" in fields else [0, 1, 2, 3]
    fields.pop("stage", None)
    out = []
    for s in stages:
        f = dict(fields)
        if s < 3:   # parameter offload exists only at stage 3; optimizer offload not at stage 0
            if opts.get("offload_param") is None:
                f.pop("offload_param", None)
            if s == 0 and opts.get("offload_optimizer") is None:
                f.pop("offload_optimizer", None)
        setup = Setup(stage=Stage(s), dp=dp, micro_batch=micro, gas=gas, **f)
        validate_setup(setup)
        if ds is not None:
            dsconfig.check_setup(ds, setup.stage, setup.dtype, setup.grad_accum_dtype, setup.offload_optimizer)
        out.append(setup)
    return out


def _shaped(num_params):
    try:
        layers = family.generic_layers(int(num_params))
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--params")
    if layers > inputs.LIMITS["num_layers"].high:
        raise InputFailure(f"--params {num_params:.3g}: the Llama-like shape assumed for it (for activations and "
                           f"step time) has {layers:,} layers, above zerocalc's limit of "
                           f"{int(inputs.LIMITS['num_layers'].high)} ({inputs.LIMITS['num_layers'].why}); ask about "
                           f"at most about 3e12 parameters, or leave out --seq-len/--gpu for a P-only estimate")
    try:
        return shaped(num_params)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--params")


def model_options(f):
    """What is trained: --params, --model, --hf-config and the architecture overrides."""
    for opt in reversed([
        click.option("--params", type=COUNT, help="Parameter count P: 7e9, 7B, 350M."),
        click.option("--model", "model_name", type=_ModelName(),
                     help="A shipped architecture (`zerocalc models` lists them), by name or Hub id "
                          "(Qwen/Qwen2.5-7B-Instruct)."),
        click.option("--hf-config", type=click.Path(),
                     help="A Hugging Face config.json (any file name) or a model directory; a model_type "
                          "without a shipped profile is read from its code (pip install 'zerocalc[trace]')."),
        click.option("--vocab-size", type=_int("vocab_size")),
        click.option("--hidden-size", type=_int("hidden_size")),
        click.option("--num-layers", type=_int("num_layers")),
        click.option("--num-heads", type=_int("num_heads")),
        click.option("--num-kv-heads", type=_int("num_kv_heads")),
        click.option("--ffn-hidden-size", type=_int("ffn_hidden_size")),
        click.option("--tie-embeddings/--untie-embeddings", default=None),
    ]):
        f = opt(f)
    return f


def adapter_options(f):
    """What trains: PEFT's LoRA (its flags or its adapter_config.json) and frozen modules."""
    for opt in reversed([
        click.option("--lora-rank", type=int, help="LoRA (PEFT) rank r: adapters on --lora-targets, the base frozen."),
        click.option("--lora-alpha", type=float, help="LoRA alpha [default: PEFT's 8]; changes the scaling only."),
        click.option("--lora-dropout", type=float, help="LoRA dropout [default: 0]."),
        click.option("--lora-targets", help="PEFT target_modules: all-linear (default; not the output head), "
                                            "module names (q_proj,v_proj) or a regex matched on the whole name."),
        click.option("--peft-config", type=click.Path(dir_okay=False),
                     help="PEFT's adapter_config.json (LoRA; DoRA and rsLoRA as the file says) instead of the --lora flags."),
        click.option("--freeze", multiple=True,
                     help="Freeze a module and all it holds, by the model's module names: embed_tokens, "
                          "'model.layers.{0..7}', a glob (repeat or comma-separate)."),
    ]):
        f = opt(f)
    return f


def _lora(rank, alpha, dropout, targets, peft_config):
    """The Lora the flags or the adapter_config.json ask for; None for neither."""
    flags = {k: v for k, v in (("--lora-alpha", alpha), ("--lora-dropout", dropout), ("--lora-targets", targets))
             if v is not None}
    if peft_config is None and rank is None:
        if flags:
            raise InputFailure(f"{', '.join(flags)} need --lora-rank")
        return None
    from zerocalc import adapters
    if peft_config is not None:
        if rank is not None or flags:
            raise InputFailure("give --peft-config or the --lora-* flags, not both")
        try:
            return adapters.from_peft_config(inputs.load_json_object(peft_config, "PEFT adapter_config.json"), peft_config)
        except ValueError as err:
            raise InputFailure(str(err))
    if targets is not None:
        names = tuple(t.strip() for t in targets.split(",") if t.strip())
        targets = adapters.ALL_LINEAR if names == (adapters.ALL_LINEAR,) else \
            (names[0] if len(names) == 1 and any(c in names[0] for c in "*()[]|\\+?") else names)
    lora = adapters.Lora(rank=rank, alpha=adapters.PEFT_DEFAULT_ALPHA if alpha is None else alpha,
                         dropout=0.0 if dropout is None else dropout, targets=targets or adapters.ALL_LINEAR)
    try:
        adapters.check_lora(lora)
    except ValueError as err:
        raise InputFailure(f"--lora-*: {err}")
    return lora


def _adaptable(hf_config, lora, freeze) -> None:
    """Before the model is read (a trace takes seconds): LoRA and --freeze refuse a quantized base."""
    if hf_config is not None and (lora is not None or freeze):
        try:
            resolve.refuse_quantized_base(hf_config)
        except ValueError as err:
            raise InputFailure(str(err))


def _adapted(spec, model_name, hf_config, overrides, lora, freeze, stages):
    """The model with LoRA applied and/or modules frozen (`zerocalc.adapters`); the model itself without."""
    freeze = tuple(p.strip() for item in freeze for p in item.split(",") if p.strip())
    if lora is None and not freeze:
        return spec
    from zerocalc import adapters
    if lora is not None and freeze:
        raise InputFailure("--freeze with LoRA: PEFT already freezes every base weight; give one of them")
    if lora is not None and lora.dora and any(s == 3 for s in stages):
        raise InputFailure("DoRA at ZeRO stage 3 is not modelled (its weight norm reads the partitioned base "
                           "weight outside the module's hooks); ask for stages 0-2")
    arch_flags = {k: v for k, v in overrides.items() if v is not None}
    try:
        p = resolve.profile_for(model_name, hf_config, arch_flags, spec)
        return adapters.spec(p, lora, freeze, spec.name)
    except ValueError as err:
        raise InputFailure(str(err))


def _modelled(spec, setups) -> None:
    """Refuse, naming what to change, a setup whose activations zerocalc cannot count for this model
    (`activations.breakdown`: a model without attention heads, Mamba's, read from its code in bf16/fp16
    only, trained in fp32)."""
    from zerocalc import activations
    for s in setups:
        try:
            activations.breakdown(spec, s)
        except ValueError as err:
            raise InputFailure(str(err))


def _streamed(spec, model_name, hf_config, overrides, lora, setups):
    """A model with frozen parameters with the allocation stream of its own trained tensors, in the
    variants the setups run (`zerocalc.hf.adapted`: PEFT's model recorded on fake tensors, cached), so
    its reserved is simulated as a full fine-tune's; each variant that cannot be recorded (no torch,
    PEFT or, for stage 3, DeepSpeed; an error of the model's or PEFT's code) left out: reserved by the
    ratio there, the error kept in the profile's `source["untraced"]` for the note to say."""
    if not spec.frozen or spec.profile is None or not setups[0].seq_len:
        return spec
    from dataclasses import replace

    from zerocalc import adapters
    from zerocalc.hf import adapted
    from zerocalc.hf.trace import why
    d = resolve.config_of(model_name, hf_config, {k: v for k, v in overrides.items() if v is not None})
    names = sorted({adapted.variant(s.activation_checkpointing, s.stage == 3) for s in setups
                    if s.stage != 3 or s.zero_init})
    recorded, failed = [], {}
    for name in names if d is not None else ():
        try:
            adapted.cached_variant(d, lora, spec.trainable, name, setups[0].attention)
            recorded.append(name)
        except Exception as err:      # no extra, or whatever the model's or PEFT's code raises: the ratio there
            failed[f"adapted {name}"] = why(err)
    if failed:
        p = spec.profile
        spec = replace(spec, profile=replace(p, source={**p.source, "untraced": {**p.source.get("untraced", {}), **failed}}))
    if not recorded:
        return spec
    return adapters.with_stream(spec, adapted.stream(d, lora, spec.trainable, recorded, setups[0].attention))


def host_options(f):
    """The host's side of step time (its speed issuing work, and offload's CPU Adam and PCIe), which
    the calibration measured on H200 hosts."""
    f = click.option("--host-launch-us", type=_float("host_launch_us"),
                     help="Microseconds the host takes to issue one tiny CUDA kernel from Python "
                          "(`python benchmarks/host_launch.py` measures yours): small and stage-3 steps are "
                          "host-bound and scale with it [default: the calibration's, the H200 VMs' median; "
                          "they drifted between 7 and 25].")(f)
    f = click.option("--host-link-gbps", type=_float("gbps"),
                     help="Offload: GB/s between a host's memory and its GPUs, all of them together "
                          "[default: the calibration's, fitted on the H200 hosts].")(f)
    return click.option("--cpu-adam-rate", type=_float("cpu_adam_rate"),
                        help="Offload: DeepSpeedCPUAdam elements per second on a whole host, e.g. 3.2e9 "
                             "(`python benchmarks/cpu_adam.py` measures yours) [default: the calibration's].")(f)


def link_options(f):
    """A cluster's node size and links, over the GPU preset's."""
    f = click.option("--inter-node-gbps", type=_float("gbps"), help="GB/s per GPU between nodes (the network) "
                     "[default: the GPU preset's].")(f)
    f = click.option("--intra-node-gbps", type=_float("gbps"), help="GB/s per GPU inside a node (NVLink, PCIe) "
                     "[default: the GPU preset's].")(f)
    return click.option("--gpus-per-node", type=_int("gpus_per_node"),
                        help="GPUs in one node: N above it crosses nodes [default: the GPU preset's].")(f)


def _linked(gpu_name, gpus_per_node, intra_node_gbps, inter_node_gbps):
    """The GPU preset with the cluster's node size and links (`link_options`)."""
    return hardware.gpu(gpu_name, gpus_per_node=gpus_per_node,
                        intra_node_bytes_per_s=intra_node_gbps and intra_node_gbps * 1e9,
                        inter_node_bytes_per_s=inter_node_gbps and inter_node_gbps * 1e9)


def _calibration(name, cpu_adam_rate, host_link_gbps, host_launch_us=None) -> dict:
    try:
        cal = calibration.load(name)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--calibration")
    host = {k: v for k, v in (("host_adam_elements_per_s", cpu_adam_rate),
                              ("host_link_bytes_per_s", host_link_gbps and host_link_gbps * 1e9),
                              ("host_launch_s", host_launch_us and host_launch_us * 1e-6)) if v}
    return {**cal, "time": {**cal["time"], **host}} if host else cal


def _spec(params, model_name, hf_config, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
          ffn_hidden_size, tie_embeddings):
    overrides = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, ffn_hidden_size=ffn_hidden_size, tie_embeddings=tie_embeddings)
    return _model(params, model_name, hf_config, overrides)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, message=f"zerocalc %(version)s (models DeepSpeed {DEEPSPEED_VERSION})")
def main():
    """Per-rank memory and communication of DeepSpeed ZeRO, as DeepSpeed really behaves.

    \b
    Examples:
      zerocalc estimate --params 7e9 --dp 8
      zerocalc estimate --params 7e9 --dp 8 --gpu-memory 32GiB --stage 2
      zerocalc estimate --model llama-2-7b --dp 8 --ds-config ds_config.json --format json
      zerocalc plan --params 70e9 --gpu h100 --max-gpus 64 --seq-len 4096 --global-batch 1024
      zerocalc sweep --params 1e9,7e9,70e9 --dp 1,8,64 --out sweep.csv
    """


ZERO_INIT_HELP = ("Stage 3: the model is built under deepspeed.zero.Init, as HF Trainer builds it (no whole copy "
                  "on the GPU at init) [default: on when the ds_config has HF Trainer \"auto\" values, else off].")


def _read_ds_config(path, spec):
    """The parsed ds_config (`dsconfig.DsConfig`), its warnings on stderr; a config DeepSpeed would
    refuse is one line naming the file, the key and the value."""
    from zerocalc import dsconfig
    hidden = spec.architecture.hidden_size if spec.architecture else None
    try:
        ds = dsconfig.parse(dsconfig.load(path), hidden)
    except DsConfigError as err:
        msg = str(err)
        raise InputFailure(msg if msg.startswith(f"{path}:") else f"{path}: {msg}")
    for w in ds.warnings:
        click.echo(f"warning: {w}", err=True)
    return ds


def _zero_init_note(setups, ds, flag) -> str | None:
    """The header line that says whether stage 3 is modelled under zero.Init, and why."""
    if not any(s.stage == 3 for s in setups):
        return None
    on = any(s.zero_init for s in setups if s.stage == 3)
    if flag is not None:
        why = "--zero-init" if flag else "--no-zero-init"
    elif ds is not None and ds.from_trainer:
        why = "default for a ds_config with HF Trainer \"auto\" values: Trainer builds stage-3 models under it"
    else:
        why = "default: the model is built outside it; --zero-init if it is built under it, as HF Trainer does"
    return f"zero.Init: {'on' if on else 'off'} ({why})"


def _dtype_note(ds, dtype_flag) -> str | None:
    """Which of fp16/bf16 a Trainer config's "auto" resolves to, and why."""
    if ds is None or not ds.dtype_auto:
        return None
    given = " and ".join(f"{k}.enabled" for k in ds.dtype_auto)
    if dtype_flag is not None:
        return f"{given} \"auto\": Trainer fills from its --fp16/--bf16; taken as {dtype_flag} (--dtype)"
    if len(ds.dtype_auto) == 2:
        return (f"{given} are \"auto\": Trainer enables the one its --bf16 or --fp16 asks for; taken as bf16 "
                "(give --dtype fp16, or --dtype fp32 for neither)")
    other = "bf16" if ds.dtype_auto[0] == "fp16" else "fp16"
    taken = ds.fields.get("dtype")
    return (f"{given} is \"auto\" (Trainer fills it from its --{ds.dtype_auto[0]}): taken as {taken}"
            + (f", since {other} is enabled" if taken == other else "") + "; --dtype to change")


def _host_memory(given, hw):
    """(host memory per node, where it came from): the user's, else the GPU preset's typical value, said
    to be an assumption; (None, None) with neither."""
    if given is not None:
        return given, None
    if hw is not None and hw.host_memory_bytes is not None:
        return hw.host_memory_bytes, f"assumed: a typical {hw.name} 8-GPU host's; give yours with --host-memory"
    return None, None


@main.command("estimate")
@model_options
@click.option("--dp", type=_int("dp"), help="Data-parallel ranks N (default: nodes × GPUs per node).")
@click.option("--nodes", type=_int("nodes"), default=1, show_default=True)
@click.option("--gpus-per-node", type=_int("gpus_per_node"), default=1, show_default=True)
@click.option("--stage", "stage_text", help="0, 1, 2, 3, a list (2,3) or all (default; or the ds_config's).")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), help="Training dtype [default: bf16].")
@click.option("--optimizer", type=click.Choice(sorted(OPTIMIZERS)), help="[default: adamw]")
@click.option("--gas", type=_int("gas"), help="Gradient-accumulation steps [default: 1].")
@click.option("--micro-batch", type=_int("micro_batch"), help="Micro-batch per GPU [default: 1].")
@click.option("--seq-len", type=_int("seq_len"), help="Sequence length (for activations).")
@click.option("--grad-accum-dtype", type=click.Choice(["fp32", "fp16", "bf16"]))
@click.option("--communication-data-type", type=click.Choice(["fp32", "fp16", "bf16"]))
@click.option("--reduce-bucket-size", type=ELEMENTS, help="Elements [default: 5e8].")
@click.option("--overlap-comm/--no-overlap-comm", default=None)
@click.option("--contiguous-gradients/--no-contiguous-gradients", default=None)
@click.option("--prefetch-bucket-size", type=ELEMENTS0, help="stage3_prefetch_bucket_size, elements [default: 5e7].")
@click.option("--max-live-parameters", type=ELEMENTS0, help="stage3_max_live_parameters [default: 1e9].")
@click.option("--param-persistence-threshold", type=ELEMENTS0, help="stage3_param_persistence_threshold [default: 1e5].")
@click.option("--max-reuse-distance", type=ELEMENTS0, help="stage3_max_reuse_distance [default: 1e9].")
@click.option("--sub-group-size", type=ELEMENTS0, help="[default: 1e9; 0 is taken as 1, as DeepSpeed groups both alike]")
@click.option("--offload-optimizer", type=click.Choice(["none", "cpu", "nvme"]))
@click.option("--offload-param", type=click.Choice(["none", "cpu", "nvme"]), help="Stage 3 only.")
@click.option("--activation-checkpointing/--no-activation-checkpointing", default=None)
@click.option("--attention", type=click.Choice(["eager", "sdpa", "flash"]))
@click.option("--zero-init/--no-zero-init", default=None, help=ZERO_INIT_HELP)
@click.option("--expandable-segments/--no-expandable-segments", default=None,
              help="PyTorch's allocator runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: less "
                   "reserved beyond allocated (measured on H200: 1.06-1.36x instead of 1.08-1.73x) [default: no].")
@click.option("--ds-config", type=click.Path(dir_okay=False), help="Read a DeepSpeed ds_config.json.")
@click.option("--gpu-memory", type=SIZE,
              help="Per-GPU memory for the fits column: 80GiB (an 80 GB card), 40e9 [default: --gpu's; "
                   "without either, the smallest usual GPU each stage fits on].")
@click.option("--host-memory", type=SIZE,
              help="Host (CPU) memory per node for the fits column: 125GiB, 2TiB; the ranks on a node are "
                   "N / --nodes [default: --gpu's typical 8-GPU host, printed as an assumption].")
@click.option("--gpu", "gpu_name", type=click.Choice(sorted(hardware.PRESETS)),
              help="Hardware for step time (and --gpu-memory's default): adds time to each estimate.")
@click.option("--peak-tflops", type=_float("peak_tflops"), help="Override the GPU's peak TFLOP/s.")
@click.option("--intra-node-gbps", type=_float("gbps"), help="GB/s per GPU inside a node.")
@click.option("--inter-node-gbps", type=_float("gbps"), help="GB/s per GPU between nodes.")
@click.option("--calibration", "calibration_name", default="h200", show_default=True,
              help="Calibrated constants: h200 (shipped), or a file `zerocalc calibrate` (your rows) or "
                   "`python -m validate fit` wrote.")
@host_options
@adapter_options
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True)
@click.option("--explain", is_flag=True, help="Also say what each column of the table counts.")
def estimate_cmd(params, model_name, hf_config, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
                 ffn_hidden_size, tie_embeddings, stage_text, gpu_memory, host_memory, gpu_name, peak_tflops,
                 intra_node_gbps,
                 inter_node_gbps, calibration_name, cpu_adam_rate, host_link_gbps, host_launch_us, ds_config, fmt,
                 explain, lora_rank, lora_alpha, lora_dropout, lora_targets, peft_config, freeze, **opts):
    """Per-rank bytes and communication per step for ZeRO stages 0–3.

    Memory is in GiB (2^30 bytes), traffic in GB (1e9). 'paper' is the ZeRO paper's figure-1 model
    states (2+2+12 bytes/param), shown for comparison; the other columns follow DeepSpeed 0.19.8's code.
    Activations need an architecture and --seq-len; step time needs --gpu too. Offload's time is the
    host's (CPU Adam, PCIe), shared by the GPUs on it: calibrated on H200 hosts; give yours with
    --cpu-adam-rate and --host-link-gbps. Small models and stage 3 are host-bound (Python issuing
    kernels and DeepSpeed's hooks): give your host's speed with --host-launch-us.

    Without --gpu-memory or --gpu, the last column says the smallest usual GPU (16 to 141 GB) each
    stage fits on; with them, whether it fits (yes, tight or NO).

    \b
    Examples:
      # Does 7B train on 8 GPUs, on which GPU size per stage, and how many GB does a rank send per step?
      zerocalc estimate --params 7e9 --dp 8
      # ... with ZeRO-2 on 8 × 32 GB cards (a 32 GB card holds 32 GiB; 32GB reads as 32e9 bytes)
      zerocalc estimate --params 7e9 --dp 8 --stage 2 --gpu-memory 32GiB
      # Llama-3-8B, ZeRO-2, 8 × 40 GB at 4k tokens: memory with activations, and step time on H100s
      zerocalc estimate --model llama-3-8b --dp 8 --stage 2 --seq-len 4096 --activation-checkpointing \\
          --gpu h100 --gpu-memory 40GiB
      # What your own ds_config does on 4 nodes of 8 GPUs, as CSV (every time field a column)
      zerocalc estimate --hf-config config.json --nodes 4 --gpus-per-node 8 --ds-config ds_config.json --format csv
    """
    ctx = click.get_current_context()
    explicit = lambda name: ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE  # noqa: E731
    if opts["dp"] is not None and (explicit("nodes") or explicit("gpus_per_node")) \
            and opts["dp"] != opts["nodes"] * opts["gpus_per_node"]:
        raise click.UsageError(f"--dp {opts['dp']} contradicts --nodes {opts['nodes']} × --gpus-per-node "
                               f"{opts['gpus_per_node']} = {opts['nodes'] * opts['gpus_per_node']}: give --dp alone "
                               "or make them agree")
    if opts["dp"] is None:
        check_int("dp", opts["nodes"] * opts["gpus_per_node"], "--nodes × --gpus-per-node")
    lora = _lora(lora_rank, lora_alpha, lora_dropout, lora_targets, peft_config)
    _adaptable(hf_config, lora, freeze)
    spec = _spec(params, model_name, hf_config, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
                 ffn_hidden_size, tie_embeddings)
    stages = _stages(stage_text)
    overrides = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, ffn_hidden_size=ffn_hidden_size, tie_embeddings=tie_embeddings)
    spec = _adapted(spec, model_name, hf_config, overrides, lora, freeze, stages or [0, 1, 2, 3])
    ds = None
    if ds_config is not None:
        ds = _read_ds_config(ds_config, spec)
        missing = [n for n in ds.needs if opts.get(n.replace("-", "_")) is None]
        if "gas" in missing:
            # HF Trainer fills it from TrainingArguments.gradient_accumulation_steps, whose default is 1
            opts["gas"] = 1
            missing.remove("gas")
            click.echo('note: gradient_accumulation_steps "auto" taken as HF Trainer fills it by default: 1 '
                       "(give --gas for yours)", err=True)
        if missing:
            raise click.UsageError(f"the ds_config leaves {', '.join(missing)} at \"auto\": give "
                                   + " and ".join(f"--{n}" for n in missing))
    try:
        setups = _setups(opts, ds, stages, spec.architecture)
    except DsConfigError as err:
        raise InputFailure(f"{ds_config}: {err}")
    except ValueError as err:
        raise click.UsageError(str(err))
    if spec.architecture is None and any(s.seq_len for s in setups):
        spec = _shaped(spec.num_params)   # activations and step time need a shape: as plan's, of exactly P
    spec = _streamed(spec, model_name, hf_config, overrides, lora, setups)
    _modelled(spec, setups)
    cal = _calibration(calibration_name, cpu_adam_rate, host_link_gbps, host_launch_us)
    hw = None
    if gpu_name is not None:
        hw = hardware.gpu(gpu_name, peak_flops_per_s=peak_tflops and peak_tflops * 1e12,
                          intra_node_bytes_per_s=intra_node_gbps and intra_node_gbps * 1e9,
                          inter_node_bytes_per_s=inter_node_gbps and inter_node_gbps * 1e9,
                          gpus_per_node=opts["gpus_per_node"] if opts["nodes"] > 1 else None)
        gpu_memory = gpu_memory or hw.memory_bytes
    elif any(x is not None for x in (peak_tflops, intra_node_gbps, inter_node_gbps)):
        raise click.UsageError("--peak-tflops and the bandwidth flags need --gpu")
    host_memory, host_note = _host_memory(host_memory, hw)
    # Ranks per host: as --nodes says, else, on a named GPU, its preset's node (as `plan` and the step
    # time's inter-node test take it: N = 512 on H200s is 64 hosts of 8, not one of 512)
    ranks_per_node = -(-setups[0].dp // opts["nodes"]) if explicit("nodes") or explicit("gpus_per_node") or hw is None \
        else min(setups[0].dp, hw.gpus_per_node)
    estimates = [estimate(spec, s, gpu_memory, cal, hw, host_memory_bytes=host_memory, ranks_per_node=ranks_per_node)
                 for s in setups]
    for note in resolve.notes(spec, setups, timed=hw is not None):
        click.echo(f"note: {note}", err=True)
    click.echo(render.render(estimates, fmt, host_note, explain))
    if fmt == "table":   # below the table (JSON carries zero_init and dtype in its inputs)
        for note in (_dtype_note(ds, opts.get("dtype")), _zero_init_note(setups, ds, opts.get("zero_init"))):
            if note:
                click.echo(note)



@main.command("plan")
@model_options
@click.option("--gpu", "gpu_name", type=click.Choice(sorted(hardware.PRESETS)), required=True)
@click.option("--gpu-memory", type=SIZE, help="Per-GPU memory [default: the GPU preset's].")
@click.option("--host-memory", type=SIZE,
              help="Host (CPU) memory per node: candidates that overflow it are rejected [default: the GPU "
                   "preset's typical 8-GPU host, printed as an assumption].")
@click.option("--max-gpus", type=_int("max_gpus"), default=8, show_default=True, help="The GPU budget.")
@click.option("--seq-len", type=_int("seq_len"), required=True)
@click.option("--global-batch", type=_int("global_batch"),
              help="Sequences per optimizer step [default: the ds_config's train_batch_size; without one, "
                   "micro-batch × GPUs × its gradient_accumulation_steps, where it fixes both].")
@click.option("--dtype", type=click.Choice(["fp16", "bf16"]), help="[default: bf16, or the ds_config's]")
@click.option("--ds-config", type=click.Path(dir_okay=False),
              help="Your ds_config.json: plan keeps what it sets (stage, offload, buckets, thresholds, and "
                   "micro-batch and accumulation unless \"auto\") and chooses the rest.")
@click.option("--min-gpus", "fewest", is_flag=True, help="Answer the fewest GPUs that can train this.")
@click.option("--price-per-gpu-hour", type=_float("price"), help="Rank by cost per token.")
@click.option("--top", type=_int("top"), default=10, show_default=True)
@click.option("--explain", is_flag=True,
              help="Also say what each column counts, and list the setups left out, grouped by reason.")
@click.option("--expandable-segments", is_flag=True,
              help="Judge fit with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less reserved).")
@click.option("--zero-init/--no-zero-init", default=None, help=(
    "Stage-3 candidates are built under deepspeed.zero.Init, as HF Trainer builds them [default: off, "
    "the model is built outside it, as a plain script does; on for a ds_config written for HF Trainer]."))
@click.option("--calibration", "calibration_name", default="h200", show_default=True,
              help="h200 (shipped), or a file `zerocalc calibrate` wrote from your rows.")
@link_options
@host_options
@adapter_options
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def plan_cmd(params, model_name, hf_config, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
             ffn_hidden_size, tie_embeddings, gpu_name, gpu_memory, host_memory, max_gpus, seq_len, global_batch, dtype,
             ds_config, fewest, price_per_gpu_hour, top, explain, expandable_segments, zero_init, calibration_name,
             gpus_per_node, intra_node_gbps, inter_node_gbps,
             cpu_adam_rate, host_link_gbps, host_launch_us, lora_rank, lora_alpha, lora_dropout, lora_targets, peft_config,
             freeze, fmt):
    """Rank every ZeRO setup that fits by predicted throughput (or cost).

    Enumerates stage × offload × GPU count (powers of two, whole nodes past one) × micro-batch ×
    gradient accumulation (global batch / micro-batch / GPUs) × activation checkpointing. Each row:
    GiB per GPU, fits (yes, or tight: can OOM at the worst allocator overhead measured), the step time,
    tokens/s, MFU, and the step's share waiting on the wire and (stage 3) on all-gather calls.
    --params has no shape: a Llama-like one of exactly P is assumed, and stated.

    \b
    Examples:
      # The fastest way to train a 70B model on up to 64 H100s, 4k tokens, 1024 sequences a step
      zerocalc plan --params 70e9 --gpu h100 --max-gpus 64 --seq-len 4096 --global-batch 1024
      # The fewest 40 GB A100s that can train Llama-3-8B at 4k tokens
      zerocalc plan --model llama-3-8b --gpu a100-40g --max-gpus 64 --seq-len 4096 --global-batch 256 --min-gpus
      # Cheapest per token at $2.50 per GPU-hour, with every rejected setup and why
      zerocalc plan --model llama-2-7b --gpu h100 --seq-len 4096 --global-batch 512 --price-per-gpu-hour 2.5 --explain
      # How many GPUs with your own ds_config (its stage, offload and buckets kept)
      zerocalc plan --hf-config config.json --ds-config ds_config.json --gpu a100-80g --max-gpus 64 --seq-len 2048
    """
    from zerocalc import plan
    lora = _lora(lora_rank, lora_alpha, lora_dropout, lora_targets, peft_config)
    _adaptable(hf_config, lora, freeze)
    spec = _spec(params, model_name, hf_config, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
                 ffn_hidden_size, tie_embeddings)
    overrides = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, ffn_hidden_size=ffn_hidden_size, tie_embeddings=tie_embeddings)
    spec = _adapted(spec, model_name, hf_config, overrides, lora, freeze, [0, 1, 2, 3])   # plan tries every stage
    if spec.architecture is None:   # activations and step time need a shape: a Llama-like one of exactly P
        spec = _shaped(spec.num_params)
    note = render.shape_note(spec)
    ds = _read_ds_config(ds_config, spec) if ds_config is not None else None
    space = plan.from_ds_config(ds) if ds else plan.Space()
    fields = {k: v for k, v in (ds.fields if ds else {}).items() if k not in ("stage", "offload_optimizer",
                                                                               "offload_param")}
    if ds is not None and ds.from_trainer:
        fields["hf_trainer"] = True
    fields["dtype"] = dtype or fields.get("dtype", "bf16")
    fields["zero_init"] = zero_init if zero_init is not None else bool(ds and ds.from_trainer)
    if "optimizer" in fields:
        fields["optimizer"] = OPTIMIZERS[fields["optimizer"]]
    if ds is not None and ds.train_batch_size:
        if global_batch is not None and global_batch != ds.train_batch_size:
            raise click.UsageError(f"--global-batch {global_batch} contradicts the ds_config's train_batch_size "
                                   f"{ds.train_batch_size}: give one or make them agree")
        global_batch = ds.train_batch_size
    if global_batch is None and space.gas is None:
        raise click.UsageError("give --global-batch (sequences per optimizer step)" + (
            ", or a ds_config that sets train_batch_size or gradient_accumulation_steps" if ds else ""))
    if ds is not None:
        kept = [f"stage {space.stages[0]:d}", "offload " + "/".join(space.offloads[0])] + \
            ([f"micro-batch {ds.micro_batch}"] if ds.micro_batch else []) + ([f"GAS {ds.gas}"] if ds.gas else []) + \
            ([f"global batch {ds.train_batch_size}"] if ds.train_batch_size else [])
        ds_note = f"From {ds_config}: {', '.join(kept)} and its buckets kept; the rest chosen" + (
            " (the global batch is micro-batch × GPUs × GAS, so it grows with the GPUs)." if global_batch is None else ".")
        note = f"{note}\n{ds_note}" if note else ds_note
    init_note = (f"zero.Init: {'on' if fields['zero_init'] else 'off'} for stage-3 candidates ("
                 + ("--zero-init" if zero_init else "the ds_config is HF Trainer's, which builds under it"
                    if fields["zero_init"] else "default; --zero-init if the model is built under it, as HF "
                                                "Trainer does") + ")")
    cal = _calibration(calibration_name, cpu_adam_rate, host_link_gbps, host_launch_us)
    hw = _linked(gpu_name, gpus_per_node, intra_node_gbps, inter_node_gbps)
    memory = gpu_memory or hw.memory_bytes
    try:
        base = Setup(seq_len=seq_len, attention="sdpa", expandable_segments=expandable_segments, **fields)
    except (TypeError, ValueError) as err:
        raise click.UsageError(str(err))
    if ds is not None:
        from zerocalc import dsconfig
        try:
            dsconfig.check_setup(ds, space.stages[0], base.dtype, base.grad_accum_dtype, space.offloads[0][0])
        except DsConfigError as err:
            raise InputFailure(f"{ds_config}: {err}")
    _modelled(spec, [base])
    host_memory, host_note = _host_memory(host_memory, hw)
    # the candidates `estimate` judges (`plan.top`) are simulated with the adapted model's own stream
    spec = _streamed(spec, model_name, hf_config, overrides, lora,
                     [replace(base, stage=Stage(s), activation_checkpointing=c) for s in space.stages
                      for c in (False, True)])
    cands = plan.candidates(spec, hw, base, global_batch, memory, 1, max_gpus, cal, host_memory, explain, space)
    dropped = []
    if fewest:
        best = plan.fewest_gpus(cands)
        ranked = [best] if best else []
    else:
        ranked, dropped = plan.top(plan.rank(cands, price_per_gpu_hour), top)
    click.echo(render.plan(spec, hw, memory, ranked, cands + dropped if explain else None, price_per_gpu_hour, fmt,
                           note, fewest, host_memory, host_note))
    if fmt == "table":
        click.echo(init_note)
    if not ranked:
        sys.exit(1)


def _list(parse, limit, option):
    """A comma-separated list, each item parsed and range-checked; an empty list refused."""
    def convert(ctx, param, value):
        if value is None:          # an optional list not given
            return None
        try:
            items = [x for x in str(value).split(",") if x.strip()]
            if not items:
                raise ValueError("give at least one value")
            if len(items) > MAX_SWEEP_VALUES:
                raise ValueError(f"{len(items):,} values; a sweep takes at most {MAX_SWEEP_VALUES:,} per axis")
            return [check_int(limit, parse(x), option) for x in items]
        except ValueError as err:
            raise click.BadParameter(f"{value!r}: {err} (give a comma-separated list)")
    return convert


_PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}   # the sweep's param_bytes axis, per --dtype


def _whole(text):
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{text.strip()!r} is not a whole number")


# A sweep evaluates about a kilobyte of numpy arrays per row; 2^21 rows keep it to a few hundred MB.
# Each distinct stage-3 parameter count costs one trace replay (milliseconds): 1000 values per axis.
MAX_SWEEP_ROWS = 2**21
MAX_SWEEP_VALUES = 1000
MAX_MODEL_SWEEP_ROWS = 10_000     # a named model's points are estimates, milliseconds each


@main.command("sweep")
@click.option("--params", "params_list", callback=_list(parse_count, "params", "--params"),
              help="Comma list of parameter counts: 1e9,7B,70e9 (or one --model / --hf-config).")
@click.option("--model", "model_name", type=_ModelName(),
              help="One shipped model instead of --params (`zerocalc models`), with its own tensors; needed for "
                   "LoRA and --freeze.")
@click.option("--hf-config", type=click.Path(), help="One Hugging Face config.json instead of --params.")
@click.option("--dp", "dp_list", default="1,8,64", show_default=True, callback=_list(_whole, "dp", "--dp"))
@click.option("--stage", "stage_list", default="0,1,2,3", show_default=True,
              callback=_list(_whole, "elements", "--stage"))
@click.option("--dtype", "dtype_list", default="bf16", show_default=True,
              help="bf16, fp16 and/or fp32. fp16 and bf16 hold the same bytes (param_bytes 2, one set of rows); "
                   "fp16's 1-byte overflow all-reduce at stage 3 is left out, as are the other few-byte collectives.")
@click.option("--gas", "gas_list", default="1", show_default=True, callback=_list(_whole, "gas", "--gas"))
@click.option("--gpu", "gpu_name", type=click.Choice(sorted(hardware.PRESETS)),
              help="Add comm_s: the wire bytes at this GPU's links (NVLink in a node, the network across nodes).")
@click.option("--calibration", "calibration_name",
              help="Add reserved_bytes (the peak times its reserved/allocated ratio); with --gpu, its link "
                   "efficiency sets comm_s [default with --gpu: h200].")
@link_options
@adapter_options
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="CSV file [default: standard output].")
def sweep_cmd(params_list, model_name, hf_config, dp_list, stage_list, dtype_list, gas_list, gpu_name,
              calibration_name, gpus_per_node, intra_node_gbps, inter_node_gbps, lora_rank, lora_alpha, lora_dropout,
              lora_targets, peft_config, freeze, out_path):
    """Every combination of the lists, vectorized: resident and peak bytes, logged and wire
    communication per rank, for P-only models (no activations). A million rows take about a second.
    With --gpu or --calibration, also reserved bytes and (with --gpu) the communication's time.
    One --model or --hf-config instead of --params is swept point by point with its own tensors, as
    `estimate` has them (no activations), with LoRA or frozen modules as estimate takes them.

    \b
    Example:
      zerocalc sweep --model qwen2.5-7b --lora-rank 16 --dp 1,8,64 --stage 1,2,3"""
    import csv
    import os
    import tempfile
    from zerocalc import sweep
    if (params_list is None) == (model_name is None and hf_config is None):
        raise click.UsageError("give --params (a list), or one --model or --hf-config")
    lora = _lora(lora_rank, lora_alpha, lora_dropout, lora_targets, peft_config)
    if params_list is None:
        _adaptable(hf_config, lora, freeze)
        spec = _adapted(_model(None, model_name, hf_config, {}), model_name, hf_config, {}, lora, freeze, stage_list)
        params_list = [spec.num_params]
    elif lora is not None or freeze:
        raise click.UsageError("LoRA and --freeze need the model's modules: give --model NAME or --hf-config "
                               "config.json instead of --params")
    else:
        spec = None
    dtype_list = [d.strip() for d in dtype_list.split(",") if d.strip()]
    unknown = [d for d in dtype_list if d not in _PARAM_BYTES]
    if unknown or not dtype_list:
        raise click.BadParameter(f"{', '.join(unknown) or 'nothing'}: give bf16, fp16 or fp32", param_hint="--dtype")
    bad = [s for s in stage_list if s not in (0, 1, 2, 3)]
    if bad:
        raise click.BadParameter(f"stage {bad[0]} does not exist: stages are 0-3", param_hint="--stage")
    few = [p for p in params_list if p < sweep.TENSORS]
    if few:
        raise click.BadParameter(f"{few[0]}: the sweep takes P as {sweep.TENSORS} equal tensors, so it needs at least "
                                 f"{sweep.TENSORS} parameters (use estimate for smaller models)", param_hint="--params")
    param_bytes = list(dict.fromkeys(_PARAM_BYTES[d] for d in dtype_list))
    rows = len(params_list) * len(dp_list) * len(stage_list) * len(param_bytes) * len(gas_list)
    if rows > MAX_SWEEP_ROWS:
        raise click.UsageError(f"{rows:,} combinations; a sweep writes at most {MAX_SWEEP_ROWS:,} rows at once "
                               "(about a few hundred MB of arrays): split it into several sweeps")
    if out_path:
        inputs.check_output_path(out_path)
    if gpu_name is None and any(x is not None for x in (gpus_per_node, intra_node_gbps, inter_node_gbps)):
        raise click.UsageError("--gpus-per-node and the bandwidth flags need --gpu")
    cal = _calibration(calibration_name or "h200", None, None) if gpu_name or calibration_name else None
    axes = dict(dp=dp_list, stage=stage_list, param_bytes=param_bytes, gas=gas_list)
    if spec is None:
        g = sweep.grid(num_params=params_list, **axes)
        out = sweep.evaluate(g)
        columns = sweep.table(g, out)
    else:
        if rows > MAX_MODEL_SWEEP_ROWS:
            raise click.UsageError(f"{rows:,} combinations; a model's sweep, point by point, takes at most "
                                   f"{MAX_MODEL_SWEEP_ROWS:,}: split it into several sweeps")
        g, out = sweep.of_model(spec, **axes)
        columns = sweep.table(g, out)
    if cal is not None:
        hw = _linked(gpu_name, gpus_per_node, intra_node_gbps, inter_node_gbps) if gpu_name else None
        columns.update(sweep.calibrated_columns(g, out, cal, hw))
    if not out_path:
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(columns)
        w.writerows(zip(*columns.values()))
        return
    # Written beside the target and renamed over it: a full disk leaves no half-written file.
    folder = os.path.dirname(os.path.abspath(out_path))
    fd, tmp = tempfile.mkstemp(prefix=".zerocalc-sweep-", suffix=".csv", dir=folder)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(columns)
            w.writerows(zip(*columns.values()))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)    # as open() would have created it
        os.replace(tmp, out_path)
    except OSError as err:
        os.unlink(tmp)
        raise InputFailure(f"cannot write {out_path}: {err.strerror or err}; nothing was written")
    click.echo(f"{len(g['num_params']):,} rows -> {out_path}", err=True)


def _measured_rows(paths, gpu_name):
    from zerocalc import measured
    return measured.read(paths, hardware.gpu(gpu_name))


@main.command("calibrate")
@click.argument("csv_paths", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="The calibration file to write (JSON), for --calibration.")
@click.option("--gpu", "gpu_name", type=click.Choice(sorted(hardware.PRESETS)), default="h200", show_default=True,
              help="The GPU the rows ran on (its peak and link bandwidths).")
@click.option("--calibration", "calibration_name", default="h200", show_default=True,
              help="The calibration whose constants the rows do not determine are kept.")
def calibrate_cmd(csv_paths, out_path, gpu_name, calibration_name):
    """Fit the constants your measured rows determine: step time (compute efficiency, element-wise
    traffic, host launch costs, link efficiency within and across nodes, the optimizer step, offload's
    host rates), the caching allocator's reserved/allocated ratios and the GPU's own memory. Each fitted
    constant is printed with its fit error and the rows it rests on; the others keep the shipped values
    and are named, with why.

    ROWS: CSV files, from `python -m validate run` or your own jobs (docs/your-cluster.md).

    \b
    Examples:
      zerocalc calibrate rows.csv -o mycluster.json
      zerocalc estimate --model llama-2-7b --dp 16 --nodes 2 --gpus-per-node 8 --seq-len 4096 --gpu h100 \\
          --calibration mycluster.json
    """
    import json as _json
    from zerocalc import calibrate, report
    inputs.check_output_path(out_path)
    base = _calibration(calibration_name, None, None)
    rows, notes = _measured_rows(csv_paths, gpu_name)
    try:
        result = calibrate.calibrate(rows, base, list(csv_paths), notes) if rows else None
    except ValueError as err:
        raise InputFailure(str(err))
    if result is None:
        raise InputFailure(f"no usable row in {', '.join(csv_paths)}" + (f" ({notes[0]})" if notes else ""))
    try:
        with open(out_path, "w") as f:
            _json.dump(result.calibration, f, indent=2)
            f.write("\n")
    except OSError as err:
        raise InputFailure(f"cannot write {out_path}: {err.strerror or err}")
    click.echo(report.calibration_text(result, len(rows), out_path))


@main.command("report")
@click.argument("csv_paths", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--gpu", "gpu_name", type=click.Choice(sorted(hardware.PRESETS)), default="h200", show_default=True,
              help="The GPU the rows ran on.")
@click.option("--calibration", "calibration_name", default="h200", show_default=True,
              help="Predict with this calibration (a file `zerocalc calibrate` wrote).")
@click.option("--figure", "figure_path", type=click.Path(dir_okay=False),
              help="Also draw predicted against measured to this image (PNG, PDF, SVG; needs matplotlib).")
def report_cmd(csv_paths, gpu_name, calibration_name, figure_path):
    """zerocalc's predictions against your measured rows: step time, peak allocated and reserved, row by
    row, then how many are within 15% (step time, also by regime), 3% (allocated) and 8% (reserved).

    ROWS: CSV files, from `python -m validate run` or your own jobs (docs/your-cluster.md).

    \b
    Examples:
      zerocalc report rows.csv --figure rows.png
      zerocalc report rows.csv --calibration mycluster.json
    """
    from zerocalc import report
    if figure_path:
        inputs.check_output_path(figure_path)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise InputFailure("--figure needs matplotlib: pip install 'zerocalc[plot]' (or pip install matplotlib)")
    cal = _calibration(calibration_name, None, None)
    rows, notes = _measured_rows(csv_paths, gpu_name)
    if not rows:
        raise InputFailure(f"no usable row in {', '.join(csv_paths)}" + (f" ({notes[0]})" if notes else ""))
    label = f"{len(rows)} rows of {', '.join(csv_paths)}, calibration {calibration_name}"
    compared = report.compare(rows, cal)
    if not any(c.step_s or c.predicted_allocated_bytes for c in compared):
        raise InputFailure("no usable row: none has a step time (measured_step_s, with seq_len and a model with a "
                           "shape) or a measured peak (measured_peak_allocated_bytes)")
    click.echo(report.table(compared, label))
    for n in notes:
        click.echo(f"note: {n}")
    if figure_path:
        report.figure(compared, figure_path, label)
        click.echo(f"wrote {figure_path}")


@main.command("models")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def models_cmd(fmt):
    """The models --model names: the shipped profiles, read from each model's own code
    (`zerocalc/profiles/`), with P, layers, hidden size and experts; "family" where the validator's
    family is the model at its sizes (its measured stream and activation formula: `zerocalc.family`);
    and the Hub repository its config was read from, which --model takes too (as its -Instruct, -chat,
    -it, -Base releases)."""
    rows = resolve.listing()
    if fmt == "json":
        click.echo(json.dumps(rows, indent=1))
        return
    click.echo(f"{'name':22s} {'model_type':13s} {'P':>16s} {'layers':>6s} {'hidden':>6s} {'experts':>8s}  {'read from':9s}  Hub id")
    for r in rows:
        experts = f"{r['experts_per_token']}/{r['num_experts']}" if r["num_experts"] else "-"
        click.echo(f"{r['name']:22s} {r['model_type']:13s} {r['num_params']:>16,} {r['num_layers']:>6d} "
                   f"{r['hidden_size']:>6d} {experts:>8s}  {r['source']:9s}  {r['hub_id']}")


if __name__ == "__main__":
    sys.exit(main())
