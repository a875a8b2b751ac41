# Source at the start of a command on the H200 machine, from the project's root, with .whl carried
# (built here by ../shared/device/make-wheelhouse.sh): installs DeepSpeed 0.19.8 and what it lacks
# into /tmp/site. Copied from ../shared/device/setup-gpu.sh, which does not travel.
[ -d /tmp/site/deepspeed ] ||   # a second sweep in one command keeps the install (and FusedAdam's build)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
# The image sets TORCH_CUDA_ARCH_LIST=9.0a; DeepSpeed 0.19.8's op builder cannot parse '9.0a' and fails
# to JIT-build FusedAdam ("invalid literal for int() with base 10: '0a'"). 9.0 builds it.
export TORCH_CUDA_ARCH_LIST=9.0
