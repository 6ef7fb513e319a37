"""Model FLOPs of a train step, counted on its jaxpr: every matrix multiply and convolution, with
the body of a `scan` (a stack of layers) counted once per iteration, and attention counted from its
shapes.

Why not XLA's cost analysis: it counts a while loop's body once, so a model whose layers run in a
scan reports the FLOPs of one layer (and it also counts elementwise work, which MFU conventionally
leaves out). For a transformer this count is the textbook one: 2 FLOPs per multiply-add, i.e.
6 x (parameters in matrix multiplies) x tokens for forward and backward, plus attention.

Attention (every call through shard.nn.hooks.attention, whatever the kernel: XLA's matrix products, or
cuDNN's or splash's fused kernel, which has no dot_general to count) is counted from the query, key and
value shapes: forward 2 x (query, key) pairs x (head_dim + value dim) per head, backward twice that.
Causal attention counts the pairs on or below the diagonal, about half the square: the work actually
needed (the convention of MaxText's and PaLM's MFU), not the masked square XLA's kernel computes.
A sliding window counts the pairs inside it, a chunk (Llama 4's chunked attention) the causal pairs inside each
query's chunk; a stack whose layers have different windows or chunks (the call's name lists them with their layer
counts) counts each call at the mean over its layers, so the scan's trip count makes it the sum of every layer's
own.
With activation checkpointing the recomputed forward is counted too (it is work the device does);
MFU and the plan count a trace without it (shard/run/job.py).
"""

import math

from shard.nn import attention
from shard.nn.hooks import NOT_MODEL_FLOPS

# Products a model runs that are not model FLOPs (the gradient of a lookup as a one-hot product,
# models/layers.py): a jitted function of this name counts 0.


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


def train_step_flops(train_jaxpr: Jaxpr, forward_jaxpr: Jaxpr) -> float:
    """Model FLOPs of one train step: its matrix products and convolutions, plus attention counted
    from the forward pass's calls, three times (forward, and backward twice that). The forward pass
    is traced on its own because autodiff splits each attention call into pieces whose inputs are
    residuals, not (q, k, v)."""
    return jaxpr_flops(train_jaxpr) + 3 * attention_flops(forward_jaxpr)


def jaxpr_flops(jaxpr: Jaxpr) -> float:
    """Matrix products (grouped ones, jax.lax.ragged_dot, as the groups' work) and convolutions; attention calls
    (and the pieces autodiff made of them) count 0."""
    def eqn_flops(eqn) -> float:
        if _attention_call(eqn) is not None or (eqn.primitive.name in ("pjit", "jit")
                                                and eqn.params.get("name") == NOT_MODEL_FLOPS):
            return 0.0
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
        if eqn.primitive.name == "ragged_dot_general":  # each row times its group's matrix only: the grouped work
            return _ragged_flops(eqn)
        if eqn.primitive.name == "conv_general_dilated":
            rhs, spec = eqn.invars[1].aval.shape, eqn.params["dimension_numbers"].rhs_spec
            # rhs_spec: (output features, input features per group, spatial...)
            per_output = math.prod(rhs[d] for d in spec[1:])
            return 2.0 * math.prod(eqn.outvars[0].aval.shape) * per_output
        return None

    return _walk(jaxpr, eqn_flops)


def grouped_flops(jaxpr: Jaxpr) -> float:
    """Forward FLOPs of the grouped products (jax.lax.ragged_dot: a mixture of experts' experts) in a forward
    jaxpr, as their groups' work: what a grouped-matmul kernel the compiler cannot see computes."""
    def eqn_flops(eqn) -> float:
        if eqn.primitive.name != "ragged_dot_general":
            return None
        return _ragged_flops(eqn)

    return _walk(jaxpr, eqn_flops)


def attention_flops(jaxpr: Jaxpr) -> float:
    """Forward FLOPs of the attention calls in a forward (not differentiated) jaxpr, from their shapes."""
    def eqn_flops(eqn) -> float:
        call = _attention_call(eqn)
        if call is None:
            return None
        return attention.flops(*(v.aval.shape for v in eqn.invars[:3]), *call)  # q, k, v (then segment ids)

    return _walk(jaxpr, eqn_flops)


def _ragged_flops(eqn) -> float:
    """2 x the rows' elements x the columns each row's group matrix gives it (not every group's)."""
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (_, rhs_contract), (_, rhs_batch) = numbers.dot_dimension_numbers
    rhs, skip = eqn.invars[1].aval.shape, {*rhs_contract, *rhs_batch, *numbers.rhs_group_dimensions}
    return 2.0 * math.prod(eqn.invars[0].aval.shape) * math.prod(n for d, n in enumerate(rhs) if d not in skip)


def _attention_call(eqn) -> tuple | None:
    """(is_causal, window, chunk) of an equation that calls an attention kernel (shard/nn/attention.py), else None."""
    if eqn.primitive.name not in ("pjit", "jit"):
        return None
    return attention.call_of(eqn.params.get("name") or "")


def _walk(jaxpr: Jaxpr, eqn_flops) -> float:
    """Sum eqn_flops over the equations; where it returns None, descend into sub-jaxprs: a scan's
    body counts once per iteration, a cond's costliest branch once, any other call once."""
    total = 0.0
    for eqn in jaxpr.eqns:
        own = eqn_flops(eqn)
        if own is not None:
            total += own
            continue
        subs = [s for v in eqn.params.values() for s in _sub_jaxprs(v)]
        if eqn.primitive.name == "cond":  # one branch runs: count the costliest
            total += max((_walk(s, eqn_flops) for s in subs), default=0.0)
        else:
            times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
            total += times * sum(_walk(s, eqn_flops) for s in subs)
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
