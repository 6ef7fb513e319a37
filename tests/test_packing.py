"""Packed rows (`data.packing=documents`): the packer fills rows first-fit with whole documents; in a packed
row a document's logits do not depend on the other documents (bitwise, under every kind of split); positions
restart with each document; padding counts for nothing; the loss is the global batch's real-target mean
whatever the microbatches and data shards; a packed run logs its target tokens and packing efficiency."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import ROOT, TINY_GPT, TINY_MODELS, overrides
from shard import config
from shard.nn import attention, hooks, partition
from shard.core import state as state_lib
from shard.objectives import lm
from shard.data import packing
from shard.errors import UserError
from shard.run import job as job_lib
from shard.nn import ring

L, B = 32, 16  # TINY_GPT's seq_len and batch size
# A small corpus of documents (this repository's docs): packing the standard library costs seconds a job.
PACKED = [*TINY_GPT, f"data.path={ROOT / 'docs'}", "data.packing=documents"]


def test_rows_are_filled_first_fit_with_whole_documents():
    docs = [np.arange(1, 6), np.arange(10, 22), np.arange(30, 34), np.arange(40, 43), [7]]  # 4, 11, 3, 2, 0 pairs
    rows = list(packing.pack(docs, 8))
    # 4 pairs open row A; 11 > 8 is cut into 8 (a new row, full: out first) and 3, which fit in A (4 + 3);
    # doc 3's 3 pairs do not (1 free), so they open row C, which doc 4's 2 pairs join; doc 5 has no pair.
    assert [r["segment_ids"].tolist() for r in rows] == [[1] * 8, [1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 2, 2, 0, 0, 0]]
    full, first = rows[0], rows[1]
    assert full["inputs"].tolist() == list(range(10, 18)) and full["targets"].tolist() == list(range(11, 19))
    assert first["inputs"][4:7].tolist() == [18, 19, 20] and first["targets"][4:7].tolist() == [19, 20, 21]
    assert first["positions"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]  # restart per document (and padding)
    assert first["loss_mask"].tolist() == [1, 1, 1, 1, 1, 1, 1, 0]
    pairs = sorted((int(i), int(t)) for r in rows for i, t, m in zip(r["inputs"], r["targets"], r["loss_mask"]) if m)
    want = sorted((int(a), int(b)) for d in docs for a, b in zip(d[:-1], d[1:]))
    assert pairs == want  # every (input, next token) pair of every document exactly once
    assert [r["segment_ids"].tolist() for r in packing.pack(docs, 8)] == [r["segment_ids"].tolist() for r in rows]
    source = packing.PackedRows(packing.Documents.of_arrays(docs), 8)
    got = source.read_batch(np.arange(3))
    for key in packing.KEYS:
        np.testing.assert_array_equal(got[key], np.stack([r[key] for r in rows]))


@pytest.mark.parametrize("causal", [True, False])
def test_the_cpu_kernel_masks_documents_as_jax_does(causal):
    """The CPU kernel's segment mask (grouped heads folded into rows) against jax.nn's attention with the mask."""
    b, t, h, kv, d = 2, 16, 4, 2, 8
    q, k, v = (jax.random.normal(key, (b, t, n, d))
               for key, n in zip(jax.random.split(jax.random.key(0), 3), (h, kv, kv)))
    segments = jnp.asarray(np.repeat([[1, 2, 3, 0], [1, 1, 2, 2]], 4, axis=1))
    ours = attention.xla_cpu(q, k, v, causal, segments)
    mask = (segments[:, :, None] == segments[:, None, :])[:, None]
    want = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal)
    np.testing.assert_allclose(ours, want, rtol=1e-6, atol=1e-6)
    with hooks.use(attention="cudnn"), hooks.packed(segments, segments), pytest.raises(UserError, match="segment ids"):
        hooks.attention(q, k, v, is_causal=causal)


def documents_batch(seed=0) -> dict:
    """B packed rows of random byte documents of 3..24 tokens, row 0 one with at least 3 documents."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, rng.integers(3, 25)) for _ in range(200)]
    rows = sorted(list(packing.pack(docs, L))[:B], key=lambda r: -min(r["segment_ids"].max(), 3))
    return {k: np.stack([r[k] for r in rows]) for k in packing.KEYS}


def prepared(*extra, devices=None):
    cfg = config.load(None, overrides("/tmp/unused", *PACKED, *extra))
    return cfg, job_lib.prepare(cfg, devices or jax.devices(), training=False)


def logits_fn(cfg, j):
    """The job's model on a batch as its train step runs it (split, reordered, hooked), logits back in order."""
    ctx = j.strategy("context")
    order = ctx.split.order if ctx else None
    traced = {k: v for s in j.strategies for k, v in s.hooks().items()}

    def logits(state, batch):
        model = nnx.merge(j.work.graphdef, state.params, state.rest)
        out = lm.run_model(model, ring.reorder(batch, order), jnp.float32)
        return out if order is None else out[:, np.argsort(order)]

    with partition.activate(j.mesh, j.rules), hooks.use(cfg.train.remat, cfg.train.attention, **traced):
        fn = jax.jit(logits, in_shardings=(j.shardings, j.batch_shardings)).lower(j.abstract, j.work.batch).compile()
    state = state_lib.init_state(j.init, j.shardings)
    return lambda batch: np.asarray(fn(state, jax.device_put(batch, j.batch_shardings)))


MESHES = {"dp": ["mesh=dp"], "fsdp": ["mesh=fsdp"], "tp": ["mesh=tp"], "cp_all_gather": ["mesh=cp"],
          "cp_ring": ["mesh=cp", "train.context_strategy=ring"]}


@pytest.fixture(scope="module")
def one_device():
    cfg, j = prepared(devices=jax.devices()[:1])
    return logits_fn(cfg, j)


@pytest.mark.parametrize("mesh", MESHES)
def test_a_document_sees_only_itself_bitwise(mesh, one_device):
    batch = documents_batch()
    row, doc = 0, 2
    assert batch["segment_ids"][row].max() >= 3, "row 0 must hold a document on each side of the changed one"
    changed = {k: v.copy() for k, v in batch.items()}
    inside = changed["segment_ids"][row] == doc
    changed["inputs"][row, inside] = (changed["inputs"][row, inside] + 1 + np.arange(inside.sum())) % 256
    cfg, j = prepared(*MESHES[mesh])
    run = logits_fn(cfg, j)
    before, after = run(batch), run(changed)
    others = np.ones(batch["inputs"].shape, bool)
    others[row, inside] = False
    assert not np.array_equal(before[row, inside], after[row, inside])  # the changed document's own do change
    np.testing.assert_array_equal(before[others], after[others])        # nobody else's, to the bit
    np.testing.assert_allclose(before, one_device(batch), rtol=2e-5, atol=2e-5)  # and the split is the model


@pytest.fixture(scope="module")
def one_device_rope():
    cfg, j = prepared("model.position=rope", devices=jax.devices()[:1])
    return logits_fn(cfg, j)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_positions_restart_and_a_document_packed_equals_it_alone(position, request):
    """Document 2 of row 0, at its place in the packed row, against the same tokens alone at the start of a row."""
    one_device = request.getfixturevalue({"learned": "one_device", "rope": "one_device_rope"}[position])
    batch = documents_batch()
    inside = batch["segment_ids"][0] == 2
    n = int(inside.sum())
    assert batch["positions"][0, inside].tolist() == list(range(n)) and np.argmax(inside) > 0
    alone = {k: v.copy() for k, v in batch.items()}
    alone["inputs"][0], alone["segment_ids"][0] = 0, 0
    alone["inputs"][0, :n], alone["segment_ids"][0, :n] = batch["inputs"][0, inside], 1
    alone["positions"][0] = packing.row_positions(alone["segment_ids"][0])
    np.testing.assert_allclose(one_device(batch)[0, inside], one_device(alone)[0, :n], rtol=1e-5, atol=1e-5)


def test_a_recurrence_restarts_at_each_document():
    """The LSTM's state does not pass from one document into the next: later documents' logits bitwise alone."""
    lstm = [*(a for a in TINY_MODELS["lstm"] if not a.startswith("data.")), f"data.seq_len={L}", f"data.batch_size={B}"]
    cfg = config.load(None, overrides("/tmp/unused", *lstm, f"data.path={ROOT / 'docs'}", "data.packing=documents"))
    run = logits_fn(cfg, job_lib.prepare(cfg, jax.devices()[:1], training=False))
    batch = documents_batch()
    changed = {k: v.copy() for k, v in batch.items()}
    first = changed["segment_ids"][0] == 1
    changed["inputs"][0, first] = (changed["inputs"][0, first] + 7) % 256
    before, after = run(batch), run(changed)
    assert not np.array_equal(before[0, first], after[0, first])
    np.testing.assert_array_equal(before[0, ~first], after[0, ~first])


def train_outputs(*extra, batch, devices=None):
    cfg, j = prepared(*extra, "optimizer.warmup_steps=2", devices=devices)
    state = state_lib.init_state(j.init, j.shardings)
    _, out = j.train_step(state, jax.device_put(batch, j.batch_shardings))
    return {k: float(v) for k, v in out.items()} | {"local_axes": j.reduction.local_axes}


def test_the_loss_is_the_global_token_mean_over_microbatches_and_shards(one_device):
    """Rows of very different real counts (even rows whole, odd rows 3 targets), so microbatch and shard
    means weighted 1/K, 1/N each would be wrong; padding's own tokens change nothing, to the bit."""
    batch = documents_batch()
    for key in ("segment_ids", "loss_mask"):
        batch[key][1::2, 3:] = 0
    batch["positions"] = packing.row_positions(batch["segment_ids"])
    token = np.asarray(optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(one_device(batch)),
                                                                       batch["targets"]))
    mask = batch["loss_mask"]
    global_mean = (token * mask).sum() / mask.sum()
    micro = [(token[k::2] * mask[k::2]).sum() / mask[k::2].sum() for k in range(2)]
    assert abs(np.mean(micro) - global_mean) > 1e-3  # what averaging microbatch means would give instead
    whole = train_outputs("mesh=dp", batch=batch)
    accumulated = train_outputs("mesh=dp", "train.grad_accum=2", batch=batch)
    assert accumulated["local_axes"] == ("data",)  # each device's own gradient, reduced once: 1/8 each
    np.testing.assert_allclose(whole["loss"], global_mean, rtol=1e-6)
    np.testing.assert_allclose(accumulated["loss"], global_mean, rtol=1e-6)
    np.testing.assert_allclose(accumulated["grad_norm"], whole["grad_norm"], rtol=1e-5)
    assert whole["target_tokens"] == mask.sum() and whole["packing_efficiency"] == mask.mean()
    padded = {k: v.copy() for k, v in batch.items()}
    pad = batch["segment_ids"] == 0
    padded["inputs"][pad], padded["targets"][pad] = 17, 99
    again = train_outputs("mesh=dp", batch=padded)
    assert (again["loss"], again["grad_norm"]) == (whole["loss"], whole["grad_norm"])


def test_a_packed_run_trains_and_logs_its_target_tokens(train):
    run = train(*PACKED, "train.steps=4", "run.log_every=1", "optimizer.warmup_steps=2", "run.cpu_devices=1")
    first, last = run.history[0], run.history[-1]
    assert last["loss"] < first["loss"]
    assert all(0.9 < r["packing_efficiency"] <= 1 and r["target_tokens"] == r["packing_efficiency"] * B * L
               for r in run.history)
    assert np.isfinite(run.eval["eval_loss"])


def test_packing_needs_documents(tmp_path):
    with pytest.raises(UserError, match="data.packing=documents packs language-model documents"):
        config_job = config.load(None, overrides(tmp_path, "data.name=digits", "data.packing=documents",
                                                 "model.name=mlp"))
        job_lib.workload(config_job, jax.devices()[:1])


@pytest.mark.parametrize("mesh", ["cp_all_gather", "cp_ring"])
def test_split_packed_rows_train_as_on_one_device(mesh):
    """The forward and backward of packed rows split over the context devices: loss and gradient norm."""
    batch = documents_batch(seed=1)
    one = train_outputs(batch=batch, devices=jax.devices()[:1])
    split = train_outputs(*MESHES[mesh], batch=batch)
    np.testing.assert_allclose([split["loss"], split["grad_norm"]], [one["loss"], one["grad_norm"]], rtol=1e-5)


def test_a_documents_corpus_packs_whole_documents(train, tmp_path):
    """data.name=documents with data.packing=documents: rows of whole documents, eval rows with the bytes
    of their real targets, and a run that trains on them."""
    import json

    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "packing", "rows"]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(2, 12)))})
                                for _ in range(300)))
    args = [*TINY_GPT, "data.name=documents", f"data.path={corpus}", "data.packing=documents",
            f"data.cache_dir={tmp_path / 'cache'}", "data.eval_fraction=0.2"]
    cfg = config.load(None, overrides(tmp_path / "run", *args))
    trained, held, _ = packing.splits(cfg.data, tmp_path / "cache")
    rows = held.read_batch(np.arange(len(held)))
    assert set(packing.KEYS) <= set(rows) and 0 < rows["bytes"].sum() <= rows["loss_mask"].sum()
    assert trained.efficiency() > 0.9 and rows["segment_ids"].max() > 2  # several documents a row
    run = train(*args, "train.steps=3", "run.log_every=1", "run.cpu_devices=1")
    assert all("target_tokens" in r for r in run.history) and np.isfinite(run.eval["eval_bits_per_byte"])
