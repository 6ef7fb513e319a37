"""What a device can do: peak FLOP/s and link bandwidth from the vendors' data sheets, and the memory
the runtime lets JAX use. One table, read by the metrics (MFU) and the plan (step estimate, fits)."""

# Per chip: peak dense bf16 TFLOP/s, and GB/s one chip sends over its fastest links (one direction).
# Matched against the device's kind (e.g. "H100" in "NVIDIA H100 80GB HBM3"); the first match wins,
# so a name that contains another comes first.
SPECS = {
    "H200": {"tflops": 989.0, "link_gbps": 450},
    "H100": {"tflops": 989.0, "link_gbps": 450},
    "A100": {"tflops": 312.0, "link_gbps": 300},
    "L4": {"tflops": 121.0, "link_gbps": 32},
    "TPU v6": {"tflops": 918.0, "link_gbps": 448},
    "TPU v5p": {"tflops": 459.0, "link_gbps": 600},
    "TPU v5 lite": {"tflops": 197.0, "link_gbps": 200},
    "TPU v5e": {"tflops": 197.0, "link_gbps": 200},
    "TPU v5": {"tflops": 459.0, "link_gbps": 600},  # v5p reports itself as "TPU v5" (after v5 lite: first match wins)
    "TPU v4": {"tflops": 275.0, "link_gbps": 300},
}


def _spec(device, key: str, override):
    """The user's override if given, else the table's figure for this device's kind, else None."""
    if override:
        return override
    kind = getattr(device, "device_kind", "")
    return next((spec[key] for name, spec in SPECS.items() if name in kind), None)


def peak_flops(device, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device: `run.peak_tflops` if given, else the table, else unknown (None)."""
    tflops = _spec(device, "tflops", override_tflops)
    return tflops * 1e12 if tflops else None


def link_gbps(device, override: float | None) -> float | None:
    """GB/s one device sends: `run.link_gbps` if given, else the table, else unknown (None)."""
    return _spec(device, "link_gbps", override)


def memory_bytes(device, override_gb: float | None) -> int | None:
    """Memory a program may use on one device: `run.device_memory_gb` if given, else what the runtime
    lets JAX allocate (`bytes_limit`: an H100's 80 GB less the runtime's reserve and the preallocation
    fraction), else unknown (None; CPUs report no limit)."""
    if override_gb:
        return int(override_gb * 1e9)
    try:
        stats = device.memory_stats() or {}
    except Exception:  # backends without memory statistics
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None
