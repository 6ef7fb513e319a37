"""The MoE's routers (models/routers.py) and the options around them, each against transformers' own module with random
weights, float32: Qwen3-MoE's softmax-then-top-k (with and without norm_topk_prob), GPT-OSS's biased top-k-then-
softmax with its experts (biases, clamped SwiGLU), DeepSeek-V3's and GLM-4.5's sigmoid scores with a correction
bias, groups and a routed scale and their shared experts, Llama 4's top-1 sigmoid scaling the expert's input beside
its shared expert, Qwen3.5's gated shared expert, Gemma 4's router (its input norm and per-expert scale); a whole
tiny GLM-4.5 (a dense first layer) against transformers' logits. The correction's auxiliary-loss-free update once
per optimizer step, and each option's refusal of a bad value in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shard.models.moe import MoE, MoELayer  # noqa: E402

H, F, N = 16, 8, 8  # width, each expert's hidden width, experts
X = np.random.default_rng(0).normal(size=(2, 5, H)).astype(np.float32)
ROUTINGS = ["dropless", "capacity"]  # capacity_factor n_experts / top_k below: room for every token


def randomize(module, seed: int = 0, scale: float = 0.3):
    """Every parameter and stored buffer (a correction bias; not the rotary frequencies) of a transformers module
    drawn at random (their experts start empty)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in module.state_dict(keep_vars=True).values():
            t.copy_(torch.randn(t.shape, generator=g) * scale)
    return module.eval()


def array(t) -> jnp.ndarray:
    return jnp.asarray(t.detach().numpy(), jnp.float32)


def layer(top_k: int, routing: str, **options) -> MoELayer:
    with nnx.use_eager_sharding(False):
        return MoELayer(H, F, N, top_k, N / top_k, 0.0, True, 0.02, nnx.Rngs(0), routing, **options)


def put_experts(ours, gate_up, down, transposed: bool = False):
    """transformers' stacked experts into ours: gate_up (E, 2I, H) and down (E, H, I) as F.linear reads them, or
    (E, H, 2I) and (E, I, H) as bmm does (transposed: Llama 4's)."""
    gate_up, down = array(gate_up), array(down)
    if not transposed:
        gate_up, down = gate_up.transpose(0, 2, 1), down.transpose(0, 2, 1)
    ours.w_gate.set_value(gate_up[..., :F])
    ours.w_in.set_value(gate_up[..., F:])
    ours.w_out.set_value(down)


def put_mlp(ours, theirs):
    """A transformers gate/up/down MLP into an MLPBlock."""
    ours.w_gate.set_value(array(theirs.gate_proj.weight).T)
    ours.w_in.set_value(array(theirs.up_proj.weight).T)
    ours.w_out.set_value(array(theirs.down_proj.weight).T)


def compare(ours, want, chosen=None, rtol=1e-5):
    """Our layer's output on X against transformers' (tokens, H), and where given, the experts each token chose."""
    got = np.asarray(ours(jnp.asarray(X)))
    want = want.detach().numpy().reshape(got.shape)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < rtol
    if chosen is not None:
        top_e = np.sort(np.asarray(ours.route(jnp.asarray(X))[1]).reshape(-1, chosen.shape[-1]), axis=-1)
        np.testing.assert_array_equal(top_e, np.sort(chosen.numpy(), axis=-1))


def tokens():
    return torch.tensor(X.reshape(-1, H))


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("norm", [True, False])
def test_softmax_then_top_k_equals_qwen3_moe(routing, norm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = randomize(Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=F, num_experts=N, num_experts_per_tok=2, norm_topk_prob=norm)))
    ours = layer(2, routing, norm_topk=norm)
    ours.router.set_value(array(block.gate.weight).T)
    put_experts(ours, block.experts.gate_up_proj, block.experts.down_proj)
    with torch.no_grad():
        compare(ours, block(torch.tensor(X)), block.gate(tokens())[2])


@pytest.mark.parametrize("routing", ROUTINGS)
def test_gpt_oss_block_equals_transformers(routing):
    """GPT-OSS's MLP whole: its biased router (top-k of the logits, softmax over those), its experts with biases, gate
    and up interleaved in one gate_up_proj, and the clamped SwiGLU; a scale that drives activations past the limit."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = transformers.GptOssConfig(hidden_size=H, intermediate_size=F, num_local_experts=N, num_experts_per_tok=2,
                                       swiglu_limit=0.5)
    config._experts_implementation = "eager"
    block = randomize(GptOssMLP(config), scale=0.6)
    ours = layer(2, routing, router="topk_softmax", router_bias=True, expert_bias=True, swiglu_limit=0.5)
    ours.router.set_value(array(block.router.weight).T)
    ours.router_bias.set_value(array(block.router.bias))
    gate_up, bias = array(block.experts.gate_up_proj), array(block.experts.gate_up_proj_bias)  # (E, H, 2F), (E, 2F)
    ours.w_gate.set_value(gate_up[..., 0::2])
    ours.w_in.set_value(gate_up[..., 1::2])
    ours.b_gate.set_value(bias[..., 0::2])
    ours.b_in.set_value(bias[..., 1::2])
    ours.w_out.set_value(array(block.experts.down_proj))
    ours.b_out.set_value(array(block.experts.down_proj_bias))
    with torch.no_grad():
        h = jnp.asarray(X.reshape(-1, H)) @ ours.w_gate[...][0] + ours.b_gate[...][0]
        assert np.max(np.asarray(h)) > 0.5  # the clamp bites
        compare(ours, block(torch.tensor(X))[0], block.router(tokens())[2])


def sigmoid_block(kind: str, **config):
    """DeepSeek-V3's or GLM-4.5's MoE block (the same math) and ours with its weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    module, make = {"deepseek_v3": (DeepseekV3MoE, transformers.DeepseekV3Config),
                    "glm4_moe": (Glm4MoeMoE, transformers.Glm4MoeConfig)}[kind]
    block = randomize(module(make(hidden_size=H, moe_intermediate_size=F, n_routed_experts=N, **config)))
    with torch.no_grad():  # a correction big enough to change choices
        block.gate.e_score_correction_bias.mul_(2.0)
    return block


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("kind,config", [
    ("deepseek_v3", dict(num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True,
                         routed_scaling_factor=2.5, n_shared_experts=1)),
    ("glm4_moe", dict(num_experts_per_tok=3, n_group=1, topk_group=1, norm_topk_prob=False,
                      routed_scaling_factor=1.0, n_shared_experts=2)),
])
def test_sigmoid_with_correction_groups_and_shared_experts_equals_transformers(routing, kind, config):
    block = sigmoid_block(kind, **config)
    k = config["num_experts_per_tok"]
    ours = layer(k, routing, router="sigmoid", norm_topk=config["norm_topk_prob"], score_correction=True,
                 n_group=config["n_group"], topk_group=config["topk_group"],
                 routed_scaling=config["routed_scaling_factor"], shared_d_ff=F * config["n_shared_experts"])
    ours.router.set_value(array(block.gate.weight).T)
    ours.correction.set_value(array(block.gate.e_score_correction_bias))
    put_experts(ours, block.experts.gate_up_proj, block.experts.down_proj)
    put_mlp(ours.shared, block.shared_experts)
    with torch.no_grad():
        compare(ours, block(torch.tensor(X)), block.gate(tokens())[2])
        # the correction chooses: without it, other experts for some tokens
        ours.correction.set_value(jnp.zeros(N))
        assert not np.array_equal(np.sort(np.asarray(ours.route(jnp.asarray(X))[1]).reshape(-1, k), axis=-1),
                                  np.sort(block.gate(tokens())[2].numpy(), axis=-1))


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_top_k_sigmoid_weighing_inputs_equals_llama4(routing, top_k):
    """Llama 4: the chosen logits' sigmoid multiplies each expert's input, its output added as it is, beside the
    shared expert (Llama 4's routers are top-1; its module takes any top_k)."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    block = randomize(Llama4TextMoe(transformers.Llama4TextConfig(
        hidden_size=H, intermediate_size=F, num_local_experts=N, num_experts_per_tok=top_k)))
    ours = layer(top_k, routing, router="topk_sigmoid", norm_topk=False, weigh_inputs=True, shared_d_ff=F)
    ours.router.set_value(array(block.router.weight).T)
    put_experts(ours, block.experts.gate_up_proj, block.experts.down_proj, transposed=True)
    put_mlp(ours.shared, block.shared_expert)
    with torch.no_grad():
        logits = block.router(tokens())[1]
        compare(ours, block(torch.tensor(X))[0], torch.topk(logits, top_k, dim=1)[1])


@pytest.mark.parametrize("routing", ROUTINGS)
def test_gated_shared_expert_equals_qwen3_5_moe(routing):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    block = randomize(Qwen3_5MoeSparseMoeBlock(transformers.Qwen3_5MoeTextConfig(
        hidden_size=H, moe_intermediate_size=F, shared_expert_intermediate_size=12, num_experts=N,
        num_experts_per_tok=2)))
    ours = layer(2, routing, shared_d_ff=12, shared_gate=True)
    ours.router.set_value(array(block.gate.weight).T)
    put_experts(ours, block.experts.gate_up_proj, block.experts.down_proj)
    put_mlp(ours.shared, block.shared_expert)
    ours.shared_gate.set_value(array(block.shared_expert_gate.weight).T)
    with torch.no_grad():
        compare(ours, block(torch.tensor(X)), block.gate(tokens())[2])


@pytest.mark.parametrize("routing", ROUTINGS)
def test_router_norm_and_per_expert_scale_equal_gemma4(routing):
    """Gemma 4's router (its input RMS-normalised, scaled, 1/sqrt(width); per_expert_scale on the renormalised
    weights) feeding its experts, here with a SwiGLU activation (the experts' GeGLU is another issue's)."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

    config = transformers.Gemma4TextConfig(hidden_size=H, num_experts=N, top_k_experts=2, moe_intermediate_size=F,
                                           enable_moe_block=True, hidden_activation="silu", rms_norm_eps=1e-6)
    router, experts = randomize(Gemma4TextRouter(config)), randomize(Gemma4TextExperts(config), seed=1)
    with torch.no_grad():
        router.scale.add_(1.0)
        router.per_expert_scale.add_(1.0)
    ours = layer(2, routing, router_norm=True, expert_scale=True, norm_eps=1e-6)
    ours.router.set_value(array(router.proj.weight).T)
    ours.router_scale.set_value(array(router.scale))
    ours.expert_scale.set_value(array(router.per_expert_scale))
    put_experts(ours, experts.gate_up_proj, experts.down_proj)
    with torch.no_grad():
        _, weights, chosen = router(tokens())
        compare(ours, experts(tokens(), chosen, weights), chosen)


# A whole GLM-4.5: its attention a Llama's with q/k biases, per-head q/k norms and half of each head rotated; its first
# layer a dense MLP, the others sigmoid-routed experts in groups with a correction, two shared experts and a scale
GLM = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=F, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, n_routed_experts=N,
           num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=1.5,
           first_k_dense_replace=1, norm_topk_prob=True, attention_bias=True, use_qk_norm=True, rms_norm_eps=1e-5)
OURS = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=F, max_len=32, position="rope",
            norm="rmsnorm", mlp="swiglu", qkv_bias=True, qk_norm="head", rotary_dim=4, norm_eps=1e-5,
            n_experts=N, top_k=2, routing="dropless", aux_loss_weight=0.0, router="sigmoid", score_correction=True,
            n_group=4, topk_group=2, routed_scaling=1.5, shared_experts=2, dense_layers=1, dense_d_ff=48)


def glm_into(ours: MoE, theirs) -> None:
    """The tensors of transformers' Glm4MoeForCausalLM into our MoE with OURS's options."""
    layers, d, heads, kv, hd = theirs.model.layers, 32, 4, 2, 8
    stacked = lambda get, rows: jnp.stack([get(layers[i]) for i in rows])  # noqa: E731
    for stack, rows in ((ours.dense_blocks, [0]), (ours.blocks, [1, 2])):
        attn = lambda i: i.self_attn  # noqa: E731
        stack.attn.q.set_value(stacked(lambda i: array(attn(i).q_proj.weight).T.reshape(d, heads, hd), rows))
        stack.attn.q_bias.set_value(stacked(lambda i: array(attn(i).q_proj.bias).reshape(heads, hd), rows))
        stack.attn.kv.set_value(stacked(lambda i: jnp.stack([array(p.weight).T.reshape(d, kv, hd) for p in (
            attn(i).k_proj, attn(i).v_proj)], axis=1), rows))
        stack.attn.kv_bias.set_value(stacked(lambda i: jnp.stack([array(p.bias).reshape(kv, hd) for p in (
            attn(i).k_proj, attn(i).v_proj)]), rows))
        stack.attn.out.set_value(stacked(lambda i: array(attn(i).o_proj.weight).T.reshape(heads, hd, d), rows))
        stack.attn.q_norm.scale.set_value(stacked(lambda i: array(attn(i).q_norm.weight), rows))
        stack.attn.k_norm.scale.set_value(stacked(lambda i: array(attn(i).k_norm.weight), rows))
        stack.ln1.scale.set_value(stacked(lambda i: array(i.input_layernorm.weight), rows))
        stack.ln2.scale.set_value(stacked(lambda i: array(i.post_attention_layernorm.weight), rows))
    dense = ours.dense_blocks.ffn
    for ours_name, theirs_name in (("w_gate", "gate_proj"), ("w_in", "up_proj"), ("w_out", "down_proj")):
        getattr(dense, ours_name).set_value(stacked(lambda i: array(getattr(i.mlp, theirs_name).weight).T, [0]))
        getattr(ours.blocks.ffn.shared, ours_name).set_value(
            stacked(lambda i: array(getattr(i.mlp.shared_experts, theirs_name).weight).T, [1, 2]))
    ffn = ours.blocks.ffn
    ffn.router.set_value(stacked(lambda i: array(i.mlp.gate.weight).T, [1, 2]))
    ffn.correction.set_value(stacked(lambda i: array(i.mlp.gate.e_score_correction_bias), [1, 2]))
    gate_up = stacked(lambda i: array(i.mlp.experts.gate_up_proj).transpose(0, 2, 1), [1, 2])
    ffn.w_gate.set_value(gate_up[..., :F])
    ffn.w_in.set_value(gate_up[..., F:])
    ffn.w_out.set_value(stacked(lambda i: array(i.mlp.experts.down_proj).transpose(0, 2, 1), [1, 2]))
    ours.tok.set_value(array(theirs.model.embed_tokens.weight))
    ours.ln_f.scale.set_value(array(theirs.model.norm.weight))
    ours.head.set_value(array(theirs.lm_head.weight).T)


def test_glm4_moe_model_with_a_dense_first_layer_equals_transformers():
    theirs = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**GLM))
    randomize(theirs, scale=0.2)
    with torch.no_grad():
        for layer_ in theirs.model.layers:  # norms near 1, as trained ones are
            for norm in (layer_.input_layernorm, layer_.post_attention_layernorm, layer_.self_attn.q_norm,
                         layer_.self_attn.k_norm):
                norm.weight.add_(1.0)
        theirs.model.norm.weight.add_(1.0)
    with nnx.use_eager_sharding(False):
        ours = MoE(**OURS, rngs=nnx.Rngs(0))
    glm_into(ours, theirs)
    rows = np.random.default_rng(1).integers(0, 64, (2, 12))
    with torch.no_grad():
        want = theirs(torch.tensor(rows)).logits.numpy()
    got = np.asarray(ours(jnp.asarray(rows)))
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5


class Squares:
    """A train step's objective for the tests below: the mean square of the logits."""
    reference = False

    def loss(self, model, batch, reference):
        return jnp.mean(model(batch["inputs"]) ** 2), {}


def stepped(rate: float, correction, accum: int = 2):
    """One train step (SGD, grad_accum=accum) of a tiny sigmoid-routed MoE whose correction starts at `correction`:
    (the model before the step, the batch, the experts' layer after it: its correction and tally)."""
    from shard.core import step
    from shard.core.state import TrainState
    from shard.strategies import gradients

    with nnx.use_eager_sharding(False):
        model = MoE(vocab_size=32, d_model=16, n_layers=3, n_heads=2, d_ff=8, max_len=8, n_experts=N, top_k=2,
                    router="sigmoid", score_correction=True, correction_rate=rate, dense_layers=1, shared_experts=1,
                    rngs=nnx.Rngs(0))
    model.blocks.ffn.correction.set_value(correction)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    assert not any("correction" in str(path) for path, _ in nnx.to_flat_state(params))  # never trained
    tx = optax.sgd(0.1)
    train = step.make_train_step(graphdef, tx, Squares(), jnp.float32, reduction=gradients.Reduction(accum=accum))
    batch = {"inputs": jnp.asarray(np.random.default_rng(4).integers(0, 32, (2, 5)))}  # 20 choices: no load ties
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest, opt_state=tx.init(params))
    new, _ = jax.jit(train)(state, batch)
    after = nnx.merge(graphdef, new.params, new.rest)
    return nnx.merge(graphdef, params, rest, copy=True), batch, after.blocks.ffn


def test_correction_moves_once_per_step_by_the_steps_whole_load():
    """Aux-loss-free balancing (DeepSeek-V3): after a step of two accumulated microbatches, the correction has moved
    by rate x sign(mean load - load) of the whole batch's load (each layer's), from the step's starting weights, and
    the tally is cleared for the next step; with rate 0 a loaded correction stays as it is."""
    start = jnp.asarray(np.random.default_rng(3).normal(size=(2, N)) * 0.01, jnp.float32)
    before, batch, ffn = stepped(0.01, start)
    signs = []
    for rows in (batch["inputs"], batch["inputs"][0::2], batch["inputs"][1::2]):  # the batch, each microbatch
        before(rows)
        load = before.blocks.ffn.load.get_value()  # each layer's share of choices per expert
        signs.append(np.sign(np.mean(load, -1, keepdims=True) - load))
    assert not np.array_equal(signs[0], signs[1]) and not np.array_equal(signs[0], signs[2])  # the test can tell
    moved = np.asarray(ffn.correction.get_value() - start)
    np.testing.assert_allclose(moved, 0.01 * signs[0], atol=1e-7)
    assert np.all(np.abs(moved) > 0.009)  # every expert moved, up or down
    np.testing.assert_array_equal(ffn.tally.get_value(), 0.0)
    _, _, frozen = stepped(0.0, start, accum=1)
    np.testing.assert_array_equal(frozen.correction.get_value(), start)


def test_new_options_keep_todays_layer():
    """Every option at its default builds today's parameters and variables, nothing more, and routes bitwise as the
    softmax over all experts, its top_k, renormalised, always did."""
    ours = layer(2, "dropless")
    assert sorted(str(p) for p, _ in nnx.to_flat_state(nnx.state(ours))) == sorted(str(p) for p in [
        ("router",), ("w_in",), ("w_gate",), ("w_out",), ("load",), ("router_mean",)])
    probs = jax.nn.softmax(jnp.einsum("btd,de->bte", jnp.asarray(X), ours.router[...]), axis=-1)
    top_p, top_e = jax.lax.top_k(probs, 2)
    for got, want in zip(ours.route(jnp.asarray(X)), (top_p / jnp.sum(top_p, axis=-1, keepdims=True), top_e, probs)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("options,expected", [
    (dict(router="softmax"), "router='softmax'; choose one of softmax_topk, topk_softmax, sigmoid, topk_sigmoid"),
    (dict(n_group=3), "n_group=3 must be a positive divisor of n_experts=8"),
    (dict(n_group=8, topk_group=1), "n_group=8: each group of the 8 experts needs at least 2"),
    (dict(n_group=4, topk_group=5), "topk_group=5 must be between 1 and n_group=4"),
    (dict(n_group=4, topk_group=1, top_k=3), "top_k=3 is more than the 2 experts of the topk_group=1 groups"),
    (dict(routed_scaling=0.0), "routed_scaling=0.0 must be positive"),
    (dict(correction_rate=0.001), "correction_rate=0.001 must be >= 0, and > 0 only with score_correction=true"),
    (dict(correction_rate=-1.0, score_correction=True), "correction_rate=-1.0 must be >= 0"),
    (dict(shared_experts=-1), "shared_experts=-1 must be >= 0"),
    (dict(shared_d_ff=-2), "shared_d_ff=-2 must be >= 0"),
    (dict(shared_gate=True), "shared_gate=true gates the shared experts: set shared_experts >= 1"),
    (dict(dense_layers=2), "dense_layers=2 must leave at least one of the n_layers=2 layers to the experts"),
    (dict(dense_d_ff=-1), "dense_d_ff=-1 must be >= 0"),
])
def test_bad_option_values_are_refused_in_one_line(options, expected):
    with pytest.raises(ValueError) as e, nnx.use_eager_sharding(False):
        MoE(**{"vocab_size": 16, "d_model": 8, "n_layers": 2, "n_heads": 2, "n_experts": N, **options},
            rngs=nnx.Rngs(0))
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_hf_export_refuses_the_new_options_in_one_line():
    """The families a Hugging Face folder is written as here (Mixtral, Qwen3-MoE, OLMoE) route with none of them."""
    from shard.errors import UserError
    from shard.hf import arch

    mixtral = dict(position="rope", norm="rmsnorm", mlp="swiglu", routing="dropless")
    assert arch.from_gpt(mixtral, "moe")["model_type"] == "mixtral"
    with pytest.raises(UserError) as e:
        arch.from_gpt({**mixtral, "router": "sigmoid", "dense_layers": 1}, "moe")
    assert "with router='sigmoid', dense_layers=1 routes as none of" in str(e.value) and "\n" not in str(e.value)


def test_dense_first_layers_generate_with_the_cache_as_by_recomputing():
    """Two stacks (the dense layers', the experts'), each with its layers' settings and caches: greedy tokens from the
    cache are those of rerunning the whole sequence; generating leaves the correction as it was."""
    from shard.use import generate

    with nnx.use_eager_sharding(False):
        model = MoE(vocab_size=256, d_model=32, n_layers=3, n_heads=4, d_ff=16, max_len=32, position="rope",
                    norm="rmsnorm", mlp="swiglu", n_experts=N, top_k=2, routing="dropless", router="sigmoid",
                    score_correction=True, correction_rate=0.01, shared_experts=1, dense_layers=1, dense_d_ff=48,
                    windows=[0, 4, 0], rngs=nnx.Rngs(1))
    start = jnp.asarray(np.random.default_rng(0).normal(size=(2, N)), jnp.float32)
    model.blocks.ffn.correction.set_value(start)
    # each stack holds its own layers' settings, with the static windows of its own layers
    assert model.dense_blocks.attn.window[...].tolist() == [0] and model.blocks.attn.window[...].tolist() == [4, 0]
    assert model.dense_blocks.attn.windows == (0,) and model.blocks.attn.windows == (4, 0)
    prompt = np.array([generate.text_tokens("def f(x):")] * 2)
    want = generate.recompute(model, prompt, 10, vocab=generate.BYTES)
    got = generate.Generator(model)(prompt, 10, generate.Sampling(temperature=0, vocab=generate.BYTES))
    np.testing.assert_array_equal(got, want)
    assert len(set(want[0].tolist())) > 2
    np.testing.assert_array_equal(model.blocks.ffn.correction.get_value(), start)
