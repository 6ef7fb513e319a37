"""Quantized weights, with Google's qwix: a frozen base stored in 4 or 8 bits under low-rank adapters (QLoRA,
base.py); int8/fp8 training and serving beside it."""
