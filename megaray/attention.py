"""Attention for the decoder blocks: causal, or each document's own in a packed row.

``train.attention`` document gives every micro-batch a ``Packing``: each token's position in
its own document (where RoPE restarts) and a mask that keeps it to its document's earlier
tokens. On CUDA the mask is a FlexAttention block mask built from the documents' block ranges
(``document_block_mask``: block-sparse and fused, never [s, s], so long rows keep working);
on the CPU, for toy heads, or without FlexAttention (torch 2.4), a dense boolean mask for
SDPA. Causal attention is SDPA's own (flash on CUDA). A sliding window (Gemma 3's local
blocks) runs on CUDA through flash attention's own window (``window_attention``: the rows as
they are, or with documents their cumulative lengths, ``Packing.cu``); elsewhere it is one more
condition of the same masks, combined with the documents' (``Packing.window_mask``;
``window_mask`` for rows without documents).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# torch >= 2.5 takes grouped kv heads as they are (``enable_gqa``); SDPA is a builtin without
# an inspectable signature, so its documented parameters tell.
SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")

try:        # torch >= 2.5: block-sparse fused attention with a mask function
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:       # pragma: no cover - torch 2.4
    BlockMask = create_block_mask = flex_attention = None

FLEX_BLOCK = 128          # FlexAttention's block size: its mask holds a few int32 per block pair
FLEX_MIN_HEAD_DIM = 16    # its Triton kernels' smallest head
# torch < 2.6 builds a BlockMask only for whole blocks (no seq_lengths): rows of other lengths take the dense mask
_FLEX_RAGGED = BlockMask is not None and "seq_lengths" in inspect.signature(BlockMask.from_kv_blocks).parameters
_flex_compiled = None


@dataclass(frozen=True)
class Packing:
    """One micro-batch's documents: each token's document within its row (``doc``, int32
    [b, s], non-decreasing along a row), its position in that document (``pos``, where RoPE
    restarts) and the attention mask that keeps a token to its own document's earlier tokens:
    a FlexAttention block mask on CUDA (block-sparse, fused; never [s, s]), a dense boolean
    [b, 1, s, s] mask for SDPA elsewhere (the CPU, tiny rows) or where FlexAttention is missing.
    ``window_mask``, for a model with sliding-window blocks, also keeps a token to the window
    of tokens before it: the document's and the window's masks combined; ``cu``, where flash
    attention's window runs (``flash_windows``), the documents' cumulative lengths it takes
    instead (``cumulative_lengths``' pair)."""
    doc: torch.Tensor
    pos: torch.Tensor
    mask: object
    window_mask: object = None
    cu: tuple | None = None

    @property
    def flex(self) -> bool:
        return not isinstance(self.mask, torch.Tensor)


def _uses_flex(doc: torch.Tensor, head_dim: int | None) -> bool:
    b, s = doc.shape
    return bool(doc.is_cuda and create_block_mask is not None
                and (head_dim or FLEX_MIN_HEAD_DIM) >= FLEX_MIN_HEAD_DIM and (_FLEX_RAGGED or s % FLEX_BLOCK == 0))


def packing(doc: torch.Tensor, head_dim: int | None = None, window: int | None = None) -> Packing:
    """The Packing of a micro-batch from its tokens' document ids (int [b, s], on the device
    the blocks run on), with the windowed mask too where ``window`` is given. FlexAttention's
    kernels need heads of at least ``FLEX_MIN_HEAD_DIM``: smaller ones (toy models) take the
    dense mask on CUDA too."""
    doc = doc.to(torch.int32).contiguous()
    b, s = doc.shape
    first = torch.searchsorted(doc, doc, side="left")          # each token's document start
    pos = torch.arange(s, device=doc.device).expand(b, s) - first
    build = document_block_mask if _uses_flex(doc, head_dim) else dense_mask
    cu = cumulative_lengths(doc) if window and flash_windows(doc.device, head_dim) else None
    return Packing(doc, pos, build(doc), build(doc, window) if window else None, cu)


def dense_mask(doc: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """SDPA's boolean [b, 1, s, s] mask of same-document causal attention, within ``window``
    tokens (the query's own included) where given."""
    s = doc.shape[1]
    i = torch.arange(s, device=doc.device)
    allowed = i[:, None] >= i[None, :]
    if window:
        allowed &= i[:, None] - i[None, :] < window
    return ((doc[:, :, None] == doc[:, None, :]) & allowed).unsqueeze(1)


def window_mask(b: int, s: int, window: int, device, head_dim: int | None = None):
    """The mask of causal rows of ``s`` tokens attending within ``window`` tokens (no
    documents): a FlexAttention block mask or a dense one, as ``packing`` chooses; built once
    per shape and device."""
    key = (b, s, window, str(device), head_dim)
    if key not in _WINDOW_MASKS:
        if len(_WINDOW_MASKS) >= 8:
            _WINDOW_MASKS.pop(next(iter(_WINDOW_MASKS)))
        _WINDOW_MASKS[key] = packing(torch.zeros(b, s, dtype=torch.int32, device=device), head_dim,
                                     window).window_mask
    return _WINDOW_MASKS[key]


_WINDOW_MASKS: dict = {}


def document_block_mask(doc: torch.Tensor, window: int | None = None):
    """FlexAttention's BlockMask of same-document causal attention, within ``window`` tokens
    where given, built from the documents' block ranges (never from a [s, s] mask, which
    ``create_block_mask`` would materialize: 17 GB at 131,072 tokens). With ``doc``
    non-decreasing along each row, kv block j < i shares a document with q block i exactly when
    j's last document is i's first, and is *full* (no element masked) when both blocks hold
    that one document alone and, with a window, its farthest pair lies within it; a pair of
    blocks whose nearest tokens lie beyond the window is skipped; the diagonal and blocks
    holding the row's end are always partial (masked element by element)."""
    b, s = doc.shape
    n = -(-s // FLEX_BLOCK)
    padded = F.pad(doc, (0, n * FLEX_BLOCK - s), mode="replicate") if n * FLEX_BLOCK > s else doc
    blocks = padded.view(b, n, FLEX_BLOCK)
    first, last = blocks[..., 0], blocks[..., -1]                         # [b, n]
    i = torch.arange(n, device=doc.device)
    below = i[None, :, None] > i[None, None, :]                           # kv block j < q block i
    shares = below & (last[:, None, :] == first[:, :, None])
    whole = torch.ones(n, dtype=torch.bool, device=doc.device)
    whole[-1] = n * FLEX_BLOCK == s
    one_doc = (first == last) & whole                                    # [b, n]
    full = shares & one_doc[:, :, None] & one_doc[:, None, :]
    if window:
        apart = (i[:, None] - i[None, :]) * FLEX_BLOCK                     # [n, n]: q block start - kv block start
        shares = shares & (apart - FLEX_BLOCK + 1 < window)              # the nearest pair within the window
        full = full & (apart + FLEX_BLOCK - 1 < window)                  # the farthest pair too
    partial = (shares & ~full) | torch.eye(n, dtype=torch.bool, device=doc.device)

    def as_kv(m):        # counts and indices (the listed blocks first, in order), [b, 1, n] and [b, 1, n, n]
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)
        return m.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    def same_document_causal(bi, h, qi, ki):
        return (doc[bi, qi] == doc[bi, ki]) & (qi >= ki)

    def same_document_window(bi, h, qi, ki):
        return (doc[bi, qi] == doc[bi, ki]) & (qi >= ki) & (qi - ki < window)

    ragged = {"seq_lengths": (s, s)} if _FLEX_RAGGED else {}
    return BlockMask.from_kv_blocks(*as_kv(partial), *as_kv(full), BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=same_document_window if window else same_document_causal, **ragged)


@functools.cache
def varlen_kernel():
    """torch >= 2.10's flash attention over documents given by cumulative lengths
    (``torch.nn.attention.varlen.varlen_attn``), or None: only ``megaray bench`` times it.
    Looked up on first use: its module imports torch._dynamo, a second of CPU time that every
    actor process would otherwise spend at its start."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:       # pragma: no cover - older torch
        return None
    return varlen_attn


def cumulative_lengths(doc: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A micro-batch's documents as flash varlen's cumulative lengths over its rows laid end
    to end (int32 [documents + 1]; a document ends at its row's end even where the next row
    starts with the same id), and the longest document."""
    b, s = doc.shape
    starts = torch.ones(b, s, dtype=torch.bool, device=doc.device)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    begin = torch.nonzero(starts.flatten()).flatten()
    cu = torch.cat([begin, begin.new_tensor([b * s])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


FLASH_MAX_HEAD_DIM = 256     # flash attention's widest head


def flash_windows(device, head_dim: int | None) -> bool:
    """Whether sliding windows run through flash attention's own window on ``device``: CUDA
    with the ``_flash_attention_forward`` op taking a window (torch >= 2.6), heads of at most
    ``FLASH_MAX_HEAD_DIM`` (tried once per device on tiny bf16 inputs, so an older GPU that
    flash does not run on takes the masks)."""
    device = torch.device(device)
    if device.type != "cuda" or not FLEX_MIN_HEAD_DIM <= (head_dim or 0) <= FLASH_MAX_HEAD_DIM:
        return False
    return _flash_window_runs(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _flash_window_runs(index: int) -> bool:
    try:
        q = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16, device=f"cuda:{index}")
        torch.ops.aten._flash_attention_forward(q, q[:, :, :1], q[:, :, :1], None, None, 4, 4, 0.0, True, False,
                                                window_size_left=1, window_size_right=0)
        return True
    except (RuntimeError, TypeError, AttributeError):
        return False


FLASH_DTYPES = (torch.bfloat16, torch.float16)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                    pk: Packing | None = None, scale: float | None = None) -> torch.Tensor:
    """A block's attention: causal, within each document of ``pk``, within ``window`` tokens
    (a sliding-window block), or both. q [b, nh, s, hd], k, v [b, nkv, s, hd]. Windows run
    through flash attention's own (``window_attention``) where it runs (CUDA, bf16 or fp16),
    else under the window's mask, as the documents do."""
    b, nh, s, hd = q.shape
    if window is None:
        return attention(q, k, v, nh, k.shape[1], None if pk is None else pk.mask, scale)
    if q.dtype in FLASH_DTYPES and flash_windows(q.device, hd):
        return window_attention(q, k, v, window, scale, None if pk is None else pk.cu)
    mask = pk.window_mask if pk is not None else window_mask(b, s, window, q.device, hd)
    return attention(q, k, v, nh, k.shape[1], mask, scale)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                     scale: float | None = None, cu: tuple | None = None) -> torch.Tensor:
    """Causal attention within ``window``: each token attends to the ``window`` tokens up to
    itself (itself included: flash's window (window - 1, 0)), through flash attention's own
    sliding window, its grouped kv heads as they are; with ``cu`` (``Packing.cu``) also within
    each document, the rows laid end to end. q [b, nh, s, hd], k, v [b, nkv, s, hd] (any
    strides with the head's elements contiguous); the result like q. CUDA only
    (``flash_windows``); autograd's backward is flash's, with the same window."""
    b, nh, s, hd = q.shape
    flash = torch.ops.aten._flash_attention_forward
    kw = {"scale": scale, "window_size_left": window - 1, "window_size_right": 0}
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)       # [b, s, heads, hd]
    if cu is None:
        return flash(q, k, v, None, None, s, s, 0.0, True, False, **kw)[0].transpose(1, 2)
    starts, longest = cu
    q, k, v = (t.reshape(b * s, t.shape[2], hd) for t in (q, k, v))
    out = flash(q, k, v, starts, starts, longest, longest, 0.0, True, False, **kw)[0]
    return out.view(b, s, nh, hd).transpose(1, 2)


def packing_mask_bytes(b: int, s: int, flex: bool) -> int:
    """GPU bytes of one micro-batch's attention mask: FlexAttention's block mask (block
    counts and indices, for the forward and the backward, partial and full blocks), or the
    dense boolean mask."""
    if not flex:
        return b * s * s
    n = -(-s // FLEX_BLOCK)
    return 4 * 4 * b * n * (n + 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nh: int, nkv: int,
              mask=None, scale: float | None = None) -> torch.Tensor:
    """Causal attention (``mask`` None), or under ``mask``: a FlexAttention block mask or SDPA's
    boolean one (``Packing``'s, ``window_mask``'s). q [b, nh, s, hd], k, v [b, nkv, s, hd];
    ``scale`` multiplies the scores (None: 1/sqrt(hd))."""
    global _flex_compiled
    if mask is not None and not isinstance(mask, torch.Tensor):
        if not q.is_cuda:       # eager (unfused) off the GPU: the tests' check of the block mask
            return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=nkv != nh)
        if _flex_compiled is None:
            _flex_compiled = torch.compile(flex_attention, dynamic=False)
        return _flex_compiled(q, k, v, block_mask=mask, scale=scale, enable_gqa=nkv != nh)
    kw = {"attn_mask": mask} if mask is not None else {"is_causal": True}
    if scale is not None:
        kw["scale"] = scale
    if nkv != nh and SDPA_GQA:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    if nkv != nh:
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, **kw)
