"""zerocalc: per-rank memory and communication of DeepSpeed ZeRO stages 0–3, as DeepSpeed 0.19.8
really behaves. Pure Python over numpy-free arithmetic; never imports torch or DeepSpeed."""
__version__ = "0.1.0"
DEEPSPEED_VERSION = "0.19.8"   # the version every formula was read from and checked against
