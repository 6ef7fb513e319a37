"""Quantization-aware training (`train.quantize=int8|fp8`), with qwix's quantized training (QtProvider), as
MaxText's AQT int8 and fp8 runs: every matrix product of activations with a weight runs on both operands
quantized, and in the backward pass so does the product giving the activations' gradient (the incoming gradient
quantized too); the weight's gradient is computed in the compute dtype from the quantized activations (MaxText's
int8 has no bits for it either: quantizing it cost the default job 3.8% of its eval loss, bench/RESULTS.md). Each
operand has absmax scales per channel of its non-contracted axes, from the values at each step (dynamic range: no
state besides the weights). int8: int8 x int8 products accumulated in int32; fp8: float8_e4m3fn forward, the
gradients float8_e5m2 (the wider range they need). The weights and the optimizer stay float32; checkpoints do not
change.

Attention's own products (queries x keys, probabilities x values: batched over heads, no weight) stay in the
compute dtype, as MaxText keeps them. qwix intercepts jax's products while the model runs; the graph of the model
(the class of its root, each module's qwix path) says so, so the train and eval steps merge the quantized graph
and nothing else changes.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from qwix._src.utils.flax_util import find_param  # private, no public equivalent: pyproject caps qwix

from shard.errors import UserError

KINDS = ("none", "int8", "fp8")
# forward operands, backward gradients
QTYPES = {"int8": (jnp.int8, jnp.int8), "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2)}
# The traces of jitted jax functions (jnp.matmul's) made while qwix intercepts are cached under this context's
# value, one per quantized graph: never reused by a model that is not quantized, nor by another graph (whose
# provider then counts every product it quantizes).
_TRACING = jax.make_user_context(None)
_GRAPHS = itertools.count(1)


class WeightProducts(qwix.QtProvider):
    """qwix's quantized training of the products with a weight: a parameter operand (einsum, dot_general,
    ragged_dot's experts) or a product with no batch axes (a matmul of activations by a weight matrix); batched
    products of activations (attention's) run as written. `count`: the products quantized in its traces so far."""

    count = 0

    def get_intercept_map(self):
        intercepts = super().get_intercept_map()
        intercepts.pop("jax.lax.conv_general_dilated", None)  # matrix products only
        return intercepts

    def einsum(self, spec, *operands, _dot_general=jax.lax.dot_general, **kwargs):
        if len(operands) == 2 and any(find_param(x) is not None for x in operands):
            self.count += 1
            return super().einsum(spec, *operands, **kwargs)
        return jnp.einsum(spec, *operands, _dot_general=self.dot_general, **kwargs)

    def dot_general(self, lhs, rhs, dimension_numbers, *args, **kwargs):
        (_, _), (lhs_batch, _) = dimension_numbers
        if lhs_batch and find_param(lhs) is None and find_param(rhs) is None:
            return jax.lax.dot_general(lhs, rhs, dimension_numbers, *args, **kwargs)
        self.count += 1
        return super().dot_general(lhs, rhs, dimension_numbers, *args, **kwargs)

    def _create_dot_general_qt_config(self, rule, op_id, lhs, rhs):
        """The weight's gradient in the compute dtype (MaxText's int8 and fp8: no drhs bits), the activations'
        gradient quantized. The weight is the operand qwix finds among the parameters, else the right one (x @ w)."""
        config = super()._create_dot_general_qt_config(rule, op_id, lhs, rhs)
        weight_left = find_param(lhs) is not None
        return dataclasses.replace(config, **{"dlhs_grad_qtype" if weight_left else "drhs_grad_qtype": None})

    def ragged_dot(self, *args, **kwargs):  # a mixture of experts' grouped products
        self.count += 1
        return super().ragged_dot(*args, **kwargs)


def provider(kind: str) -> WeightProducts:
    forward, backward = QTYPES[kind]
    return WeightProducts([qwix.QtRule(module_path=".*", weight_qtype=forward, act_qtype=forward,
                                       bwd_qtype=backward)])


def model_graph(cfg, graphdef: nnx.GraphDef, abstract, inputs=None) -> nnx.GraphDef:
    """The model's graph with every weight product quantized as train.quantize says (`none`: the graph as it is);
    combinations that cannot run are refused first, and, traced on `inputs` (a batch's shapes), a model in which
    nothing was quantized (a convolutional one: qwix's products only) after."""
    kind = cfg.train.quantize
    if kind == "none":
        return graphdef
    check(cfg)
    model = nnx.merge(graphdef, abstract.params, abstract.rest)
    products = provider(kind)
    quantized = qwix.quantize_model(model, products, None, skip_nnx_init=True)  # dynamic: nothing to set up
    call, graph = type(quantized).__call__, next(_GRAPHS)

    def traced(self, *args, **kwargs):
        with _TRACING(graph):
            return call(self, *args, **kwargs)

    root = type(quantized)
    quantized.__class__ = type(root.__name__, (root,), {"__call__": traced, "__module__": root.__module__})
    out = nnx.graphdef(quantized)
    if inputs is not None:
        jax.eval_shape(lambda state, x: nnx.merge(out, state.params, state.rest)(x), abstract, inputs)
        if not products.count:
            raise UserError(f"train.quantize={kind}: model {cfg.model.name!r} multiplies no activations by a weight "
                            "in a product qwix quantizes (jnp.einsum, jax.lax.dot_general, a matmul); convolutions "
                            "are not quantized: leave train.quantize=none")
    return out


def check(cfg) -> None:
    """train.quantize's combinations, refused in one line where they cannot run."""
    kind = cfg.train.quantize
    if cfg.train.lora.rank:
        raise UserError(f"train.quantize={kind} trains every weight quantization-aware; low-rank adapters "
                        "(train.lora.rank) train on a frozen base: for a quantized base use train.lora.base")
