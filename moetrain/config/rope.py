"""Rope scaling: how the released long-context checkpoints stretch their rotary frequencies
(``model.rope_scaling``). moetrain implements the types of transformers' ``rope_parameters`` that
the families it converts use: "linear" (Code Llama style position interpolation), "llama3"
(Llama 3.1: long wavelengths interpolated, short ones kept, a smooth band between), "yarn"
(DeepSeek-V3, Kimi-K2, Qwen long-context: a ramp between interpolated and original frequencies
over the feature pairs, with an attention temperature) and "dynamic" (NTK: the base grows with the
length of the sequence once it passes the original context). The frequencies themselves are computed
in ``moetrain.models.attention``; this module holds the fields, their rules and the two scalars
attention needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from moetrain.config._checks import require_bool, require_int
from moetrain.config.base import require, require_active, require_choice

ROPE_TYPES = ("linear", "llama3", "yarn", "dynamic")
"""Rope scaling types moetrain implements (transformers' ``rope_type`` names)."""

_ONLY = {"original_max_seq_len": ("llama3", "yarn", "dynamic"), "low_freq_factor": ("llama3",),
         "high_freq_factor": ("llama3",), "beta_fast": ("yarn",), "beta_slow": ("yarn",), "mscale": ("yarn",),
         "mscale_all_dim": ("yarn",), "attention_factor": ("yarn",)}
"""Optional fields and the types that read them; every other type requires them None."""

_REQUIRED = {"llama3": ("original_max_seq_len", "low_freq_factor", "high_freq_factor"),
             "yarn": ("original_max_seq_len",), "dynamic": ("original_max_seq_len",)}


@dataclass(frozen=True)
class RopeScaling:
    """One rope scaling (``model.rope_scaling``), e.g. DeepSeek-V3's ``{rope_type: yarn, factor: 40,
    original_max_seq_len: 4096, beta_fast: 32, beta_slow: 1, mscale: 1.0, mscale_all_dim: 1.0}``."""

    rope_type: str = ""
    """"linear", "llama3", "yarn" or "dynamic" (transformers' ``rope_type``)."""

    factor: float = 1.0
    """How many times longer than ``original_max_seq_len`` the context is stretched (>= 1): the
    interpolated frequencies are the plain ones divided by it (all of them with "linear", the
    long wavelengths with "llama3", the pairs past the yarn ramp with "yarn"). "dynamic": a
    sequence of L > original_max_seq_len positions rotates with the base
    ``rope_theta * (factor * L / original_max_seq_len - factor + 1) ** (P / (P - 2))`` (P rotary dims)."""

    original_max_seq_len: int | None = None
    """Context length of pretraining before the stretch (transformers'
    ``original_max_position_embeddings``; Llama 3.1: 8192, DeepSeek-V3: 4096). Required by
    "llama3" and "yarn", which decide per feature pair from its wavelength against this length,
    and by "dynamic" (transformers' ``max_position_embeddings`` there): sequences up to this
    length get plain RoPE. None with "linear"."""

    low_freq_factor: float | None = None
    """"llama3": wavelengths above ``original_max_seq_len / low_freq_factor`` are interpolated
    (divided by ``factor``). Required by "llama3", None otherwise."""

    high_freq_factor: float | None = None
    """"llama3": wavelengths below ``original_max_seq_len / high_freq_factor`` are kept; between
    the two bounds the frequency blends smoothly. Must exceed ``low_freq_factor``. Required by
    "llama3", None otherwise."""

    beta_fast: float | None = None
    """"yarn": pairs that turn more than ``beta_fast`` times over ``original_max_seq_len`` keep
    their frequency (None = 32, the paper's). None with other types."""

    beta_slow: float | None = None
    """"yarn": pairs that turn fewer than ``beta_slow`` times are fully interpolated; a linear
    ramp over the pairs between (None = 1). None with other types."""

    mscale: float | None = None
    """"yarn": the attention temperature's coefficient on the rotary features: with
    ``mscale_all_dim`` too, cos and sin are scaled by ``m(mscale) / m(mscale_all_dim)`` where
    ``m(c) = 0.1 c ln(factor) + 1`` (DeepSeek). None = ``m(1)`` alone. Only with "yarn", with
    ``mscale_all_dim`` set and ``attention_factor`` None (otherwise it would not act)."""

    mscale_all_dim: float | None = None
    """"yarn": DeepSeek's temperature over every q.k feature: the softmax scale is multiplied by
    ``m(mscale_all_dim)**2`` (``softmax_multiplier``). None = no such scaling. Only with "yarn"."""

    attention_factor: float | None = None
    """"yarn": the scale of cos and sin given outright, overriding the one derived from ``mscale``.
    None = derived. Only with "yarn"."""

    truncate: bool = True
    """"yarn": round the ramp's ends to whole pairs (floor / ceil), as the paper's code does;
    false = the exact ends (gpt-oss). Must stay true with other types."""

    def __post_init__(self) -> None:
        require_choice("model.rope_scaling.rope_type", self.rope_type, ROPE_TYPES)
        require(_is_number(self.factor) and self.factor >= 1, "model.rope_scaling.factor", self.factor,
                "must be a number >= 1")
        for name, types in _ONLY.items():
            value = getattr(self, name)
            if self.rope_type not in types:
                require_active(value is None, f"model.rope_scaling.{name}", value,
                               f"acts only with rope_type {' or '.join(map(repr, types))} (rope_type is "
                               f"{self.rope_type!r}): leave it None")
            elif name in _REQUIRED.get(self.rope_type, ()):
                require(value is not None, f"model.rope_scaling.{name}", value,
                        f"is required with rope_type {self.rope_type!r}")
        require_int("model.rope_scaling.original_max_seq_len", self.original_max_seq_len, min_value=1,
                    none_ok=True)
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                     "attention_factor"):
            value = getattr(self, name)
            require(value is None or (_is_number(value) and value > 0), f"model.rope_scaling.{name}", value,
                    "must be None or a number > 0")
        if self.rope_type == "yarn":
            fast = 32.0 if self.beta_fast is None else self.beta_fast
            slow = 1.0 if self.beta_slow is None else self.beta_slow
            require(fast > slow, "model.rope_scaling.beta_fast", fast,
                    f"must be > model.rope_scaling.beta_slow ({slow}): the ramp runs from the pairs kept (more "
                    "than beta_fast turns) to those interpolated (fewer than beta_slow)")
        if self.rope_type == "llama3":
            assert self.low_freq_factor is not None and self.high_freq_factor is not None
            require(self.high_freq_factor > self.low_freq_factor, "model.rope_scaling.high_freq_factor",
                    self.high_freq_factor, f"must be > model.rope_scaling.low_freq_factor ({self.low_freq_factor})")
        require_active(self.mscale is None or (self.mscale_all_dim is not None and self.attention_factor is None),
                       "model.rope_scaling.mscale", self.mscale,
                       "acts only with mscale_all_dim set and attention_factor None: leave it None")
        require_bool("model.rope_scaling.truncate", self.truncate)
        require_active(self.truncate or self.rope_type == "yarn", "model.rope_scaling.truncate", self.truncate,
                       f"acts only with rope_type 'yarn' (rope_type is {self.rope_type!r}): leave it true")

    @property
    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by (yarn's attention temperature on the rotary
        features); 1.0 for the other types."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale is not None and self.mscale_all_dim is not None:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor, 1.0)

    @property
    def softmax_multiplier(self) -> float:
        """What the 1/sqrt(head dim) softmax scale is multiplied by: ``m(mscale_all_dim)**2`` with
        yarn's ``mscale_all_dim`` (DeepSeek), else 1.0."""
        if self.rope_type != "yarn" or self.mscale_all_dim is None:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def rope_scaling_from(values: Mapping) -> RopeScaling:
    """A ``RopeScaling`` of a mapping of its fields; ValueError naming any other key."""
    names = [f.name for f in fields(RopeScaling)]
    unknown = sorted(str(k) for k in values if k not in names)
    require(not unknown, "model.rope_scaling", dict(values),
            f"has unknown fields {', '.join(unknown)}; valid fields: {', '.join(names)}")
    return RopeScaling(**values)


def yarn_mscale(factor: float, coefficient: float) -> float:
    """YaRN's temperature ``0.1 * coefficient * ln(factor) + 1`` (1 for no stretch)."""
    return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
