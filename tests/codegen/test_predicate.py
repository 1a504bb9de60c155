"""Index predicates (codegen/predicate.py): text, words, tile expressions and, by brute force,
the interval reasoning behind the kernels' loop bounds."""

from __future__ import annotations

import random

import pytest
import torch

from fuser.codegen import predicate as P

WINDOW = ("and", ("atom", 1, -1, 0), ("atom", -1, 1, 1))  # i - C1 <= j <= i + C0
PREFIX_LM = ("or", ("atom", 1, -1, 0), ("atom", 0, -1, 1))  # j <= i + C0 or j <= C1


def _random_pred(rng: random.Random, n_atoms: int, n_consts: int = 3) -> tuple:
    """A random formula of ``n_atoms`` atoms (|a|, |b| <= 2) under random and/or nesting."""
    def atom():
        return ("atom", rng.randint(-2, 2), rng.randint(-2, 2), rng.randrange(n_consts))

    def build(n):
        if n == 1:
            return atom() if rng.random() > 0.03 else rng.choice([P.TRUE, P.FALSE])
        split = rng.randint(1, n - 1)
        op = rng.choice(["and", "or"])
        return (op, build(split), build(n - split))

    return build(n_atoms)


def _check_bounds(pred, consts, first, last, size):
    """Brute force: every true (i, j) of the block lies in [lo, hi); every key of [full_lo,
    full_hi) is true for every row; lo, full_lo >= 0, hi, full_hi <= size (lo >= hi: empty).
    Returns the four values."""
    env = {"i_first": first, "i_last": last, "N_K": size}
    env.update({f"PC{k}": c for k, c in enumerate(consts)})
    ns = P.eval_bounds(P.render_bounds(pred), env)
    lo, hi, full_lo, full_hi = ns["lo"], ns["hi"], ns["full_lo"], ns["full_hi"]
    assert 0 <= lo and 0 <= full_lo and hi <= size and full_hi <= size, (
        P.serialize(pred), consts, first, last, size, (lo, hi, full_lo, full_hi))
    for i in range(first, last + 1):
        for j in range(size):
            truth = P.evaluate(pred, i, j, consts)
            if truth:
                assert lo <= j < hi, (P.serialize(pred), consts, first, last, size, i, j, (lo, hi))
            if full_lo <= j < full_hi:
                assert truth, (P.serialize(pred), consts, first, last, size, i, j, (full_lo, full_hi))
    return lo, hi, full_lo, full_hi


def test_bounds_brute_force_random_formulas():
    rng = random.Random(1234)
    for n in range(3000):
        pred = _random_pred(rng, rng.randint(1, 4))
        consts = [rng.randint(-12, 12) for _ in range(3)]
        size = rng.randint(1, 20)
        first = rng.randint(0, 20)
        last = first + rng.randint(0, 6)
        _check_bounds(pred, consts, first, last, size)


def test_bounds_single_atoms_are_tight():
    # one atom with b != 0: the hull is exactly the keys some row keeps, the full range exactly
    # the keys every row keeps (so the kernels skip what they can)
    for a in range(-2, 3):
        for b in (-2, -1, 1, 2):
            for c in range(-9, 10):
                for first, last in ((0, 0), (3, 7), (5, 6)):
                    pred = ("atom", a, b, 0)
                    lo, hi, full_lo, full_hi = _check_bounds(pred, [c], first, last, 16)
                    some = [j for j in range(16) if any(P.evaluate(pred, i, j, [c]) for i in range(first, last + 1))]
                    every = [j for j in range(16) if all(P.evaluate(pred, i, j, [c]) for i in range(first, last + 1))]
                    if some:
                        assert (lo, hi) == (min(some), max(some) + 1)
                    else:
                        assert lo >= hi
                    if every:
                        assert (full_lo, full_hi) == (min(every), max(every) + 1)
                    else:
                        assert full_lo >= full_hi


@pytest.mark.parametrize("w", [1, 3, 16, 100])
def test_bounds_sliding_window_and_prefix_lm(w):
    # the sliding window (i - w < j <= i) and prefix-LM (j <= i or j < p) bounds are exact
    for first in range(0, 40, 8):
        last = first + 7
        lo, hi, full_lo, full_hi = _check_bounds(WINDOW, [0, w - 1], first, last, 40)
        assert (lo, hi) == (max(first - w + 1, 0), min(last + 1, 40))
        assert (full_lo, full_hi) == (max(last - w + 1, 0), min(first + 1, 40)) or full_lo >= full_hi
        lo, hi, full_lo, full_hi = _check_bounds(PREFIX_LM, [0, w - 1], first, last, 40)
        assert (lo, hi) == (0, min(max(last + 1, w), 40))
        assert (full_lo, full_hi) == (0, min(max(first + 1, w), 40))


def test_bounds_of_swapped_roles():
    # the dK/dV kernels' query range for a block of keys: the same reasoning on swap(pred)
    rng = random.Random(99)
    for _ in range(1500):
        pred = _random_pred(rng, rng.randint(1, 4))
        consts = [rng.randint(-12, 12) for _ in range(3)]
        n_q = rng.randint(1, 20)
        first = rng.randint(0, 20)
        last = first + rng.randint(0, 6)
        lines = P.render_bounds(P.swap(pred), first="n_first", last="n_last", size="N_Q", tmp="_q",
                                names=("q_lo", "q_hi", "q_full_lo", "q_full_hi"))
        env = {"n_first": first, "n_last": last, "N_Q": n_q, **{f"PC{k}": c for k, c in enumerate(consts)}}
        ns = P.eval_bounds(lines, env)
        for j in range(first, last + 1):
            for i in range(n_q):
                truth = P.evaluate(pred, i, j, consts)
                if truth:
                    assert ns["q_lo"] <= i < ns["q_hi"]
                if ns["q_full_lo"] <= i < ns["q_full_hi"]:
                    assert truth


def test_floordiv_helper_on_negative_values():
    # eval_bounds emulates Triton's truncating // and the helper's correction: exact floor
    ns = P.eval_bounds(["r = [_floordiv(x, d) for x in range(-20, 21) for d in (1, 2, 3)]"], {})
    assert ns["r"] == [x // d for x in range(-20, 21) for d in (1, 2, 3)]
    assert "q * d > x" in P.FLOORDIV_HELPER
    assert P.needs_floordiv(("atom", 2, -1, 0)) and not P.needs_floordiv(WINDOW)
    assert any("_floordiv" in line for line in P.render_bounds(("atom", 1, -2, 0)))
    assert not any("_floordiv" in line for line in P.render_bounds(WINDOW))


def test_mutated_bounds_are_caught():
    # the brute-force check catches a too-small hull or a too-large full range
    env = {"i_first": 8, "i_last": 9, "N_K": 40, "PC0": 0, "PC1": 7}  # full range [2, 9)
    for name, delta in (("hi", -1), ("lo", 1), ("full_hi", 1), ("full_lo", -1)):
        lines = P.render_bounds(WINDOW) + [f"{name} = {name} + ({delta})"]
        ns = P.eval_bounds(lines, env)
        bad = False
        for i in range(8, 10):
            for j in range(40):
                t = P.evaluate(WINDOW, i, j, [0, 7])
                bad |= t and not ns["lo"] <= j < ns["hi"]
                bad |= ns["full_lo"] <= j < ns["full_hi"] and not t
        assert bad, name


# --- text, words, tile expressions -----------------------------------------------------------


def test_serialize_parse_round_trip():
    rng = random.Random(7)
    for _ in range(300):
        pred = _random_pred(rng, rng.randint(1, 5), n_consts=12)
        text = P.serialize(pred)
        assert " " not in text and P.parse(text) == pred and P.serialize(P.parse(text)) == text
    assert P.serialize(WINDOW) == "and(ge(1,-1,0),ge(-1,1,1))"
    assert P.parse(" and( ge(1, -1, 0), ge(-1,1,1) ) ") == WINDOW
    assert P.parse("true") == P.TRUE and P.parse("false") == P.FALSE
    assert P.validate([["atom", 1, 2, 0]][0]) == ("atom", 1, 2, 0)  # JSON lists accepted


@pytest.mark.parametrize("text", ["", "ge(1,2)", "ge(1,2,3", "and()", "not(ge(1,1,0))", "ge(1,2,3)x", "ge(1,2,-1)",
                                  "or(ge(1,1,0),)", "ge(a,1,0)"])
def test_parse_rejects_malformed_text(text):
    with pytest.raises(ValueError):
        P.parse(text)


def test_validate_rejects_bad_tuples():
    for bad in (("atom", 1, 2), ("atom", 1.0, 2, 0), ("atom", True, 2, 0), ("not", ("true",)), ("and",), (), "true"):
        with pytest.raises(ValueError):
            P.validate(bad)


def test_simplify_and_consts():
    assert P.simplify(("and", P.TRUE, ("atom", 1, -1, 0))) == ("atom", 1, -1, 0)
    assert P.simplify(("or", P.TRUE, ("atom", 1, -1, 0))) == P.TRUE
    assert P.simplify(("and", P.FALSE, ("atom", 1, -1, 3))) == P.FALSE
    assert P.simplify(("and", ("and", ("atom", 1, 0, 0), ("atom", 0, 1, 1)), ("atom", 1, 1, 2))) == (
        "and", ("atom", 1, 0, 0), ("atom", 0, 1, 1), ("atom", 1, 1, 2))
    assert P.n_consts(WINDOW) == 2 and P.n_consts(P.TRUE) == 0
    assert P.swap(WINDOW) == ("and", ("atom", -1, 1, 0), ("atom", 1, -1, 1))
    assert len(P.digest(WINDOW)) == 8 and P.digest(WINDOW) != P.digest(PREFIX_LM)


def test_describe_in_words():
    assert P.describe(WINDOW) == "j <= i + PC0 and j >= i - PC1"
    assert P.describe(PREFIX_LM) == "j <= i + PC0 or j <= PC1"
    assert P.describe(("and", ("atom", 2, -1, 0), ("or", ("atom", 0, 2, 1), ("atom", -1, 0, 0)))) == (
        "j <= 2 * i + PC0 and (2 * j >= -PC1 or i <= PC0)")
    assert P.describe(("atom", 0, 0, 0)) == "PC0 >= 0"


def test_elementwise_matches_evaluate():
    rng = random.Random(5)
    i = torch.arange(-3, 25)[:, None]
    j = torch.arange(0, 30)[None, :]
    for _ in range(300):
        pred = _random_pred(rng, rng.randint(1, 4))
        consts = [rng.randint(-12, 12) for _ in range(3)]
        expr = P.render_elementwise(pred, i="I", j="J")
        got = eval(expr, {"I": i, "J": j, **{f"PC{k}": c for k, c in enumerate(consts)}})  # noqa: S307
        want = torch.tensor([[bool(P.evaluate(pred, int(a), int(b), consts)) for b in j[0]] for a in i[:, 0]])
        assert torch.equal(torch.as_tensor(got).expand_as(want), want), expr
    assert P.render_elementwise(WINDOW) == (
        "((offs_n[None, :] <= offs_m[:, None] + PC0) & (offs_n[None, :] >= offs_m[:, None] - PC1))")
