"""The full gradient's buffers: what a loss sends back to a prompt state (:class:`StateGrads`), and the dK/dV of
one layer's K/V pages (:class:`KVGrad`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .errors import LongStrawError
from .host_memory import HOST_ADDS
from .layer_state import KVPages, LayerState
from .prompt_state import PromptState


class KVGrad:
    """dK/dV of a loss with respect to the tokens one :class:`KVPages` holds on this rank (the full gradient).

    fp32 buffers in the layout of the pages' segments, on their storage device (host memory when the
    pages are offloaded), allocated when first written. Later tokens read the pages as constants: their
    attention backward hands each page's dK/dV to :meth:`sink`, and the segment that produced the tokens
    takes the sum back with :meth:`take`. A fork's buffers: the first ``shared`` segments are ``parent``'s
    (its buffers, or no gradient at all when ``parent`` is ``None``), the others its own.
    """

    def __init__(self, pages: KVPages, shared: int = 0, parent: KVGrad | None = None):
        self.pages, self.shared, self.parent = pages, shared, parent
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _buffer(self, j: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if j < self.shared:
            return None if self.parent is None else self.parent._buffer(j)
        if j not in self._buffers:
            kb, vb, filled = self.pages.segments[j]
            dv = None  # `grad_values` False: the values take no gradient
            if self.pages.grad_values:
                dv = torch.zeros(vb.shape[0], filled, vb.shape[2], dtype=torch.float32, device=vb.device)
            dk = torch.zeros(kb.shape[0], filled, kb.shape[2], dtype=torch.float32, device=kb.device)
            self._buffers[j] = (dk, dv)
        return self._buffers[j]

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for pair in self._buffers.values() for t in pair if t is not None
        )

    def sink(self, view: KVPages):
        """For the attention backward over ``view`` (this state or a :meth:`KVPages.prefix` of it): block
        index (``view.stream`` order) -> accumulator of that block's ``(dk, dv)``, or ``None`` (constant)."""
        blocks = list(view.blocks())

        def for_block(i: int):
            j, s, e = blocks[i]
            if self._buffer(j) is None:
                return None

            def add(dk: torch.Tensor | None, dv: torch.Tensor | None) -> None:
                bk, bv = self._buffer(j)
                if dk is not None:
                    HOST_ADDS.add(bk[:, s:e], dk)
                if dv is not None and bv is not None:
                    HOST_ADDS.add(bv[:, s:e], dv)

            return add

        return for_block

    def sink_joined(self, view: KVPages) -> Callable[[torch.Tensor | None, torch.Tensor | None], None]:
        """:meth:`sink` for a kernel that reads ``view``'s blocks joined into one table (in ``view.stream``
        order): the returned function takes the table's ``(dk [Hkv, N, D], dv)`` (either ``None``: no gradient
        there) and hands each block its rows."""
        blocks = list(view.blocks())
        for_block = self.sink(view)

        def add(dk: torch.Tensor | None, dv: torch.Tensor | None) -> None:
            at = 0
            for i, (_, s, e) in enumerate(blocks):
                sink = for_block(i)
                if sink is not None:
                    sink(
                        None if dk is None else dk[:, at : at + e - s],
                        None if dv is None else dv[:, at : at + e - s],
                    )
                at += e - s

        return add

    def take(self, start: int, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The accumulated ``(dk [Hkv, T, D], dv)`` of global tokens ``[start, end)`` on ``device``: this
        rank's owned tokens, zeros elsewhere (context parallelism: the caller all-reduces). Read-only: where one
        buffer holds the whole range (one rank, a segment's own tokens) it is a slice of that buffer, not a copy
        (zeros and a copy were four kernels per layer of every recomputed segment)."""
        pages = self.pages
        HOST_ADDS.wait()  # the dK/dV handed to offloaded buffers are all in them
        if pages.cp_size == 1:
            pieces = list(self._pieces(start, end - start))
            if len(pieces) == 1 and pieces[0][3] == (0, end - start):
                buf = self._buffer(pieces[0][0])
                if buf is not None and buf[1] is not None:
                    lo, hi = pieces[0][1:3]
                    return buf[0][:, lo:hi].to(device), buf[1][:, lo:hi].to(device)
        dk = torch.zeros(pages.num_kv_heads, end - start, pages.head_dim, device=device)
        dv = torch.zeros(pages.num_kv_heads, end - start, pages.v_head_dim, device=device)
        pos = start
        while pos < end:
            page, offset = divmod(pos, pages.page_size)
            n = min(pages.page_size - offset, end - pos) if pages.cp_size > 1 else end - pos
            if pages.owns(page):
                self._copy_stored(pages.stored_index(pos), n, dk, dv, pos - start)
            pos += n
        return dk, dv

    def _pieces(self, index: int, n: int) -> Iterator[tuple[int, int, int, tuple[int, int]]]:
        """Where stored tokens ``[index, index + n)`` lie: ``(segment, start, end within it, (start, end) within the
        n tokens)`` for each segment they touch."""
        base = 0
        for j, (_, _, filled) in enumerate(self.pages.segments):
            lo, hi = max(index, base), min(index + n, base + filled)
            if lo < hi:
                yield j, lo - base, hi - base, (lo - index, hi - index)
            base += filled

    def _copy_stored(self, index: int, n: int, dk: torch.Tensor, dv: torch.Tensor, out: int) -> None:
        for j, lo, hi, (a, b) in self._pieces(index, n):
            buf = self._buffer(j)
            if buf is not None:
                dst = slice(out + a, out + b)
                dk[:, dst] = buf[0][:, lo:hi].to(dk.device)
                if buf[1] is not None:
                    dv[:, dst] = buf[1][:, lo:hi].to(dv.device)


class StateGrads:
    """The gradient of a loss with respect to a :class:`PromptState`'s resident tensors, accumulated by the
    calls that read the state under autograd and carried back by :func:`prompt_backward`.

    One mechanism for every segment of a sequence (the prompt's capture chunks, a response's blocks): a
    segment is recomputed under autograd from the state at its start, where

    - growing layer states (``grad_kind == "buffer"``, K/V pages) are constants whose gradient the attention
      backward accumulates into a buffer of the state's size (:class:`KVGrad`, fp32);
      the segment that produced those tokens takes it back as the gradient of its own K/V;
    - fixed-size layer states (``grad_kind == "leaf"``, GDN conv + recurrent state) at each boundary are a
      leaf (one per boundary, shared by every call starting there, so the gradients of all of them add up);
      the segment ending at that boundary takes the leaf's gradient as that of the state it produced.

    ``parent`` / ``base_tokens``: the grads of a state forked from ``parent.state`` after its
    ``base_tokens`` resident tokens (a response's reverse block replay): what lies before goes to
    ``parent`` (``None``: constants, the response-only gradient).

    Attributes:
        state: the state whose gradient this is.
    """

    def __init__(self, state: PromptState, parent: StateGrads | None = None, base_tokens: int = 0):
        self.state, self.parent, self.base_tokens = state, parent, base_tokens
        self.base_state: PromptState | None = None
        self._kv: dict[int, KVGrad] = {}
        self._leaves: dict[tuple[int, int], LayerState] = {}

    @classmethod
    def for_fork(cls, fork: PromptState, base: PromptState, parent: StateGrads | None) -> StateGrads:
        """Grads of ``fork`` (``base.fork()``, then extended): ``base``'s part goes to ``parent``."""
        grads = cls(fork, parent, base.resident_tokens)
        grads.base_state = base
        return grads

    def check_kind(self, idx: int, layer: LayerState) -> None:
        if layer.grad_kind is None:
            raise LongStrawError(
                f"layer {idx} keeps a {type(layer).__name__}, which has no full gradient (gradient_mode='full' "
                "and reverse block replay support K/V pages and windows, MLA latent pages, Gated DeltaNet and Mamba-2 states)"
            )

    def kv(self, idx: int) -> KVGrad:
        """The dK/dV buffers of layer ``idx`` (K/V pages)."""
        if idx not in self._kv:
            layer = self.state.layers[idx]
            shared, parent = 0, None
            if self.base_state is not None and idx in self.base_state.layers:
                shared = len(self.base_state.layers[idx].segments)
                parent = self.parent.kv(idx) if self.parent is not None else None
            self._kv[idx] = KVGrad(layer, shared, parent)
        return self._kv[idx]

    def leaf(self, tokens: int, idx: int, layer: LayerState) -> LayerState | None:
        """The leaf standing for layer ``idx``'s state ``layer`` after ``tokens`` resident tokens (``None``:
        a constant, when that boundary belongs to no gradient)."""
        if tokens <= self.base_tokens and self.base_state is not None:
            return None if self.parent is None else self.parent.leaf(tokens, idx, layer)
        key = (tokens, idx)
        if key not in self._leaves:
            tensors = [None if t is None else t.detach().requires_grad_() for t in layer.grad_tensors()]
            self._leaves[key] = layer.with_tensors(tensors)
        return self._leaves[key]

    def release(self, tokens: int) -> None:
        """Drop the leaves standing for the states after ``tokens`` resident tokens, and so their gradients: once
        the segment ending there has taken them (:func:`~longstraw_trl.engine.prompt_backward`), nothing reads them
        again. Kept, every boundary's leaf and gradient stayed on the device to the end of the prompt backward
        (the 27B's GDN layers: 2 x 144 MiB a capture chunk, 8.8 GiB more at 262K than at 16K on an H100)."""
        for key in [k for k in self._leaves if k[0] == tokens]:
            del self._leaves[key]

    def leaves_held(self) -> list[int]:
        """The boundaries (resident tokens) whose leaves are held now, sorted."""
        return sorted({tokens for tokens, _ in self._leaves})

    def carried(self, tokens: int, idx: int) -> list[torch.Tensor | None]:
        """The gradient the calls starting after ``tokens`` resident tokens sent to layer ``idx``'s state."""
        if tokens <= self.base_tokens and self.base_state is not None:
            return [None, None] if self.parent is None else self.parent.carried(tokens, idx)
        leaf = self._leaves.get((tokens, idx))
        if leaf is None:
            return [None] * len(self.state.layers[idx].grad_tensors())
        return [None if t is None else t.grad for t in leaf.grad_tensors()]

    def nbytes(self) -> int:
        """Bytes of the gradient buffers and leaves held now."""
        kv = sum(g.nbytes() for g in self._kv.values())
        leaves = sum(
            t.numel() * t.element_size()
            for leaf in self._leaves.values()
            for t in leaf.grad_tensors()
            if t is not None and t.grad is not None
        )
        return kv + leaves
