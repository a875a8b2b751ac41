"""Where it runs: GPU presets. Peak dense bf16/fp16 tensor throughput and link bandwidths per
direction from the vendors' data sheets; memory as `nvidia-smi` reports it. `host_memory_bytes` is a
typical host's memory per node, that of the vendor's 8-GPU system (DGX H200/H100: 2 TiB; DGX A100
640 GB: 2 TiB, 320 GB: 1 TiB; DGX-2: 1.5 TiB): an assumption the CLI prints whenever it uses it, since
cloud hosts often carry far less (one H200 VM measured here had 125 GiB)."""
from dataclasses import dataclass, replace

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops_per_s: float          # dense bf16/fp16 tensor-core peak
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float    # NVLink/NVSwitch, per direction per GPU
    inter_node_bytes_per_s: float    # network per GPU (e.g. 400 Gb/s InfiniBand = 50 GB/s)
    gpus_per_node: int
    memory_bytes: int
    host_memory_bytes: int | None = None   # typical host RAM per node (an assumption; see the docstring)


PRESETS = {
    "h200": Hardware("h200", 989e12, 4.8e12, 450e9, 50e9, 8, 143771 * 2**20, 2048 * GiB),
    "h100": Hardware("h100", 989e12, 3.35e12, 450e9, 50e9, 8, 80 * GiB, 2048 * GiB),
    "a100-80g": Hardware("a100-80g", 312e12, 2.04e12, 300e9, 25e9, 8, 80 * GiB, 2048 * GiB),
    "a100-40g": Hardware("a100-40g", 312e12, 1.56e12, 300e9, 25e9, 8, 40 * GiB, 1024 * GiB),
    "v100-32g": Hardware("v100-32g", 125e12, 0.9e12, 150e9, 12.5e9, 8, 32 * GiB, 1536 * GiB),
}


def gpu(name: str, **overrides) -> Hardware:
    if name not in PRESETS:
        raise ValueError(f"unknown GPU {name!r}; presets: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
