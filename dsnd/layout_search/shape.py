"""A model as the planner sees it: its pipeline layers' parameter counts and the dimensions that
set FLOPs, activations and messages. Built from a dsnd model (`from_model`: the counts are the
model's own, on the meta device) or from a GPT's published dimensions (`gpt`: Megatron's GPT
layer, for checking the planner against published measurements)."""

from __future__ import annotations

from dataclasses import dataclass

from dsnd.model.source import ModelSpec

MLP_SAVED = {
    "silu": 4,
    "swiglu": 4,
    "gelu_new": 5,
    "gelu_pytorch_tanh": 5,
    "gelu_fast": 5,
    "gelu": 2,
    "relu": 2,
    "megatron": 2,
}
"""Tensors of the MLP's intermediate width one block's forward saves for backward, by activation
function, counted in dsnd's blocks (`torch.autograd.graph.saved_tensors_hooks`): SwiGLU keeps the
gate and up projections, SiLU's output and the down projection's input; GPT-2's tanh GELU keeps
four intermediates and the projection's input; an exact GELU or ReLU its input and output."""


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know of a model (see the module docstring)."""

    name: str
    layer_params: tuple[int, ...]  # per pipeline layer: embedding, blocks ..., norm, head
    blocks: tuple[int, ...]  # indices into layer_params of the transformer blocks
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    max_seq: int
    block_matmul_params: int  # parameters of one block's matrix multiplications
    mlp_saved: int  # see MLP_SAVED
    rms_norm: bool = True  # RMSNorm (one statistic) or LayerNorm (two)
    megatron_layer: bool = False  # activations as Megatron's GPT layer (dropout, scores saved)
    top_k: int = 0  # mixture-of-experts blocks: experts per token (`ffn` spans all of them)
    experts: int = 0  # ... of this many per layer (0 and 0: a dense model)
    layer_experts: tuple[int, ...] = ()  # per pipeline layer: its routed experts' parameters

    def experts_of(self, layers: list[int]) -> int:
        """Routed-expert parameters of `layers` (what expert parallelism splits)."""
        return sum(self.layer_experts[i] for i in layers) if self.layer_experts else 0

    @property
    def moe(self) -> bool:
        return self.top_k > 0

    @property
    def params(self) -> int:
        return sum(self.layer_params)

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def largest_layer(self) -> int:
        return max(self.layer_params)

    def forward_flops(self, layer: int, tokens: int, seq: int) -> float:
        """Forward FLOPs of pipeline layer `layer` for `tokens` tokens in sequences of `seq`:
        2 per multiply-add of each weight matrix (the head: hidden x vocab), plus attention's
        QK^T and AV, 4 x seq x heads x head_dim per token, computed in full as kernels do."""
        if layer in self.blocks:
            attention = 4.0 * tokens * seq * self.heads * self.head_dim
            return 2.0 * tokens * self.block_matmul_params + attention
        if layer == len(self.layer_params) - 1:
            return 2.0 * tokens * self.hidden * self.vocab
        return 0.0


def from_model(model: ModelSpec, name: str) -> ModelShape:
    from dsnd.model.count import expert_table, layer_table, matmul_params
    from dsnd.model.moe_config import num_experts, token_ffn

    table = layer_table(model)
    per_block = (matmul_params(model) - model.vocab_size * model.hidden_size) // model.num_layers
    act = getattr(model.config, "hidden_act", None) or getattr(
        model.config, "activation_function", "gelu"
    )
    if act not in MLP_SAVED:
        raise ValueError(f"no activation accounting for the MLP activation {act!r}")
    blocks = tuple(i for i, kind, _ in table if "Block" in kind)
    moe = model.family.moe
    ffn = token_ffn(model.config) if moe else model.ffn_size
    routing = (model.config.num_experts_per_tok, num_experts(model.config)) if moe else (0, 0)
    experts = expert_table(model)
    return ModelShape(
        name,
        tuple(n for _, _, n in table),
        blocks,
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        ffn,
        model.vocab_size,
        model.max_seq_len,
        per_block,
        MLP_SAVED[act],
        rms_norm=hasattr(model.config, "rms_norm_eps"),
        top_k=routing[0],
        experts=routing[1],
        layer_experts=tuple(experts.get(i, 0) for i, _, _ in table),
    )


def gpt(
    name: str, layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048
) -> ModelShape:
    """Megatron's GPT: learned positions, LayerNorm, 4h GELU MLP, biases, a tied head;
    12h^2 + 13h parameters per block."""
    block = 12 * hidden * hidden + 13 * hidden
    counts = (vocab * hidden + seq * hidden, *([block] * layers), 2 * hidden, 0)
    return ModelShape(
        name,
        counts,
        tuple(range(1, layers + 1)),
        hidden,
        heads,
        heads,
        hidden // heads,
        4 * hidden,
        vocab,
        seq,
        12 * hidden * hidden,
        MLP_SAVED["megatron"],
        rms_norm=False,
        megatron_layer=True,
    )


def llama(
    name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int
) -> ModelShape:
    """A Llama from its published dimensions (RMSNorm, SwiGLU, no biases, an untied head), as
    `from_model` counts a dsnd Llama: for checking the planner against published runs of sizes
    dsnd has no preset for."""
    head_dim = hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    matmul = attention + 3 * hidden * ffn
    counts = (vocab * hidden, *([matmul + 2 * hidden] * layers), hidden, vocab * hidden)
    return ModelShape(
        name,
        counts,
        tuple(range(1, layers + 1)),
        hidden,
        heads,
        kv_heads,
        head_dim,
        ffn,
        vocab,
        seq,
        matmul,
        MLP_SAVED["swiglu"],
    )
