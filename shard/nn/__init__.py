"""What a model imports: the floor of the house, importing nothing of shard above it (only shard.errors).

partition.py (logical axis names, the rules that map them to mesh axes, constraints), hooks.py (the choices a
model leaves to the run: how a stack of layers runs, activation checkpointing, attention, positions, experts,
recurrences), attention.py and splash.py (the attention kernels and which one runs), ring.py and gathered.py
(attention over a sequence split over the context devices, and its load-balanced layout), softmax.py (the online
softmax over blocks of keys that the ring and generation's long prefills share), dropless.py (experts' routing
over the mesh), decoding.py (generation's caches), deferred.py (weights built one layer at a time in a stack),
recorded.py (auxiliary losses and statistics a model records for the step).

The run hands these what they need while a step is traced (hooks.use: the pipeline's schedule, the context
split, the decode cache), so nothing here imports a strategy, the config or the mesh. This face imports nothing.
"""
