"""QLoRA (train.lora.base=nf4|int4|int8|fp8): the frozen base stored quantized with qwix, dequantized in the step; the
adapters train as under LoRA, on every mesh as on one device, resume bitwise, and the plan shows the base's
stored bytes."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import TINY_GPT, overrides, same_curve_as_one_device
from shard import config
from shard.plan import analysis
from shard.errors import UserError
from test_lora import leaves, saved

QLORA = [*TINY_GPT, "train.steps=4", "run.log_every=1", "model.mlp=swiglu", "train.lora.rank=4",
         "train.lora.targets=[q,k,v,o,mlp]", "optimizer.lr=3e-2", "train.lora.base=nf4"]
SAVED = ["checkpoint.enabled=true", "checkpoint.every=2"]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The reference: QLoRA on one device, checkpointed at steps 2 and 4 (what the resume starts from)."""
    from shard.run import trainer

    folder = tmp_path_factory.mktemp("one")
    return folder, trainer.run(config.load(None, overrides(folder, *QLORA, *SAVED, "run.cpu_devices=1")))


def test_on_fsdp_and_tp_the_curve_is_one_devices(train, one_device):
    # one run over both splits (fsdp=2 x tensor=2): the codes and scales split on each axis by their logical names
    one, many = one_device[1], train(*QLORA, "mesh=fsdp_tp", "run.cpu_devices=4")
    np.testing.assert_allclose([r["loss"] for r in many.history], [r["loss"] for r in one.history], rtol=2e-5)
    assert many.eval["eval_loss"] == pytest.approx(one.eval["eval_loss"], rel=2e-5)
    assert one.history[-1]["loss"] < one.history[0]["loss"]


def test_on_pipeline_stages_the_curve_is_one_devices(train, one_device):
    # each stage builds its own layers' weights from its share of the codes, scales and adapters
    one, many = one_device[1], train(*QLORA, "mesh=pp", "run.cpu_devices=2")
    np.testing.assert_allclose([r["loss"] for r in many.history], [r["loss"] for r in one.history], rtol=2e-5)
    assert many.eval["eval_loss"] == pytest.approx(one.eval["eval_loss"], rel=2e-5)


def test_a_stock_flax_models_base_quantizes_and_trains_the_one_device_curve_under_fsdp(train):
    """Flax's stock layers carry no logical names: their codes and scales carry none either (the automatic rule
    splits them, as it splits the weights), and the adapters train as on one device."""
    stock = ["model.name=stock_models:StockTransformer", "model.d=64", "data.name=text", "data.seq_len=32",
             "data.batch_size=16", "train.steps=3", "run.log_every=1", "train.lora.rank=4",
             "train.lora.targets=[kernel]", "train.lora.base=nf4"]
    same_curve_as_one_device(train, stock, ["mesh=fsdp", "run.cpu_devices=4"])


def test_the_base_is_stored_once_quantized_and_resume_is_bitwise(train, tmp_path, one_device):
    folder, one = one_device
    shutil.copytree(folder, tmp_path / "run")
    got = saved(tmp_path / "run", 4)
    q = leaves(got["model"]["params"]["blocks"]["attn"]["q"])[0]
    assert q.dtype == np.uint8 and q.shape == (2, 32, 8, 2)  # (layers, embed, heads, head_dim 4 packed in 2)
    assert leaves(got["optimizer"]["extra"]["lora_base"]["blocks"]["attn"]["q"])[0].shape == (2, 32, 8, 1)
    state = lambda got: leaves(got["model"]) + leaves(got["optimizer"])
    before = state(got)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")  # as if stopped after step 2
    resumed = train(*QLORA, *SAVED, "run.cpu_devices=1")
    assert resumed.start_step == 2
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in one.history][2:]
    assert resumed.eval == one.eval
    for a, b in zip(before, state(saved(tmp_path / "run", 4))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("extra, message", [
    (["train.offload=params"],
     "train.lora.rank=4 with train.lora.base=nf4 with train.offload=params: the quantized base"),
    (["train.sync=diloco", "mesh.replica=2", "run.cpu_devices=2"],
     "train.lora.rank=4 with train.lora.base=nf4 with train.sync=diloco: the replicas would average"),
])
def test_what_cannot_combine_is_one_line(tmp_path, extra, message):
    with pytest.raises(UserError, match="^" + message):
        analysis.analyse(config.load(None, overrides(tmp_path, *QLORA, *extra)), jax.devices()[:2])


# The logits' bound: the model on the dequantized base in float32 against the same model on the weights before
# quantization, the error's norm relative to the logits' spread, at most BOUND x the largest relative error of
# one matrix (measured on this model: 1.47x for int8, int4 and nf4 alike; the matrices' errors add up over the
# layers). The matrices' own errors, blocks of 64 with absmax scales: int8 0.6%, int4 10.3%, nf4 9.3%.
BOUND = 2.0


def test_logits_of_the_quantized_base_within_its_own_error():
    from shard.core import state as state_lib
    from shard.models.gpt import GPT
    from shard.quant import base as quant

    model = state_lib.build_model(GPT, dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=128,
                                            max_len=32, mlp="swiglu"), 0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    forward = jax.jit(lambda p, tokens: nnx.merge(graphdef, p, rest)(tokens))
    tokens = jax.random.randint(jax.random.key(1), (4, 32), 0, 256)
    exact = forward(params, tokens)
    spread = jnp.linalg.norm(exact - exact.mean(-1, keepdims=True))
    is_var = lambda x: isinstance(x, nnx.Variable)
    for kind, most in (("int8", 0.01), ("int4", 0.15), ("nf4", 0.15), ("fp8", 0.05)):
        back = jax.jit(lambda p: quant.dequantize(*quant.quantize(p, kind, {}, {}), kind))(params)
        rel = max(float(jnp.linalg.norm(a[...] - b[...]) / jnp.linalg.norm(a[...]))
                  for a, b in zip(jax.tree.leaves(params, is_leaf=is_var), jax.tree.leaves(back, is_leaf=is_var))
                  if a[...].ndim >= 2)
        assert 0 < rel < most, kind
        err = float(jnp.linalg.norm(forward(back, tokens) - exact) / spread)
        assert err <= BOUND * rel, (kind, err, rel)


# NF4's 16 values: QLoRA's code book (Dettmers et al. 2023, Appendix E), as bitsandbytes writes it out
# (csrc/kernels.cu, dDequantizeNF4; functional.py's get_4bit_type("nf4")).
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)


def test_nf4_codes_are_the_published_table_and_a_block_of_64_is_its_absmax_times_the_nearest_value():
    from qwix._src.core import numerics

    from shard.quant import base as quant

    np.testing.assert_array_equal(quant.nf4_values(jnp.arange(16, dtype=jnp.int8)), NF4)
    x = jnp.linspace(-1.0, 1.0, 4001)
    codes = np.asarray(quant.nf4_codes(x))
    np.testing.assert_array_equal(codes, np.abs(np.asarray(x)[:, None] - NF4).argmin(-1))  # the nearest value
    np.testing.assert_array_equal(codes, numerics.fp_to_nf4(x).astype(np.int8))  # qwix's own nf4, raveled
    np.testing.assert_array_equal(quant.nf4_values(jnp.asarray(codes)), numerics.nf4_to_fp(jnp.asarray(codes)))
    # a stored matrix: each block of 64 along the last axis its absmax times the table's value nearest w / absmax
    w = np.random.default_rng(0).standard_normal((3, 8, 128)).astype(np.float32)
    w[0, 0, 5] = 40.0  # an outlier takes its own block's scale, not its row's
    blocks = w.reshape(3, 8, 2, 64)
    absmax = np.abs(blocks).max(-1, keepdims=True)
    want = (NF4[np.abs((blocks / absmax)[..., None] - NF4).argmin(-1)] * absmax).reshape(w.shape)
    back = quant.dequantize(*quant.quantize(nnx.State({"w": nnx.Param(jnp.asarray(w))}), "nf4", {}, {}), "nf4")
    np.testing.assert_allclose(back["w"][...], want, rtol=1e-6, atol=0)


def test_fp8_codes_are_e4m3_of_a_block_over_its_absmax_at_448():
    """The fp8 base: each block of 64 along the last axis scaled so its absmax is e4m3's largest value (448), rounded
    to the nearest e4m3 number (ml_dtypes' cast, as NumPy sees the format), times the scale back."""
    import ml_dtypes

    from shard.quant import base as quant

    w = np.random.default_rng(0).standard_normal((3, 8, 128)).astype(np.float32)
    w[0, 0, 5] = 40.0  # an outlier takes its own block's scale
    blocks = w.reshape(3, 8, 2, 64)
    scale = np.abs(blocks).max(-1, keepdims=True) / 448.0
    want = ((blocks / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale).reshape(w.shape)
    codes, scales = quant.quantize(nnx.State({"w": nnx.Param(jnp.asarray(w))}), "fp8", {}, {})
    assert codes["w"][...].dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(quant.dequantize(codes, scales, "fp8")["w"][...], want, rtol=1e-6, atol=0)


def test_the_step_builds_one_layers_weights_at_a_time(tmp_path):
    """The compiler's memory for the step: with an nf4 base, each layer's weights are dequantized and merged in the
    layer (shard/strategies/deferred.py), so the step holds no float copy of the stack; a float32 base (plain
    LoRA) merges the whole stack first. Measured on this shape (8 layers of 1M weights, 32 MiB in float32):
    float32 base 35 MiB of arguments + 78 MiB temporaries, nf4 7 + 10 (train.remat=none; 7 + 7 under full)."""
    shape = ["model.name=gpt", "model.vocab_size=256", "model.d_model=256", "model.n_layers=8", "model.n_heads=4",
             "model.d_ff=1024", "model.mlp=swiglu", "model.max_len=16", "data.name=text", "data.seq_len=16",
             "data.batch_size=2", "train.lora.rank=4", "train.lora.targets=[q,k,v,o,mlp]", "run.cpu_devices=1"]
    total = {}
    for base in ("float32", "nf4"):
        got = analysis.analyse(config.load(None, overrides(tmp_path, *shape, f"train.lora.base={base}")),
                               jax.devices()[:1])
        memory = got["memory_per_device"]
        total[base] = memory["arguments"] + memory["temp"]
    weights = 8 * (4 * 256 * 256 + 3 * 256 * 1024) * 4
    assert total["float32"] > 2 * weights  # the stack, and its merged copy
    assert total["nf4"] < 0.6 * weights, total  # less than the stack in float32: no layer but one built at once


def test_fsdp_gathers_a_layers_codes_not_its_float_weights(tmp_path):
    """Under fsdp each layer gathers its nf4 codes (uint8), scales and adapters, never the dequantized weight
    (shard/strategies/deferred.py's `as_used`): no all-gather in the step has a stacked weight's per-layer shape
    in a float type."""
    import re

    from shard.run import job as job_lib

    cfg = config.load(None, overrides(tmp_path, *QLORA, "mesh=fsdp", "run.cpu_devices=4"))
    job = job_lib.prepare(cfg, jax.devices()[:4], training=False)
    text = job.train_step.as_text()
    gathered = re.findall(r"= \(?(\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", text)
    is_var = lambda x: isinstance(x, nnx.Variable)
    shapes = [jax.tree.leaves(v)[0].shape for v in jax.tree.leaves(job.work.abstract.params, is_leaf=is_var)]
    layer_weights = {tuple(shape[1:]) for shape in shapes if len(shape) >= 3}
    floats = {tuple(int(d) for d in dims.split(",") if d) for kind, dims in gathered if kind.startswith(("f", "bf"))}
    assert any(kind == "u8" for kind, _ in gathered)
    assert not floats & layer_weights, floats & layer_weights
