"""Every array sits where its logical names say; FSDP really divides the state over the devices."""

import jax
from jax.sharding import PartitionSpec as P

from conftest import TINY_GPT

# That every parameter and optimizer moment has the sharding its logical names give, under every
# preset and for every model, is checked by the matrix in test_equivalence.py.


def test_tp_splits_heads_and_fsdp_splits_embed(train):
    tp = train(*TINY_GPT, "train.steps=1", "mesh=tp", subdir="tp")
    q = tp.state.params["blocks"]["attn"]["q"].get_value()
    assert q.sharding.spec == P(None, None, "tensor", None)  # (layers, embed, heads, head_dim)
    assert q.addressable_shards[0].data.shape == (2, 32, 1, 4)  # 8 heads over 8 devices
    fsdp = train(*TINY_GPT, "train.steps=1", "mesh=fsdp", subdir="fsdp")
    head = fsdp.state.params["head"].get_value()
    assert head.sharding.spec == P("fsdp", None) and head.addressable_shards[0].data.shape == (4, 256)
    mu = fsdp.state.opt_state[1][0].mu["head"].get_value()  # Adam's first moment: sharded like its parameter
    assert mu.addressable_shards[0].data.shape == (4, 256)


def test_fsdp_per_device_state_is_total_over_devices(train):
    result = train(*TINY_GPT, "train.steps=1", "mesh=fsdp")
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((result.state.params, result.state.opt_state)))
    batch_bytes_per_device = 2 * 16 * 32 * 4 // 8  # inputs and targets, int32, split over 8 devices
    analysis = result.train_step.memory_analysis()
    per_device_state = analysis.argument_size_in_bytes - batch_bytes_per_device
    ideal = state_bytes / 8
    assert abs(per_device_state - ideal) / ideal < 0.10, (per_device_state, ideal)


def test_dp_replicates_the_state(train):
    result = train(*TINY_GPT, "train.steps=1", "mesh=dp")
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((result.state.params, result.state.opt_state)))
    analysis = result.train_step.memory_analysis()
    assert analysis.argument_size_in_bytes >= state_bytes  # every device holds all of it


def test_batch_is_split_over_batch_axes(train):
    result = train(*TINY_GPT, "train.steps=1", "mesh=hybrid")
    text = result.train_step.as_text()
    assert "all-reduce" in text  # gradients are reduced across the data axis
    assert result.mesh.shape["data"] == 4 and result.mesh.shape["tensor"] == 2
