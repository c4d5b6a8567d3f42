"""The four slice types, parsed from any of the forms users and kernels write them in.

Inside one slice with `sq` query rows and `sk` keys, local row `i` sees local key `j` when::

    FULL        all pairs             CAUSAL (bottom-right)   INV_CAUSAL (top-left)   BI_CAUSAL (both)
    sq=3, sk=5: 1 1 1 1 1             1 1 1 0 0               1 1 1 1 1               1 1 1 0 0
                1 1 1 1 1             1 1 1 1 0               0 1 1 1 1               0 1 1 1 0
                1 1 1 1 1             1 1 1 1 1               0 0 1 1 1               0 0 1 1 1

CAUSAL keeps `j <= i + sk - sq`, INV_CAUSAL keeps `j >= i`, BI_CAUSAL keeps both. As int codes (what the
kernels and range tensors carry) bit 1 is the causal bound and bit 2 the inverse-causal one.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any

__all__ = ["BI_CAUSAL", "CAUSAL", "FULL", "INV_CAUSAL", "AttnMaskType", "normalize_types"]

FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3
CAUSAL_BIT, INV_CAUSAL_BIT = 1, 2

_VALID = "full, causal, inv_causal, bi_causal (or an int code 0-3)"


class AttnMaskType(StrEnum):
    """The four slice types. `.code` is the int the kernels take (FULL=0, CAUSAL=1, INV_CAUSAL=2, BI_CAUSAL=3).

    `AttnMaskType(x)` and `AttnMaskType.from_any(x)` accept a member, its value or name in any case
    ("causal", "CAUSAL", "inv-causal", "invcausal") or its int code (any int-like but bool).
    """

    FULL = "full"
    CAUSAL = "causal"
    INV_CAUSAL = "inv_causal"
    BI_CAUSAL = "bi_causal"
    # MagiAttention's spellings: aliases of the same members
    INVCAUSAL = "inv_causal"
    BICAUSAL = "bi_causal"

    @property
    def code(self) -> int:
        return _CODES[self]

    @property
    def is_causal(self) -> bool:
        """The causal (upper) diagonal bound applies: CAUSAL or BI_CAUSAL."""
        return bool(_CODES[self] & CAUSAL_BIT)

    @property
    def is_inv_causal(self) -> bool:
        """The inverse-causal (lower) diagonal bound applies: INV_CAUSAL or BI_CAUSAL."""
        return bool(_CODES[self] & INV_CAUSAL_BIT)

    def to_int_type(self) -> int:
        return _CODES[self]

    def __int__(self) -> int:
        return _CODES[self]

    @classmethod
    def _missing_(cls, value: object) -> AttnMaskType | None:
        try:
            return cls.from_any(value)
        except (TypeError, ValueError):
            return None

    @classmethod
    def from_any(cls, value: Any, name: str = "attn_mask_type") -> AttnMaskType:
        """Parse `value` (member, name/value in any case, int code 0-3); `name` is the argument in errors."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            t = _BY_NAME.get(value.strip().lower().replace("-", "_"))
            if t is None:
                raise ValueError(f"`{name}`: unknown mask type {value!r}; valid: {_VALID}")
            return t
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError(
                f"`{name}` must be an AttnMaskType, a name or an int code 0-3, got "
                f"{type(value).__name__} {value!r}"
            )
        code = int(value.__index__())
        if not 0 <= code <= 3:
            raise ValueError(
                f"`{name}` int code must be 0 (full), 1 (causal), 2 (inv_causal) or 3 (bi_causal), got {code}"
            )
        return _BY_CODE[code]

    @classmethod
    def from_code(cls, code: int) -> AttnMaskType:
        return cls.from_any(code)


_CODES = {AttnMaskType.FULL: 0, AttnMaskType.CAUSAL: 1, AttnMaskType.INV_CAUSAL: 2, AttnMaskType.BI_CAUSAL: 3}
_BY_CODE = {v: k for k, v in _CODES.items()}
_BY_NAME = {t.value: t for t in AttnMaskType} | {
    "invcausal": AttnMaskType.INV_CAUSAL,
    "bicausal": AttnMaskType.BI_CAUSAL,
}


def normalize_types(attn_mask_type: Any, num_slices: int, name: str = "attn_mask_type") -> list[int]:
    """One int code per slice. A single type (a member, a name, an int) applies to every slice; a sequence
    (list, tuple, or anything with `.tolist()` such as a numpy array or a CPU tensor) gives one per slice."""
    if hasattr(attn_mask_type, "tolist") and not isinstance(attn_mask_type, (str, AttnMaskType)):
        attn_mask_type = attn_mask_type.tolist()  # numpy / torch: a scalar comes back as an int
    if isinstance(attn_mask_type, Sequence) and not isinstance(attn_mask_type, str):
        if len(attn_mask_type) != num_slices:
            raise ValueError(
                f"`{name}` has {len(attn_mask_type)} entries but there are {num_slices} slices; "
                "give one per slice or a single type for all"
            )
        return [AttnMaskType.from_any(t, f"{name}[{i}]").code for i, t in enumerate(attn_mask_type)]
    return [AttnMaskType.from_any(attn_mask_type, name).code] * num_slices
