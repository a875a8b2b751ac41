"""Stage 3's fetch order against DeepSpeed 0.19.8's own, logged module by module on a CPU rank 0 of a fake
world (`validate run --backend cpu --fake-world`, matrices validate/matrices/cpu-stage3-order-*.json,
rows tests/data/cpu-stage3-order.csv): GPT-2 with its dropout, whose checkpointed layers DeepSpeed
recomputes from the last dropout on, Mixtral, whose MoE blocks are stage-3 leaves (data/README.md,
"GPT-2 with its dropout"), and Llama-3.1-405B, whose layers outgrow the reuse distance (data/README.md,
"405B and Mixtral at scale")."""
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The hooks DeepSpeed ran in one training step of the 2-layer GPT-2 of cpu-stage3-order-n4.json,
# checkpointed (a coordinator patched to log each fetch_sub_module: its module's own parameters, and
# whether it ran as forward's hook): the wrapper, the model, the embeddings, each block's
# ln_1, attn (c_attn, c_proj, resid_dropout), ln_2, mlp (c_fc, act, c_proj, dropout), ln_f, the tied head.
FORWARD = [(), (), (), (0,), (1,), (), (), (2, 3), (), (4, 5), (6, 7), (), (8, 9), (), (10, 11), (), (12, 13), (),
           (), (14, 15), (), (16, 17), (18, 19), (), (20, 21), (), (22, 23), (), (24, 25), (), (26, 27), (0,)]
# Backward: each block's container, mlp and last dropout hooks first, then the block run forward again up
# to its last dropout (R: a forward hook inside backward), then the rest of its backward hooks.
BACKWARD = "() () (0,) () (26,27) () () () " \
           "R(14,15) R() R(16,17) R(18,19) R() R(20,21) R() R(22,23) R() R(24,25) R() " \
           "(24,25) () (22,23) (20,21) () () (18,19) (16,17) (14,15) () () () " \
           "R(2,3) R() R(4,5) R(6,7) R() R(8,9) R() R(10,11) R() R(12,13) R() " \
           "(12,13) () (10,11) (8,9) () () (6,7) (4,5) (2,3) () (1,) (0,)"


def _steps(text):
    out = []
    for item in text.split():
        again = item.startswith("R")
        inside = item.lstrip("R")[1:-1].rstrip(",")
        out.append((tuple(int(x) for x in inside.split(",")) if inside else (), again))
    return out


def test_gpt2_checkpointed_hooks_run_in_deepspeeds_order():
    """The traced GPT-2's forward and checkpointed backward steps are the 32 and 54 hooks DeepSpeed ran,
    in order, recomputations where it recomputed: a dropout at p > 0 keeps its mask, so the
    recomputation starts after its hook and runs up to it."""
    pytest.importorskip("torch")
    from zerocalc.hf import trace
    from zerocalc.model import from_profile
    cfg = json.load(open(os.path.join(ROOT, "validate", "matrices", "cpu-stage3-order-n4.json")))["hf_models"][1]["config"]
    assert cfg["n_layer"] == 2 and cfg["resid_pdrop"] == 0.1
    spec = from_profile(trace.trace(cfg, "gpt2-2l", activations=False, steps=False))
    assert [tuple(s) for s in spec.trace] == FORWARD
    backward = _steps(BACKWARD)
    assert [tuple(s) for s in spec.backward(True)] == [s for s, _ in backward]
    assert list(spec.recomputed(True)) == [again for _, again in backward]


def test_stage3_communication_to_the_byte():
    """Every row's logged communication equals what zerocalc predicts from the traced config and from the
    calls the run recorded (its dropouts and leaves with them). Before the
    dropout's mask and the leaf rule were replayed, GPT-2 XL's shape checkpointed was predicted 51,200 B a
    step short (one MLP weight DeepSpeed gathers again) and Mixtral's 12,160 B over (it keeps gathered
    what a leaf's release reads as used again). Llama-3.1-405B's config scaled down (its MLP weights 87% of
    the reuse distance, as in the full model) was 1,664 B over, one down projection a layer: DeepSpeed
    releases a module after its backward, so the down projection whose backward starts the
    recomputation stays gathered through it (the H200 row of the full model,
    data/h200-fake-s5-405b-n1024.csv, was 214,695,936 B over, now exact)."""
    pd = pytest.importorskip("pandas")
    pytest.importorskip("torch")
    from validate import hf_models
    from validate.jobs import to_zerocalc
    from validate.rows import job_from_row, predicted_state_bytes
    from zerocalc.estimate import estimate
    rows = pd.read_csv(os.path.join(ROOT, "tests", "data", "cpu-stage3-order.csv"))
    assert len(rows) == 6 and set(rows["nproc"]) == {4, 256, 1024} and (rows["stage"] == 3).all()
    for _, r in rows.iterrows():
        job = job_from_row(r.to_dict())
        recorded, setup = to_zerocalc(job)      # the calls the run recorded (`zerocalc.probe.record`)
        for spec in (hf_models.traced_spec(job), recorded):
            e = estimate(spec, setup)
            assert e.comm_bytes == r["measured_comm_bytes"], r["key"]
            assert predicted_state_bytes(e, "cpu") == r["measured_state_bytes"], r["key"]
