"""The config schema: every key, defined once, as a dataclass field with its type, default and help.

YAML files and the command line only set values (`shard.config.loading`). The `model` section is the
exception by design: apart from `model.name`, its keys are the model class's constructor arguments, so
the class signature is their schema (checked in `shard.core.registry`).
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional


def option(default: Any, help: str, choices: tuple | None = None, key: str | None = None,
           min: float | None = None, max: float | None = None, job: bool | None = None):
    """A schema field: its default, one line of help, optionally the allowed values or range, and the key
    users write where it differs from the field name (`checkpoint.async`: `async` is a Python keyword).
    `job`: whether the key changes what is trained, and so the run's folder (`job_key`); None takes the
    section's rule (`shard.config.naming.JOB_SECTIONS`)."""
    meta = {"help": help, "choices": choices, "key": key, "min": min, "max": max, "job": job}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    name: str = option("gpt", "registered model name (see models/) or package.module:Class")
    # Filled by the loader with every other model.* key; checked against the class signature.
    kwargs: dict = field(default_factory=dict, metadata={"internal": True})


@dataclass
class DataConfig:
    name: str = option("text", "data source",
                       choices=("text", "documents", "digits", "tabular", "arrays", "array_record", "synthetic"))
    task: str = option("auto", "what is predicted; auto = the source's own task",
                       choices=("auto", "lm", "classification", "binary", "regression"))
    path: Optional[str] = option(None, "text: file, folder or glob (default: Python's own .py sources); documents: "
                                 "file, folder or glob of .jsonl(.gz), .json, .parquet, .txt, .arrow files or a "
                                 "datasets save_to_disk folder; tabular: diabetes (default), breast_cancer or a CSV; "
                                 "arrays: .npz or folder; array_record: files")
    mixture: dict = option({}, "documents: several corpora sampled by weight, {path: weight, ...} (each path as "
                           "data.path reads it; weights positive numbers, relative); eval reports each one's loss too; "
                           "instead of data.path")
    field: str = option("text", "documents: the column (JSON key) holding each document's text, or a chat's messages "
                        "(a list of {role, content}; rendered with the tokenizer's chat template, only the assistant's "
                        "turns trained)")
    prompt_field: Optional[str] = option(None, "documents: with data.completion_field, rows are prompt/completion "
                                         "pairs and only the completion (and its EOS) is trained; the "
                                         "prompt's column")
    completion_field: Optional[str] = option(None, "documents: the completion's column (with data.prompt_field)")
    chosen_field: Optional[str] = option(None, "documents, train.objective=dpo: the preferred answer's column "
                                         "(text, or a chat's messages continuing data.prompt_field's)")
    rejected_field: Optional[str] = option(None, "documents, train.objective=dpo: the dispreferred answer's column")
    answer_field: Optional[str] = option(None, "documents, train.objective=grpo: the reference answer's column, which "
                                         "train.grpo.rewards score each completion against")
    tokenizer: str = option("bytes", "documents: bytes (one token per UTF-8 byte), a Hugging Face tokenizer.json (or a "
                            "folder holding one) or a SentencePiece .model; model.vocab_size follows it unless set")
    packing: str = option("concat", "text, documents: concat = documents joined (documents: with EOS), cut into "
                          "seq_len windows; documents = whole documents packed first-fit per row, attention and "
                          "positions kept inside each, padding out of the loss", choices=("concat", "documents"))
    cache_dir: Optional[str] = option(None, "documents: where token caches are kept (one per corpus, field and "
                                      "tokenizer); default: .token_cache beside the run folder", job=False)
    target: str = option("target", "tabular CSV: the column to predict")
    batch_size: int = option(32, "global batch size (all devices together)", min=1)
    seq_len: int = option(128, "tokens per sequence (sequence data)", min=1)
    eval_fraction: float = option(0.05, "text: share held out for eval (by file; by bytes for one file); documents: "
                                  "share of the documents held out", min=0.001, max=0.999)
    features: list = option([16], "synthetic: shape of one input example")
    classes: int = option(10, "synthetic: number of classes (classification)", min=2)
    size: int = option(65536, "synthetic: examples in the train split", min=1)
    prefetch: Optional[int] = option(None, "batches a background thread keeps on the devices ahead of the step; "
                                     "default: 2 on accelerators, 0 on CPU (where the thread competes with "
                                     "XLA for the cores: bench/overhead.py)", min=0, job=False)


@dataclass
class OptimizerConfig:
    name: str = option("adamw", "the optimizer: adamw, or sgd (with optimizer.momentum)", choices=("adamw", "sgd"))
    lr: float = option(3e-3, "peak learning rate", min=0)
    warmup_steps: int = option(50, "linear warmup from 0 to lr", min=0)
    min_lr_ratio: float = option(0.1, "cosine decay ends at lr * min_lr_ratio", min=0, max=1)
    weight_decay: float = option(0.1, "decoupled weight decay (matrices only)", min=0)
    b1: float = option(0.9, "Adam beta1", min=0, max=1)
    b2: float = option(0.95, "Adam beta2", min=0, max=1)
    eps: float = option(1e-8, "Adam epsilon", min=0)
    momentum: float = option(0.0, "sgd: momentum (0 = none)", min=0, max=1)
    clip_norm: float = option(1.0, "clip gradients to this global norm; 0 disables", min=0)


@dataclass
class LoraConfig:
    """train.lora.*: low-rank adapters (shard/strategies/lora.py); checked by the strategy (rank >= 0, alpha > 0)."""
    rank: int = option(0, "train low-rank adapters of this rank instead of the weights (LoRA); 0 = off", job=True)
    alpha: Optional[float] = option(None, "adapters' scale is alpha / rank; default: 2 x rank (scale 2)", job=True)
    targets: list = option(["q", "k", "v", "o"], "weights adapted: q, k, v, o, mlp (the library's transformers), a "
                           "model's own adapter_targets, or any weight's name", job=True)
    base: str = option("float32", "how the frozen weights under the adapters are stored: float32 (as without "
                       "adapters), bfloat16, or quantized with qwix (QLoRA): nf4, int4, int8, fp8 (float8 e4m3), in "
                       "blocks of 64 with a float32 scale each, dequantized in the step",
                       choices=("float32", "bfloat16", "int8", "int4", "nf4", "fp8"), job=True)


@dataclass
class LmEvalConfig:
    """train.lm_eval.*: lm-evaluation-harness's tasks on the model as it trains (shard/run/lm_eval_hook.py; needs the
    eval extra), their metrics logged as lm_eval/<task>/<metric>; python -m shard.eval takes the same flags."""
    tasks: list = option([], "lm_eval task names to evaluate during training (empty: none)")
    every: int = option(0, "evaluate them every N steps, and at the end; 0 = only at the end", min=0)
    include_path: Optional[str] = option(None, "a folder of task YAML files of your own (lm_eval's --include_path)")
    limit: Optional[float] = option(None, "the first N documents of each task (below 1: that fraction); null = all",
                                    min=0)
    num_fewshot: Optional[int] = option(None, "examples before each prompt; null = the task's own", min=0)
    batch_size: int = option(8, "sequences scored or prompts generated a pass", min=1)


@dataclass
class DpoConfig:
    """train.dpo.*: direct preference optimisation (shard/objectives/dpo.py), read with train.objective=dpo."""
    beta: float = option(0.1, "the strength of the implicit KL penalty to the reference (DPO's beta)", min=0, job=True)
    loss: str = option("sigmoid", "sigmoid (DPO's -log sigmoid(beta x margin)) or ipo ((margin - 1 / (2 beta))^2)",
                       choices=("sigmoid", "ipo"), job=True)
    reference: str = option("init", "init: the starting weights, frozen (under LoRA the weights without the "
                            "adapters, no second copy); none: reference-free, each answer's log-likelihood averaged "
                            "over its tokens (SimPO's length-normalised margin)", choices=("init", "none"), job=True)
    precompute: bool = option(False, "reference=init without LoRA: the reference's log-likelihoods computed once "
                              "before the first step (kept in <run.dir>/dpo_reference.npz for a resume) instead of "
                              "a frozen copy of the weights in device memory and its forward passes every step",
                              job=True)
    margin: float = option(0.0, "reference=none: SimPO's target reward margin (gamma)", min=0, job=True)


@dataclass
class GrpoConfig:
    """train.grpo.*: group relative policy optimisation on rewarded rollouts (shard/objectives/grpo.py), read with
    train.objective=grpo."""
    group: int = option(4, "completions sampled per prompt; rewards are normalised within each prompt's group", min=2,
                        job=True)
    max_new_tokens: int = option(32, "the most tokens a completion may have (it ends earlier at an end token)", min=1,
                                 job=True)
    temperature: float = option(1.0, "the rollouts' sampling temperature (0: greedy, which gives a group no "
                                "variety)", min=0, job=True)
    top_p: float = option(1.0, "the rollouts' nucleus: keep the likeliest tokens holding this much of the mass",
                          min=0.01, max=1, job=True)
    beta: float = option(0.04, "weight of the KL penalty to the reference (the starting weights; under LoRA the "
                         "weights without the adapters); 0: no reference", min=0, job=True)
    epsilon: float = option(0.2, "the policy ratio is clipped to [1 - epsilon, 1 + epsilon]", min=0, job=True)
    updates: int = option(1, "optimisation steps on each batch of rollouts (after the first, importance ratios "
                          "against the policy that sampled them)", min=1, job=True)
    rewards: list = option(["exact"], "reward functions, summed: exact, number, regex, length (a penalty), or "
                           "package.module:function(completions, answers) -> floats (needs train.grpo.trust_code)",
                           job=True)
    weights: list = option([], "one weight per reward (empty: all 1)", job=True)
    pattern: Optional[str] = option(None, "the regex reward's pattern (a completion scores 1 where it matches)",
                                    job=True)
    tolerance: float = option(1e-6, "the number reward's absolute tolerance", min=0, job=True)
    trust_code: bool = option(False, "import and run the package.module:function rewards train.grpo.rewards names "
                              "(importing a module runs its code): on the command line only, never from a file, "
                              "and not written to the run's config.yaml")


@dataclass
class TrainConfig:
    steps: int = option(300, "optimizer steps", min=1)
    seed: int = option(0, "seed for parameters and data order", min=0, job=True)
    dtype: str = option("float32", "compute dtype; parameters stay float32",
                        choices=("float32", "bfloat16"), job=True)
    loss: str = option("auto", "loss name (see shard/core/losses.py); auto = the task's default", job=True)
    objective: str = option("lm", "what the step optimises (shard/objectives/): lm = train.loss on the data's targets; "
                            "dpo = preference pairs (train.dpo.*); grpo = rewarded rollouts (train.grpo.*)",
                            choices=("lm", "dpo", "grpo"), job=True)
    dpo: DpoConfig = field(default_factory=DpoConfig, metadata={"group": DpoConfig, "job": True})
    grpo: GrpoConfig = field(default_factory=GrpoConfig, metadata={"group": GrpoConfig, "job": True})
    remat: str = option("none", "activation checkpointing of each layer: none keeps every activation, full "
                        "recomputes the layer, dots keeps matmul outputs, qkv keeps the query/key/value projections, "
                        "attention keeps those and attention's output (recomputes the MLP), offload keeps matmul "
                        "outputs in host memory (TPU, GPU)",
                        choices=("none", "full", "dots", "qkv", "attention", "offload"))
    scan_layers: bool = option(True, "run a model's stacked layers as one scanned layer (fast compile); false "
                               "writes every layer out (slower compile; the compiler schedules across layers)")
    context_strategy: str = option("all_gather", "attention under mesh.context > 1: all_gather (each device keeps "
                                   "its queries and gathers every key and value) or ring (keys and values pass "
                                   "round the context devices, never whole on one)", choices=("all_gather", "ring"))
    attention: str = option("auto", "attention kernel: auto (splash on TPU, cudnn on an NVIDIA GPU where it "
                            "applies, else xla), xla (XLA's products, any device: the reference), cudnn (fused flash "
                            "attention; NVIDIA GPU, bfloat16, head size <= 128) or splash "
                            "(Pallas splash attention; TPU)", choices=("auto", "xla", "cudnn", "splash"))
    grouped_matmul: str = option("auto", "a mixture of experts' grouped products (dropless routing): auto (JAX's "
                                 "megablox kernels on TPU, else tiled), tiled (a product per tile of rows and "
                                 "expert it meets), megablox (TPU), tokamax, or xla (jax.lax.ragged_dot as XLA lowers "
                                 "it: dense per expert on CPU and GPU)",
                                 choices=("auto", "xla", "tiled", "megablox", "tokamax"))
    expert_exchange: str = option("auto", "how dropless routing's (token, choice) pairs travel to their experts' "
                                  "devices under expert parallelism: auto (ragged on an NVIDIA GPU, else padded), "
                                  "padded (every bucket whole, all-to-all) or ragged (only the pairs, the counts "
                                  "first: jax.lax.ragged_all_to_all; TPU, GPU)",
                                  choices=("auto", "padded", "ragged"))
    attention_precision: str = option("float32", "the XLA attention's logits and softmax: float32, or bfloat16 "
                                      "(normalised after the value product; less memory, as MaxText does)",
                                      choices=("float32", "bfloat16"))
    init_from: Optional[str] = option(None, "load parameters only from this checkpoint (run, checkpoints or step "
                                      "folder), e.g. to fine-tune", job=True)
    deterministic: bool = option(False, "bitwise-reproducible GPU kernels (XLA's --xla_gpu_deterministic_ops; "
                                 "slower); CPU runs are deterministic anyway")
    nonfinite: Optional[str] = option(None, "a step whose loss or gradients are not finite: stop (one line, exit 1), "
                                      "skip (drop the update) or rollback (restore the last checkpoint, skip the "
                                      "batches since it, go on); null = stop, or skip under train.skip_nonfinite",
                                      choices=("stop", "skip", "rollback"))
    skip_nonfinite: bool = option(False, "the older spelling of train.nonfinite=skip")
    max_rollbacks: int = option(3, "train.nonfinite=rollback: stop after this many rollbacks in a row (no new "
                                "checkpoint between them)", min=1)
    grad_accum: int = option(1, "gradient accumulation: run each batch as this many microbatches one after "
                             "another, one update (less activation memory, the same update)", min=1)
    grad_dtype: str = option("float32", "dtype the gradients are summed in across the data axis (bfloat16 halves "
                             "the data-parallel reduction's bytes)", choices=("float32", "bfloat16"), job=True)
    accum_dtype: str = option("float32", "dtype the microbatches' gradients are summed in under grad_accum > 1",
                              choices=("float32", "bfloat16"), job=True)
    offload: str = option("none", "keep state in host memory between steps (pinned_host), moved to the device "
                          "inside the step: the optimizer state, or also the parameters",
                          choices=("none", "optimizer", "params"))
    sync: str = option("allreduce", "how the replicas (mesh.replica) meet: allreduce (gradients averaged every "
                       "step), local_sgd (parameters averaged every sync_every steps) or diloco (an outer Nesterov "
                       "step on the averaged change every sync_every steps)",
                       choices=("allreduce", "local_sgd", "diloco"), job=True)
    sync_every: int = option(16, "local_sgd, diloco: steps between syncs (H)", min=1, job=True)
    sync_fragments: int = option(1, "local_sgd, diloco: parameter fragments synced at staggered steps (streaming "
                                 "DiLoCo; each sync moves 1/F of the model)", min=1, job=True)
    outer_lr: float = option(0.7, "diloco: outer learning rate", min=0, job=True)
    outer_momentum: float = option(0.9, "diloco: outer Nesterov momentum (0 = plain SGD)", min=0, max=1, job=True)
    ema: float = option(0.0, "keep an exponential moving average of the weights with this decay (e.g. 0.999), "
                        "used by eval, the sample, load_model and export; 0 = off", min=0, max=0.99999, job=True)
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"group": LoraConfig, "job": True})
    quantize: str = option("none", "quantization-aware training (qwix): every product of activations with a weight, "
                           "and its activations' gradient, in int8 (int32 sums) or fp8 (e4m3 forward, e5m2 gradients), "
                           "absmax scaled per channel at each step; the weights' gradients and the weights as without "
                           "(shard/quant/training.py); none = off", choices=("none", "int8", "fp8"), job=True)
    lm_eval: LmEvalConfig = field(default_factory=LmEvalConfig, metadata={"group": LmEvalConfig, "job": False})
    eval_every: int = option(0, "evaluate every N steps; 0 = only at the end", min=0)
    eval_batches: int = option(8, "batches per evaluation, spread evenly over the eval split; 0 = all of it", min=0)
    sample_len: int = option(200, "lm: tokens to generate after training; 0 disables", min=0)
    sample_prompt: str = option("def ", "lm: prompt for the generated sample")


@dataclass
class CheckpointConfig:
    enabled: bool = option(True, "write checkpoints and resume from them")
    every: int = option(100, "save every N steps, and always at the end; 0 = only at the end", min=0)
    keep: int = option(3, "how many of the newest checkpoints to keep", min=1)
    async_: bool = option(True, "write in the background while training goes on", key="async")
    dir: Optional[str] = option(None, "checkpoint folder; default: <run.dir>/checkpoints")
    restore_from: Optional[str] = option(None, "start from another run's checkpoint (whole state: parameters, "
                                         "optimizer, step)", job=True)


@dataclass
class MeshConfig:
    preset: str = option("dp", "mesh preset in meshes/ (also settable as mesh=NAME); auto = the fastest "
                         "estimated mesh that fits (see --compare)")
    replica: Optional[int] = option(None, "replica axis size: copies of the job that sync as train.sync says "
                                    "(allreduce: one more data axis); "
                                    "-1 = remaining devices; default: preset's, else 1")
    stage: Optional[int] = option(None, "pipeline axis size: the stacked layers are cut into this many stages "
                                  "(see pipeline.*); -1 = remaining devices; default: preset's, else 1")
    data: Optional[int] = option(None, "data-parallel axis size; -1 = remaining devices; default: preset's, else 1")
    expert: Optional[int] = option(None, "expert-parallel axis size (experts split over it; it also splits the batch); "
                                   "-1 = remaining devices; default: preset's, else 1")
    fsdp: Optional[int] = option(None, "fully-sharded (ZeRO-3) axis size; "
                                 "-1 = remaining devices; default: preset's, else 1")
    context: Optional[int] = option(None, "context (sequence) axis size: each sequence is split over it (see "
                                    "train.context_strategy); -1 = remaining devices; default: preset's, else 1")
    tensor: Optional[int] = option(None, "tensor (Megatron) axis size; "
                                   "-1 = remaining devices; default: preset's, else 1")
    rules: dict = option({}, "logical axis -> mesh axis or list of axes (null = replicated), over the preset's")
    zero: Optional[int] = option(None, "ZeRO stage over the data axis: 1 splits the optimizer state over it, 2 also "
                                 "the gradients (parameters stay whole; fsdp is stage 3); default: preset's, else 0",
                                 choices=(0, 1, 2))
    auto_shard: bool = option(True, "split parameters that logical names leave whole: unnamed ones over fsdp, "
                              "tensor and expert, named ones over fsdp (ZeRO-3), each on its largest divisible free "
                              "dimension")
    auto_shard_min_size: int = option(16384, "parameters with fewer elements stay whole under auto_shard "
                                      "(biases, norm scales: gathering them costs more than they save)", min=1)
    # Multi-slice / multi-node: how many of an axis's devices lie across the slow network between
    # slices (TPU) or processes (GPU nodes). Each divides its axis; all of them together multiply
    # to the number of slices or processes.
    dcn_data: Optional[int] = option(None, "part of the data axis across slices/nodes; default: the number of "
                                     "TPU slices when there are several, else 1", min=1)
    dcn_replica: int = option(1, "part of the replica axis across slices/nodes", min=1)
    dcn_stage: int = option(1, "part of the stage axis across slices/nodes", min=1)
    dcn_expert: int = option(1, "part of the expert axis across slices/nodes", min=1)
    dcn_fsdp: int = option(1, "part of the fsdp axis across slices/nodes", min=1)
    dcn_context: int = option(1, "part of the context axis across slices/nodes", min=1)
    dcn_tensor: int = option(1, "part of the tensor axis across slices/nodes", min=1)


@dataclass
class PipelineConfig:
    microbatches: Optional[int] = option(None, "microbatches the global batch is cut into under mesh.stage > 1 "
                                         "(M), a multiple of the stages; default: twice the stages", min=1)
    repeats: int = option(1, "layer groups each stage holds (R): 1 = GPipe; more = a circular schedule, each "
                          "stage holding R non-adjacent groups, bubble (S-1)/(R*M+S-1)", min=1)
    schedule: str = option("gpipe", "gpipe: every microbatch's forward before any backward (with repeats > 1 the "
                           "circular schedule), activations of all M microbatches held; 1f1b: each microbatch's "
                           "backward as soon as its forward ends (PipeDream-Flush; with repeats > 1 interleaved "
                           "1F1B), at most 2*R*S-1 stage inputs held, the same bubble", choices=("gpipe", "1f1b"))


@dataclass
class RunConfig:
    dir: Optional[str] = option(None, "run folder: resolved config, metrics.jsonl, checkpoints. null (the default): "
                                "runs/<config file name>, plus -<8 hex digits> when the command line changes what "
                                "is trained (a model, data or optimizer key but data.prefetch and data.cache_dir, or "
                                "one marked [picks the folder] here; not train.steps, nor eval, sample, log, mesh or "
                                "run keys), so the same command resumes its own run and another job gets another "
                                "folder; a config file outside configs/ always gets the suffix")
    log_every: int = option(10, "log metrics every N steps", min=1)
    cpu_devices: Optional[int] = option(None, "run on N simulated CPU devices per process (set before JAX starts)",
                                        min=1)
    distributed: str = option("auto", "join several processes into one mesh: auto = when the environment says so "
                              "(coordinator set, SLURM tasks, TPU pod), on = always (JAX detects the cluster), off",
                              choices=("auto", "on", "off"))
    coordinator: Optional[str] = option(None, "host:port of process 0 (else JAX_COORDINATOR_ADDRESS or detected)")
    num_processes: Optional[int] = option(None, "processes in the job (else JAX_NUM_PROCESSES or detected)", min=1)
    process_id: Optional[int] = option(None, "this process's index (else JAX_PROCESS_ID or detected)", min=0)
    init_timeout_s: int = option(300, "seconds to wait for every process to join before giving up", min=1)
    step_timeout_s: Optional[float] = option(None, "when no step finishes within this many seconds (a hung "
                                             "collective), write every thread's stack to <run.dir>/hang-*.txt and exit "
                                             "(status 3) so the launcher restarts the job; null = off on CPU, else "
                                             "100 x the measured step time (at least 300 s); 0 = off", min=0)
    heartbeat_timeout_s: int = option(30, "seconds without a heartbeat before a process counts as dead and the "
                                      "others stop", min=1)
    peak_tflops: Optional[float] = option(None, "device peak TFLOP/s for MFU; default: known accelerators only", min=0)
    device_memory_gb: Optional[float] = option(None, "memory of one device for the plan's fits check; default: what "
                                               "the runtime lets JAX use (GPU, TPU), unknown on CPU", min=0)
    link_gbps: Optional[float] = option(None, "bytes/s (GB) one device sends over its links, for the plan's step "
                                        "estimate; default: known accelerators only", min=0)
    target: Optional[str] = option(None, "compile for hardware this machine does not have, with its real compiler: "
                                   "a TPU slice (v4-8, v5e-16, v5p-128, v6e-64; TensorCores on v4/v5p, chips on "
                                   "v5e/v6e) or GPUs (h100x8, h100x16 = two nodes, a100x8, h200x8); with --dry-run "
                                   "or --compare only (nothing runs on it)")
    compiler_flags: dict = option({}, "XLA/libtpu flags for the compiler, {name: value}, over the target's "
                                  "recommended ones (shard/plan/chips.yaml); a null value drops a recommended flag")
    recommended_flags: bool = option(True, "compile for a TPU or GPU (run.target, or the device itself) with the "
                                     "flags chips.yaml recommends for it (collective fusion, async collectives, "
                                     "scoped VMEM; the latency-hiding scheduler)")
    target_slices: int = option(1, "run.target's TPU slices (multi-slice: mesh.dcn_* axes cross between them)", min=1)
    search_compiles: int = option(6, "mesh=auto with run.target: how many of the candidates (mesh x train.remat x "
                                  "train.grad_accum) ranked best by formula to compile for the target, besides "
                                  "the mesh presets", min=1)
    progress: bool = option(True, "show progress: a bar on a terminal, else a line every log_every steps")
    tensorboard: bool = option(True, "write TensorBoard event files to <run.dir>/tensorboard (process 0)")
    wandb: bool = option(False, "also log the metrics, the config and the plan to Weights & Biases (offline, under "
                         "<run.dir>/wandb, unless an API key is set; needs pip install wandb)")
    plot: bool = option(True, "draw <run.dir>/curves.png when the run ends (loss, eval loss, throughput)")
    profile_steps: Optional[str] = option(None, "START:END traces steps START..END-1 with jax.profiler into "
                                          "<run.dir>/profile (TensorBoard's profile plugin, XProf, Perfetto)")
    compile_cache: Optional[str] = option(None, "folder for JAX's persistent compilation cache: "
                                          "restarts skip compiling")
    reuse_host_memory: bool = option(True, "on CPU, glibc's malloc keeps the memory a step frees for the next step "
                                     "instead of unmapping it (XLA:CPU allocates every step's buffers anew; saves "
                                     "their page faults, ~17% of the default job's step); false, or any MALLOC_* or "
                                     "GLIBC_TUNABLES variable set, leaves malloc as it is")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_SECTION_CLASSES = {f.name: f.default_factory for f in dataclasses.fields(Config)}
FREE_FORM = {("model",), ("mesh", "rules")}  # keys below these are not schema fields


def schema_fields(section: str) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(_SECTION_CLASSES[section]) if not f.metadata.get("internal")]


def keys_of(section: str) -> list[tuple[str, dataclasses.Field, tuple]]:
    """(key as users write it, field, attribute path) of every key of a section, a group's keys one by one
    (`train.lora.rank`: the field `rank` of the group `lora`)."""
    out = []
    for f in schema_fields(section):
        if group := f.metadata.get("group"):
            out += [(f"{section}.{f.name}.{key_of(g)}", g, (f.name, g.name)) for g in dataclasses.fields(group)]
        else:
            out.append((f"{section}.{key_of(f)}", f, (f.name,)))
    return out


def key_of(f: dataclasses.Field) -> str:
    """The name users write for a field."""
    return f.metadata.get("key") or f.name


def renamed(layer: dict, to_field: bool) -> dict:
    """User keys <-> field names, where they differ (only `checkpoint.async` today)."""
    out = dict(layer)
    for section, values in layer.items():
        if section not in SECTIONS or section == "model" or not isinstance(values, dict):
            continue
        names = {key_of(f): f.name for f in schema_fields(section)}
        if not to_field:
            names = {v: k for k, v in names.items()}
        out[section] = {names.get(k, k): v for k, v in values.items()}
    return out


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(type_name(a) for a in args) + " or null"
    return getattr(tp, "__name__", str(tp))


def to_dict(cfg: Config, model_kwargs: dict | None = None) -> dict:
    """The config as plain data, with model kwargs back in the model section (as a user writes it)."""
    out = dataclasses.asdict(cfg)
    kwargs = cfg.model.kwargs if model_kwargs is None else model_kwargs
    out["model"] = {"name": cfg.model.name, **kwargs}
    return plain(renamed(out, to_field=False))


def plain(x):
    """Tuples as lists, all the way down: what YAML writes and what compares equal to what it reads."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x
