"""Picks emulated-card configurations near zerocalc's boundary whose verdict does not depend on timing:
random Llama shapes (make_fake_scale.M), stages 1-3, N = 8-256; those whose unbounded reserved is within
14% of a card's allocator capacity are estimated on that card, and those within 2-10% of their boundary
(headroom / capacity), not timing-dependent, are printed. The set run is chosen from these by hand for
spread (h200-cards-chosen-2.json, then make_fake_cards.py):
    python validate/matrices/choose_cards.py SEED COUNT OUT.json
With --hf, published Hugging Face configs (validate/hf_configs: biases, MoE, tied heads, dropout, other
norms and positions) at N = 8-64 instead, predicted from their trace as `estimate --hf-config` does
(needs the trace extra; h200-cards-chosen-3.json):
    python validate/matrices/choose_cards.py SEED COUNT OUT.json --hf
or with --hf=CONFIG,... those config.json files (the Hub's, tests/data/hub-configs; h100-cards-chosen-4.json)."""
import json, random, sys, os
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE); sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from multiprocessing import Pool
from make_fake_cards import CONTEXT_BYTES as CONTEXT
from make_fake_scale import M
from zerocalc import arch as _arch
from zerocalc.estimate import estimate
from validate import hf_models
from validate.jobs import make_hf_job, make_job, to_zerocalc
CARDS = [24, 40, 48, 80, 94]
# Published configs the validator has trained before, up to 8B (a job of five steps stays under a minute
# on rank 0 of a fake world, which computes the whole micro-batch).
HF = ["qwen2.5-1.5b", "qwen2.5-7b", "qwen3-1.7b", "phi-3-mini-4k", "olmo-2-1b", "starcoder2-3b", "granite-3.0-2b",
      "stablelm-2-1.6b", "smollm3-3b", "gpt2-xl", "falcon-7b", "pythia-1b", "opt-1.3b", "bloom-560m",
      "granite-3.0-1b-a400m", "olmoe-1b-7b", "qwen1.5-moe-a2.7b", "gemma-2b"]
HF_MODE = any(a.startswith("--hf") for a in sys.argv)
HF = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--hf=")), HF)

def cand(rng):
    m = rng.choice(HF if HF_MODE else ["1b", "1bt", "3b", "7b", "8b", "13b", "34b", "70b"])
    st = rng.choice([1, 2, 3, 3])
    n = rng.choice([8, 16, 32, 64] if HF_MODE else [8, 16, 32, 64, 256])
    mb = rng.choice([1, 2, 4, 8]); seq = rng.choice([1024, 2048, 4096])
    ck = rng.choice([True, False]); gas = rng.choice([1, 1, 2])
    zi = rng.choice([True, False]) if st == 3 else None
    return dict(m=m, st=st, n=n, mb=mb, seq=seq, ck=ck, gas=gas, zi=zi)

def setup_of(c, cap=None):
    kw = dict(stage=c["st"], dtype="bf16", micro_batch=c["mb"], seq_len=c["seq"], activation_checkpointing=c["ck"],
              gas=c["gas"], zero_weights=True)
    if c["st"] == 3: kw["zero_init"] = c["zi"]
    if cap: kw["allocator_capacity_bytes"] = cap
    if c["m"] not in M:    # a published config: its spec from the trace (to_zerocalc's needs a run)
        job = make_hf_job({"config": c["m"]}, c["n"], **kw)
        return hf_models.traced_spec(job), to_zerocalc(job)[1]
    job = make_job(_arch.Architecture(**M[c["m"]]), c["n"], **kw)
    return to_zerocalc(job)

def first(c):
    try:
        spec, setup = setup_of(c)
        e = estimate(spec, setup)
        return c, int(e.peak_bytes), int(e.peak_reserved_bytes)
    except Exception as ex:
        return c, None, repr(ex)

def second(arg):
    c, card = arg
    cap = card * 2**30 - CONTEXT
    spec, setup = setup_of(c, cap)
    e = estimate(spec, setup, gpu_memory_bytes=cap + CONTEXT)
    td = bool(e.at_capacity is not None and e.at_capacity.timing_dependent)
    return dict(c, card=card, fits=bool(e.fits_device), rel=e.headroom_bytes / cap, td=td, source=e.fits_source,
                alloc=int(e.peak_bytes), res=int(e.peak_reserved_bytes))

if __name__ == "__main__":
    rng = random.Random(int(sys.argv[1])); k = int(sys.argv[2])
    cs = {json.dumps(c, sort_keys=True): c for c in (cand(rng) for _ in range(k))}.values()
    with Pool(2) as p:
        r1 = p.map(first, list(cs))
    near = []
    for c, a, res in r1:
        if a is None: continue
        for card in CARDS:
            cap = card * 2**30 - CONTEXT
            if 0.86 * cap < res < 1.14 * cap and a < 1.02 * cap:
                near.append((c, card))
    print(len(r1), "candidates,", len(near), "near", file=sys.stderr)
    with Pool(2) as p:
        r2 = p.map(second, near)
    json.dump(r2, open(sys.argv[3], "w"), indent=0)
    for r in r2:
        if 0.02 <= abs(r["rel"]) <= 0.10 and not r["td"]:
            print(r)
