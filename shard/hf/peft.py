"""A LoRA run's adapters alone, in the layout Hugging Face's `peft` library loads
(`python -m shard.export RUN --adapters-only --out FOLDER`): adapter_config.json (r, lora_alpha,
target_modules, base_model_name_or_path) and adapter_model.safetensors, with for every adapted Linear
`base_model.model.<module>.lora_A.weight` (r, in) and `.lora_B.weight` (out, r), so that
`PeftModel.from_pretrained(base, FOLDER)` runs the base model plus (lora_alpha / r) B A: our merged weights.

Which Hugging Face module each adapted weight is comes from the architecture's tensor table (tables.py): a
Llama-style GPT (llama, mistral, qwen2, gemma, qwen3, smollm3, olmo2, phi3). GPT-2's fused Conv1D c_attn has no
per-projection module for PEFT's q/k/v adapters, so it is refused. Phi-3's fused qkv_proj and gate_up_proj hold
several of our weights: their pairs go side by side along the rank, each B at its part's rows of the fused output,
the module's rank parts x r (`rank_pattern`) and its scale alpha / r kept (`alpha_pattern`): B A is exactly the sum
of our deltas.
"""

import json
import math
from pathlib import Path

import jax
import numpy as np

from shard.errors import UserError
from shard.hf import arch, peft_params, read, tables

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# The Linears' names that peft, beside a model's stacked experts, takes for the experts' own (DeepSeek-V3's, GLM-4.5's)
EXPERT_NAMES = {"gate_proj", "up_proj", "down_proj"}


def row_for(kind: str, site, size: dict | None = None) -> tables.Row:
    """The table row of the Hugging Face Linear that this adapted weight (or fused half) is (`size`: the letters'
    sizes, where they place it: a scanned period's length)."""
    ours = ".".join(site.path)
    period = size if size and "period" in size else None  # (only a period's rows need the sizes to be found)
    for r in tables.offset(tables.rows(kind, {ours}, period), size):  # (a row of unlike layers made this layer's)
        picked = [v for l, v in r.at.items() if l not in {x for g in r.groups() for x in g}]
        if r.ours == ours and picked == ([] if site.weight.pick is None else [site.weight.pick]):
            if len(r.groups()) == 2 and r.theirs.endswith(".weight"):
                return r
    raise UserError(f"--adapters-only: the adapted weight {ours} ({site.target}) is no single Linear of a {kind} "
                    "model, so PEFT has no module for its adapters; export the merged model with --format hf")


def linear_pair(row: tables.Row, site, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer's A (our input dims..., r) and B (r, our output dims...) as PEFT's lora_A (r, in) and lora_B
    (out, r), the flattened dimensions in the order of the Hugging Face weight (out, in)."""
    letters = [l for l in row.letters() if not (l in row.at and l not in {x for g in row.groups() for x in g})]
    _, n_in, _ = site.split
    ins, outs = letters[:n_in], letters[n_in:]
    their_out, their_in = row.groups()
    their_out = tuple(l for l in their_out if l in outs or l not in row.at)  # less a fused part's index (placed)
    if sorted(their_in) != sorted(ins) or sorted(their_out) != sorted(outs):
        raise UserError(f"--adapters-only: {row.theirs} is not laid out (out, in) over {site.target}'s dimensions")
    a = a.transpose([ins.index(l) for l in their_in] + [len(ins)]).reshape(-1, a.shape[-1])
    b = b.transpose([0] + [1 + outs.index(l) for l in their_out]).reshape(b.shape[0], -1)
    return np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)


def tensors(kind: str, site_list, values: dict, size: dict | None = None) -> tuple[dict, list[str], dict[str, int]]:
    """{PEFT tensor name: array} for every adapted weight and layer, the target module names, and {module: parts}
    for the fused Linears several of our weights fill (`size`: the letters' sizes, to place each part)."""
    out, modules, fused, groups = {}, [], {}, {}
    for s in site_list:
        row = row_for(kind, s, size)
        groups.setdefault((row.theirs, row.offset), []).append((row, s))  # (a period's places: one module each)
    for (theirs, _), parts in groups.items():
        module = theirs.removesuffix(".weight")
        modules.append(module.rsplit(".", 1)[-1])
        shared = parts[0][0].fused
        if shared:
            fused[modules[-1]] = len(parts)
        stacked = values[parts[0][1].key]["lora_a"].shape[0] if parts[0][0].layered else 0  # its stack's layers
        for i in (range(stacked) if parts[0][0].layered else [None]):
            pairs = []
            for row, s in parts:
                a, b = (values[s.key][k] if i is None else values[s.key][k][i] for k in ("lora_a", "lora_b"))
                lora_a, lora_b = linear_pair(row, s, a, b)
                pairs.append((lora_a, placed(tables.resolved(row, size), lora_b, size) if shared else lora_b))
            first = parts[0][0]
            name = "base_model.model." + (module.format(i=i * first.stride + first.offset) if i is not None else module)
            out[f"{name}.lora_A.weight"] = np.concatenate([a for a, _ in pairs])
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(np.concatenate([b for _, b in pairs], axis=1))
    return out, sorted(set(modules)), fused


def placed(row: tables.Row, b: np.ndarray, size: dict) -> np.ndarray:
    """A fused part's lora_B (its out, r) at its rows of the whole fused output (zeros elsewhere)."""
    lo, hi, picks, _ = read.their_slices(row, {l: range(size[l]) for l in row.letters()}, size)[0]
    whole = np.zeros((tables.their_shape(row, size)[0], b.shape[1]), b.dtype)
    whole[lo + (np.arange(hi - lo) if picks is None else picks)] = b
    return whole


def write(out: Path, kind: str, site_list, values: dict, rank: int, alpha: float, base: str | None,
          size: dict | None = None) -> int:
    """The folder: adapter_config.json and adapter_model.safetensors. Returns the bytes written."""
    from safetensors.numpy import save_file

    table = tables.FUSED.get(kind, kind)  # the names of transformers' modules: a mixture's experts stacked
    bare = [s for s in site_list if peft_params.row(table, s)]
    named, modules, fused = tensors(table, [s for s in site_list if s not in bare], values, size)
    if table in tables.FUSED.values() and set(modules) & EXPERT_NAMES:
        taken = ", ".join(sorted(set(modules) & EXPERT_NAMES))
        raise UserError(f"--adapters-only: peft reads adapters on a {kind} model's {taken} as its experts' and drops "
                        "those of the dense and shared MLPs of those names, so the folder would not run as the run "
                        "does; export the merged model with --format hf, or train adapters on the attention and the "
                        "router alone")
    more, params, parts = peft_params.tensors(table, bare, values, size)
    parts = {**fused, **parts}
    named.update(more)
    out.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": modules, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "base_model_name_or_path": base}
    if params:
        config.update(target_parameters=params)
    if parts:
        config.update(rank_pattern={k: n * rank for k, n in parts.items()},
                      alpha_pattern={k: n * alpha for k, n in parts.items()})
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.astype(np.float32) for k, v in named.items()}, str(out / WEIGHTS))
    return sum(math.prod(v.shape) * 4 for v in named.values())


def export(run: str, overrides: list[str], step: int | None, out_arg: str | None, trust_code: bool) -> str:
    """`python -m shard.export RUN --adapters-only --out FOLDER`: the adapters of the run's checkpoint, read on
    one device (they are small), written as PEFT's folder. Returns the line to print."""
    from shard.core import mesh as mesh_lib
    from shard.core import registry
    from shard.core import state as state_lib
    from shard.hf import write as hf_write
    from shard.run import checkpoint as ckpt_lib
    from shard.strategies import adapters, lora
    from shard.use import load
    from flax import nnx

    if not out_arg:
        raise UserError("--adapters-only needs --out FOLDER (a new or empty folder)")
    out = Path(out_arg).expanduser().absolute()
    hf_write.check_out(out)
    cfg = load.run_settings(run, overrides, "RUN")
    got = lora.settings(cfg)
    if got is None:
        raise UserError(f"RUN {run!r} trained no adapters (train.lora.rank=0); export its model with --format hf")
    rank, alpha, _ = got
    kind = arch.from_gpt(cfg.model.kwargs, cfg.model.name)["model_type"]
    if kind not in tables.TABLES or kind == "gpt2":
        raise UserError(f"--adapters-only writes PEFT adapters for Llama-style GPTs; this run's model is a {kind}: "
                        "export the merged model with --format hf")
    model_cls, kwargs = registry.load(cfg.model, trusted=trust_code, source=f"RUN={run!r} (its config.yaml)")
    params = nnx.split(nnx.eval_shape(lambda: state_lib.build_model(model_cls, kwargs, cfg.train.seed)),
                       nnx.Param, ...)[1]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(mesh_lib.AXES)), mesh_lib.AXES)
    site_list, _, held = lora.LoRA.adapters_target(cfg, model_cls, params, mesh)
    folder, at = ckpt_lib.open_named(run, "RUN", step)
    saved = ckpt_lib.read_parts(folder, at, {"optimizer": {"extra": {lora.KEY: held}}})["optimizer"]["extra"][lora.KEY]
    values = {s.key: {k: np.asarray(v[...]) for k, v in adapters.pair(saved, s).items()} for s in site_list}
    base = cfg.train.init_from
    g = arch.with_defaults(cfg.model.kwargs)
    size = write(out, kind, site_list, values, rank, alpha, base, tables.sizes(g, kind))
    return (f"wrote {out} ({len(site_list)} adapted weights, rank {rank}, alpha {alpha:g}, {size / 1e6:.2f} MB, "
            f"step {at} of {run}); load it with peft.PeftModel.from_pretrained(<the base model>, {str(out)!r})")
