"""Every array sits where its logical names say; FSDP really divides the state over the devices."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from conftest import TINY_GPT, overrides

# That every parameter and optimizer moment has the sharding its logical names give, under every
# preset and for every model, is checked by the matrix in test_equivalence.py. Here the expected
# specs are written out by hand from the rules (shard/nn/partition.py RULES: embed -> fsdp; heads,
# kv_heads, mlp, vocab -> tensor; layers, head_dim -> None) and the mesh presets (meshes/*.yaml),
# so that a wrong rule or a wrong mapping cannot agree with itself.


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """trained(mesh, *extra): TINY_GPT trained one step on 8 devices, once per module for each setting."""
    from shard import config
    from shard.run import trainer

    runs = {}

    def get(mesh, *extra):
        if (mesh, extra) not in runs:
            args = overrides(tmp_path_factory.mktemp(mesh), *TINY_GPT, "train.steps=1", "run.cpu_devices=8",
                             f"mesh={mesh}", *extra)
            runs[mesh, extra] = trainer.run(config.load(None, args))
        return runs[mesh, extra]

    return get


# TINY_GPT: vocab 256, d_model 32, 8 heads of 4, d_ff 64, max_len 32, 2 stacked layers. The logical
# names (models/gpt.py, models/layers.py) of each parameter, then its spec under each preset.
# Stacked layers lead with `layers`, never split; mesh axes of size 1 are dropped. No parameter of
# this model reaches mesh.auto_shard_min_size, and all of them name `embed`, so the automatic split
# adds nothing here.
NAMES = {
    "tok": ("vocab", "embed"),
    "pos": (None, "embed"),
    "blocks/attn/q": ("layers", "embed", "heads", "head_dim"),
    "blocks/attn/kv": ("layers", "embed", None, "kv_heads", "head_dim"),
    "blocks/attn/out": ("layers", "heads", "head_dim", "embed"),
    "blocks/ffn/w_in": ("layers", "embed", "mlp"),
    "blocks/ffn/w_out": ("layers", "mlp", "embed"),
    "blocks/ln1/scale": ("layers", "embed"),
    "ln_f/scale": ("embed",),
    "head": ("embed", "vocab"),
}
EXPECTED = {
    "fsdp": {  # fsdp=8: embed is split, everything else whole
        "tok": P(None, "fsdp"),
        "pos": P(None, "fsdp"),
        "blocks/attn/q": P(None, "fsdp", None, None),
        "blocks/attn/kv": P(None, "fsdp", None, None, None),
        "blocks/attn/out": P(None, None, None, "fsdp"),
        "blocks/ffn/w_in": P(None, "fsdp", None),
        "blocks/ffn/w_out": P(None, None, "fsdp"),
        "blocks/ln1/scale": P(None, "fsdp"),
        "ln_f/scale": P("fsdp"),
        "head": P("fsdp", None),
    },
    "tp": {  # tensor=8: Megatron's columns (q, kv, MLP in) and rows (out, MLP out); norms and positions whole
        "tok": P("tensor", None),
        "pos": P(None, None),
        "blocks/attn/q": P(None, None, "tensor", None),
        "blocks/attn/kv": P(None, None, None, "tensor", None),
        "blocks/attn/out": P(None, "tensor", None, None),
        "blocks/ffn/w_in": P(None, None, "tensor"),
        "blocks/ffn/w_out": P(None, "tensor", None),
        "blocks/ln1/scale": P(None, None),
        "ln_f/scale": P(None),
        "head": P(None, "tensor"),
    },
    "fsdp_tp": {  # fsdp=4 x tensor=2: both at once, each on its own dimension
        "tok": P("tensor", "fsdp"),
        "pos": P(None, "fsdp"),
        "blocks/attn/q": P(None, "fsdp", "tensor", None),
        "blocks/attn/kv": P(None, "fsdp", None, "tensor", None),
        "blocks/attn/out": P(None, "tensor", None, "fsdp"),
        "blocks/ffn/w_in": P(None, "fsdp", "tensor"),
        "blocks/ffn/w_out": P(None, "tensor", "fsdp"),
        "blocks/ln1/scale": P(None, "fsdp"),
        "ln_f/scale": P("fsdp"),
        "head": P("fsdp", "tensor"),
    },
}
# With no rule mapping `embed` to fsdp, nothing names an fsdp split, and mesh.auto_shard gives each
# named parameter (threshold lowered to 1 element so that all qualify) fsdp on its largest dimension
# that fsdp=8 divides, the first of equals, never `layers` (partition.param_spec).
AUTO_FSDP = {
    "tok": P("fsdp", None),                          # 256 x 32
    "pos": P("fsdp", None),                          # 32 x 32: the first of equals
    "blocks/attn/q": P(None, "fsdp", None, None),    # 2 x 32 x 8 x 4
    "blocks/attn/kv": P(None, "fsdp", None, None, None),
    "blocks/attn/out": P(None, None, None, "fsdp"),  # 2 x 8 x 4 x 32
    "blocks/ffn/w_in": P(None, None, "fsdp"),        # 2 x 32 x 64
    "blocks/ffn/w_out": P(None, "fsdp", None),       # 2 x 64 x 32
    "blocks/ln1/scale": P(None, "fsdp"),             # 2 x 32: layers (2) is never taken anyway
    "ln_f/scale": P("fsdp"),
    "head": P(None, "fsdp"),                         # 32 x 256
}
SETTINGS = {"fsdp": ("fsdp",), "tp": ("tp",), "fsdp_tp": ("fsdp_tp",),
            "auto_fsdp": ("fsdp", "mesh.rules.embed=null", "mesh.auto_shard_min_size=1")}


def at(tree, path: str):
    for key in path.split("/"):
        tree = tree[key]
    return tree.get_value()


def moments(opt_state, path: str) -> list:
    """The optimizer state's arrays that belong to this parameter (Adam's mu and nu)."""
    keys = tuple(path.split("/"))
    out = []
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        names = tuple(str(getattr(k, "key", "")) for k in key_path)
        if names[-len(keys) - 1:-1] == keys or names[-len(keys):] == keys:  # with or without a trailing .value
            out.append(leaf)
    return out


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_named_parameters_and_their_moments_sit_where_the_rules_say(trained, setting):
    result = trained(*SETTINGS[setting])
    expected = AUTO_FSDP if setting == "auto_fsdp" else EXPECTED[setting]
    live = {path: at(result.state.params, path).sharding.spec for path in expected}
    assert live == expected
    for path, spec in expected.items():
        mu_nu = moments(result.state.opt_state, path)
        assert [m.sharding.spec for m in mu_nu] == [spec, spec], path  # Adam's mu and nu, like the parameter


def test_shards_have_the_split_shapes(trained):
    q = at(trained("tp").state.params, "blocks/attn/q")
    assert {s.data.shape for s in q.addressable_shards} == {(2, 32, 1, 4)}  # 8 heads over 8 devices
    head = at(trained("fsdp").state.params, "head")
    assert {s.data.shape for s in head.addressable_shards} == {(4, 256)}
    assert len({s.device for s in head.addressable_shards}) == 8


def test_fsdp_per_device_state_is_total_over_devices(trained):
    result = trained("fsdp")
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((result.state.params, result.state.opt_state)))
    batch_bytes_per_device = 2 * 16 * 32 * 4 // 8  # inputs and targets, int32, split over 8 devices
    analysis = result.train_step.memory_analysis()
    per_device_state = analysis.argument_size_in_bytes - batch_bytes_per_device
    ideal = state_bytes / 8
    assert abs(per_device_state - ideal) / ideal < 0.10, (per_device_state, ideal)


def test_dp_replicates_the_state(trained):
    result = trained("dp")
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((result.state.params, result.state.opt_state)))
    analysis = result.train_step.memory_analysis()
    assert analysis.argument_size_in_bytes >= state_bytes  # every device holds all of it


def test_batch_is_split_over_batch_axes(trained):
    result = trained("hybrid")
    text = result.train_step.as_text()
    assert "all-reduce" in text  # gradients are reduced across the data axis
    assert result.mesh.shape["data"] == 4 and result.mesh.shape["tensor"] == 2


# A tiny DeepSeek-V3-shaped MoE (latent attention with its own query latent, a dense first layer, a shared expert,
# the sigmoid router with its score correction): under `ep` the preset's rule puts the model's width on the expert
# axis, and MLA's q_b and kv_b, which have no `embed` dimension, were left whole on every device (at DeepSeek-R1's
# size, 37 GiB a chip of v5p-512's 66 GiB of arguments).
DEEPSEEK_SHAPED = ["model.name=moe", "model.vocab_size=256", "model.d_model=64", "model.n_layers=3",
                   "model.n_heads=16", "model.d_ff=32", "model.max_len=32", "model.position=rope",
                   "model.norm=rmsnorm", "model.mlp=swiglu", "model.rope_interleaved=true",
                   "model.latent={q_rank: 64, kv_rank: 64, nope_dim: 16, rope_dim: 8, v_dim: 16}",
                   "model.n_experts=8", "model.top_k=2", "model.router=sigmoid", "model.n_group=4",
                   "model.topk_group=2", "model.score_correction=true", "model.shared_experts=1",
                   "model.dense_layers=1", "model.dense_d_ff=128", "model.routing=dropless", "data.name=text",
                   "data.seq_len=16", "data.batch_size=16", "mesh=ep"]


def test_ep_splits_every_large_leaf_of_a_deepseek_shaped_state_over_all_devices(tmp_path):
    """The train state's bytes a device under `ep` on 8 devices (each leaf's shard, from the shardings the framework
    assigns) against the formula: every leaf of at least mesh.auto_shard_min_size elements a device holds an eighth
    of (each has a dimension 8 divides); only smaller ones (norm scales, the router's correction) may stay whole."""
    import math

    from shard import config
    from shard.core import mesh as mesh_lib, optim, registry, state as state_lib
    from shard.nn import partition

    cfg = config.load(None, overrides(tmp_path, *DEEPSEEK_SHAPED))
    model_cls, kwargs = registry.load(cfg.model)
    tx, _ = optim.build(cfg.optimizer, cfg.train.steps)
    _, abstract, _ = state_lib.abstract_state(model_cls, kwargs, tx, 0, cfg.model.name)
    mesh = mesh_lib.build_mesh(cfg.mesh, jax.devices()[:8])
    assert dict(mesh.shape)["expert"] == 8
    laid = state_lib.state_shardings(abstract, mesh, partition.merged_rules(cfg.mesh.rules, mesh.axis_names),
                                     state_lib.auto_min_size(cfg.mesh))
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    shardings = jax.tree.leaves(laid)
    large = [(jax.tree_util.keystr(path), x, s) for (path, x), s in zip(leaves, shardings)
             if x.size >= cfg.mesh.auto_shard_min_size]
    assert any("q_b" in p for p, _, _ in large) and any("kv_b" in p for p, _, _ in large)
    whole = sum(x.size * x.dtype.itemsize for _, x, _ in large)
    held = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for _, x, s in large)
    unsplit = [p for p, x, s in large if s.shard_shape(x.shape) == x.shape]
    assert held == whole // 8, (held, whole // 8, unsplit)
