"""MoE routing (with router replay), token permutation and fused SwiGLU experts.

Shapes: T tokens, k experts per token, E experts, D model dim, I expert dim.
Expert weights are fused as in Hugging Face: ``w13 [E, 2I, D]`` (rows 0..I-1 the gate projection,
I..2I-1 the up projection) and ``w2 [E, D, I]``; an expert computes ``w2 @ (silu(w1 x) * (w3 x))``.

>>> import torch
>>> from primerl.kernels.moe import topk_route, fused_experts
>>> T, D, I, E, k = 6, 16, 8, 4, 2
>>> x, gate = torch.randn(T, D), torch.randn(E, D)
>>> ids, w = topk_route(x @ gate.T, k, route_norm=True)          # ids [T, k] int32, w [T, k] fp32
>>> y = fused_experts(x, torch.randn(E, 2 * I, D), torch.randn(E, D, I), ids, w)   # [T, D]
>>> ids2, w2 = topk_route(x @ gate.T, k, route_norm=True, replay_ids=ids)   # replay: same ids
"""

from __future__ import annotations

import torch

from .._args import check_int
from .._opaque import tracing
from .._backend import resolve_backend
from .._value_checks import check_values
from . import _functions, reference

__all__ = ["topk_route", "expert_counts", "moe_align", "permute", "unpermute_combine", "fused_experts"]

SCORE_FUNCS = ("softmax", "sigmoid")
ACTIVATIONS = ("swiglu",)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64)
# replay ids as recorded: MoETransformer.routing() stores the smallest unsigned dtype that holds them
_REPLAY_DTYPES = (torch.uint8, torch.uint16, torch.int16, torch.int32, torch.int64)


def _check_tensor(op: str, name: str, t, dims: int, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{op}: {name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} dtype must be one of {dtypes}, got {t.dtype}")


def _check_ids(op: str, name: str, ids, num_experts: int, shape=None, unique_rows: bool = False,
               dtypes=_INT_DTYPES) -> None:
    """Validate expert ids [T, k]: shape and dtype on the host, values (range, duplicates) on the
    device through :func:`primerl.kernels.check_values` (no host read; ValueError in debug mode)."""
    _check_tensor(op, name, ids, 2, dtypes)
    if shape is not None and tuple(ids.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(ids.shape)}")
    if num_experts <= 0:
        raise ValueError(f"{op}: num_experts must be positive, got {num_experts}")
    if ids.numel() == 0:
        return
    wide = ids.long()
    check_values(((wide >= 0) & (wide < num_experts)).all(), f"{op}: {name} must lie in [0, {num_experts})",
                 lambda: f"got values in [{int(wide.min())}, {int(wide.max())}]")
    if unique_rows and ids.shape[1] > 1:
        s = wide.sort(dim=1).values
        dup = (s[:, 1:] == s[:, :-1]).any(dim=1)

        def detail() -> str:
            row = int(dup.nonzero()[0, 0])
            return f"row {row} is {ids[row].tolist()}"

        check_values(~dup.any(), f"{op}: {name} has a repeated expert (within a row)", detail)


def _weights_float32(op: str, topk_weights: torch.Tensor) -> torch.Tensor:
    """Routing weights in float32 (the combine's precision): bf16 / fp16 weights are cast here, a
    differentiable cast (their gradient comes back in their dtype)."""
    _check_tensor(op, "topk_weights", topk_weights, 2, _FLOAT_DTYPES)
    return topk_weights.float()


def topk_route(
    logits: torch.Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    n_groups: int = 1,
    topk_groups: int = 1,
    expert_bias: torch.Tensor | None = None,
    route_norm: bool = False,
    route_scale: float = 1.0,
    replay_ids: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick k experts per token: logits [T, E] -> (topk_ids [T, k] int32, topk_weights [T, k] fp32).

    Scores are ``softmax`` or ``sigmoid`` of the logits in float32. Selection is the top-k of
    ``scores + expert_bias`` (the bias steers selection only, never the weights), restricted to the
    ``topk_groups`` best of ``n_groups`` expert groups (a group scored by the sum of its top-2).
    Weights are the scores of the chosen experts, renormalised to sum 1 if ``route_norm``, times
    ``route_scale``. With ``replay_ids [T, k]`` the selection is taken from it as is (column order
    kept; bias and groups skipped) and the weights are gathered from this forward's scores, so the
    router still gets gradients. Ids are best-first when selected here. ``replay_ids`` may be any
    integer dtype that holds them (``MoETransformer.routing()`` records uint8 for <= 256 experts).
    The weights are float32 whatever the logits' dtype (the ops taking them accept bf16 too).
    """
    op = "topk_route"
    _check_tensor(op, "logits", logits, 2, _FLOAT_DTYPES)
    check_int(op, "top_k", top_k)
    check_int(op, "n_groups", n_groups)
    check_int(op, "topk_groups", topk_groups)
    t, e = logits.shape
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"{op}: score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if not 1 <= top_k <= e:
        raise ValueError(f"{op}: top_k must be in [1, {e}] (E = logits.shape[1]), got {top_k}")
    if n_groups < 1 or e % n_groups != 0:
        raise ValueError(f"{op}: n_groups={n_groups} must be >= 1 and divide E={e}")
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"{op}: topk_groups must be in [1, n_groups={n_groups}], got {topk_groups}")
    if n_groups > 1 and top_k > topk_groups * (e // n_groups):
        raise ValueError(
            f"{op}: top_k={top_k} exceeds the {topk_groups * (e // n_groups)} experts of {topk_groups} groups"
        )
    if expert_bias is not None:
        _check_tensor(op, "expert_bias", expert_bias, 1, _FLOAT_DTYPES)
        if expert_bias.shape[0] != e:
            raise ValueError(f"{op}: expert_bias must have shape ({e},), got {tuple(expert_bias.shape)}")
    if replay_ids is not None:
        _check_ids(op, "replay_ids", replay_ids, e, shape=(t, top_k), unique_rows=True, dtypes=_REPLAY_DTYPES)
        if replay_ids.device != logits.device:
            raise ValueError(f"{op}: replay_ids is on {replay_ids.device}, logits on {logits.device}")
    resolve_backend(op, backend, logits.device, supported=("torch",))
    return reference.topk_route(
        logits, top_k, score_func, n_groups, topk_groups, expert_bias, route_norm, float(route_scale), replay_ids
    )


def expert_counts(topk_ids: torch.Tensor, num_experts: int, *, backend: str | None = None) -> torch.Tensor:
    """Tokens routed to each expert: topk_ids [T, k] -> counts [E] int32."""
    op = "expert_counts"
    _check_ids(op, "topk_ids", topk_ids, num_experts)
    be = resolve_backend(op, backend, topk_ids.device, supported=("torch", "triton", "cuda"))
    return _functions.op(_functions.backend_impl(be), "expert_counts")(topk_ids, num_experts)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_size: int, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the n = T*k slots (slot t*k + j) by expert, padding each expert to ``block_size``.

    Returns ``sorted_token_ids [P]`` int32 (slot per row, ``n`` on padding rows;
    P = n + E*(block_size-1), a bound known without a host sync), ``expert_ids [ceil(P/block_size)]``
    int32 (expert of each block, -1 for blocks past the end) and ``num_tokens_post_padded [1]``
    int32 (the padded total). Within an expert, slots keep increasing order (deterministic).
    """
    op = "moe_align"
    _check_ids(op, "topk_ids", topk_ids, num_experts)
    if block_size < 1:
        raise ValueError(f"{op}: block_size must be >= 1, got {block_size}")
    be = resolve_backend(op, backend, topk_ids.device, supported=("torch", "triton", "cuda"))
    _, sorted_slots, block_expert, total, _ = _functions.backend_impl(be).align(topk_ids, num_experts, block_size)
    return sorted_slots, block_expert, total


def permute(
    x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, align: int = 1, *, num_rows: int | None = None,
    backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group token copies by expert: x [T, D] -> (x_perm [M, D], row_map [T, k] int32, offsets [E] int32).

    Row ``row_map[t, j]`` of x_perm is x[t] (token t's j-th expert). Expert e owns rows
    ``[offsets[e-1], offsets[e])`` (offsets[-1] = the padded total; the ``offs`` of
    ``torch._grouped_mm``), its count padded up to a multiple of ``align`` with zero rows. M = T*k
    when align == 1. Otherwise M is ``num_rows`` when given (at least the padded total, e.g. the
    static bound ``T*k + E*(align-1)``; rows past ``offsets[-1]`` are zero; no host read, and what
    torch.compile / FakeTensor need) or else the exact padded total (one host read; eager only).
    Differentiable in x.
    """
    op = "permute"
    _check_tensor(op, "x", x, 2, _FLOAT_DTYPES)
    _check_ids(op, "topk_ids", topk_ids, num_experts)
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: topk_ids has {topk_ids.shape[0]} rows, x has {x.shape[0]}")
    if align < 1:
        raise ValueError(f"{op}: align must be >= 1, got {align}")
    t, k = topk_ids.shape
    if num_rows is not None:
        check_int(op, "num_rows", num_rows)
        if num_rows < t * k:
            raise ValueError(f"{op}: num_rows={num_rows} is less than the T*k={t * k} routed rows")
    elif align > 1 and tracing(x, topk_ids):
        raise ValueError(f"{op}: with align={align} the padded row count depends on the ids; pass num_rows= (e.g. "
                         f"the bound T*k + E*(align-1) = {t * k + num_experts * (align - 1)}) to trace this op")
    be = resolve_backend(op, backend, x.device, supported=("torch", "triton", "cuda"))
    impl = _functions.backend_impl(be)
    with torch.no_grad():
        row_of_slot, _, _, total, ends = _functions.op(impl, "align")(topk_ids, num_experts, align)
    if num_rows is None:
        num_rows = t * k if align == 1 else int(total)  # the documented host read
    else:
        check_values(total[0] <= num_rows, f"{op}: num_rows={num_rows} is less than the padded total",
                     lambda: f"the padded total is {int(total)}")
    row_map = row_of_slot.view(t, k)
    return _functions.Permute.apply(x.contiguous(), row_map, num_rows, impl), row_map, ends


def unpermute_combine(
    y_perm: torch.Tensor, row_map: torch.Tensor, topk_weights: torch.Tensor | None, *, backend: str | None = None
) -> torch.Tensor:
    """Weighted sum of each token's k expert outputs: y[t] = sum_j w[t, j] * y_perm[row_map[t, j]].

    y_perm [M, D], row_map [T, k] (from :func:`permute`), topk_weights [T, k] float32 (bf16 / fp16
    are cast to float32; None: sum)
    -> y [T, D] in y_perm's dtype, summed in float32 in fixed j order (bitwise reproducible).
    Differentiable in y_perm and topk_weights.
    """
    op = "unpermute_combine"
    _check_tensor(op, "y_perm", y_perm, 2, _FLOAT_DTYPES)
    _check_ids(op, "row_map", row_map, max(y_perm.shape[0], 1))
    if topk_weights is not None:
        topk_weights = _weights_float32(op, topk_weights)
        if topk_weights.shape != row_map.shape:
            raise ValueError(
                f"{op}: topk_weights shape {tuple(topk_weights.shape)} != row_map shape {tuple(row_map.shape)}"
            )
    be = resolve_backend(op, backend, y_perm.device, supported=("torch", "triton"))
    return _functions.Combine.apply(y_perm.contiguous(), row_map, topk_weights, _functions.backend_impl(be))


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str = "swiglu",
    fp8_recipe=None,
    backend: str | None = None,
) -> torch.Tensor:
    """The routed experts of an MoE layer: x [T, D] -> y [T, D], differentiable in x, w13, w2 and
    topk_weights (float32; bf16 / fp16 are cast to float32, the combine's precision).

    permute -> grouped GEMM with w13 [E, 2I, D] -> SwiGLU -> grouped GEMM with w2 [E, D, I] ->
    weighted combine (float32, fixed order). ``backend`` picks the permute / SwiGLU / combine
    kernels; the GEMMs are :func:`primerl.kernels.gemm.grouped_gemm_nt` (bf16), or with
    ``fp8_recipe`` (``"blockwise"``, ``"blockwise_fp8_wgrad"`` or ``"rowwise"``, see :mod:`.fp8`) the
    FP8 grouped GEMMs with SwiGLU fused into the quantization (D and I multiples of 128).
    """
    op = "fused_experts"
    _check_tensor(op, "x", x, 2, _FLOAT_DTYPES)
    _check_tensor(op, "w13", w13, 3, _FLOAT_DTYPES)
    _check_tensor(op, "w2", w2, 3, _FLOAT_DTYPES)
    t, d = x.shape
    e, two_i, d13 = w13.shape
    if d13 != d or two_i % 2 != 0:
        raise ValueError(f"{op}: w13 must have shape (E, 2I, D={d}), got {tuple(w13.shape)}")
    if tuple(w2.shape) != (e, d, two_i // 2):
        raise ValueError(f"{op}: w2 must have shape ({e}, {d}, {two_i // 2}), got {tuple(w2.shape)}")
    if not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"{op}: x, w13, w2 dtypes differ: {x.dtype}, {w13.dtype}, {w2.dtype}")
    _check_ids(op, "topk_ids", topk_ids, e)
    if topk_ids.shape[0] != t:
        raise ValueError(f"{op}: topk_ids has {topk_ids.shape[0]} rows, x has {t}")
    topk_weights = _weights_float32(op, topk_weights)
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{op}: topk_weights shape {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if fp8_recipe is not None:
        from .fp8 import check_shapes, recipe_name

        recipe_name(fp8_recipe)
        check_shapes(op, d, two_i // 2)
    be = resolve_backend(op, backend, x.device, supported=("torch", "triton"))
    impl = _functions.backend_impl(be)
    return _functions.fused_experts(x.contiguous(), w13, w2, topk_ids, topk_weights, impl, fp8_recipe)
