"""Writes the fake-world matrices of the first scale call (validate/matrices/h200-fake-*.json):
    python validate/matrices/make_fake_scale.py validate/matrices"""
import json, sys
L = lambda v,h,l,a,k,f,tie=False: dict(family="hf-llama", vocab_size=v, hidden_size=h, num_layers=l, num_heads=a, num_kv_heads=k, ffn_hidden_size=f, tie_embeddings=tie, max_positions=8192)
M = {
 "1b": L(128256, 2048, 16, 32, 8, 8192),          # Llama-3.2-1B shape, untied
 "1bt": L(128256, 2048, 16, 32, 8, 8192, True),   # tied, as published
 "3b": L(128256, 3072, 28, 24, 8, 8192),          # Llama-3.2-3B shape, untied
 "7b": L(32000, 4096, 32, 32, 32, 11008),         # Llama-2-7B
 "8b": L(128256, 4096, 32, 32, 8, 14336),         # Llama-3-8B
 "13b": L(32000, 5120, 40, 40, 40, 13824),        # Llama-2-13B
 "34b": L(32000, 8192, 48, 64, 8, 22016),         # CodeLlama-34B
 "70b": L(32000, 8192, 80, 64, 8, 28672),         # Llama-2-70B
 "405b": L(128256, 16384, 126, 128, 8, 53248),    # Llama-3.1-405B
}
def job(m, stage, mb, seq, ckpt, gas=1, zi=None, dtype="bf16", **kw):
    """A Llama shape of M, or, for a name M lacks, a published config under validate/hf_configs (one timed step)."""
    model, timed = (dict(arch=M[m]), {}) if m in M else (dict(hf={"config": m}), {"timed_steps": 1})
    j = dict(model, stage=stage, dtype=dtype, micro_batch=mb, seq_len=seq, activation_checkpointing=ckpt,
             gas=gas, zero_weights=True, **timed, **kw)
    if stage == 3:
        j["zero_init"] = True if zi is None else zi
    return j
lanes = {  # lane -> {nproc: [jobs]}
 "a": {64: [job("70b",3,1,2048,True), job("70b",3,1,2048,True,gas=2), job("34b",3,1,4096,True)],
       256: [job("70b",3,1,4096,True)],
       1024: [job("70b",3,2,2048,True), job("405b",3,1,1024,True)]},
 "b": {16: [job("13b",3,1,4096,True), job("8b",2,1,2048,True)],
       64: [job("13b",3,1,4096,True), job("13b",3,1,4096,True,zi=False), job("13b",3,2,2048,True,gas=2),
            job("7b",2,1,2048,False), job("8b",3,1,2048,False)],
       256: [job("13b",3,1,2048,False), job("7b",1,2,2048,True)]},
 "c": {8: [job("1b",1,4,1024,False), job("1b",2,8,1024,True), job("1b",2,2,2048,False,gas=2), job("1b",3,4,2048,True),
           job("1b",3,2,2048,False,zi=False)],
       16: [job("3b",2,4,2048,True), job("3b",3,2,2048,False), job("3b",3,8,1024,True,gas=2)],
       64: [job("1b",1,8,512,False), job("1b",3,1,2048,False), job("1bt",2,4,2048,True), job("1bt",3,4,1024,False)],
       1024: [job("1b",2,2,2048,True), job("1b",3,2,2048,True), job("3b",3,4,1024,False,zi=False)]},
}
if __name__ == "__main__":
    out = sys.argv[1]
    for lane, by_n in lanes.items():
        for n, jobs in by_n.items():
            name = f"{out}/h200-fake-{lane}-n{n}.json"
            json.dump({"about": "rank 0 of a fake world of nproc ranks (validate run --fake-world), zero weights; "
                       "the first scale call (data/README.md)", "nproc": n, "jobs": jobs}, open(name, "w"), indent=1)
