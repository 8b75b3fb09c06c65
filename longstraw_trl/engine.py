"""The prompt-boundary engine: capture a prompt once, replay responses on its read-only state.

How the state reaches the model: the engine calls the model's root forward (so peft, DDP and accelerate
wrappers, LoRA, MoE blocks, norms and HF gradient checkpointing all behave as usual) with a
:class:`ForwardContext` as the ``longstraw`` keyword, which HF passes down to every decoder layer. HF
attention modules forward unknown keywords to their attention interface; the engine wraps every registered
interface so that, when the keyword is present, attention runs over the prompt K/V plus the response's own
causal keys (``kernels.attention``), and otherwise falls through to the original implementation untouched.
Because the context travels as a call argument, a checkpointed layer recomputed during ``backward()`` sees
the same context. The output head is bound per instance so that, inside a LongStraw call, it computes what
the engine asks for (token log-probs, or nothing during capture) instead of full logits.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable

import torch
from torch import nn

from longstraw_trl.kernels.logprob import token_logprobs
from longstraw_trl.model_patches import find_patch, patch_model, unwrap_model

from .constants import DEFAULT_CHUNK_SIZE, DEFAULT_PAGE_SIZE
from .context import CTX_KWARG, ForwardContext, Mode, ResponseKV
from .errors import LongStrawError, PromptTooLongError
from .fsdp import is_fsdp2
from .hooks import head_request, install_head, skip_head, zero_hidden
from .host_memory import DeviceShare, storage_device
from .prompt_state import PromptState
from .state_grads import StateGrads

# re-exported: the runtime's public names a user of the engine reaches for
__all__ = [
    "CTX_KWARG",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_PAGE_SIZE",
    "Mode",
    "ForwardContext",
    "ResponseKV",
    "StateGrads",
    "TokenLogprobs",
    "backward_segment",
    "capture_prompt",
    "check_completion_mask",
    "check_max_position_embeddings",
    "check_token_ids",
    "checkpointing_off",
    "extend_state",
    "forward_model",
    "model_device",
    "prompt_backward",
    "replay_blocks_backward",
    "replay_logprobs",
    "vocab_size",
]


# ----------------------------------------------------------------------------------------------------
# Entering the model through its root forward
# ----------------------------------------------------------------------------------------------------
def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class TokenLogprobs:
    """Head request: log-probs of ``targets`` (chunked, checkpointed under autograd), not logits; with
    ``with_entropy`` a pair (log-probs, entropies) from the same logits, the entropies differentiable only with
    ``entropy_grad``.

    ``logits_transform`` is the family's post-processing of the head's logits (``FamilyPatch.
    logits_transform``: a final soft-cap, a logit scale), applied here as the stock model applies it
    after its head. The result is kept in :attr:`result`; the model gets an empty view of it as its
    ``logits`` (still in the autograd graph), so the model's own post-processing runs on nothing.
    """

    def __init__(
        self,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool = False,
        entropy_grad: bool = False,
    ):
        self.targets, self.temperature = targets, temperature
        self.with_entropy, self.entropy_grad = with_entropy, entropy_grad
        self.logits_transform: Callable | None = None
        self.result: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, stock, hidden):
        self.result = token_logprobs(
            hidden,
            stock,
            self.targets,
            self.temperature,
            self.with_entropy,
            entropy_grad=self.entropy_grad,
            logits_transform=self.logits_transform,
        )
        first = self.result[0] if self.with_entropy else self.result
        return first.unsqueeze(-1)[..., :0]


def forward_model(
    model: nn.Module,
    input_ids: torch.Tensor,
    start: int | torch.Tensor,
    ctx: ForwardContext,
    head: Callable | None = None,
    logits_to_keep: int = 0,
) -> torch.Tensor:
    """Run ``input_ids [B, T]`` at positions ``start...`` (an int, or a 0-dim device tensor for fixed-shape
    decoding) through the model's root forward (its wrappers included: peft, DDP) with ``ctx`` passed
    down. Returns what the output head computed under ``head`` (``None``: logits of the last
    ``logits_to_keep`` positions, 0 = all)."""
    base = unwrap_model(model)
    patch = find_patch(base)
    install_head(base)  # peft may have wrapped the head since patch_model
    b, t = input_ids.shape
    position_ids = patch.position_ids(start, t, b, input_ids.device)
    if isinstance(head, TokenLogprobs):
        head.logits_transform = patch.logits_transform(base)
    with head_request(head):
        out = model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=patch.no_attention_masks(base),
            use_cache=False,
            logits_to_keep=logits_to_keep,
            **{CTX_KWARG: ctx},
        )
    if isinstance(head, TokenLogprobs):
        return head.result
    return out.logits if hasattr(out, "logits") else out[0]


# ----------------------------------------------------------------------------------------------------
# Input validation
# ----------------------------------------------------------------------------------------------------
def vocab_size(model: nn.Module) -> int:
    return unwrap_model(model).get_output_embeddings().weight.shape[0]


def check_token_ids(ids: torch.Tensor, model: nn.Module, name: str) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise LongStrawError(f"{name} must be an integer torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.numel() == 0:
        raise LongStrawError(f"{name} is empty: give at least one token")
    vocab = vocab_size(model)
    if bool(((ids < 0) | (ids >= vocab)).any()):  # one host sync per call; the details only on error
        lo, hi = int(ids.min()), int(ids.max())
        raise LongStrawError(
            f"{name} holds token ids outside the vocabulary [0, {vocab}): min {lo}, max {hi}"
        )


def check_max_position_embeddings(model: nn.Module, total: int, what: str) -> None:
    limit = find_patch(model).max_positions(unwrap_model(model))
    if limit is not None and total > limit:
        raise PromptTooLongError(
            f"{what} needs {total} positions but the model's max_position_embeddings is {limit}; "
            "raise it in the config (with a RoPE scaling suited to the model) or shorten the prompt"
        )


# ----------------------------------------------------------------------------------------------------
# Capture, extend, replay
# ----------------------------------------------------------------------------------------------------
def _progress(total: int, enabled: bool | None, desc: str):
    from tqdm.auto import tqdm

    if enabled is None:  # long work only, and one bar per run: not one per context-parallel rank
        first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        enabled = total >= 1 << 17 and first
    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, disable=not enabled, leave=False)


@torch.no_grad()
def _prefill(
    state: PromptState,
    model: nn.Module,
    ids: torch.Tensor,
    start: int,
    chunk_size: int,
    progress,
    keep_boundaries: bool = False,
) -> None:
    """Append ``ids`` (1-D) at positions ``start...`` to the layer states of ``state``; with
    ``keep_boundaries`` also keep the fixed-size layers' states at every chunk boundary (the full gradient)."""
    if ids.numel() == 0:
        return
    device = state.device
    ctx = ForwardContext(Mode.CAPTURE, state, reserve_tokens=ids.numel())
    clock = _ChunkClock(device)
    with _progress(ids.numel(), progress, "capture") as bar:
        for s in range(0, ids.numel(), chunk_size):
            if keep_boundaries and start + s > 0:
                state.keep_boundary(start + s)
            chunk = ids[s : s + chunk_size].to(device)[None]
            forward_model(model, chunk, start + s, ctx, head=skip_head, logits_to_keep=1)
            clock.tick()
            bar.update(chunk.shape[1])
    state.chunk_seconds = clock.seconds()


class _ChunkClock:
    """Seconds of each prefill chunk: CUDA events recorded on the stream between chunks (read once at the end,
    so the loop never waits on the device), wall-clock time elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = [self._mark()]

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def tick(self) -> None:
        self.marks.append(self._mark())

    def seconds(self) -> list[float]:
        if not self.cuda:
            return [b - a for a, b in itertools.pairwise(self.marks)]
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self.marks)]


def capture_prompt(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    chunk_size: int | None = None,
    page_size: int | None = None,
    offload_prompt_state: str | None = None,
    cp_group=None,
    progress: bool | None = None,
    keep_boundaries: bool = False,
    device_share: DeviceShare | None = None,
) -> PromptState:
    """Capture ``prompt_ids`` (1-D) once, without autograd, into a :class:`PromptState`.

    The layer states hold the first ``P - 1`` tokens; the last one is kept as an id and runs with every
    replay, so completion token 0 is scored through the whole network (docs/design.md, "Objective").

    Args:
        model: a supported causal LM (patched on the fly; peft-wrapped is fine).
        prompt_ids: 1-D LongTensor, the whole prompt.
        chunk_size: prompt tokens per prefill step (default 8192). Peak memory apart from the state
            grows with the chunk, never with the prompt.
        page_size: tokens per K/V page (default 16384): the unit of context-parallel ownership and of
            offload streaming. Resident K/V is stored contiguously whatever the page size.
        offload_prompt_state: ``None`` keeps K/V on the model's device; ``"cpu"`` keeps it in pinned host memory and
            streams it to the device a page at a time.
        cp_group: a ``torch.distributed`` group: pages are spread round-robin over its ranks.
        progress: show a progress bar (default: only for prompts of 128K tokens or more).
        keep_boundaries: keep what :func:`prompt_backward` needs (the full gradient): the prompt's token
            ids and, at every chunk boundary, the fixed-size layers' states (GDN: conv + recurrent state,
            the state's fixed-size bytes once per chunk boundary, on the model's device).
        device_share: with ``offload_prompt_state="cpu"``: a device budget (:class:`DeviceShare`, shared by the
            states captured with it) within which whole layers' K/V stay on the device, in layer order; only the
            other layers stream from host memory. ``None``: every layer's K/V goes to host memory.
    """
    patch_model(model)
    check_token_ids(prompt_ids, model, "prompt_ids")
    if prompt_ids.dim() != 1:
        raise LongStrawError(
            f"prompt_ids must be 1-D (one prompt per state), got shape {tuple(prompt_ids.shape)}"
        )
    check_max_position_embeddings(model, prompt_ids.numel(), f"a prompt of {prompt_ids.numel()} tokens")
    chunk_size = chunk_size or DEFAULT_CHUNK_SIZE
    page_size = page_size or DEFAULT_PAGE_SIZE
    if chunk_size <= 0 or page_size <= 0:
        raise LongStrawError("chunk_size and page_size must be positive")
    device = model_device(model)
    storage_device(device, offload_prompt_state)  # validates `offload_prompt_state`
    state = PromptState({}, device, offload_prompt_state, cp_group, page_size, chunk_size)
    state.device_share = device_share if offload_prompt_state else None
    _prefill(state, model, prompt_ids[:-1], 0, chunk_size, progress, keep_boundaries)
    state.device_share = None  # the layers are placed; an extension's new segments follow their layer's
    state.num_tokens = prompt_ids.numel()
    state.last_token = prompt_ids[-1].to(device)
    if keep_boundaries:
        state.token_ids = prompt_ids[:-1].detach().cpu().clone()
        state.boundaries = state.boundaries or {}
    return state


def extend_state(
    state: PromptState, model: nn.Module, more_ids: torch.Tensor, progress: bool | None = None
) -> PromptState:
    """A new state for prompt + ``more_ids``; it shares ``state``'s K/V, and ``state`` is unchanged."""
    state.check_not_empty()
    check_token_ids(more_ids, model, "more_ids")
    if more_ids.dim() != 1:
        raise LongStrawError(f"more_ids must be 1-D, got shape {tuple(more_ids.shape)}")
    check_max_position_embeddings(model, state.num_tokens + more_ids.numel(), "the extended prompt")
    new = state.fork()
    ids = torch.cat([state.last_token.view(1).cpu(), more_ids[:-1].cpu()])
    keep = state.token_ids is not None  # the full gradient: the extension keeps what prompt_backward needs
    _prefill(new, model, ids, state.resident_tokens, new.chunk_size or DEFAULT_CHUNK_SIZE, progress, keep)
    new.num_tokens = state.num_tokens + more_ids.numel()
    new.last_token = more_ids[-1].to(state.device)
    if keep:
        new.token_ids = torch.cat([state.token_ids, ids])
    return new


def check_completion_mask(mask: torch.Tensor, ids: torch.Tensor) -> None:
    if mask.shape != ids.shape:
        raise LongStrawError(
            f"completion_mask shape {tuple(mask.shape)} != completion_ids {tuple(ids.shape)}"
        )
    m = mask.to(torch.int64)
    if (m[:, 1:] > m[:, :-1]).any():
        raise LongStrawError("completion_mask must be right-padded (ones, then zeros) in every row")


def replay_logprobs(
    state: PromptState,
    model: nn.Module,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    grad: bool = False,
    checkpoint_layers: bool = False,
    return_entropy: bool = False,
    entropy_grad: bool = False,
    grads: StateGrads | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``[G, R]`` log-probs of ``completion_ids`` continuing the captured prompt (fp32); with
    ``return_entropy`` also ``[G, R]`` entropies of the same distributions (without gradient unless
    ``entropy_grad``: with ``grad=True`` too, they then carry the graph like the log-probs, for an entropy bonus).

    The model runs ``[last prompt token, completion[:-1]]`` (R positions) on the read-only state; the
    log-prob of completion token ``j`` is read at position ``j``. Positions past a row's mask are computed
    but meaningless (right padding cannot affect earlier tokens under causal attention). With
    ``grad=True`` the result carries the autograd graph of these rows only; ``checkpoint_layers``
    recomputes each decoder layer in backward instead of storing it. ``grads`` (the full gradient, with
    ``grad=True``): backward also accumulates the gradient of the prompt state into it, for
    :func:`prompt_backward` to carry into the prompt's tokens.
    """
    state.check_not_empty()
    if grads is not None and grads.state is not state:
        raise LongStrawError("grads belong to another prompt state: make them with StateGrads(state)")
    if completion_ids.dim() == 1:
        completion_ids = completion_ids[None]
    check_token_ids(completion_ids, model, "completion_ids")
    if completion_mask is not None:
        check_completion_mask(completion_mask, completion_ids)
    g, r = completion_ids.shape
    check_max_position_embeddings(
        model, state.num_tokens + r, f"prompt ({state.num_tokens}) + completion ({r})"
    )
    ids = completion_ids.to(state.device)
    inputs = torch.cat([state.last_token.view(1, 1).expand(g, 1), ids[:, :-1]], dim=1)
    with torch.set_grad_enabled(grad):
        ctx = ForwardContext(
            Mode.REPLAY, state, checkpoint_layers=checkpoint_layers, grads=grads if grad else None
        )
        head = TokenLogprobs(ids, temperature, return_entropy, entropy_grad)
        out = forward_model(model, inputs, state.resident_tokens, ctx, head=head)
    return out


# ----------------------------------------------------------------------------------------------------
# The full gradient: segments recomputed in reverse under autograd
# ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def checkpointing_off(model: nn.Module):
    """Switch HF activation checkpointing off in every layer of ``model`` for the block (a graph-free pass has
    nothing to recompute; a recomputed segment checkpoints with the engine's own non-reentrant checkpointing);
    yields the modules it switched off."""
    modules = [
        m for m in unwrap_model(model).modules() if getattr(m, "gradient_checkpointing", False) is True
    ]
    for m in modules:
        m.gradient_checkpointing = False
    try:
        yield modules
    finally:
        for m in modules:
            m.gradient_checkpointing = True


def backward_segment(
    model: nn.Module,
    state: PromptState,
    grads: StateGrads,
    ids: torch.Tensor,
    start: int,
    head: Callable | None = None,
    loss: Callable[[object], torch.Tensor] | None = None,
    checkpoint_layers: bool | None = None,
):
    """Recompute the segment ``ids [1, T]`` at resident positions ``start ... start + T`` of ``state`` under
    autograd and back-propagate into the parameters: the gradient later segments sent to what it added to
    the state (``grads``), plus ``loss(head result)`` when a loss is given (a response block's own tokens).

    The segment reads the state at ``start`` (its earlier tokens' K/V are constants whose dK/dV go to
    ``grads``; the fixed-size states there are leaves of ``grads``). Returns the head's result.
    """
    end = start + ids.shape[1]
    view = state.at(start)
    # HF's checkpointing may be reentrant, which runs the layer without a graph and would cut the K/V and states the
    # segment hands out: the engine's own (non-reentrant) layer checkpointing replaces it here
    with torch.enable_grad(), checkpointing_off(model) as hf:
        if checkpoint_layers is None:  # as the model's own (HF) checkpointing says
            checkpoint_layers = bool(hf) and model.training
        ctx = ForwardContext(
            Mode.SEGMENT, view, checkpoint_layers=checkpoint_layers, grads=grads, segment=(start, end)
        )
        keep = 1 if head is None else 0  # a prompt chunk needs no logits
        out = forward_model(model, ids, start, ctx, head=head or skip_head, logits_to_keep=keep)
        tensors = [t for t, _ in ctx.emitted]
        grad_tensors = [g for _, g in ctx.emitted]
        if loss is not None:
            tensors.append(loss(out))
            grad_tensors.append(None)
        if tensors:
            torch.autograd.backward(tensors, grad_tensors)
    return out


def prompt_backward(
    state: PromptState,
    model: nn.Module,
    grads: StateGrads,
    checkpoint_layers: bool | None = None,
    progress: bool | None = None,
    no_sync: Callable | None = None,
    sync_last: bool = False,
    segment_loss: Callable[[], contextlib.AbstractContextManager[Callable[[], torch.Tensor]]] | None = None,
) -> None:
    """Carry the gradient the replays accumulated in ``grads`` into the prompt's tokens: the capture chunks are
    recomputed under autograd in reverse order, each receiving the gradient that later chunks and every
    response sent to its K/V and state, and passing its own on. Adds to the parameters' ``.grad``: after the
    replays' backward, the parameter gradient is the full-sequence one (docs/design.md, "The full gradient").

    Needs a state captured with ``keep_boundaries=True`` (same chunks); extra memory: one chunk's graph
    (``checkpoint_layers`` recomputes each layer in backward) and the chunk's GDN leaves' gradients.
    Context parallelism: every rank runs every chunk; the chunk's dK/dV are all-reduced before it runs.
    ``no_sync`` (DDP): a context factory the chunks' backward runs under, except, with ``sync_last``, the last
    one's (the first chunk), which then also scores its tokens with a zero weight, so that every parameter
    (the output head too) takes part in the synchronising backward. ``segment_loss``: a loss of the prompt's own
    tokens (TRL's MoE router loss over the prompt), a context factory each chunk's recompute runs under, yielding
    a function that gives the chunk's share of that loss once its forward has run; added to its backward.
    """
    if grads.state is not state:
        raise LongStrawError("grads belong to another prompt state: make them with StateGrads(state)")
    if state.token_ids is None:
        raise LongStrawError(
            "prompt_backward needs a state captured with keep_boundaries=True (the prompt's ids and the "
            "GDN states at its chunk boundaries)"
        )
    n = state.resident_tokens
    # the segments are the capture's chunks (an extension's too): one starts at every kept boundary
    starts = [0] + sorted(t for t in state.boundaries or {} if 0 < t < n)
    ends = starts[1:] + [n]
    # FSDP2 gathers a layer's parameters for backward when the gradient reaches the layer's output; a chunk's gradient
    # enters through its K/V and states, which leaves the last layer's output without one: a zero-weighted term on the
    # final hidden states carries a (zero) gradient there
    fsdp2 = is_fsdp2(model)
    with _progress(n, progress, "prompt backward") as bar:
        for s, e in reversed(list(zip(starts, ends, strict=True))):
            ids = state.token_ids[s:e].to(state.device)[None]
            head = loss = None
            if sync_last and s == 0:
                head, loss = TokenLogprobs(ids, 1.0), (lambda out: out.sum() * 0.0)
            elif fsdp2:
                head, loss = zero_hidden, (lambda out: out)
            sync = (
                no_sync() if no_sync is not None and not (sync_last and s == 0) else contextlib.nullcontext()
            )
            own = segment_loss() if segment_loss is not None else contextlib.nullcontext()
            with sync, own as own_loss:
                if own_loss is not None:
                    loss = _plus(loss, own_loss)
                backward_segment(model, state, grads, ids, s, head, loss, checkpoint_layers)
            grads.release(e)  # the gradient the later calls sent to the state at `e` is in this segment now
            bar.update(ids.shape[1])


def _plus(loss: Callable[[object], torch.Tensor] | None, extra: Callable[[], torch.Tensor]):
    """``loss`` (of the head's result; ``None``: none) plus ``extra()``."""
    if loss is None:
        return lambda out: extra()
    return lambda out: loss(out) + extra()


def replay_blocks_backward(
    state: PromptState,
    model: nn.Module,
    completion_ids: torch.Tensor,
    block_size: int,
    loss: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
    temperature: float = 1.0,
    grads: StateGrads | None = None,
    return_entropy: bool = False,
    entropy_grad: bool = False,
    checkpoint_layers: bool | None = None,
    no_sync: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Reverse block replay of one response: the gradient of ``loss(logps, entropies)`` (``[R]`` each) with
    peak memory of one block's graph plus the response's own state, whatever R.

    The response (``completion_ids [1, R]`` or ``[R]``) runs in blocks of ``block_size`` positions: forward without
    autograd block by block on a fork of ``state`` that keeps the state at each block boundary (the
    response's K/V so far, the GDN states there), then the blocks are recomputed under autograd in reverse
    order (:func:`backward_segment`): each back-propagates ``loss`` through its own log-probs (the others held
    at their values, so the gradients of the blocks sum to the whole response's) plus the gradient later
    blocks sent to its K/V and state. ``grads`` (the full gradient): what reaches the prompt state goes there,
    as a whole replay with ``grads`` would send it; ``None``: the prompt state is a constant. ``no_sync``: a
    context factory every backward but the last runs under (DDP). Returns the detached ``[R]`` log-probs,
    entropies (``None`` unless ``return_entropy``) and the loss value.
    """
    state.check_not_empty()
    if completion_ids.dim() == 1:
        completion_ids = completion_ids[None]
    if completion_ids.shape[0] != 1:
        raise LongStrawError(
            f"reverse block replay takes one response at a time, got {completion_ids.shape[0]}"
        )
    if block_size <= 0:
        raise LongStrawError(f"block_size must be positive, got {block_size}")
    if grads is not None and grads.state is not state:
        raise LongStrawError("grads belong to another prompt state: make them with StateGrads(state)")
    check_token_ids(completion_ids, model, "completion_ids")
    r = completion_ids.shape[1]
    check_max_position_embeddings(
        model, state.num_tokens + r, f"prompt ({state.num_tokens}) + completion ({r})"
    )
    ids = completion_ids.to(state.device)
    inputs = torch.cat([state.last_token.view(1, 1), ids[:, :-1]], dim=1)
    base = state.resident_tokens
    starts = list(range(0, r, block_size))
    with_entropy = return_entropy or entropy_grad

    # forward without autograd: every block but the last appended to a fork, the state kept at each boundary
    fork = state.fork()
    logps, entropies = ids.new_zeros(r, dtype=torch.float32), ids.new_zeros(r, dtype=torch.float32)
    ctx = ForwardContext(Mode.CAPTURE, fork, reserve_tokens=starts[-1])
    with torch.no_grad():
        for s in starts[:-1]:
            e = min(r, s + block_size)
            fork.keep_boundary(base + s)
            head = TokenLogprobs(ids[:, s:e], temperature, with_entropy)
            out = forward_model(model, inputs[:, s:e], base + s, ctx, head=head)
            lp, h = out if with_entropy else (out, None)
            logps[s:e] = lp[0].float()
            if h is not None:
                entropies[s:e] = h[0].float()
    fork.num_tokens = state.num_tokens + starts[-1]
    block_grads = StateGrads.for_fork(fork, state, grads)

    value = None
    for n, s in enumerate(reversed(starts)):
        e = min(r, s + block_size)
        head = TokenLogprobs(ids[:, s:e], temperature, with_entropy, entropy_grad)

        def block_loss(out, s=s, e=e):
            nonlocal value
            lp, h = out if with_entropy else (out, None)
            full_lp = torch.cat([logps[:s], lp[0], logps[e:]])
            full_h = torch.cat([entropies[:s], h[0], entropies[e:]]) if h is not None else None
            term = loss(full_lp, full_h)
            value = term.detach() if value is None else value
            return term

        last = n == len(starts) - 1
        sync = no_sync() if no_sync is not None and not last else contextlib.nullcontext()
        with sync:
            out = backward_segment(
                model, fork, block_grads, inputs[:, s:e], base + s, head, block_loss, checkpoint_layers
            )
        lp, h = out if with_entropy else (out, None)
        logps[s:e] = lp[0].detach().float()
        if h is not None:
            entropies[s:e] = h[0].detach().float()
    return logps, (entropies if return_entropy else None), value
