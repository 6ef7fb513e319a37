"""Does zero bubble (Qi et al. 2023, ZB-H1: the weight gradient W split from the input gradient B and deferred)
shorten a step of one SPMD program whose stages tick in lockstep (shard/strategies/pipeline_1f1b.py)?

In lockstep every stage runs the tick's program: a tick pays F if any stage runs a forward, B if any runs an input
gradient, W if any runs a weight gradient, whatever the other stages do (masked work is still paid). Two
placements on the 1F1B table (`Table`, whose forwards and backwards tests/test_pipeline.py checks tick by tick):
- 1f1b: as built, the backward B + W of a visit at the tick the table gives it;
- zb: B at that tick, W of backward visit j on every stage at the tick stage 0 runs j's B (stage s defers its W by
  s ticks, checked to follow its B), so the S - 1 ticks in which only the last stages have begun their backwards
  pay no W. This meets the lockstep bound (R M + S - 1)(F + B) + R M W.
Per stage: activations kept (visits forwarded, W not yet run: checked to fit 1F1B's ring of slots) and cotangents
pending (B run, W not).
Then what F, B and W cost on one stage of GPT layers, from the compiled program's matrix products: the full
backward, the backward to the input alone, and to the weights alone (what a jax.vjp split can give).

Run: `python bench/zero_bubble.py` (CPU; prints markdown tables).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shard.strategies.pipeline_1f1b import Table  # noqa: E402


def placement(S: int, R: int, M: int, zb: bool):
    """Per tick: (any forward, any input gradient, any weight gradient); per stage: the most visits kept and the
    most cotangents pending at once."""
    table = Table(S, R, M)
    fwd, bwd, wgt, slots, ticks = {}, {}, {}, {}, []
    for t in range(table.ticks):
        kinds = [False, False, False]
        for s in range(S):
            ok, m, r, slot = table.forward(t, s)
            if ok:
                fwd[m, r, s], slots[m, r, s], kinds[0] = t, slot, True
            ok, m, r, _ = table.backward(t, s)
            if ok:
                bwd[m, r, s], kinds[1] = t, True
                if not zb:
                    wgt[m, r, s], kinds[2] = t, True
            ok, m, r, _ = table.backward(t, 0)  # zb: W of what stage 0 runs B of now, on every stage
            if zb and ok:
                assert bwd[m, r, s] <= t  # its B ran on stage s already
                wgt[m, r, s], kinds[2] = t, True
        ticks.append(kinds)
    assert len(fwd) == len(bwd) == len(wgt) == M * R * S
    live = lambda s, t, start, end: [k for k, v in start.items() if k[2] == s and v <= t <= end[k]]
    at = [(s, t) for s in range(S) for t in range(table.ticks)]
    # the visits a stage keeps sit in distinct slots of its ring: the ring of 1F1B's 2 R S - 1 slots holds them
    assert all(len({slots[k] for k in live(s, t, fwd, wgt)}) == len(live(s, t, fwd, wgt)) for s, t in at)
    kept = max(len(live(s, t, fwd, wgt)) for s, t in at)
    pending = max(len(live(s, t, bwd, {k: v - 1 for k, v in wgt.items()})) for s, t in at)
    return ticks, kept, pending


def step(ticks, F, B, W, BW, zb):
    """A step's time: each tick pays each kind of work some stage runs (1f1b's backward, B and W together: BW)."""
    return sum(f * F + (b * B + w * W if zb else b * BW) for f, b, w in ticks)


def stage_costs():
    """F, the full backward, the backward to the input alone and to the weights alone, of two GPT layers (d_model
    256, d_ff 1024, 4 x 256 tokens), in forwards: matrix-product FLOPs of the compiled programs."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from shard.models.gpt import GPT
    from shard.nn import hooks
    from shard.plan import hlo

    with nnx.use_eager_sharding(False):
        model = GPT(vocab_size=256, d_model=256, n_layers=2, n_heads=8, d_ff=1024, max_len=256, rngs=nnx.Rngs(0))
    graphdef, w, rest = nnx.split(model.blocks, nnx.Param, ...)
    x = jnp.ones((4, 256, 256))
    forward = lambda w, x: hooks.scan(nnx.merge(graphdef, w, rest), x)
    flops = lambda fn, *a: hlo.dot_flops(jax.jit(fn).lower(*a).compile().as_text())

    def backward(pick):
        def run(w, x, dy):
            return pick(jax.vjp(forward, w, x)[1](dy))
        return flops(run, w, x, x) - f

    out = {}
    for remat in ("none", "full"):
        with hooks.use(remat=remat):
            f = flops(forward, w, x)
            out[remat] = [backward(pick) / f for pick in (lambda g: g, lambda g: g[1], lambda g: g[0])]
    return out


def main() -> int:
    costs = stage_costs()
    both, dx, dw = costs["none"]
    print("| train.remat | B + W | B alone (dx) | W by a vjp to the weights |\n|---|---:|---:|---:|")
    for remat, (a, b, c) in costs.items():
        print(f"| {remat} | {a:.2f} F | {b:.2f} F | {c:.2f} F |")
    models = {"F=B=W=1": (1, 1, 1, 2), f"ideal split: B {dx:.2f}, W {both - dx:.2f}": (1, dx, both - dx, both),
              f"vjp split: B {dx:.2f}, W {dw:.2f}": (1, dx, dw, both)}
    print("\n| S, R, M | ticks | kept (1f1b, zb) | pending (zb) | F, B, W | 1f1b | zb | no bubble |\n"
          "|---|---:|---:|---:|---|---:|---:|---:|")
    for S, R, M in ((4, 1, 8), (4, 1, 16), (4, 2, 8), (4, 2, 16)):
        plain, kept, _ = placement(S, R, M, zb=False)
        split, kept_zb, pending = placement(S, R, M, zb=True)
        for name, (F, B, W, BW) in models.items():
            one, zb = step(plain, F, B, W, BW, False), step(split, F, B, W, BW, True)
            print(f"| {S}, {R}, {M} | {len(plain)} | {kept}, {kept_zb} | {pending} | {name} | {one:.2f} | "
                  f"{zb:.2f} ({zb / one - 1:+.1%}) | {M * R * (F + BW):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
