"""Model FLOPs (MFU's numerator): the textbook count, whichever attention kernel runs."""

import jax
import pytest

from conftest import TINY_GPT, overrides
from shard import config


@pytest.mark.parametrize("layers,remat", [(1, "none"), (3, "none"), (3, "full")])
def test_model_flops_are_the_textbook_count_and_xla_agrees_for_one_layer(tmp_path, layers, remat):
    """6 x (matmul parameters) x tokens + causal attention (forward 4 x width x the L(L+1)/2 (query, key)
    pairs at or below the diagonal, backward twice that), with scanned layers counted once per layer
    and without the forward that activation checkpointing recomputes (MFU, not hardware utilisation).
    XLA's cost analysis counts a loop body once, so it agrees (within its elementwise extras and the
    masked half of the attention square its kernel computes) only for one layer."""
    from shard.core.flops import xla_flops
    from shard.run.job import prepare

    cfg = config.load(None, overrides(tmp_path, *TINY_GPT, f"model.n_layers={layers}", "run.cpu_devices=1",
                                      f"train.remat={remat}"))
    job = prepare(cfg, jax.devices()[:1], training=False)
    d, ff, vocab, length, batch = 32, 64, 256, 32, 16
    tokens = batch * length
    matmul_params = layers * (4 * d * d + 2 * d * ff) + d * vocab  # q, k, v, o; MLP in and out; output layer
    causal_pairs = length * (length + 1) // 2
    expected = 3 * (2 * matmul_params * tokens + layers * batch * 4 * d * causal_pairs)
    assert job.work.flops_per_step == expected
    xla = xla_flops(job.train_step)
    if layers == 1:
        lookup_grad = 2 * tokens * vocab * d  # the embedding's gradient, a one-hot product: XLA counts it, MFU not
        assert expected + lookup_grad <= xla <= 1.25 * (expected + lookup_grad)
    else:
        assert xla < expected  # one layer's worth of the loop


def test_attention_flops_are_the_same_for_the_xla_and_cudnn_kernels(tmp_path, monkeypatch):
    """cuDNN's fused attention is one primitive with no matrix product in the jaxpr; the count comes
    from the attention call's shapes either way. Its jaxpr is traced on the CPU by telling JAX's
    cuDNN wrapper a version (tracing needs no GPU; running would)."""
    import jax._src.cudnn.fused_attention_stablehlo as cudnn

    from shard.run import job

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(job.attn, "check", lambda *args: None)  # a GPU's check
    counts = {}
    for kernel in ("xla", "cudnn"):
        cfg = config.load(None, overrides(tmp_path, *TINY_GPT, "model.n_heads=2", "train.dtype=bfloat16",
                                          f"train.attention={kernel}", "run.cpu_devices=1"))
        counts[kernel] = job.workload(cfg, jax.devices()[:1]).flops_per_step
    matmuls = 3 * 2 * (2 * (4 * 32 * 32 + 2 * 32 * 64) + 32 * 256) * 16 * 32
    assert counts["xla"] == counts["cudnn"] > matmuls  # attention counted, once, by both
