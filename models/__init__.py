"""The model library. Each model is a Flax NNX module written once, with logical axis names on its
parameters; none of them knows about meshes or parallelism strategies.

A model class takes its hyperparameters as keyword arguments plus `rngs: nnx.Rngs`, and its
`__call__(inputs)` returns the outputs the loss compares with the targets.
"""

# name -> "module:Class", imported only when picked.
REGISTRY = {
    "cnn": "shard.models.cnn:ResNet",
    "gpt": "shard.models.gpt:GPT",
    "lstm": "shard.models.lstm:LSTM",
    "mlp": "shard.models.mlp:MLP",
    "moe": "shard.models.moe:MoE",
    "vit": "shard.models.vit:ViT",
}
