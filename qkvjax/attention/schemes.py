"""Tying schemes as data, and what each one costs.

Scaled dot-product attention (Vaswani et al. 2017, arXiv:1706.03762) gives each head n three roles::

    q_t = x_t W^Q_n,   k_s = x_s W^K_n,   v_s = x_s W^V_n,   o_t = sum_s softmax_s(q_t . k_s / sqrt(H)) v_s

A *scheme* says which roles share one projection: a partition of {q, k, v}. ``separate`` = {q}{k}{v};
``shared_qk`` = {q,k}{v}; ``shared_kv`` = {q}{k,v}; ``shared_qv`` = {q,v}{k}; ``shared_qkv`` = {q,k,v}. The module
makes one kernel per group, named ``w_`` + the group's roles, and caches one tensor per group that produces keys
or values. Two variations ride on top of a partition:

* ``normalize_keys`` / ``mask_self`` -- Reformer's shared-QK attention (Kitaev et al. 2020, arXiv:2001.04451,
  section 2): keys are ``k / |k|`` and a token attends to itself only when it has no other allowed target.
* ``bilinear`` -- the query and key roles are replaced by one full-rank form per head,
  ``score(t, s) = x_t^T W_QK[n] x_s / sqrt(H)`` with ``W_QK[n] = W^Q_n (W^K_n)^T`` of shape (D, D); only the value
  role keeps a projection. The key side of the cache is then the input ``x`` itself.
* ``latent`` -- Multi-head Latent Attention (DeepSeek-AI 2024, DeepSeek-V2, arXiv:2405.04434, section 2.1): the
  ``kv`` group is factored, ``k_{s,j} = c_s W^UK_j`` and ``v_{s,j} = c_s W^UV_j`` with one shared latent
  ``c_s = norm(x_s W^DKV)`` of width R, so K and V tie their first factor only (a partial K = V tying) and the cache
  holds ``c`` alone. Its stages are :class:`qkvjax.attention.latent.Latent`, run by the same ``Attention``.

Adding a scheme is one :func:`register_scheme` call; nothing else in the package branches on a scheme's name.
What a scheme costs is read off this data by :mod:`qkvjax.attention.costs`.
"""

from __future__ import annotations

import dataclasses

from qkvjax import checks

ROLES = ("q", "k", "v")


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One tying scheme.

    Attributes:
      name: registry key, also the value of ``AttentionConfig.scheme``.
      groups: the partition, one string of roles per distinct projection, e.g. ``("qk", "v")``. For a
        ``bilinear`` scheme the groups cover only the roles that keep a projection (``("v",)``).
      summary: one line for tables and ``--help``.
      reference: where the idea comes from.
      bilinear: scores come from a per-head (D, D) form instead of projected queries and keys.
      normalize_keys: keys are divided by their length (Reformer).
      mask_self: in self-attention a token may attend to itself only if nothing else is allowed (Reformer).
      latent: the ``kv`` group is a low-rank latent with per-role up-projections (MLA); the ranks are
        ``AttentionConfig.kv_rank`` (and ``q_rank`` for a low-rank query path).
    """

    name: str
    groups: tuple[str, ...]
    summary: str
    reference: str
    bilinear: bool = False
    normalize_keys: bool = False
    mask_self: bool = False
    latent: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"Scheme.name={self.name!r}; allowed: a name such as 'shared_qk' (letters, digits, _)")
        groups = self.groups
        if (
            isinstance(groups, str)
            or not isinstance(groups, tuple | list)
            or not all(isinstance(g, str) for g in groups)
        ):
            raise ValueError(
                f"scheme {self.name!r}: groups={groups!r}; allowed: a tuple of role strings, one per projection, "
                "e.g. ('qk', 'v')"
            )
        object.__setattr__(self, "groups", tuple(groups))
        for name in ("bilinear", "normalize_keys", "mask_self", "latent"):
            checks.flag(self, name)
        for name in ("summary", "reference"):
            checks.text(self, name)
        roles = [r for g in self.groups for r in g]
        expected = {"v"} if self.bilinear else set(ROLES)
        if sorted(roles) != sorted(expected) or any(not g for g in self.groups):
            raise ValueError(
                f"scheme {self.name!r}: groups {self.groups} must partition the roles {sorted(expected)} "
                "(each role in exactly one non-empty group)"
            )
        if self.bilinear and (self.normalize_keys or self.mask_self):
            raise ValueError(f"scheme {self.name!r}: a bilinear scheme has no keys to normalise or mask")
        if self.latent and (self.groups != ("q", "kv") or self.bilinear or self.normalize_keys or self.mask_self):
            raise ValueError(f"scheme {self.name!r}: a latent scheme has the groups ('q', 'kv') and nothing else")

    def group_of(self, role: str) -> str | None:
        """The group that produces ``role``, or None (q and k of a bilinear scheme)."""
        return next((g for g in self.groups if role in g), None)

    @property
    def query_groups(self) -> tuple[str, ...]:
        """Groups applied to the query-side input."""
        return tuple(g for g in self.groups if "q" in g)

    @property
    def kv_groups(self) -> tuple[str, ...]:
        """Groups applied to the key/value-side input; each is one cached tensor when decoding."""
        return tuple(g for g in self.groups if set(g) & {"k", "v"})

    @property
    def ties_query_to_kv(self) -> bool:
        """One projection makes both queries and keys or values, so query heads and kv heads must coincide."""
        return any("q" in g and len(g) > 1 for g in self.groups)

    @property
    def keys_finished_at_write(self) -> bool:
        """Keys have a projection of their own (the group ``"k"``), so they are finished (QK-norm, Reformer's unit
        length, rotary) once, when made, and cached and handed to other layers finished: decoding then does not
        rotate the whole cache at every step (that cost 6-13x the rest of the step,
        ``benchmarks/levers/rope_cache.py``).
        Keys tied to values (K = V) stay raw, so their cache stays halved, and are finished on read, over the slots
        read only; tied to queries, they are the queries' own tensor. (A latent scheme's key-only part, its
        decoupled rotary key, is likewise rotated when made.)"""
        return "k" in self.groups

    def heads(self, group: str, num_heads: int, num_kv_heads: int) -> int:
        """Heads a group's kernel produces: N if it makes queries, else K."""
        return num_heads if "q" in group else num_kv_heads


#: Every registered :class:`Scheme` by name: the one table the modules, costs and converters read.
SCHEMES: dict[str, Scheme] = {}


def register_scheme(scheme: Scheme) -> Scheme:
    """Adds ``scheme`` to :data:`SCHEMES` under its name (a name already taken is refused) and returns it, so that
    ``AttentionConfig(scheme=name)`` builds it: a new tying scheme is a new partition, no new module code."""
    if not isinstance(scheme, Scheme):
        raise ValueError(f"register_scheme({scheme!r}); allowed: a qkvjax.Scheme")
    if scheme.name in SCHEMES:
        raise ValueError(f"scheme {scheme.name!r} is already registered")
    SCHEMES[scheme.name] = scheme
    return scheme


def get_scheme(name: str) -> Scheme:
    """The registered :class:`Scheme` called ``name``; an unknown name is refused, listing the known ones."""
    if not isinstance(name, str) or name not in SCHEMES:  # a list would be unhashable: a TypeError, not this line
        raise ValueError(f"unknown attention scheme {name!r}; allowed: {sorted(SCHEMES)}")
    return SCHEMES[name]


register_scheme(Scheme("separate", ("q", "k", "v"), "W^Q, W^K, W^V", "Vaswani et al. 2017"))
register_scheme(Scheme("shared_qk", ("qk", "v"), "W^Q = W^K: scores are a symmetric bilinear form", "tying"))
register_scheme(
    Scheme(
        "reformer_qk",
        ("qk", "v"),
        "W^Q = W^K, unit-length keys, no self-attention unless nothing else is allowed",
        "Kitaev et al. 2020",
        normalize_keys=True,
        mask_self=True,
    )
)
# Reformer's attention taken apart: each of its two additions to shared QK alone
register_scheme(
    Scheme(
        "shared_qk_unit_keys",
        ("qk", "v"),
        "W^Q = W^K with unit-length keys (Reformer without its self-mask)",
        "Kitaev et al. 2020, in part",
        normalize_keys=True,
    )
)
register_scheme(
    Scheme(
        "shared_qk_self_mask",
        ("qk", "v"),
        "W^Q = W^K, no self-attention unless nothing else is allowed (Reformer without unit keys)",
        "Kitaev et al. 2020, in part",
        mask_self=True,
    )
)
register_scheme(Scheme("shared_kv", ("q", "kv"), "W^K = W^V: K = V, one cached tensor", "tying"))
register_scheme(Scheme("shared_qv", ("qv", "k"), "W^Q = W^V", "tying"))
register_scheme(Scheme("shared_qkv", ("qkv",), "W^Q = W^K = W^V: one matrix for all roles", "tying"))
register_scheme(
    Scheme(
        "bilinear",
        ("v",),
        "per-head full-rank W_QK (D x D) = W^Q (W^K)^T merged, plus W^V",
        "merged bilinear form",
        bilinear=True,
    )
)
register_scheme(
    Scheme(
        "mla",
        ("q", "kv"),
        "MLA: K, V up-projected from one cached rank-R latent; absorbed W^UQ W^UK at decode",
        "DeepSeek-AI 2024 (DeepSeek-V2)",
        latent=True,
    )
)
