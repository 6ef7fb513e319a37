"""Issue 47's families at real size: each one's train step compiled for hardware we do not have (`run.target`),
its memory per chip and whether it fits, by the compiler (compile-only devices: nothing runs, no accelerator).

Each family's config.json (a dict) is written alone into a folder (<out>/TARGET/configs/FAMILY/config.json) and
planned from it: `train.init_from=FOLDER --dry-run` reads a folder of config.json alone at its real size (the
framework's own reader, shard/hf/config_only.py; no weights, no tokenizer):

  python train.py configs/gpt_1b.yaml train.init_from=FOLDER run.target=TARGET mesh=fsdp
      train.remat=full data.seq_len=4096 data.batch_size=8 train.dtype=bfloat16 run.dir=... --dry-run

(float32 parameters and Adam moments, bfloat16 compute, batch 8 sequences of 4096 tokens a step, the plan's
data a byte corpus: the model's vocabulary sets the embedding and the logits, the tokens' values do not matter to
a compile). The figures come from the plan file the run writes (<run.dir>/plan-TARGET.json): the compiler's
arguments + outputs not aliased + temporaries per chip against the chip's memory. Where the TPU compiler refuses
a program larger than the chip, train.py says so in one line (exit 2), read here as the verdict.

Where ../shared/fixtures/hf holds a family's real config.json it is read as is; for the others PUBLISHED below
holds the config.json values of the model card's published config (the Hugging Face Hub's <repo>/config.json),
each saying where it came from. Fields left out are transformers' defaults, which the reader supplies.

A family whose row does not fit (or does not compile) gets the rows in MORE planned after it (and any family those
in COMPARED, whatever its verdict): more GPUs, another
mesh or routing, a compiler flag; each says why.

GPU targets need the CUDA plugin: run with /work/.venv-cuda/bin/python (jax-cuda12-plugin, no GPU needed);
TPU targets with libtpu (this repository's own venv).

  /work/.venv-cuda/bin/python bench/family_plans.py --target h100x8              # every family
  /work/.venv-cuda/bin/python bench/family_plans.py --target h100x8 --only qwen3-8b,mixtral-8x7b
  python bench/family_plans.py --target v5p-8 --only qwen3-8b
  python bench/family_plans.py --target v5p-8 --only qwen3-8b --more run.recommended_flags=false
  python bench/family_plans.py --target h100x8 --table                          # the table so far

Each row is appended to --out (default runs/family_plans/TARGET.jsonl) as it finishes; a row already there is
not compiled again (--redo to recompile). One compile at a time, under `nice -n 10`. Not imported by the tests.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from anchor_compile import run_logged, tail  # the same subprocess-with-a-log (bench/ is this script's folder)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT.parent / "shared" / "fixtures" / "hf"
BASE = ["configs/gpt_1b.yaml", "train.remat=full", "data.seq_len=4096", "data.batch_size=8", "train.dtype=bfloat16"]

# Published config.json values, where fixtures/hf has no real file of the family: the architecture's fields as the
# model card's config.json on the Hugging Face Hub gives them (ids, dtypes and dropout, which a plan does not read,
# left out).
PUBLISHED = {
    "qwen3-8b": ("Qwen/Qwen3-8B config.json", dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        max_window_layers=36, rms_norm_eps=1e-6, rope_theta=1000000, rope_scaling=None, sliding_window=None,
        use_sliding_window=False, attention_bias=False, hidden_act="silu", tie_word_embeddings=False)),
    "gemma-2-9b": ("google/gemma-2-9b config.json", dict(
        model_type="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, query_pre_attn_scalar=256,
        sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, rms_norm_eps=1e-6,
        rope_theta=10000.0, attention_bias=False)),
    # The Hub's gemma-3-12b-pt config.json is a Gemma3ForConditionalGeneration; this is its text_config (the
    # fields it sets; the rest are Gemma3TextConfig's defaults: vocab 262208, head_dim 256, rope_theta 1e6,
    # rope_local_base_freq 10000, query_pre_attn_scalar 256, a global layer every 6th).
    "gemma-3-12b": ("google/gemma-3-12b-pt config.json, its text_config", dict(
        model_type="gemma3_text", hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, rope_scaling=dict(factor=8.0, rope_type="linear"),
        sliding_window=1024)),
    "phi-3-mini-4k": ("microsoft/Phi-3-mini-4k-instruct config.json", dict(
        model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=4096,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        sliding_window=2047, tie_word_embeddings=False)),
    # Phi-3-mini-128k's architecture (Phi-3-mini-4k's, with LongRoPE to 131072 positions); the factors are those
    # of microsoft/Phi-3.5-mini-instruct's config.json, the same shape: a plan's memory does not depend on them.
    "phi-3-mini-128k": ("microsoft/Phi-3.5-mini-instruct config.json (Phi-3-mini-128k's shape and LongRoPE)", dict(
        model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=131072,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=262144,
        tie_word_embeddings=False, rope_scaling=dict(type="longrope", long_factor=[
            1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
            1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
            4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
            17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
            32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
            50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
            62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
            63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
            64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
            64.51000213623047, 64.52999877929688, 64.83999633789062], short_factor=[
            1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842,
            1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979,
            1.0999999046325684, 1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662,
            1.2899998426437378, 1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083,
            1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745,
            2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
            2.0199997425079346, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
            2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
            2.0799996852874756, 2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533,
            2.729999542236328, 2.749999523162842, 2.8399994373321533]))),
    "olmo-2-7b": ("allenai/OLMo-2-1124-7B config.json", dict(
        model_type="olmo2", vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=500000, rope_scaling=None, attention_bias=False, tie_word_embeddings=False)),
    "mistral-7b": ("mistralai/Mistral-7B-v0.1 config.json", dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False)),
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1 config.json", dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
        output_router_logits=False, router_aux_loss_coef=0.02, tie_word_embeddings=False)),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B config.json", dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, hidden_act="silu",
        max_position_embeddings=40960, max_window_layers=48, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=None, sliding_window=None, use_sliding_window=False, attention_bias=False, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        output_router_logits=False, router_aux_loss_coef=0.001, tie_word_embeddings=False)),
    # no config.json of a Qwen3.5 MoE in fixtures/hf: transformers 5.24's Qwen3_5MoeTextConfig defaults, which its
    # docstring names as Qwen/Qwen3.5-35B-A3B's (40 layers, three DeltaNet to one full; 256 experts, 8 a token)
    "qwen3.5-35b-a3b": ("transformers' Qwen3_5MoeTextConfig defaults (Qwen/Qwen3.5-35B-A3B's shape)", dict(
        model_type="qwen3_5_moe_text", rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                        "partial_rotary_factor": 0.25})),
    # the fixture holds Scout's tokenizer alone: its published text_config's fields
    "llama-4-scout-17b-16e": ("meta-llama/Llama-4-Scout-17B-16E config.json (text_config)", dict(
        model_type="llama4_text", vocab_size=202048, hidden_size=5120, intermediate_size=8192,
        intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        hidden_act="silu", max_position_embeddings=10485760, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                          original_max_position_embeddings=8192), attention_bias=False, attention_chunk_size=8192,
        attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1, no_rope_layers=[], use_qk_norm=True,
        num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1, output_router_logits=False,
        router_aux_loss_coef=0.001, tie_word_embeddings=False)),
    # no config.json of the 31B in fixtures/hf: MaxText's gemma4-31b.yml (src/maxtext/configs/models/) in
    # transformers' fields: 60 layers, five sliding (1024) to one global, the global layers 512 wide with 4 key/value
    # heads of their own and values from the keys (share_kv_projections), no per-layer embeddings or shared layers
    "glm-4.5-air": ("zai-org/GLM-4.5-Air config.json", dict(
        model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128, partial_rotary_factor=0.5,
        hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1000000, attention_bias=True,
        use_qk_norm=False, n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, first_k_dense_replace=1, num_nextn_predict_layers=1,
        tie_word_embeddings=False)),
    "gemma-4-31b": ("MaxText's gemma4-31b.yml in Gemma4TextConfig's fields", dict(
        model_type="gemma4_text", vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
        num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512,
        num_global_key_value_heads=4, attention_k_eq_v=True, hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6, sliding_window=1024, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
        num_kv_shared_layers=0, use_double_wide_mlp=False, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}
# The real config.json files of fixtures/hf, read as they are.
FIXTURE_FAMILIES = {"qwen3-4b": "qwen3-4b", "smollm3-3b": "smollm3-3b", "gemma-3-1b": "gemma-3-1b-it",
                    "llama-3.2-3b": "llama-3.2-3b-instruct", "gpt-oss-20b": "gpt-oss-20b",
                    "olmo-3-32b": "olmo-3.1-32b-instruct", "gemma-4-e2b": "gemma-4-E2B-it",
                    "qwen3.5-9b": "qwen3.5-9b", "deepseek-r1": "deepseek-r1"}
ORDER = ["qwen3-4b", "qwen3-8b", "smollm3-3b", "gemma-2-9b", "gemma-3-1b", "gemma-3-12b", "phi-3-mini-4k",
         "phi-3-mini-128k", "olmo-2-7b", "mistral-7b", "mixtral-8x7b", "qwen3-30b-a3b", "llama-3.2-3b",
         # issue 59's
         "gpt-oss-20b", "olmo-3-32b", "llama-4-scout-17b-16e", "gemma-4-e2b", "gemma-4-31b",
         # issue 60's
         "qwen3.5-9b", "qwen3.5-35b-a3b", "glm-4.5-air", "deepseek-r1"]
# What else is planned on a target, per family, after its `mesh=fsdp` row: (target, overrides). Found by these
# plans on h100x8 (bench/RESULTS.md, issue 47):
# - Phi-3's step does not compile for the H100 with the plan's defaults: XLA's GPU compiler finds no Triton tiling
#   for a dot of its key/value projection's backward (head_dim 96); without Triton GEMMs it compiles.
# - Mixtral's float32 parameters, gradients and Adam moments alone are 87 GiB a GPU over 8: 16 GPUs, the same
#   sequence a GPU (batch 16).
# - The MoE families' dropless routing (transformers' numbers, each device sorting its own tokens: shard/nn/dropless.py)
#   and the capacity routing beside it, for its memory: on 16 GPUs for Mixtral, in COMPARED for Qwen3-30B-A3B.
NO_TRITON_GEMM = "run.compiler_flags={xla_gpu_enable_triton_gemm: false}"
MORE = {
    "h100x8": {
        "phi-3-mini-4k": [("h100x8", ["mesh=fsdp", NO_TRITON_GEMM])],
        "phi-3-mini-128k": [("h100x8", ["mesh=fsdp", NO_TRITON_GEMM])],
        "gemma-4-31b": [("h100x16", ["mesh=fsdp", "data.batch_size=16"])],
        # 106B weights with float32 Adam take 1.7 TB: 32 GPUs in full; on 8, adapters on a bfloat16 base
        "glm-4.5-air": [("h100x32", ["mesh=ep", "data.batch_size=32"]),
                        ("h100x8", ["mesh=ep", "train.lora.rank=16", "train.lora.base=bfloat16"])],
        "mixtral-8x7b": [("h100x16", ["mesh=fsdp", "data.batch_size=16"]),
                         ("h100x16", ["mesh=fsdp", "data.batch_size=16", "model.routing=capacity"])],
    },
}
# Planned after a family's row whether it fits or not: the MoE's dropless routing with its experts split (ep: all
# the GPUs; or 4 of them, fsdp over 2), and the capacity routing beside it, for their memory.
COMPARED = {
    "h100x8": {"qwen3-30b-a3b": [("h100x8", ["mesh=ep"]), ("h100x8", ["mesh=fsdp", "mesh.expert=4"]),
                                 ("h100x8", ["mesh=fsdp", "model.routing=capacity"])],
               "qwen3.5-35b-a3b": [("h100x8", ["mesh=ep"])]},
}


def family_config(name: str) -> tuple[str, dict]:
    """(where it came from, the config.json as a dict)."""
    if name in PUBLISHED:
        return PUBLISHED[name]
    path = FIXTURES / FIXTURE_FAMILIES[name] / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is absent (a clone without ../shared/fixtures/hf)")
    return f"fixtures/hf/{FIXTURE_FAMILIES[name]}/config.json (real)", json.loads(path.read_text())


def config_folder(name: str, config: dict, work: Path) -> Path:
    """A folder holding only the family's config.json, for train.init_from (written afresh: PUBLISHED may change)."""
    folder = work / "configs" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def raised(log: Path) -> str:
    """The exception a traceback ended with (its first line), if the log holds one."""
    found = [x for x in log.read_text(errors="replace").splitlines() if re.match(r"[\w.]+(Error|Exception): ", x)]
    return found[-1][:600] if found else ""


def plan_row(name: str, target: str, more: list[str], work: Path, timeout_s: float) -> dict:
    """One family's plan on one target: compile it in a subprocess and read its plan file."""
    where, config = family_config(name)
    tag = "-".join([name, target, *[m.replace("=", "_").replace(".", "_") for m in more]])
    run_dir = work / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    folder = config_folder(name, config, work)
    cmd = ["nice", "-n", "10", sys.executable, "train.py", *BASE, f"train.init_from={folder}", f"run.target={target}",
           *(more or ["mesh=fsdp"]), f"run.dir={run_dir}", "--dry-run"]
    log = work / f"{tag}.log"
    start = time.time()
    rc = run_logged(cmd, log, {**os.environ, "JAX_PLATFORMS": "cpu"}, timeout_s)
    shown = "python " + shlex.join(cmd[4:])
    row = {"family": name, "source": where, "target": target, "more": more, "command": shown,
           "wall_s": round(time.time() - start, 1)}
    plans = sorted(run_dir.glob("plan-*.json"))
    said = tail(log, 1)
    if rc == 2:  # train.py's one line: the TPU compiler's refusal of the chip's HBM (the verdict), or another
        return {**row, "fits": False, "refused": said} if "does not fit" in said else {**row, "error": said}
    if rc or not plans:
        return {**row, "error": f"exit {rc}: {raised(log) or tail(log, 12)}"}
    plan = json.loads(plans[0].read_text())
    mem = plan["memory_per_device"]
    return {**row, "fits": mem["fits"], "total": mem["total"], "arguments": mem["arguments"], "temp": mem["temp"],
            "params": mem["params"], "optimizer": mem["optimizer"], "capacity": mem["capacity"],
            "param_count": plan["param_count"], "mesh": {k: v for k, v in plan["mesh"].items() if v > 1},
            "device": plan["target"], "strategies": plan["strategies"],
            "kernel_calls": plan["compiler"].get("kernel_calls"),  # cuDNN's or splash attention, where it runs
            "compiler_step_s": plan["compiler"].get("step_s"),  # the TPU cost model's; the GPU compiler gives none
            "collectives": {k: v["count"] for k, v in plan["collectives"].items() if v["count"]},
            "versions": versions()}


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("jax", "jaxlib", "jax-cuda12-plugin", "libtpu", "flax"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def load(path: Path) -> dict:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[(r["family"], r["target"], tuple(r["more"]))] = r
    return done


def measure(args) -> None:
    work = args.out.parent / args.target
    work.mkdir(parents=True, exist_ok=True)
    done = load(args.out)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or None  # the tree compiled (dirty: others' edits too)

    def one(name: str, target: str, more: list[str]) -> dict:
        key = (name, target, tuple(more))
        if key in done and not args.redo and "error" not in done[key]:
            return done[key]
        print(f"compiling {name} for {target} {' '.join(more) or 'mesh=fsdp'} ...", flush=True)
        r = plan_row(name, target, more, work, args.timeout_s)
        r["when"] = time.strftime("%Y-%m-%d %H:%M")
        r["commit"] = commit
        done[key] = r
        with open(args.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        print("  " + line(r), flush=True)
        return r

    for name in args.only:
        try:
            family_config(name)
        except FileNotFoundError as e:
            print(f"skipping {name}: {e}")
            continue
        r = one(name, args.target, ["mesh=fsdp", *args.more] if args.more else [])
        for target, more in [*(MORE.get(args.target, {}).get(name, []) if not r.get("fits") else []),
                             *COMPARED.get(args.target, {}).get(name, [])]:
            one(name, target, more)


def gib(b) -> str:
    return f"{b / 2**30:.2f}" if b is not None else "-"


def line(r: dict) -> str:
    if "error" in r:
        return f"error: {r['error']}"
    if "refused" in r:
        return f"does not fit (refused by the compiler): {r['refused']}"
    verdict = "fits" if r["fits"] else f"does NOT fit by {(r['total'] - r['capacity']) / 2**30:.2f} GiB"
    return f"{gib(r['total'])} GiB a chip ({gib(r['arguments'])} arguments + {gib(r['temp'])} temp): {verdict}"


def table(args) -> str:
    done = load(args.out)
    lines = ["| family (config.json) | params | target, settings | memory per chip, GiB (args + temp) | verdict (of "
             "the chip's GiB) | attention | compile s |", "|---|---|---|---|---|---|---|"]
    for r in sorted(done.values(), key=lambda r: (ORDER.index(r["family"]) if r["family"] in ORDER else 99,
                                                   r["when"])):
        where = f"{r['target']}, " + (" ".join(r["more"]) if r["more"] else "mesh=fsdp")
        if "error" in r:
            lines.append(f"| {r['family']} | - | {where} | - | does not compile: {r['error'][:200]} | - | "
                         f"{r['wall_s']:.0f} |")
            continue
        if "refused" in r:
            lines.append(f"| {r['family']} | - | {where} | - | does not fit (refused by the compiler) | - | "
                         f"{r['wall_s']:.0f} |")
            continue
        verdict = "fits" if r["fits"] else f"does not fit by {(r['total'] - r['capacity']) / 2**30:.2f} GiB"
        lines.append(f"| {r['family']} | {r['param_count'] / 1e9:.2f} B | {where} | {gib(r['total'])} "
                     f"({gib(r['arguments'])} + {gib(r['temp'])}) | {verdict} (of {gib(r['capacity'])}) | "
                     f"{'kernel' if r.get('kernel_calls') else 'XLA'} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="h100x8")
    p.add_argument("--only", default=",".join(ORDER), help="comma-separated families (default: all)")
    p.add_argument("--more", nargs="*", default=[], help="more overrides for each family's row (KEY=VALUE ...)")
    p.add_argument("--out", type=Path)
    p.add_argument("--redo", action="store_true", help="compile rows already in --out again")
    p.add_argument("--table", action="store_true", help="only print the table from --out")
    p.add_argument("--timeout-s", type=float, default=3600)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    args.only = [x for x in args.only.split(",") if x]
    unknown = [x for x in args.only if x not in ORDER]
    if unknown:
        raise SystemExit(f"unknown families {unknown}: choose from {', '.join(ORDER)}")
    args.out = (args.out or ROOT / "runs" / "family_plans" / f"{args.target}.jsonl").resolve()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not args.table:
        measure(args)
    print(table(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
