"""Model FLOPs of a step, counted on its jaxpr: every matrix multiply and convolution, with the
body of a `scan` (a stack of layers) counted once per iteration.

Why not XLA's cost analysis: it counts a while loop's body once, so a model whose layers run in a
scan reports the FLOPs of one layer (and it also counts elementwise work, which MFU conventionally
leaves out). For a transformer this count is the textbook one: 2 FLOPs per multiply-add, i.e.
6 x (parameters in matrix multiplies) x tokens for forward and backward, plus the attention scores
and weighted sums (forward 4 x layers x length x width per token, backward twice that). With
activation checkpointing the recomputed forward is counted too (it is work the device does).
"""

import math


try:  # the jaxpr types moved between JAX versions
    from jax.extend.core import ClosedJaxpr, Jaxpr
except ImportError:  # pragma: no cover
    from jax.core import ClosedJaxpr, Jaxpr


def _sub_jaxprs(value):
    if isinstance(value, ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def jaxpr_flops(jaxpr: Jaxpr) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
        elif name == "conv_general_dilated":
            rhs, spec = eqn.invars[1].aval.shape, eqn.params["dimension_numbers"].rhs_spec
            # rhs_spec: (output features, input features per group, spatial...)
            per_output = math.prod(rhs[d] for d in spec[1:])
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * per_output
        subs = [s for v in eqn.params.values() for s in _sub_jaxprs(v)]
        if name == "cond":  # one branch runs: count the costliest
            total += max((jaxpr_flops(s) for s in subs), default=0.0)
        else:
            times = eqn.params.get("length", 1) if name == "scan" else 1
            total += times * sum(jaxpr_flops(s) for s in subs)
    return total


def xla_flops(compiled) -> float | None:
    """FLOPs of one call of a compiled program, per device, as XLA's cost analysis counts them
    (loop bodies once; elementwise work included): the cross-check for jaxpr_flops."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # not every backend implements it
        return None
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    flops = (analysis or {}).get("flops")
    return float(flops) if flops and flops > 0 else None
