"""Bad input gets a clear ValueError or TypeError whose message names the argument (docs/conventions.md).

Every case runs against every algorithm that takes the argument in question. Each case is paired with a control:
the same call with a *valid* value for the same keyword must succeed, so a test cannot pass because the function
rejects the keyword itself, or fails for an unrelated reason.
"""

from __future__ import annotations

import numpy as np
import pytest

import fa2edu
from fa2edu.memory import HBM

rng = np.random.default_rng(0)
B, H_q, H_kv, N_q, N_k, d = 2, 4, 2, 5, 7, 3


def base_call() -> dict:
    """A valid GQA problem, and valid saved tensors for the backward passes."""
    Q = rng.standard_normal((B, H_q, N_q, d))
    K = rng.standard_normal((B, H_kv, N_k, d))
    V = rng.standard_normal((B, H_kv, N_k, d))
    O, _ = fa2edu.attention_reference(Q, K, V)
    L = np.zeros((B, H_q, N_q))
    L[0, 0, 0] = np.inf                                        # +inf is legal in L (a fully masked row)
    return {"Q": Q, "K": K, "V": V, "O": O, "L": L, "dO": np.ones((B, H_q, N_q, d)), "kwargs": {},
            "l": np.ones((B, H_q, N_q)), "m": np.zeros((B, H_q, N_q)), "P": np.full((B, H_q, N_q, N_k), 1 / N_k)}


def forward(name):
    return lambda c: getattr(fa2edu, name)(c["Q"], c["K"], c["V"], **c["kwargs"])


def flash2_backward(c):
    return fa2edu.flash2_backward(c["Q"], c["K"], c["V"], c["O"], c["L"], c["dO"], **c["kwargs"])


def flash1_backward(c):
    return fa2edu.flash1_backward(c["Q"], c["K"], c["V"], c["O"], c["l"], c["m"], c["dO"], **c["kwargs"])


def standard_backward(c):
    return fa2edu.standard_attention_backward(c["Q"], c["K"], c["V"], c["P"], c["dO"], **c["kwargs"])


def reference_backward(c):
    return fa2edu.attention_reference_backward(c["Q"], c["K"], c["V"], c["dO"], **c["kwargs"])


# name: (call, features). Features: "tiled" takes M, block_sizes, hbm; "dropout" takes dropout_p, seed;
# "saved" checks O, L; "dO" checks dO; "redundant" is flash2_backward's redundant_loads.
FUNCTIONS = {
    "attention_reference": (forward("attention_reference"), {"dropout"}),
    "attention_reference_backward": (reference_backward, {"dropout", "dO"}),
    "standard_attention": (forward("standard_attention"), {"tiled", "dropout"}),
    "standard_attention_backward": (standard_backward, {"tiled", "dropout", "dO"}),
    "flash1_forward": (forward("flash1_forward"), {"tiled", "dropout"}),
    "flash1_backward": (flash1_backward, {"tiled", "dropout", "dO"}),
    "flash2_forward": (forward("flash2_forward"), {"tiled", "dropout"}),
    "flash2_backward": (flash2_backward, {"tiled", "dropout", "saved", "dO", "redundant"}),
}

GOOD_MASK = np.ones((N_q, N_k), dtype=bool)
VALID = {"scale": 0.5, "causal": True, "mask": GOOD_MASK, "M": 64, "block_sizes": (2, 3), "hbm": HBM(),
         "dropout_p": 0.1, "seed": 3, "redundant_loads": True}


def kw(**kwargs):
    """A case that only changes keyword arguments."""
    def mutate(c):
        c["kwargs"].update(kwargs)
    return mutate


def arg(name, change):
    """A case that replaces positional input ``name`` by ``change(old)``."""
    def mutate(c):
        c[name] = change(c[name])
    return mutate


def kv(change):
    """A case that changes K and V alike (their shared leading axes)."""
    def mutate(c):
        c["K"], c["V"] = change(c["K"]), change(c["V"])
    return mutate


def with_value(index, value):
    def change(x):
        x = x.copy()
        x[index] = value
        return x
    return change


# (id, feature needed or None, error message must match this regex, the change)
CASES = [
    # arrays: type, rank, sizes, dtypes, non-finite values
    ("Q is a list", None, r"^Q must be a numpy\.ndarray", arg("Q", lambda x: x.tolist())),
    ("K is a list", None, r"^K must be a numpy\.ndarray", arg("K", lambda x: x.tolist())),
    ("V is a scalar", None, r"^V must be a numpy\.ndarray", arg("V", lambda x: 1.0)),
    ("Q has rank 1", None, r"^Q must have shape", arg("Q", lambda x: x[0, 0, 0])),
    ("K has fewer axes", None, r"Q, K, V must have the same number of axes", arg("K", lambda x: x[0])),
    ("Q is empty", None, r"^Q must not be empty", arg("Q", lambda x: x[:, :, :0])),
    ("d of K differs", None, r"^K's head dimension", arg("K", lambda x: x[..., :2])),
    ("N of V differs", None, r"^V must have as many rows as K", arg("V", lambda x: x[..., :-1, :])),
    ("batch of K differs", None, r"Q and K must have the same batch axes", kv(lambda x: x[:1])),
    ("H_q not a multiple of H_kv", None, r"H_q = 4 must be a multiple of .* H_kv = 3",
     kv(lambda x: np.concatenate([x, x[:, :1]], axis=1))),
    ("K and V heads differ", None, r"K and V must have the same leading axes", arg("V", lambda x: x[:, :1])),
    ("Q is int", None, r"^Q must have a floating dtype", arg("Q", lambda x: x.astype(np.int64))),
    ("V is bool", None, r"^V must have a floating dtype", arg("V", lambda x: x > 0)),
    ("K is complex", None, r"^K must have a floating dtype", arg("K", lambda x: x.astype(np.complex128))),
    ("mixed dtypes", None, r"Q, K, V must share one dtype", arg("K", lambda x: x.astype(np.float32))),
    ("Q has NaN", None, r"^Q contains NaN", arg("Q", with_value((0, 0, 0, 0), np.nan))),
    ("K has inf", None, r"^K contains NaN or infinite", arg("K", with_value((1, 1, 2, 1), np.inf))),
    ("V has -inf", None, r"^V contains NaN or infinite", arg("V", with_value((0, 1, 0, 0), -np.inf))),
    # keywords every algorithm takes
    ("scale is a string", None, r"^scale must be a real number", kw(scale="0.5")),
    ("scale is NaN", None, r"^scale must be finite", kw(scale=float("nan"))),
    ("scale is inf", None, r"^scale must be finite", kw(scale=float("inf"))),
    ("scale is a bool", None, r"^scale must be a real number", kw(scale=True)),
    ("causal is a string", None, r"^causal must be a bool", kw(causal="yes")),
    ("mask has the wrong shape", None, r"^mask must have shape", kw(mask=np.ones((N_k, N_q), dtype=bool))),
    ("mask has a wrong leading axis", None, r"^mask axis 0", kw(mask=np.ones((3, 1, N_q, N_k), dtype=bool))),
    ("mask is float", None, r"^mask must have dtype bool", kw(mask=np.ones((N_q, N_k)))),
    ("mask is a list", None, r"^mask must be a numpy\.ndarray", kw(mask=GOOD_MASK.tolist())),
    # tiling
    ("M below 4d", "tiled", r"^M = 11 is too small for d = 3", kw(M=4 * d - 1)),
    ("M is a float", "tiled", r"^M \(SRAM size in elements\) must be an int", kw(M=64.0)),
    ("block size 0", "tiled", r"^block_sizes B_r must be at least 1", kw(block_sizes=(0, 2))),
    ("negative block size", "tiled", r"^block_sizes B_c must be at least 1", kw(block_sizes=(2, -1))),
    ("block size a float", "tiled", r"^block_sizes B_r must be an int", kw(block_sizes=(2.0, 2))),
    ("block_sizes not a pair", "tiled", r"^block_sizes must be a pair", kw(block_sizes=(2,))),
    ("block_sizes an int", "tiled", r"^block_sizes must be a pair", kw(block_sizes=4)),
    ("hbm of the wrong type", "tiled", r"^hbm must be a fa2edu\.memory\.HBM", kw(hbm={})),
    # dropout
    ("dropout_p is 1", "dropout", r"^dropout_p must lie in \[0, 1\)", kw(dropout_p=1.0)),
    ("dropout_p negative", "dropout", r"^dropout_p must lie in \[0, 1\)", kw(dropout_p=-0.5)),
    ("seed negative", "dropout", r"^seed must be a non-negative int", kw(seed=-1)),
    # the backward pass's saved tensors and upstream gradient
    ("dO has the wrong shape", "dO", r"^dO must have shape", arg("dO", lambda x: x[..., :-1])),
    ("dO has NaN", "dO", r"^dO contains NaN", arg("dO", with_value((0, 0, 0, 0), np.nan))),
    ("dO is a list", "dO", r"^dO must be a numpy\.ndarray", arg("dO", lambda x: x.tolist())),
    ("dO is int", "dO", r"^dO must have a floating dtype", arg("dO", lambda x: x.astype(np.int32))),
    ("dO has another dtype", "saved", r"^dO must have Q's dtype", arg("dO", lambda x: x.astype(np.float32))),
    ("O has the wrong shape", "saved", r"^O must have shape", arg("O", lambda x: x[:, :, :-1])),
    ("O has inf", "saved", r"^O contains NaN", arg("O", with_value((1, 0, 0, 0), np.inf))),
    ("O has another dtype", "saved", r"^O must have Q's dtype", arg("O", lambda x: x.astype(np.float16))),
    ("L has the wrong shape", "saved", r"^L must have shape", arg("L", lambda x: x[..., None])),
    ("L has NaN", "saved", r"^L contains NaN or -inf", arg("L", with_value((0, 1, 1), np.nan))),
    ("L has -inf", "saved", r"^L contains NaN or -inf", arg("L", with_value((0, 1, 1), -np.inf))),
    ("L is a list", "saved", r"^L must be a numpy\.ndarray", arg("L", lambda x: x.tolist())),
    ("redundant_loads not a bool", "redundant", r"^redundant_loads must be a bool", kw(redundant_loads="no")),
]


def applicable() -> list:
    """Every (function, case) pair whose function takes the case's argument. A list: parametrize wants a
    collection (a generator is deprecated)."""
    return [pytest.param(call, pattern, mutate, id=f"{fname}: {case_id}")
            for fname, (call, features) in FUNCTIONS.items()
            for case_id, feature, pattern, mutate in CASES
            if feature is None or feature in features]


@pytest.mark.parametrize("call, pattern, mutate", applicable())
def test_bad_input_raises_an_error_naming_the_argument(call, pattern, mutate):
    bad = base_call()
    mutate(bad)
    with pytest.raises((ValueError, TypeError), match=pattern):
        call(bad)
    # Control: the same keywords with valid values are accepted (positional changes: the base call itself).
    good = base_call()
    good["kwargs"] = {key: VALID[key] for key in bad["kwargs"]}
    call(good)


def test_errors_are_value_or_type_errors_not_assertions():
    """The SRAM overflow error is a ValueError too, so callers can catch bad block sizes with one except clause."""
    assert issubclass(fa2edu.SRAMOverflowError, ValueError)
    c = base_call()
    with pytest.raises(ValueError, match="block_sizes"):
        fa2edu.flash2_forward(c["Q"], c["K"], c["V"], M=4 * d, block_sizes=(N_q, N_k))
