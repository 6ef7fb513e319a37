"""The parallelism strategies beyond the rules table: pipeline, context, gradient reduction and accumulation,
low-communication training."""
