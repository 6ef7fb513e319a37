"""The plan: what a mesh costs in memory and communication, read from the compiled train step.

`python train.py CONFIG --dry-run` compiles the step for the configured mesh (allocating nothing
but what compiling needs), prints a short report and writes `<run.dir>/plan.json`; `--compare` does
it for every preset and every factorization of the devices into the canonical axes that the model's
dimensions allow; `mesh=auto` trains with the fastest estimate that fits.

Every figure is per device and per step. Memory comes from XLA's memory analysis of the compiled
program (arguments, outputs not aliased to donated inputs, temporaries) and from the shardings of the
state; collectives and their bytes from the program's HLO (shard/plan/hlo.py). The step-time estimate is
compute + communication with no overlap (an upper bound for a well-overlapped step):
  flops_per_device / peak FLOP/s  +  wire_bytes_per_device / link bandwidth.

The modules: analysis.py (one job's plan: `analyse`, `report`, `write`), meshes.py (`--compare` and mesh=auto:
every candidate mesh of the devices, the table, the choice), hlo.py (collectives and their bytes from a compiled
program), hardware.py (peak FLOP/s, memory and links of known chips), target.py (compile-only TPU and GPU devices,
run.target) and search.py (mesh=auto for a target). This face imports none of them.
"""
