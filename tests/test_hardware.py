"""Device figures: the user's override, else what the runtime reports, else the data-sheet table."""

from types import SimpleNamespace

import jax

from shard.plan import hardware


def fake(kind: str, stats: dict | None):
    return SimpleNamespace(device_kind=kind, memory_stats=lambda: stats)


def test_memory_is_what_the_runtime_lets_jax_use_not_the_data_sheet():
    h100 = fake("NVIDIA H100 80GB HBM3", {"bytes_limit": 63_000_000_000, "bytes_in_use": 0})
    assert hardware.memory_bytes(h100, None) == 63_000_000_000  # e.g. XLA's 75% preallocation, not 80 GB
    assert hardware.memory_bytes(h100, 16) == 16_000_000_000   # run.device_memory_gb wins
    assert hardware.memory_bytes(fake("cpu", None), None) is None
    assert hardware.memory_bytes(jax.devices()[0], None) is None  # JAX's CPU reports no limit


def test_peak_and_link_come_from_one_table_matched_by_kind():
    h100 = fake("NVIDIA H100 80GB HBM3", None)
    assert hardware.peak_flops(h100, None) == 989e12 and hardware.link_gbps(h100, None) == 450
    assert hardware.peak_flops(h100, 500) == 500e12 and hardware.link_gbps(h100, 100) == 100
    assert hardware.peak_flops(fake("TPU v5 lite", None), None) == 197e12
    assert hardware.peak_flops(fake("cpu", None), None) is None and hardware.link_gbps(fake("cpu", None), None) is None
