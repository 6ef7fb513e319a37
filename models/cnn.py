"""A small ResNet for image classification: a convolutional stem, stages of residual blocks (each
stage after the first halves the resolution), global average pooling and a linear classifier.

Normalisation is BatchNorm. Its statistics are means over the batch axis of the global batch: under
any mesh the batch is one logical array, so XLA computes the mean across every device's examples
(an all-reduce of per-channel sums), never per device. The eval step uses the running averages.

Channel names: the residual stream's channels are `embed`, a block's inner channels `mlp`. Under
tensor parallelism the first convolution of a block is split by output channels and the second by
input channels (Megatron's column/row pairing), so each block needs one all-reduce.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from shard.nn.partition import constrain

NAMES = ("batch", None, None)  # an image activation: (batch, height, width, channels) + channel name


def _conv(cin: int, cout: int, kernel: int, stride: int, names: tuple, rngs: nnx.Rngs) -> nnx.Conv:
    return nnx.Conv(cin, cout, (kernel, kernel), strides=stride, use_bias=False, rngs=rngs,
                    kernel_init=nnx.with_partitioning(nnx.initializers.he_normal(), (None, None, *names)))


def _batchnorm(channels: int, name: str, rngs: nnx.Rngs, zero: bool = False) -> nnx.BatchNorm:
    # zero: start a residual branch at zero, so each block begins as the identity
    scale = nnx.initializers.zeros if zero else nnx.initializers.ones
    return nnx.BatchNorm(channels, momentum=0.9, rngs=rngs,
                         scale_init=nnx.with_partitioning(scale, (name,)),
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros, (name,)))


class ResidualBlock(nnx.Module):
    """conv3x3-BN-relu-conv3x3-BN plus the input (through a strided 1x1 projection when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int, rngs: nnx.Rngs):
        self.conv1 = _conv(cin, cout, 3, stride, ("embed", "mlp"), rngs)
        self.bn1 = _batchnorm(cout, "mlp", rngs)
        self.conv2 = _conv(cout, cout, 3, 1, ("mlp", "embed"), rngs)
        self.bn2 = _batchnorm(cout, "embed", rngs, zero=True)
        reshape = stride != 1 or cin != cout
        self.project = _conv(cin, cout, 1, stride, ("embed", "mlp"), rngs) if reshape else None
        self.bn_project = _batchnorm(cout, "mlp", rngs) if reshape else None

    def __call__(self, x):
        h = jax.nn.relu(self.bn1(constrain(self.conv1(x), (*NAMES, "mlp"))))
        h = self.bn2(self.conv2(h))
        shortcut = x if self.project is None else self.bn_project(self.project(x))
        return jax.nn.relu(constrain(h + shortcut, (*NAMES, "embed")))


class ResNet(nnx.Module):
    """Images (batch, height, width, channels) (or (batch, height, width) for one channel) -> class scores.

    widths: channels of each stage; blocks: residual blocks per stage.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, widths: list = (32, 64), blocks: int = 2,
                 *, rngs: nnx.Rngs):
        if not widths or blocks < 1:
            raise ValueError(f"widths={widths!r}, blocks={blocks}: need at least one stage of one block")
        self.in_channels = in_channels
        self.stem = _conv(in_channels, widths[0], 3, 1, ("features", "embed"), rngs)
        self.bn_stem = _batchnorm(widths[0], "embed", rngs)
        stages, cin = [], widths[0]
        for s, width in enumerate(widths):
            for b in range(blocks):
                stages.append(ResidualBlock(cin, width, 2 if s > 0 and b == 0 else 1, rngs))
                cin = width
        self.blocks = nnx.List(stages)
        self.head = nnx.Linear(cin, num_classes, rngs=rngs,
                               kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "classes")),
                               bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("classes",)))

    def __call__(self, images):
        x = images if images.ndim == 4 else images[..., None]
        if x.shape[-1] != self.in_channels:
            raise ValueError(f"images of shape {images.shape[1:]} have {x.shape[-1]} channels; "
                             f"the model was built for in_channels={self.in_channels}")
        x = jax.nn.relu(self.bn_stem(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))  # global average pool
