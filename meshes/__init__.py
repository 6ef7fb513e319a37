"""Mesh presets: one YAML file each, holding axis sizes (-1 = the remaining devices) and,
optionally, `rules:` that override single entries of the logical-axis table in shard/nn/partition.py."""
