"""What zerocalc accepts, checked at the edge: the range of every number with the reason for its
limits, the files it reads (named in every error), and the size of the question (a model so deep
that the stage-3 replay would take minutes is refused up front, with the smaller question offered).

Every check raises `InputError` (a ValueError) whose message names what to fix; the CLI turns it
into exit code 2 and one line."""
import json
import math
import os
from dataclasses import dataclass


class InputError(ValueError):
    """An input zerocalc refuses; the message says what to fix."""


class DsConfigError(InputError):
    """A ds_config DeepSpeed would refuse (or zerocalc cannot model); the message names key and value
    (`zerocalc.dsconfig`, imported only where a ds_config is read)."""


@dataclass(frozen=True)
class Limit:
    low: float
    high: float
    why: str            # why the upper limit is where it is


# Upper limits sit well above any real training run and below where zerocalc's arithmetic or its
# running time would stop being trustworthy.
LIMITS = {
    # 1e15 is 500x the largest dense models trained (~2e12); byte counts of ~20 per parameter stay
    # below 2^63 and element counts below 2^53, where float64 still holds them exactly.
    "params": Limit(1, 10**15, "10^15 parameters (500x the largest models trained) keeps every byte count exact"),
    "dp": Limit(1, 2**20, "2^20 ranks is 10x the largest GPU clusters"),
    "nodes": Limit(1, 2**17, "2^17 nodes is 10x the largest GPU clusters"),
    "gpus_per_node": Limit(1, 1024, "no host holds more than 1024 GPUs"),
    "max_gpus": Limit(1, 2**17, "2^17 GPUs is above the largest GPU clusters"),
    "micro_batch": Limit(1, 2**16, "2^16 sequences per GPU per micro-step"),
    "gas": Limit(1, 2**20, "2^20 accumulation steps"),
    "global_batch": Limit(1, 2**30, "2^30 sequences per step"),
    "seq_len": Limit(1, 2**24, "2^24 tokens (16M) is 16x the longest context trained"),
    # plan simulates every row it shows through the allocator (0.05-0.8 s CPU a row, by model size)
    "top": Limit(1, 100, "plan simulates each row it shows through the allocator; 100 rows take up to a minute"),
    "vocab_size": Limit(1, 2**24, "a vocabulary of 16M tokens is 60x the largest in use"),
    "hidden_size": Limit(1, 2**18, "a hidden size of 262144 is 10x the widest published model"),
    # The stage-3 replay and the allocator simulation grow faster than linearly with the number of
    # parameter tensors (a 500-layer Llama takes ~30 s); 256 layers is twice the deepest published
    # dense model (Llama-3.1-405B, 126) and answers in seconds.
    "num_layers": Limit(1, 256, "zerocalc replays stage 3 module by module; 256 layers (twice "
                                "Llama-3.1-405B's 126) answer in seconds, deeper models would take minutes: ask "
                                "about at most 256 layers, or give --params alone for a P-only answer"),
    "num_heads": Limit(1, 2**14, "16384 attention heads"),
    "num_kv_heads": Limit(1, 2**14, "16384 attention heads"),
    "ffn_hidden_size": Limit(1, 2**20, "an MLP width of 2^20"),
    "max_positions": Limit(1, 2**24, "2^24 positions"),
    # Elements; DeepSpeed's own default for stage3_model_persistence_threshold is sys.maxsize.
    "elements": Limit(0, 2**63 - 1, "DeepSpeed keeps element counts in 64-bit integers"),
    "gpu_memory": Limit(2**20, 2**50, "a GPU between 1 MiB and 1 PiB"),
    # Rates and times: a lower bound too, far below any real machine, so that no quotient overflows.
    "peak_tflops": Limit(1e-3, 1e5, "100 PFLOP/s per GPU is 50x today's fastest"),
    "gbps": Limit(1e-3, 1e5, "100 TB/s per GPU is 50x today's fastest links"),
    "host_launch_us": Limit(1e-3, 1e5, "0.1 s per kernel launch is 10,000x a slow host"),
    "cpu_adam_rate": Limit(1e3, 1e13, "10^13 elements/s is 1000x a fast host"),
    "price": Limit(1e-6, 1e6, "$10^6 per GPU-hour"),
}


def check_int(name: str, value: int, label: str | None = None) -> int:
    """`value` within LIMITS[name]; `label` is how the user wrote it (an option or a config key)."""
    lim, label = LIMITS[name], label or name
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{label} must be a whole number, got {value!r}")
    if value < lim.low:
        raise InputError(f"{label} must be at least {lim.low:,}, got {value:,}")
    if value > lim.high:
        raise InputError(f"{label} = {value:,} is above zerocalc's limit of {int(lim.high):,}: {lim.why}")
    return value


def check_float(name: str, value: float, label: str | None = None) -> float:
    """A finite number in [low, high] of LIMITS[name]; NaN and infinities are refused."""
    lim, label = LIMITS[name], label or name
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{label} must be a finite number, got {value!r}")
    if value < lim.low:
        raise InputError(f"{label} must be at least {lim.low:g}, got {value:g}")
    if value > lim.high:
        raise InputError(f"{label} = {value:g} is above zerocalc's limit of {lim.high:g}: {lim.why}")
    return float(value)


# A configuration file is a few kilobytes; 16 MiB leaves room for anything real and keeps a hostile
# file from costing more than a few hundred MB to read.
MAX_FILE_BYTES = 16 * 2**20


def read_text(path: str, what: str) -> str:
    """The UTF-8 text of a configuration file; every failure names the file."""
    try:
        if os.path.isdir(path):
            raise InputError(f"{path}: is a directory; give the {what} file")
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise InputError(f"{path}: {size:,} bytes is not a {what} (zerocalc reads files up to 16 MiB)")
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise InputError(f"cannot read {what} {path}: {err.strerror or err}")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); "
                         f"save the {what} as UTF-8")


def _refuse_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def load_json_object(path: str, what: str, constants: bool = False) -> dict:
    """A JSON object from a file (an HF config.json, a calibration): a list, a number, or nesting
    deeper than Python's parser goes is refused with the file named; NaN and Infinity too unless
    `constants` (transformers reads a config.json with Python's json, which takes them)."""
    text = read_text(path, what)
    try:
        doc = json.loads(text, **({} if constants else {"parse_constant": _refuse_constant}))
    except json.JSONDecodeError as err:
        raise InputError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})")
    except ValueError as err:   # NaN / Infinity
        raise InputError(f"{path}: not valid JSON ({err})")
    except RecursionError:
        raise InputError(f"{path}: nested too deeply to be a {what}")
    if not isinstance(doc, dict):
        raise InputError(f"{path}: a {what} is a JSON object {{...}}, this file holds a {type(doc).__name__}")
    return doc


# The config.json keys `zerocalc.family.from_config` reads, per model_type: (key, limit, required).
# `null` is accepted only where Hugging Face reads it as "the default" (n_inner, num_key_value_heads).
_HF_KEYS = {
    "gpt2": (("vocab_size", "vocab_size", False), ("n_embd", "hidden_size", False), ("n_layer", "num_layers", False),
             ("n_head", "num_heads", False), ("n_inner", "ffn_hidden_size", False),
             ("n_positions", "max_positions", False)),
    "llama": (("vocab_size", "vocab_size", True), ("hidden_size", "hidden_size", True),
              ("num_hidden_layers", "num_layers", True), ("num_attention_heads", "num_heads", True),
              ("num_key_value_heads", "num_kv_heads", False), ("intermediate_size", "ffn_hidden_size", True),
              ("max_position_embeddings", "max_positions", False)),
}
_HF_KEYS["mistral"] = _HF_KEYS["llama"]
# Any other model_type: the usual size keys, checked where present (null allowed: the model's
# own code decides its default), so a hostile size stops here and not in a trace.
_HF_KEYS_ANY = (("vocab_size", "vocab_size", False), ("hidden_size", "hidden_size", False),
                ("num_hidden_layers", "num_layers", False), ("num_attention_heads", "num_heads", False),
                ("num_key_value_heads", "num_kv_heads", False), ("intermediate_size", "ffn_hidden_size", False))
_HF_NULLABLE = {"n_inner", "num_key_value_heads"}


def check_hf_config(cfg: dict, path: str = "config.json") -> dict:
    """Refuse a Hugging Face config.json that `zerocalc.family.from_config` would misread: every
    size it takes must be a JSON integer in range (not "4096", not null, not 4096.5), required keys
    present. For other model types the usual size keys are checked where present. Returns `cfg`."""
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: a Hugging Face config is a JSON object, this file holds a {type(cfg).__name__}")
    kind = cfg.get("model_type")
    if kind is None:
        raise InputError(f"{path}: no \"model_type\" key; is this a Hugging Face config.json?")
    if not isinstance(kind, str) or not kind.strip():
        raise InputError(f"{path}: model_type = {kind!r}: must be a string such as \"llama\"")
    for key, limit, required in _HF_KEYS.get(kind, _HF_KEYS_ANY):
        if key not in cfg:
            if required:
                raise InputError(f"{path}: no \"{key}\" key, which a {kind} config needs")
            continue
        value = cfg[key]
        if value is None and (key in _HF_NULLABLE or kind not in _HF_KEYS):
            continue
        if kind not in _HF_KEYS and isinstance(value, list) and value:   # one per layer (Gemma 3n's widths)
            for v in value:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise InputError(f"{path}: {key} = {json.dumps(value)}: must be whole numbers (JSON integers)")
                check_int(limit, v, f"{path}: {key}")
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"{path}: {key} = {json.dumps(value)}: must be a whole number (a JSON integer)")
        check_int(limit, value, f"{path}: {key}")
    tie = cfg.get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):
        raise InputError(f"{path}: tie_word_embeddings = {json.dumps(tie)}: must be true or false")
    return cfg


def check_model_size(num_layers: int | None, num_params: int, what: str) -> None:
    """Refuse a model zerocalc cannot answer in seconds or exactly, before any work is done."""
    if num_layers is not None and num_layers > LIMITS["num_layers"].high:
        raise InputError(f"{what} has {num_layers:,} layers, above zerocalc's limit of "
                         f"{int(LIMITS['num_layers'].high)}: {LIMITS['num_layers'].why}")
    check_int("params", num_params, f"{what}'s parameter count")


def check_output_path(path: str) -> None:
    """An output file whose folder exists and can be written, checked before any work."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise InputError(f"{path} is a directory; give a file name")
    if os.path.exists(path) and not os.path.isfile(path):
        # the file is written beside the target and renamed over it: never over a device or a pipe
        raise InputError(f"cannot write {path}: not a regular file (leave out --out to write to standard output)")
    if not os.path.isdir(folder):
        raise InputError(f"cannot write {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise InputError(f"cannot write {path}: the folder {folder} is not writable")
