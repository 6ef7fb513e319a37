"""The strategies beyond the rules table, one class each behind the interface of base.py, listed in
registry.ALL: pipeline, context, gradient accumulation, ZeRO, host offload, the data-parallel reduction,
low-communication training (local SGD, DiLoCo) and the weights' moving average (EMA)."""
