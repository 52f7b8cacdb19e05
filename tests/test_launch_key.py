"""The launch cache's key: it must change exactly when Triton would specialize differently
(a dtype, a pointer's 16-byte alignment, an integer equal to 1, divisible by 16 or beyond 32
bits), else a cached launch would run a kernel compiled for other arguments."""

from types import SimpleNamespace

import pytest
import torch

from fusedmaxsim._launch.runtime import _CachedLauncher


def _launcher(n_args: int, unspecialized=()) -> _CachedLauncher:
    params = [SimpleNamespace(name=f"a{i}", do_not_specialize=i in unspecialized, is_constexpr=False)
              for i in range(n_args)]
    launcher = _CachedLauncher(SimpleNamespace(params=params))
    launcher.unspecialized = frozenset(unspecialized)  # set even where the interpreter disables it
    return launcher


def _rule(a, unspecialized: bool):
    """What Triton specializes on, one argument at a time (the specification of the key)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    fits = -(2**31) <= a < 2**31
    return fits if unspecialized else (a == 1, a % 16 == 0, fits)


BASE = torch.zeros(64, dtype=torch.float32)


@pytest.mark.parametrize("value", [0, 1, 2, 15, 16, 17, 32, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**40])
def test_key_follows_the_specialization_rule_for_integers(value):
    launcher = _launcher(3, unspecialized=(2,))
    args = (BASE, value, value)
    _, key = launcher._key(args)
    assert key == (*_rule(BASE, False), *_rule(value, False), _rule(value, True))


def test_key_separates_dtypes_alignment_and_integer_classes():
    launcher = _launcher(4, unspecialized=(3,))
    aligned, misaligned = BASE[4:], BASE[1:]  # 16 and 4 bytes past a 16-byte aligned start
    assert aligned.data_ptr() % 16 == 0 and misaligned.data_ptr() % 16 != 0
    variants = [
        (aligned, aligned, 32, 7),
        (misaligned, aligned, 32, 7),
        (aligned.half(), aligned, 32, 7),
        (aligned, aligned, 1, 7),
        (aligned, aligned, 33, 7),
        (aligned, aligned, 2**33, 7),
        (aligned, aligned, 32, 2**33),
    ]
    keys = [launcher._key(v) for v in variants]
    assert len(set(keys)) == len(keys)
    # Same classes, other values: the same key (no recompilation, the cached launch is reused).
    assert launcher._key((aligned, BASE[8:], 48, 9)) == keys[0]


def test_key_tells_argument_types_apart():
    launcher = _launcher(2)
    assert launcher._key((BASE, 16)) != launcher._key((BASE, 16.0))
    assert launcher._key((BASE, 1)) != launcher._key((BASE, True))
