"""Model-level checks that hold on any mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shard.models.gpt import GPT
from shard.models.layers import rotary


def test_rotary_scores_depend_only_on_relative_position():
    q = jnp.tile(jax.random.normal(jax.random.key(0), (1, 1, 1, 8)), (1, 6, 1, 1))
    k = jnp.tile(jax.random.normal(jax.random.key(1), (1, 1, 1, 8)), (1, 6, 1, 1))
    qr, kr = rotary(q, 10000.0), rotary(k, 10000.0)
    score = lambda m, n: float(jnp.dot(qr[0, m, 0], kr[0, n, 0]))
    assert score(3, 1) == pytest.approx(score(4, 2), rel=1e-5) == pytest.approx(score(5, 3), rel=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(qr, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)


def test_llama_options_build_and_run():
    with nnx.use_eager_sharding(False):
        model = GPT(vocab_size=64, d_model=32, n_layers=2, n_heads=8, n_kv_heads=2, position="rope", norm="rmsnorm",
                    mlp="swiglu", d_ff=48, tie_embeddings=True, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    assert model.head is None and model.pos is None  # tied output layer, no learned positions
    assert params["blocks"]["attn"]["kv"].get_value().shape == (2, 32, 2, 2, 4)  # 2 layers, 2 key/value heads
    assert model(jnp.zeros((2, 10), jnp.int32)).shape == (2, 10, 64)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        GPT(n_heads=8, n_kv_heads=3, d_model=32, rngs=nnx.Rngs(0))


def test_causal_mask_hides_the_future():
    with nnx.use_eager_sharding(False):
        model = GPT(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=8, rngs=nnx.Rngs(0))
    a = model(jnp.array([[1, 2, 3, 4, 5, 6]]))
    b = model(jnp.array([[1, 2, 3, 9, 9, 9]]))
    np.testing.assert_allclose(a[0, :3], b[0, :3], rtol=1e-6)  # positions before the change are unaffected
    assert not np.allclose(a[0, 3:], b[0, 3:])


def test_layers_are_scanned_and_remat_policies_change_memory_not_results(train):
    from conftest import TINY_GPT

    runs = {r: train(*TINY_GPT, "model.n_layers=3", "train.steps=3", "run.log_every=1", f"train.remat={r}",
                     "run.cpu_devices=2", "mesh=fsdp", subdir=r) for r in ("none", "full", "dots")}
    curves = {r: [h["loss"] for h in result.history] for r, result in runs.items()}
    np.testing.assert_allclose(curves["full"], curves["none"], rtol=1e-5)
    np.testing.assert_allclose(curves["dots"], curves["none"], rtol=1e-5)
    hlo = runs["none"].train_step.as_text()
    assert "while" in hlo  # one block in a loop, not three copies
    w = runs["none"].state.params["blocks"]["ffn"]["w_in"].get_value()
    assert w.shape == (3, 32, 64) and w.sharding.spec[0] is None  # the layers axis stays whole
    temp = {r: result.train_step.memory_analysis().temp_size_in_bytes for r, result in runs.items()}
    assert temp["full"] < temp["none"]  # recomputing the layer keeps fewer activations


def test_attention_kernel_is_the_configured_one(monkeypatch):
    from shard.nn import attention, hooks, partition
    from shard.errors import UserError

    seen = []
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, implementation=None, **kw: seen.append(implementation) or real(*a, **kw))
    cpu = attention.xla_cpu  # train.attention=xla on a CPU: the same attention, written for XLA:CPU
    monkeypatch.setattr(attention, "xla_cpu", lambda *a, **kw: seen.append("xla") or cpu(*a, **kw))
    axes = ("data", "expert", "fsdp", "tensor")
    mesh = jax.make_mesh((1,) * 4, axes, axis_types=(jax.sharding.AxisType.Auto,) * 4, devices=jax.devices()[:1])
    with nnx.use_eager_sharding(False):
        model = GPT(vocab_size=32, d_model=32, n_layers=1, n_heads=2, max_len=8, rngs=nnx.Rngs(0))
    tokens, rules = jnp.zeros((1, 8), jnp.int32), partition.merged_rules(None, mesh.axis_names)
    model(tokens)
    with partition.activate(mesh, rules), hooks.use(attention="cudnn"):
        graphdef, state = nnx.split(model)
        jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)  # traced only: cuDNN needs a GPU
    assert seen == ["xla", "cudnn"]  # outside the framework XLA's; inside, train.attention's
    q = jnp.zeros((1, 8, 2, 12), jnp.bfloat16)
    with hooks.use(attention="cudnn"), pytest.raises(UserError, match="head size"):
        hooks.attention(q, q, q, is_causal=True)


@pytest.mark.parametrize("heads,kv_heads,causal,q_len", [(4, 4, True, 16), (4, 2, True, 8), (4, 1, False, 16)])
def test_cpu_attention_is_jax_attention(heads, kv_heads, causal, q_len):
    """The CPU formulation of `train.attention=xla` gives jax.nn.dot_product_attention's outputs and
    gradients (grouped heads, a causal mask aligned at the top left for fewer queries than keys)."""
    from shard.nn import attention

    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, q_len, heads, 8))
    k, v = jax.random.normal(kk, (2, 16, kv_heads, 8)), jax.random.normal(kv, (2, 16, kv_heads, 8))
    ours = lambda q, k, v: jnp.sum(jnp.sin(attention.xla_cpu(q, k, v, causal)))  # noqa: E731
    ref = lambda q, k, v: jnp.sum(jnp.sin(jax.nn.dot_product_attention(q, k, v, is_causal=causal)))  # noqa: E731
    np.testing.assert_allclose(attention.xla_cpu(q, k, v, causal),
                               jax.nn.dot_product_attention(q, k, v, is_causal=causal), atol=2e-6)
    for got, want in zip(jax.grad(ours, (0, 1, 2))(q, k, v), jax.grad(ref, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(got, want, atol=2e-6)


def test_dense_is_the_matrix_product_with_tokens_merged_unless_the_sequence_is_split():
    from shard.nn import ring
    from shard.nn import hooks

    x, w = jax.random.normal(jax.random.key(0), (4, 8, 16)), jax.random.normal(jax.random.key(1), (16, 24))
    loss = lambda dense: lambda x, w: jnp.sum(jnp.sin(dense(x, w)))  # noqa: E731
    for got, want in zip(jax.grad(loss(hooks.dense), (0, 1))(x, w), jax.grad(loss(jnp.matmul), (0, 1))(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def ranks():  # a new function each time: JAX caches a function's trace, not the hooks' settings
        jaxpr = jax.make_jaxpr(lambda x, w: hooks.dense(x, w))(x, w)
        return [e.invars[0].aval.ndim for e in jaxpr.eqns if e.primitive.name == "dot_general"]

    assert ranks() == [2]  # one (tokens, width) product: what XLA's CPU backend compiles best
    with hooks.use(split=ring.Split(size=2, strategy="ring")):
        assert ranks() == [3]  # a split length stays its own axis


# ----------------------------------------------------------------------------- mixture of experts

def moe_layer(top_k=2, capacity_factor=8.0, n_experts=4):
    from shard.models.moe import MoELayer

    with nnx.use_eager_sharding(False):
        return MoELayer(d_model=8, d_ff=16, n_experts=n_experts, top_k=top_k, capacity_factor=capacity_factor,
                        aux_loss_weight=1.0, swiglu=False, out_std=0.1, rngs=nnx.Rngs(0))


def test_moe_output_is_the_routers_weighted_sum_of_its_top_k_experts():
    layer = moe_layer(top_k=2, capacity_factor=8.0)  # room for every token: nothing dropped
    layer.router[...] = jax.random.normal(jax.random.key(1), (8, 4))
    x = jax.random.normal(jax.random.key(2), (2, 5, 8))
    got = layer(x)

    probs = jax.nn.softmax(x @ layer.router[...], axis=-1)
    want = np.zeros_like(x)
    for b in range(2):
        for t in range(5):
            top = np.argsort(-probs[b, t])[:2]
            weights = probs[b, t, top] / probs[b, t, top].sum()
            for e, w in zip(top, weights):
                hidden = jax.nn.gelu(x[b, t] @ layer.w_in[e])
                want[b, t] += w * (hidden @ layer.w_out[e])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_moe_dropless_routing_equals_capacity_routing_with_room_for_every_token():
    """Nothing dropped (capacity n_experts / top_k): the ragged products give the dispatch einsums' output,
    gelu and swiglu experts, the chosen weights renormalised or not (then the output is the renormalised one
    times the chosen probabilities' sum)."""
    from shard.models.moe import MoELayer

    x = jax.random.normal(jax.random.key(2), (2, 5, 8))
    out = {}
    for swiglu in (False, True):
        for norm_topk in (True, False):
            with nnx.use_eager_sharding(False):
                capacity, dropless = (MoELayer(8, 16, 4, 2, 2.0, 1.0, swiglu, 0.1, nnx.Rngs(0), routing, norm_topk)
                                      for routing in ("capacity", "dropless"))
            out[norm_topk] = dropless(x)
            np.testing.assert_allclose(out[norm_topk], capacity(x), rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(dropless.load.get_value(), capacity.load.get_value())
        chosen = jax.lax.top_k(jax.nn.softmax(x @ dropless.router[...], axis=-1), 2)[0].sum(-1, keepdims=True)
        np.testing.assert_allclose(out[False], chosen * out[True], rtol=1e-5, atol=1e-6)


def test_moe_drops_tokens_over_an_experts_capacity_in_order():
    layer = moe_layer(top_k=1, capacity_factor=1.0)  # 8 tokens, 4 experts: 2 slots per expert per sequence
    assert layer.capacity(8) == 2
    layer.router[...] = jnp.zeros((8, 4)).at[:, 0].set(100.0)  # every token wants expert 0
    x = jnp.abs(jax.random.normal(jax.random.key(3), (1, 8, 8)))  # positive, so the router is sure
    y = layer(x)
    norms = np.linalg.norm(np.asarray(y[0]), axis=-1)
    assert (norms[:2] > 0).all() and (norms[2:] == 0).all()  # the first two are served, the rest dropped
    np.testing.assert_allclose(layer.load.get_value(), [1, 0, 0, 0])
    from shard.models.moe import balancing_loss

    loss = balancing_loss(layer.load.get_value(), layer.router_mean.get_value(), 1.0)
    assert float(loss) == pytest.approx(4.0, rel=1e-4)  # n x f_0 x p_0 = 4 x 1 x 1: worst case


def test_moe_balancing_loss_is_one_when_the_router_is_uniform():
    layer = moe_layer(top_k=1)
    layer.router[...] = jnp.zeros((8, 4))  # every expert equally likely
    layer(jax.random.normal(jax.random.key(4), (2, 6, 8)))
    from shard.models.moe import balancing_loss

    assert (float(balancing_loss(layer.load.get_value(), layer.router_mean.get_value(), 1.0))
            == pytest.approx(1.0, rel=1e-6))
    assert float(jnp.sum(layer.load.get_value())) == pytest.approx(1.0)


def test_moe_model_records_aux_loss_and_expert_share():
    from shard.models.moe import MoE
    from shard.nn.recorded import collect

    with nnx.use_eager_sharding(False):
        model = MoE(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_len=8, n_experts=4, top_k=2,
                    aux_loss_weight=0.5, rngs=nnx.Rngs(0))
    assert model(jnp.zeros((2, 8), jnp.int32)).shape == (2, 8, 32)
    aux, stats = collect(model)
    from shard.models.moe import balancing_loss

    load, mean = model.blocks.ffn.load.get_value(), model.blocks.ffn.router_mean.get_value()
    per_layer = [float(balancing_loss(load[i], mean[i], 0.5)) for i in range(2)]
    assert load.shape == (2, 4) and float(aux) == pytest.approx(sum(per_layer))
    assert 0.5 <= per_layer[0] <= 0.5 * 4  # weight x (1 when balanced ... n_experts when collapsed)
    assert 0.0 <= float(stats["min_expert_share"]) <= 1.0


# ----------------------------------------------------------------------------- LSTM

def test_lstm_cell_follows_the_textbook_equations():
    from shard.models.lstm import LSTMLayer

    with nnx.use_eager_sharding(False):
        layer = LSTMLayer(4, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(5), (1, 3, 4))
    h = c = np.zeros(4)
    sig = lambda v: 1 / (1 + np.exp(-v))
    w_x, w_h, b = (np.asarray(v[...], np.float64) for v in (layer.w_x, layer.w_h, layer.b))
    for t in range(3):
        g = np.einsum("d,dgh->gh", np.asarray(x[0, t]), w_x) + np.einsum("d,dgh->gh", h, w_h) + b
        c = sig(g[1]) * c + sig(g[0]) * np.tanh(g[2])
        h = sig(g[3]) * np.tanh(c)
    np.testing.assert_allclose(layer(x)[0, -1], h, rtol=1e-5, atol=1e-6)


def test_lstm_classifier_learns_an_order_dependent_task():
    """Label: the sign of the first of 6 inputs. A bag of inputs cannot tell; a recurrence that
    carries the first input to the end can."""
    import optax
    from shard.models.lstm import LSTM

    with nnx.use_eager_sharding(False):
        model = LSTM(vocab_size=0, in_features=1, d_model=16, n_layers=1, num_classes=2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def batch(key):
        x = jax.random.normal(key, (64, 6, 1))
        return x, (x[:, 0, 0] > 0).astype(jnp.int32)

    @nnx.jit
    def step(model, opt, x, y):
        loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    for i in range(200):
        step(model, opt, *batch(jax.random.key(i)))
    x, y = batch(jax.random.key(10_000))
    assert float(jnp.mean(jnp.argmax(model(x), -1) == y)) >= 0.9


def test_weight_decay_reaches_matrices_only_in_scanned_and_recurrent_models():
    from shard.models.lstm import LSTM
    from shard.core.optim import decay_mask

    with nnx.use_eager_sharding(False):
        gpt = GPT(vocab_size=64, d_model=32, n_layers=2, n_heads=4, rngs=nnx.Rngs(0))
        lstm = LSTM(d_model=16, n_layers=2, rngs=nnx.Rngs(0))
    decayed = lambda model: {jax.tree_util.keystr(p, simple=True, separator="/").removesuffix("/value"): bool(v)
                             for p, v in jax.tree_util.tree_flatten_with_path(
                                 decay_mask(nnx.state(model, nnx.Param)))[0]}
    g, l = decayed(gpt), decayed(lstm)
    # Stacked over layers, a norm scale is (layers, embed): still a vector per layer, not decayed.
    assert gpt.blocks.ln1.scale.get_value().ndim == 2
    assert not any(g[k] for k in ("blocks/ln1/scale", "blocks/ln1/bias", "blocks/ln2/scale", "ln_f/scale"))
    assert all(g[k] for k in ("blocks/attn/q", "blocks/attn/kv", "blocks/ffn/w_in", "blocks/ffn/w_out", "head"))
    assert not l["layers/b"] and not l["head_bias"]  # (layers, 4 gates, width): a bias
    # a per-head bias and a projection-wide q/k norm have two named dimensions, yet are no matrices (their role)
    with nnx.use_eager_sharding(False):
        qwen = GPT(vocab_size=64, d_model=32, n_layers=2, n_heads=4, qkv_bias=True, qk_norm="projection",
                   rngs=nnx.Rngs(0))
    q = decayed(qwen)
    assert qwen.blocks.attn.q_bias.get_value().ndim == 3 and qwen.blocks.attn.q_norm.scale.get_value().ndim == 3
    assert not any(q[k] for k in ("blocks/attn/q_bias", "blocks/attn/kv_bias", "blocks/attn/q_norm/scale",
                                  "blocks/attn/k_norm/scale"))
    assert q["blocks/attn/q"] and q["blocks/attn/kv"]
    assert l["layers/w_x"] and l["layers/w_h"] and l["head"]
