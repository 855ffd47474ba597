"""The run config: one YAML file, one dataclass per section, one docstring per field.

Batch sizes, optimizer, LR schedule, ZeRO, precision and clipping are NOT here: they live in the
DeepSpeed JSON named by the top-level `deepspeed:` key, which stays DeepSpeed-native.
Each field's ``doc`` metadata is the text of the config reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def doc(text: str, default: Any) -> Any:
    """A dataclass field with a default and a line of documentation."""
    return field(default=default, metadata={"doc": text})


@dataclass
class ModelConfig:
    config: str | None = doc(
        "The architecture: a transformers model directory (its config.json), a config.json "
        "file, or a shipped preset name (`dsnd model list`). Defaults to init_from's directory, "
        "else to `preset`.",
        None,
    )
    preset: str | None = doc(
        "A shipped preset (llama-tiny, gpt2-tiny, gpt2, llama-3.1-8b, ...; `dsnd model list`); "
        "the same as model.config naming it. llama-tiny when neither is set.",
        None,
    )
    seq_len: int = doc("Tokens per training sample (<= the config's max_position_embeddings).", 64)
    hidden_size: int | None = doc("Override the config's hidden size.", None)
    num_layers: int | None = doc("Override the config's number of transformer blocks.", None)
    num_heads: int | None = doc("Override the config's number of attention heads.", None)
    num_kv_heads: int | None = doc("Override the config's key/value heads (GQA).", None)
    head_dim: int | None = doc(
        "Override the config's head_dim (by default hidden_size / num_heads whenever either of "
        "those is overridden).",
        None,
    )
    ffn_size: int | None = doc("Override the config's MLP hidden size (intermediate_size).", None)
    vocab_size: int | None = doc(
        "Override the config's vocabulary (the tiny presets have 256 byte tokens), e.g. for a "
        "token file prepared with a transformers tokenizer; with tp > 1 it is padded to a "
        "multiple of tp.",
        None,
    )
    max_position_embeddings: int | None = doc(
        "Override the config's max_position_embeddings (the longest model.seq_len allowed; "
        "GPT-2's learned position table has this many rows).",
        None,
    )
    moe_capacity_factor: float | None = doc(
        "Mixture-of-experts models: each expert of a layer takes at most ceil(f * T * k / E) "
        "of the (token, choice) rows of a rank's forward of T tokens, earliest tokens first; "
        "the rest are dropped (their router weight 0: the residual carries the token) and "
        "counted in metrics.jsonl (moe_dropped_tokens); at most E / k, where nothing is "
        "dropped. null = dropless, as transformers routes (and as exports compute).",
        None,
    )
    overrides: dict = field(
        default_factory=dict,
        metadata={
            "doc": (
                "Any other config.json key to set, as transformers would read it (e.g. "
                "{rope_theta: 500000.0} for a Llama, {resid_pdrop: 0.0} for a GPT-2; a 4.x rope "
                "key on a config with rope_parameters is set inside them); recorded in "
                "checkpoints and exports."
            )
        },
    )
    init_from: str | None = doc(
        "A transformers checkpoint directory (safetensors, as save_pretrained writes it) to "
        "start from instead of the seeded initialisation; every tensor's name and shape is "
        "checked against the model before start. null = seeded init.",
        None,
    )


@dataclass
class ParallelConfig:
    pp: int = doc("Pipeline-parallel stages. dp = world_size / (pp * tp).", 1)
    tp: int = doc("Tensor-parallel ranks per stage (Megatron-style).", 1)
    cp: int = doc(
        "Context-parallel ranks: each holds a slice of every sequence (world = pp * dp * cp * "
        "tp; cp ranks share their samples, so the batch counts dp only; ZeRO shards and "
        "averages gradients over dp * cp).",
        1,
    )
    cp_impl: str = doc(
        "How attention sees the whole sequence with cp > 1: ring (keys and values pass around "
        "the cp group, overlapped with blockwise attention; each rank holds sequence chunks i "
        "and 2*cp-1-i, so causal work is balanced; seq_len must divide by 2*cp) or ulysses "
        "(all-to-all from sequence slices to head groups and back; heads and key/value heads "
        "per tensor-parallel rank must divide by cp).",
        "ring",
    )
    ep: int = doc(
        "Expert parallelism (mixture-of-experts models): each data-parallel group cut into "
        "groups of ep consecutive ranks that split every MoE layer's experts (rank i computes "
        "experts [i*E/ep, (i+1)*E/ep)) and exchange tokens with all-to-all, dropless. Must "
        "divide dp and the number of experts. ZeRO shards and averages a rank's experts over "
        "its expert-data-parallel group (the dp/ep ranks, times cp, holding the same experts), "
        "the dense parameters over dp (times cp); checkpoints hold whole tensors, so they do "
        "not depend on ep. "
        "1 = every rank computes every expert.",
        1,
    )
    dp_shard: int | None = doc(
        "Hybrid sharding (FSDP's HSDP, DeepSpeed's former MiCS mics_shard_size): ZeRO-3 "
        "partitions each stage's parameters, gradients and optimizer state over groups of this "
        "many consecutive data-parallel ranks (a host's ranks, say) and the dp / dp_shard groups "
        "are replicas whose gradients are averaged; each rank holds 1/dp_shard of the model "
        "states and parameter all-gathers stay inside its group. Must divide dp; needs ZeRO "
        "stage 3. null or 0 = dp (plain ZeRO-3).",
        None,
    )
    reshard_after_forward: bool = doc(
        "ZeRO-3 (FSDP's name): true = DeepSpeed's way, each layer's parameters gathered for its "
        "use and partitioned again after it, in every micro-batch's forward and backward (least "
        "memory; gathers grow with the micro-batches); false = each stage's parameters stay "
        "gathered from their first use to the optimizer step: one all-gather per step whatever "
        "the micro-batches, for the stage's whole parameters in memory during the step (ZeRO-2's "
        "parameter memory while it runs). Needs zero_optimization.stage 3.",
        True,
    )
    partition: str | list = doc(
        "How layers split into stages: uniform, parameters, type:<regex> (as DeepSpeed names "
        "them), or explicit boundaries [0, 3, 7] / per-stage lists [[0, 1, 2], [3, 4, 5, 6]].",
        "parameters",
    )
    sequence_parallel: bool = doc(
        "With tp > 1, split norms, residuals and the activations between stages along the "
        "sequence (Megatron's sequence parallelism: an all-gather and a reduce-scatter replace "
        "each all-reduce; model.seq_len must divide by tp). Ignored when tp = 1, as in Megatron.",
        False,
    )
    schedule: str = doc(
        "Micro-batch schedule: 1f1b, gpipe, interleaved-1f1b (parallel.virtual_stages chunks "
        "per stage; bubble (pp-1)/(v*m)) or zb-h1 (zero-bubble: backward split into input and "
        "weight gradients; bubble about (pp-1)/(3m) at 1f1b's memory; ZeRO 0-2).",
        "1f1b",
    )
    virtual_stages: int = doc(
        "Model chunks per pipeline stage for interleaved-1f1b (Megatron's virtual pipeline "
        "size); 1 for the other schedules.",
        1,
    )
    profile_memory_cap_gb: float | None = doc(
        "With partition: profile, the most memory (GiB: parameters with gradients and Adam "
        "state, plus one micro-batch's saved activations, as measured) a stage may hold; "
        "null = no cap.",
        None,
    )
    activation_checkpoint_interval: int = doc(
        "Activation checkpointing: 0 = off; k = each stage runs its layers in consecutive runs "
        "of k and recomputes each run in backward instead of keeping its activations, as "
        "DeepSpeed's PipelineModule(activation_checkpoint_interval=k).",
        0,
    )


@dataclass
class DataConfig:
    path: str | None = doc(
        "Text, JSONL or pre-tokenized .bin file (dsnd data prepare), or a Hugging Face dataset "
        "(a save_to_disk directory, a .parquet or .arrow file) to train on; null = the Python "
        "standard library's own source (its first 4,000,000 bytes), unless data.blend is set.",
        None,
    )
    blend: list | None = doc(
        "Token files (dsnd data prepare) trained on together, each by its share, as Megatron's "
        "--data-path 0.3 A 0.7 B: a list of {path, weight} (weights > 0, normalised to sum 1). "
        "Each position of the sample stream draws from one file by a fixed schedule of the "
        "weights (in every prefix of the stream each file's count is within a sample or two of "
        "prefix x weight), then from that file's own shuffled epochs: a function of "
        "(train.seed, step), as for one file. The files must share one tokenizer and "
        "vocabulary; not with data.path. null = data.path alone.",
        None,
    )
    format: str = doc(
        "auto (by extension: .jsonl/.json, .bin, a directory / .parquet / .arrow = hf, else "
        "text), text, jsonl, tokens, hf (a Hugging Face dataset's data.text_field) or chat (a "
        "`messages` list of {role, content} per JSONL line or dataset row, rendered with the "
        "tokenizer's chat template; only assistant tokens count in the loss).",
        "auto",
    )
    text_field: str = doc("JSONL field / dataset column holding each document's text.", "text")
    split: str = doc("The split to read when data.path is a Hugging Face DatasetDict.", "train")
    vocab: str | None = doc(
        "The tokenizer that turns text into ids (the key avoids 'token', which marks a secret "
        "in saved configs): null = bytes for text, JSONL and the default corpus, the "
        "model's tokenizer (model.init_from's directory, else model.config's) for hf and chat "
        "data; model = the model's tokenizer for any text; byte; or a local transformers "
        "tokenizer directory. Token files carry their own (dsnd data prepare).",
        None,
    )
    packing: str = doc(
        "How documents share a sample: stream = concatenated, attention and positions run "
        "across document boundaries (nanoGPT's way); documents = positions restart at each "
        "document and attention stays within it (block-diagonal causal mask), and no token "
        "is predicted from the previous document. documents needs document boundaries (JSONL, "
        "hf or chat data, a token file with its .docs) and parallel.cp = 1.",
        "stream",
    )
    allow_vocab_mismatch: bool = doc(
        "Train although model.init_from has a tokenizer and the data is not tokenized with it "
        "(byte tokens, or another tokenizer's): refused by default, as the pretrained weights "
        "would read the ids as other tokens.",
        False,
    )
    max_bytes: int | None = doc(
        "Read at most this many bytes of the corpus (of each file of a blend; of text, for "
        "JSONL, datasets and chat data), said in a line at start; null = all of it. The default "
        "corpus (no data.path) is the first 4,000,000 bytes of the standard library's sources, "
        "cut further by a smaller value.",
        None,
    )
    eval_path: str | None = doc(
        "A separate held-out file to evaluate on, in data.path's format (read with the same "
        "tokenizer, packing and data.max_bytes); the whole of data.path then trains and "
        "eval.fraction is not used. null = hold out eval.fraction of data.path.",
        None,
    )


@dataclass
class TrainConfig:
    steps: int = doc("Optimizer steps to train (counted from the start of training).", 20)
    seed: int = doc("Seed of weights and sample order; the layout never changes either.", 1234)
    lr: float | None = doc(
        'Peak learning rate, for the DeepSpeed JSON\'s "auto" optimizer.params.lr and '
        "scheduler.params.warmup_max_lr (refused where the JSON sets another number). null = "
        "the JSON's, else 3e-3, or 5e-5 (the Hugging Face Trainer's) with model.init_from.",
        None,
    )
    warmup_steps: int | None = doc(
        "Steps of linear warm-up from min_lr to lr (DeepSpeed's warmup_num_steps, which its "
        "schedulers raise to 2; 0 = none). null = the JSON's, else 5, or 0 with "
        "model.init_from, or 0 where the JSON has an optimizer and no scheduler.",
        None,
    )
    lr_decay: str | None = doc(
        "After the warm-up: constant (DeepSpeed's WarmupLR), linear down to min_lr at "
        "train.steps (WarmupDecayLR) or cosine down to min_lr (WarmupCosineLR), for a JSON "
        'scheduler of "type": "auto" or none. null = the JSON\'s, else constant, or linear '
        "with model.init_from.",
        None,
    )
    min_lr: float | None = doc(
        "Where the warm-up starts and the decay ends (DeepSpeed's warmup_min_lr; cosine: "
        "cos_min_ratio and warmup_min_ratio x lr). null = the JSON's, else lr / 10, or 0 with "
        "model.init_from.",
        None,
    )
    lr_scaling: str = doc(
        "Scale the JSON's learning rates by global batch / lr_reference_batch: none, linear "
        "or sqrt.",
        "none",
    )
    lr_reference_batch: int = doc("Global batch the JSON's learning rates were tuned for.", 16)


@dataclass
class CheckpointConfig:
    dir: str | None = doc(
        "Checkpoint root directory, visible to every host; null = <log.dir>/checkpoints.", None
    )
    every: int = doc("Steps between checkpoints; 0 = only at the end of training.", 0)
    at_end: bool = doc(
        "Save a checkpoint when training ends (false: only every checkpoint.every steps, and on "
        "a stop request; benchmarks and plan --validate measure without one).",
        True,
    )
    keep: int = doc("Keep the newest N committed checkpoints; 0 = keep all.", 0)
    async_: bool = field(  # the YAML key `async` is a Python keyword (strict.key_of)
        default=False,
        metadata={
            "key": "async",
            "doc": (
                "Write checkpoints in the background: the save's step only gathers the state "
                "and copies it to host memory; a writer thread writes the files while training "
                "goes on, and the checkpoint is committed (latest moves) once every rank's "
                "files are on disk. One save in flight at a time; a failed write fails the run "
                "at the next save or at the end, as a synchronous save would. Same files."
            ),
        },
    )
    resume: str = doc(
        "auto: resume from the newest valid checkpoint under checkpoint.dir (corrupt ones are "
        "skipped with a warning), or start fresh if there is none; never; or a path (a "
        "checkpoint root, meaning its latest, or a step directory) that must verify.",
        "auto",
    )
    export_hf: str | None = doc(
        "At the end of the run write the model here as a transformers directory (config.json, "
        "model.safetensors) that AutoModelForCausalLM.from_pretrained loads; null = none. A new "
        "or empty directory, or this run's earlier export (replaced whole); anything else is "
        "refused before the start.",
        None,
    )


@dataclass
class EvalConfig:
    every: int = doc(
        "Evaluate on the held-out samples every this many steps and at the end of training; "
        "0 = at each checkpoint.every step and at the end only.",
        0,
    )
    fraction: float = doc(
        "Share of the corpus's samples held out for evaluation (the last ones; never trained "
        "on) unless data.eval_path is set; 0 = hold out nothing and never evaluate. A corpus "
        "too small to hold out one sample trains on everything, unevaluated (a line says so).",
        0.02,
    )
    batches: int = doc("Global batches per evaluation (the same ones each time).", 2)


@dataclass
class LogConfig:
    dir: str = doc(
        "Run directory: metrics.jsonl, the resolved configs, per-rank logs.", "runs/dsnd"
    )
    every: int = doc("Print a progress line every this many steps (rank 0).", 1)
    tensorboard: bool = doc(
        "Write TensorBoard event files into log.dir: loss, lr, grad norm, throughput, MFU, step "
        "time by phase, pipeline bubble, memory per stage, and the resolved config.",
        True,
    )
    expert_load_warn: float = doc(
        "Mixture-of-experts runs: warn (a console line, moe_load_alert in metrics.jsonl, "
        "TensorBoard events/expert_load) when some MoE layer's busiest expert gets more than "
        "this many times the mean tokens per expert for 5 steps in a row (the router "
        "collapsing onto few experts); at most 90% of experts / top-k, the most an expert can "
        "get (every token picks it). 0 = never.",
        2.0,
    )
    peak_flops: float | None = doc(
        "Peak FLOP/s of one device, for MFU; null = the vendor's dense (no sparsity) peak of "
        "the exact GPU product in the run's precision (fp16 or bf16 if the DeepSpeed JSON "
        "enables it, else fp32; MFU not reported for a GPU not in the table), or a measured "
        "fp32 matmul rate on CPU.",
        None,
    )


@dataclass
class DistConfig:
    timeout_s: float = doc(
        "Collective timeout in seconds: a dead peer ends the job. Under `dsnd launch` it is also "
        "how long a rank may stay stopped (SIGSTOP, a debugger) before the job is ended.",
        300.0,
    )
    backend: str = doc("auto (gloo on CPU, nccl on CUDA), gloo or nccl.", "auto")


@dataclass
class LaunchConfig:
    env: list = field(
        default_factory=list,
        metadata={
            "doc": (
                "Names of variables that `dsnd launch` copies from its own environment to every "
                "rank on "
                "every host, byte for byte (with .deepspeed_env's KEY=VALUE lines). Values never "
                "enter "
                "the config, logs or checkpoints; those of names containing KEY, TOKEN, SECRET or "
                "PASSWORD are masked wherever dsnd prints them."
            )
        },
    )


@dataclass
class ElasticConfig:
    enabled: bool = doc(
        "Choose the layout for the world each start is given (dsnd launch --min-hosts sets "
        "it; under torchrun --nnodes=MIN:MAX or sbatch --nodes=MIN-MAX set it here): the "
        "DeepSpeed JSON's train_batch_size kept on every layout (accumulation follows), the "
        "parallel degrees and micro-batch kept where they divide the world, else the layout "
        "changing fewest of them with the least model state per device; the newest checkpoint "
        'resumes on it. docs/launching.md, "Elastic jobs".',
        False,
    )
    memory_gb: float | None = doc(
        "With elastic.enabled: the model-state GiB per device (parameters, gradients, master "
        "weights, optimizer state, as dsnd ds-config explain counts them) a chosen layout may "
        "need; a world no layout fits is refused. null = not checked.",
        None,
    )


@dataclass
class RunConfig:
    deepspeed: str = doc(
        "DeepSpeed JSON, relative to this YAML file (--set: to the current "
        "directory). Absent: dsnd's packaged zero0.json.",
        "zero0.json",
    )
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "The model."})
    parallel: ParallelConfig = field(
        default_factory=ParallelConfig, metadata={"doc": "The parallel layout."}
    )
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "Training data."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "Training loop."})
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata={"doc": "Checkpoints."}
    )
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"doc": "Held-out evaluation."})
    log: LogConfig = field(default_factory=LogConfig, metadata={"doc": "Logging."})
    dist: DistConfig = field(default_factory=DistConfig, metadata={"doc": "Process groups."})
    launch: LaunchConfig = field(
        default_factory=LaunchConfig, metadata={"doc": "What `dsnd launch` passes to the ranks."}
    )
    elastic: ElasticConfig = field(
        default_factory=ElasticConfig,
        metadata={"doc": "A layout chosen for the world each start is given."},
    )


CHOICES: dict[str, tuple[str, ...]] = {
    "data.format": ("auto", "text", "jsonl", "tokens", "hf", "chat"),
    "data.packing": ("stream", "documents"),
    "parallel.schedule": ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1"),
    "train.lr_decay": ("constant", "linear", "cosine"),
    "train.lr_scaling": ("none", "linear", "sqrt"),
    "dist.backend": ("auto", "gloo", "nccl"),
}
"""Fields that take one of a fixed set of strings."""
