"""Data masks that hide everything above the diagonal: the run-time proof
(``codegen/attention.py`` ``mask_tiles_skippable``, the mask-rows kernel) and the kernels' tile
skipping it enables, against the float64 reference.

A model that builds its causal mask outside the compiled code (a transformer block compiled on
its own, as under FSDP2; a DDP graph piece) hands the attention a plain tensor mask: the kernels
cannot know it is causal, so the launcher checks the mask's values at run time and the kernels
skip the key tiles past each block's diagonal only when every entry there adds exactly 0
(``MASK_SKIP_ABOVE``), and do not read the mask on the tiles below the diagonal only when it
leaves every entry there as it is (``MASK_FREE_BELOW``).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_attention_kernels import _check, _qkv, check_forced_skip

from fuser.codegen import attention, variants
from fuser.patterns.attention import reference

F32_MIN = torch.finfo(torch.float32).min
NEG_INF = -math.inf
ABOVE, FREE = attention.MASK_SKIP_ABOVE, attention.MASK_FREE_BELOW
BOTH = ABOVE | FREE


def _causal(n_q: int, n_k: int, offset: int = 0) -> torch.Tensor:
    """[Nq, Nk] bool: key j visible to query i iff j <= i + offset."""
    return torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + offset


def _hf_mask(b: int, n_q: int, n_k: int, fill: float = F32_MIN, pad=None) -> torch.Tensor:
    """transformers' eager causal mask: [B, 1, Nq, Nk] float, 0 where visible, ``fill`` elsewhere
    (bottom-right causal); ``pad``: per batch the number of key positions hidden at the right."""
    keep = _causal(n_q, n_k, n_k - n_q).expand(b, 1, n_q, n_k).clone()
    if pad is not None:
        for i, p in enumerate(pad):
            if p:
                keep[i, :, :, n_k - p:] = False
    return torch.zeros(b, 1, n_q, n_k).masked_fill(~keep, fill)


def _flag(q, k, mask, kind="additive", scale=0.25, fill=NEG_INF) -> int:
    b, hq, n_q, _ = q.shape
    mask4, _ = variants.expand_mask(mask, kind, (b, hq, n_q, k.shape[2]))
    return int(attention.mask_tiles_skippable(q, k, mask4, scale=scale, mask_kind=kind, mask_fill=fill,
                                              offset=attention.mask_skip_offset(n_q, k.shape[2])))


def test_the_proof_accepts_masks_that_hide_the_upper_triangle():
    """A causal mask as data: both bits (the kernels then do what causal attention does); a mask
    that also hides entries below the diagonal (padding, a top-left mask under the bottom-right
    test): the upper triangle's bit alone."""
    q, k, _ = _qkv(1, 2, 2, 2, 40, 40, 16, 16)
    assert _flag(q, k, _hf_mask(2, 40, 40)) == BOTH
    assert _flag(q, k, _hf_mask(2, 40, 40, fill=NEG_INF)) == BOTH
    assert _flag(q, k, _hf_mask(2, 40, 40, pad=[0, 7])) == ABOVE  # right padding: every row keeps key 0
    # bottom-right alignment with a KV cache (Nk > Nq), and a top-left mask hides more: both pass
    q5 = q[:, :, :5]
    assert _flag(q5, k, _hf_mask(2, 5, 40)) == BOTH
    assert _flag(q5, k, torch.zeros(1, 1, 5, 40).masked_fill(~_causal(5, 40), F32_MIN)) == ABOVE
    # per-head masks, and a mask broadcast over batch and heads ([Nq, Nk])
    assert _flag(q, k, _hf_mask(2, 40, 40).expand(2, 2, 40, 40).contiguous()) == BOTH
    assert _flag(q, k, _hf_mask(1, 40, 40)[0, 0]) == BOTH
    # boolean masks: -inf hidden, and a finite fill (masked_fill(~keep, finfo.min))
    keep = _causal(40, 40)
    assert _flag(q, k, keep, "bool_keep") == BOTH and _flag(q, k, ~keep, "bool_drop") == BOTH
    assert _flag(q, k, keep, "bool_keep", fill=F32_MIN) == BOTH


def test_the_mask_is_free_below_the_diagonal_only_where_it_changes_nothing():
    """MASK_FREE_BELOW needs every entry on and below the diagonal to leave its score as it is:
    an additive ±0, a boolean keep; anything else there (a bias, NaN, a hidden key) clears it,
    whatever the upper triangle holds. It needs no bound on the scores."""
    q, k, _ = _qkv(3, 2, 2, 2, 40, 40, 16, 16)
    mask = _hf_mask(2, 40, 40)

    def poked(value, i=30, j=3, m=mask):
        m = m.clone()
        m[1, 0, i, j] = value
        return m

    assert _flag(q, k, poked(-0.0)) == BOTH  # s + (-0.0) is s
    for value in (-1e-30, 1e-30, -1.0, F32_MIN, NEG_INF, float("nan"), float("inf")):
        assert _flag(q, k, poked(value)) & FREE == 0, value
    assert _flag(q, k, poked(-1.0, i=30, j=30)) & FREE == 0  # on the diagonal itself
    assert _flag(q, k, poked(0.0, i=3, j=30)) == FREE  # the upper triangle visible: the lower still free
    assert _flag(q, k, mask, scale=1e37) == FREE  # huge scores: no skip above, the lower part still free
    keep = _causal(40, 40).clone()
    keep[30, 3] = False
    assert _flag(q, k, keep, "bool_keep") == ABOVE and _flag(q, k, ~keep, "bool_drop") == ABOVE


def test_the_proof_refuses_whatever_could_change_a_row():
    q, k, _ = _qkv(2, 2, 2, 2, 40, 40, 16, 16)
    mask = _hf_mask(2, 40, 40)

    def poked(value, i=3, j=30):
        m = mask.clone()
        m[1, 0, i, j] = value
        return m

    def above(m, *args, q=q, **kw) -> int:  # the upper triangle's bit alone
        return _flag(q, k, m, *args, **kw) & ABOVE

    assert above(poked(0.0)) == 0  # a visible key above the diagonal
    assert above(poked(-50.0)) == 0  # a moderate bias: it still weighs
    assert above(poked(float("nan"))) == 0  # eager's row is NaN: never skipped away
    assert above(poked(float("inf"))) == 0
    assert above(poked(-1e30)) == ABOVE  # far below every score: adds exactly 0
    # left padding: the first rows see no key at or below the diagonal; eager spreads them over
    # every key (all scores equal finfo.min), which skipping the upper triangle would change
    left = mask.clone()
    left[0, :, :, :4] = F32_MIN
    assert _flag(q, k, left) == 0
    # ...unless the fill is -inf (such rows are empty both ways)
    left_inf = _hf_mask(2, 40, 40, fill=NEG_INF)
    left_inf[0, :, :, :4] = NEG_INF
    assert _flag(q, k, left_inf) == ABOVE
    # huge scores swamp finfo.min; non-finite norms prove nothing
    assert above(mask, scale=1e37) == 0
    bad = q.clone()
    bad[0, 1, 5, 2] = float("inf")
    assert above(mask, q=bad) == 0
    # a boolean mask with a finite fill and a row with nothing visible: eager spreads it over the fill
    keep = _causal(40, 40).clone()
    keep[7, :] = False
    assert above(keep, "bool_keep", fill=F32_MIN) == 0
    assert above(keep, "bool_keep") == ABOVE  # -inf hides: the row is empty either way
    # a small finite fill of a boolean mask keeps the hidden keys in play
    assert above(_causal(40, 40), "bool_keep", fill=-3.0) == 0
    # the bound's edge: a bias just beyond 2 S + 200 (base 2) below the visible entries passes
    s_max = 0.25 * q.norm(dim=-1).max().item() * k.norm(dim=-1).max().item()
    edge = -(2 * s_max + attention.SKIP_MARGIN_BASE2 / attention.LOG2E)
    assert above(_hf_mask(2, 40, 40, fill=edge * 1.01)) == ABOVE
    assert above(_hf_mask(2, 40, 40, fill=edge * 0.99)) == 0


CASES = [
    # name, b, hq, hkv, n_q, n_k, d, mask builder, kind, fill, the flag's bits
    ("hf_causal", 2, 2, 2, 70, 70, 16, lambda b, nq, nk: _hf_mask(b, nq, nk), "additive", NEG_INF, BOTH),
    ("hf_causal_padded_gqa", 2, 4, 2, 53, 53, 24, lambda b, nq, nk: _hf_mask(b, nq, nk, pad=[0, 9]), "additive",
     NEG_INF, ABOVE),
    ("kv_cache_bottom_right", 1, 2, 1, 19, 77, 16, lambda b, nq, nk: _hf_mask(b, nq, nk), "additive", NEG_INF,
     BOTH),
    ("bool_keep", 2, 2, 2, 45, 45, 16, lambda b, nq, nk: _causal(nq, nk), "bool_keep", NEG_INF, BOTH),
    ("bool_drop_finite_fill", 1, 2, 2, 45, 45, 16, lambda b, nq, nk: ~_causal(nq, nk), "bool_drop", F32_MIN, BOTH),
    ("left_padded_not_skipped", 2, 2, 2, 40, 40, 16,
     lambda b, nq, nk: torch.cat([_hf_mask(1, nq, nk), _hf_mask(1, nq, nk).index_fill(3, torch.arange(5), F32_MIN)]),
     "additive", NEG_INF, 0),
    ("visible_upper_free_lower", 1, 2, 2, 50, 50, 16,
     lambda b, nq, nk: _hf_mask(b, nq, nk).index_fill(3, torch.tensor([47]), 0.0), "additive", NEG_INF, FREE),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_masked_kernels_equal_the_reference(case):
    """Forward and both backwards with the launcher's own proof (skipping where it holds, not
    where it does not), against float64, outputs poisoned; ragged sizes."""
    name, b, hq, hkv, n_q, n_k, d, build, kind, fill, want = case
    q, k, v = _qkv(sum(map(ord, name)) % 1000, b, hq, hkv, n_q, n_k, d, d)
    mask = build(b, n_q, n_k)
    assert _flag(q, k, mask, kind, scale=d ** -0.5, fill=fill) == want
    _check(q, k, v, mask=mask, mask_kind=kind, mask_fill=fill)


def test_fp16_hf_mask():
    q, k, v = _qkv(9, 1, 2, 2, 64, 64, 32, 32, dtype=torch.float16)
    _check(q, k, v, mask=_hf_mask(1, 64, 64).half(), mask_kind="additive")


def test_the_flag_decides_what_the_kernels_skip(monkeypatch):
    """A mask whose upper triangle is hidden except a few "ghost" entries far above it (rows 0-15,
    the last 8 keys): the proof refuses, so the ghosts count. Forced to 1, the kernels (16x16
    tiles) skip every key tile past a block's last diagonal: the ghosts drop out of the forward,
    the dQ and the dK/dV kernels alike, and the result is the causal mask's."""
    n, blk = 96, 16
    q, k, v = _qkv(11, 1, 2, 2, n, n, 16, 16)
    causal = torch.zeros(n, n).masked_fill(~_causal(n, n), F32_MIN)
    ghosts = causal.clone()
    ghosts[:16, n - 8:] = 0.0
    fwd_cfg = {"BLOCK_M": blk, "BLOCK_N": blk, "num_warps": 4, "num_stages": 1}
    bwd_cfg = {"BLOCK_M1": blk, "BLOCK_N1": blk, "BLOCK_M2": blk, "BLOCK_N2": blk, "PRE_BLOCK_M": blk,
               "num_warps": 4, "num_stages": 1}
    assert _flag(q, k, ghosts, scale=0.5) == FREE  # refused above; nothing changed below
    _check(q, k, v, mask=ghosts, mask_kind="additive", scale=0.5, config=fwd_cfg, bwd_config=bwd_cfg)

    calls = []

    def always(q, k, mask, **_):
        calls.append(1)
        return torch.ones((), dtype=torch.int32, device=q.device)

    monkeypatch.setattr(attention, "mask_tiles_skippable", always)
    kw = dict(scale=0.5, mask=ghosts, mask_kind="additive")

    def expected(q, k, v):  # float64: the causal mask's attention (the ghosts' tiles skipped)
        return reference(q, k, v, scale=0.5, mask=causal.double(), mask_kind="additive")[0]

    check_forced_skip(q, k, v, kw, fwd_cfg, bwd_cfg, expected, calls)


def test_the_free_bit_decides_where_the_kernels_read_the_mask(monkeypatch):
    """A causal mask with biases below the diagonal: one on a tile strictly below the diagonal
    (query tile 2, key tile 0 of 16x16 tiles), one on a diagonal tile (tile 2, 2). The proof
    clears MASK_FREE_BELOW, so both count. Forced on, the forward, the dQ and the dK/dV kernels
    alike leave the mask unread on the tiles entirely below the diagonal: the first bias drops
    out, the second stays — the tiles the kernels spare are exactly those."""
    n, blk = 80, 16
    q, k, v = _qkv(13, 1, 2, 2, n, n, 16, 16)
    causal = torch.zeros(n, n).masked_fill(~_causal(n, n), F32_MIN)
    biased = causal.clone()
    biased[40, 5] = 3.0  # tile (2, 0): strictly below the diagonal
    biased[41, 35] = 3.0  # tile (2, 2): on the diagonal, below it within the tile
    seen = causal.clone()
    seen[41, 35] = 3.0
    fwd_cfg = {"BLOCK_M": blk, "BLOCK_N": blk, "num_warps": 4, "num_stages": 1}
    bwd_cfg = {"BLOCK_M1": blk, "BLOCK_N1": blk, "BLOCK_M2": blk, "BLOCK_N2": blk, "PRE_BLOCK_M": blk,
               "num_warps": 4, "num_stages": 1}
    assert _flag(q, k, biased, scale=0.5) == ABOVE
    _check(q, k, v, mask=biased, mask_kind="additive", scale=0.5, config=fwd_cfg, bwd_config=bwd_cfg)

    calls = []

    def forced(q, k, mask, **_):
        calls.append(1)
        return torch.full((), BOTH, dtype=torch.int32, device=q.device)

    monkeypatch.setattr(attention, "mask_tiles_skippable", forced)
    kw = dict(scale=0.5, mask=biased, mask_kind="additive")

    def expected(q, k, v):  # float64: only the diagonal tile's bias is seen
        return reference(q, k, v, scale=0.5, mask=seen.double(), mask_kind="additive")[0]

    check_forced_skip(q, k, v, kw, fwd_cfg, bwd_cfg, expected, calls)


def test_which_variants_skip_and_what_explain_lists():
    assert attention.mask_skips("none", "additive", False, None)
    assert not attention.mask_skips("none", "additive", True, None)  # one row broadcast: key padding only
    assert not attention.mask_skips("top_left", "additive", False, None)  # causal: static bounds already
    assert not attention.mask_skips("none", "none", False, None)
    window = ("atom", 1, -1, 0)  # i - j >= 0: a predicate of the pattern's own (static bounds)
    assert not attention.mask_skips("none", "bool_keep", False, window)
    kernels = attention.kernels_for(causal="none", mask_kind="additive", mask_row_broadcast=False,
                                    bwd_mode="two_kernel", interpret=True, need_lse=True, training=True)
    names = [kn.name for kn in kernels]
    assert any(nm.startswith("attention_mask_rows_maskadd") for nm in names), names
    rows = next(kn for kn in kernels if kn.name.startswith("attention_mask_rows"))
    assert "def attention_mask_rows_kernel" in rows.source
    fwd = next(kn for kn in kernels if kn.name.startswith("attention_fwd"))
    assert "SkipHidden" in fwd.source and "mask_tiles_skippable" in fwd.source
    plain = attention.kernels_for(causal="none", mask_kind="additive", mask_row_broadcast=True,
                                  bwd_mode="two_kernel", interpret=True, need_lse=True, training=False)
    assert not any(kn.name.startswith("attention_mask_rows") for kn in plain)
    with pytest.raises(ValueError, match="mask_kind"):
        attention.mask_rows_kernel(mask_kind="none", interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pad", [None, [0, 300]], ids=["causal", "right_padded"])
def test_gpu_hf_mask_skips_and_matches_the_reference(dtype, pad):
    """transformers' causal mask as a bf16/fp16 tensor at a real size (ragged N): the proof holds
    on the GPU, and the forward and both backwards equal float64 (as close as SDPA on the causal
    case is)."""
    dev = torch.device("cuda")
    b, h, n, d = 2, 4, 1000, 128
    q, k, v = _qkv(31, b, h, h, n, n, d, d, dtype=dtype, device=dev)
    mask = _hf_mask(b, n, n, fill=torch.finfo(dtype).min, pad=pad).to(dev, dtype)
    assert _flag(q, k, mask, scale=d ** -0.5) == (ABOVE if pad else BOTH)
    _check(q, k, v, mask=mask, mask_kind="additive", tol=2e-2)
