"""Memory planner: will a LongStraw run fit, and where do the bytes go (per rank)?

The budget is computed, not guessed, from the model config: parameters are counted on the meta device
(exact), the prompt state from its per-token and per-layer formulas (exact, as ``PromptState.nbytes``),
and the transient terms (one response's autograd graph, chunked logits, the capture chunk's activations)
from the tensors the engine keeps, per token. ``tests/test_planner.py`` checks the prediction against
peaks measured on the H200 (``bench/results/engine_*.json``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from longstraw_trl.kernels.logprob import LOGITS_CHUNK_ELEMENTS

GiB = 2**30

GPU_MEMORY_GIB = {"h200": 139.8, "h100": 79.1, "h20": 95.0, "a100-80g": 79.1, "a100-40g": 39.4}


@dataclass
class MemoryPlan:
    """Per-rank bytes of one LongStraw GRPO step (see :func:`plan_memory`)."""

    weights: int
    gradients: int
    optimizer: int
    state_by_kind: dict[str, int]
    response_graph: int
    logits: int
    capture_workspace: int
    gpu_bytes: int
    params: int = 0
    trainable_params: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def state(self) -> int:
        return sum(self.state_by_kind.values())

    @property
    def capture_peak(self) -> int:
        """Peak while capturing: weights, optimizer states, the state, one chunk's activations (gradients
        are freed by ``zero_grad(set_to_none=True)`` before the next step's capture)."""
        return self.weights + self.optimizer + self.state + self.capture_workspace

    @property
    def replay_peak(self) -> int:
        """Peak while replaying one response under autograd (the step's high-water mark)."""
        return self.weights + self.gradients + self.optimizer + self.state + self.response_graph + self.logits

    @property
    def peak(self) -> int:
        return max(self.capture_peak, self.replay_peak)

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu_bytes

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            state=self.state, capture_peak=self.capture_peak, replay_peak=self.replay_peak, fits=self.fits
        )
        return d


def _layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)[: config.num_hidden_layers]
    return ["full_attention"] * config.num_hidden_layers


def count_parameters(config, ep_size: int = 1) -> tuple[int, int, int]:
    """``(all params on this rank, expert params on this rank, embedding+head params)`` via the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = experts = vocab = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if ".experts." in name or name.endswith(".experts"):
            n //= ep_size
            experts += n
        if "embed_tokens" in name or "lm_head" in name:
            vocab += n
        total += n
    return total, experts, vocab


def lora_parameters(config, rank: int) -> int:
    """LoRA params on every non-expert Linear of the decoder (attention, GDN and MLP projections)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lm_head" not in name and ".experts" not in name:
            n += rank * (mod.in_features + mod.out_features)
    return n


def state_bytes(config, prompt_tokens: int, cp_size: int = 1, page_size: int = 16384, dtype_bytes: int = 2):
    """Per-rank prompt state by kind, the ``PromptState.nbytes_by_kind`` formulas (pages rounded up)."""
    types = _layer_types(config)
    out: dict[str, int] = {}
    pages = -(-prompt_tokens // page_size)
    tokens_per_rank = min(prompt_tokens, -(-pages // cp_size) * page_size)
    if getattr(config, "kv_lora_rank", None):  # MLA latent + DSA indexer keys (GLM-5 class)
        latent = (config.kv_lora_rank + config.qk_rope_head_dim) * dtype_bytes
        out["mla"] = len(types) * latent * tokens_per_rank
        if getattr(config, "index_head_dim", None):
            out["indexer"] = len(types) * config.index_head_dim * dtype_bytes * tokens_per_rank
        return out
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    full = sum(t == "full_attention" for t in types)
    out["kv"] = 2 * full * config.num_key_value_heads * head_dim * dtype_bytes * tokens_per_rank
    gdn = sum(t == "linear_attention" for t in types)
    if gdn:
        hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
        hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
        conv_dim = 2 * hk * dk + hv * dv
        conv = conv_dim * (config.linear_conv_kernel_dim - 1) * dtype_bytes
        recurrent = hv * dk * dv * 4  # fp32
        out["gdn"] = gdn * (conv + recurrent)
    return out


def _layer_graph_bytes(config, kind: str, tokens: int, b: int) -> int:
    """Tensors autograd keeps for one decoder layer over ``tokens`` response tokens."""
    h = config.hidden_size
    inter = getattr(config, "moe_intermediate_size", None) if getattr(config, "num_experts", 0) else None
    inter = (inter or config.intermediate_size) * max(1, getattr(config, "num_experts_per_tok", 1) or 1)
    mlp = (2 * h + 3 * inter) * b  # norm in/out, gate, up, act(gate)*up
    if kind == "linear_attention":
        hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
        hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
        conv_dim = 2 * hk * dk + hv * dv
        # projections + conv in/out + gate z + norm; the chunked delta rule keeps ~6x its fp32 inputs
        # (q and k repeated to the value heads) and one [Hv, K, V] fp32 state per 64-token chunk
        rule = 6 * (2 * hv * dk + hv * dv) * 4 + hv * dk * dv * 4 // 64
        mixer = (2 * h + 3 * conv_dim + 3 * hv * dv) * b + rule
    else:
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        gate = q if "qwen3_5" in config.model_type or "qwen3_next" in config.model_type else 0
        # norm in/out, projections (+ q/k norm and rope copies), output, the fp32 merged out kept for backward
        mixer = (2 * h + 3 * (q + 2 * kv) + 2 * q + 2 * gate) * b + q * 4
    return tokens * (mixer + mlp)


def plan_memory(
    config,
    prompt_tokens: int,
    num_generations: int = 8,
    response_tokens: int = 2048,
    cp_size: int = 1,
    ep_size: int = 1,
    lora_rank: int | None = None,
    optimizer: str = "adamw",
    gpu_memory_gib: float = GPU_MEMORY_GIB["h200"],
    capture_chunk_size: int = 16384,
    page_size: int = 16384,
    dtype_bytes: int = 2,
    checkpoint_layers: bool = False,
) -> MemoryPlan:
    """Per-rank memory of a LongStraw GRPO step on ``config`` (bf16 weights by default).

    ``num_generations`` does not change the peak (one response's graph at a time); it is kept for the
    report. ``optimizer``: ``"adamw"`` (two states per trainable parameter, in the parameter dtype) or
    ``"none"`` (e.g. a benchmark that only runs backward).
    """
    params, experts, vocab = count_parameters(config, ep_size)
    trainable = lora_parameters(config, lora_rank) if lora_rank else params
    weights = params * dtype_bytes + (trainable * dtype_bytes if lora_rank else 0)
    gradients = trainable * dtype_bytes
    optimizer_bytes = {"adamw": 2 * trainable * dtype_bytes, "none": 0}[optimizer]
    types = _layer_types(config)
    r = response_tokens
    if checkpoint_layers:
        graph = len(types) * r * config.hidden_size * dtype_bytes + max(
            _layer_graph_bytes(config, t, r, dtype_bytes) for t in set(types)
        )
    else:
        graph = sum(_layer_graph_bytes(config, t, r, dtype_bytes) for t in types)
    # logits: one fp32 chunk, its log_softmax and gradient; with full fine-tuning the head's and the
    # embedding's weight gradients also appear once as a dense temporary before accumulation
    logits = 3 * LOGITS_CHUNK_ELEMENTS * 4 + (0 if lora_rank else vocab * dtype_bytes)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    chunk = capture_chunk_size
    capture_ws = chunk * (
        (2 * config.hidden_size + 3 * config.intermediate_size) * dtype_bytes
        + 3 * config.num_attention_heads * head_dim * 4
    )
    plan = MemoryPlan(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer_bytes,
        state_by_kind=state_bytes(config, prompt_tokens, cp_size, page_size, dtype_bytes),
        response_graph=graph,
        logits=logits,
        capture_workspace=capture_ws,
        gpu_bytes=int(gpu_memory_gib * GiB),
        params=params,
        trainable_params=trainable,
    )
    if experts and ep_size > 1:
        plan.notes.append(f"experts sharded over {ep_size} EP ranks")
    plan.notes.append(f"G={num_generations}: the peak does not grow with G (one response graph at a time)")
    return plan


def largest_prompt(config, page_size: int = 16384, limit_tokens: int = 1 << 34, **plan_kwargs) -> int:
    """The largest prompt (a whole number of pages) whose step fits ``gpu_memory_gib``; 0 if none does.

    ``plan_kwargs`` are :func:`plan_memory`'s other arguments. The peak grows with P, so this bisects.
    """

    def fits(pages: int) -> bool:
        return plan_memory(config, pages * page_size, page_size=page_size, **plan_kwargs).fits

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi * page_size > limit_tokens:
            return lo * page_size
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * page_size


def format_plan(plan: MemoryPlan) -> str:
    def g(x: int) -> str:
        return f"{x / GiB:10.2f} GiB"

    lines = [
        f"parameters {plan.params / 1e9:.2f} B on this rank, trainable {plan.trainable_params / 1e9:.3f} B",
        f"  weights           {g(plan.weights)}",
        f"  gradients         {g(plan.gradients)}",
        f"  optimizer         {g(plan.optimizer)}",
    ]
    for kind, n in plan.state_by_kind.items():
        lines.append(f"  state[{kind}]{' ' * (11 - len(kind))}{g(n)}")
    lines += [
        f"  response graph    {g(plan.response_graph)}",
        f"  logits/head temp  {g(plan.logits)}",
        f"  capture chunk     {g(plan.capture_workspace)}",
        f"capture peak        {g(plan.capture_peak)}",
        f"replay peak         {g(plan.replay_peak)}",
        f"GPU memory          {g(plan.gpu_bytes)}  ->  {'FITS' if plan.fits else 'DOES NOT FIT'}",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
