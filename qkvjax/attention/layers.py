"""Attention per layer: a pattern of configs over a stack, and cross-layer K/V sharing.

A model may give every layer the same :class:`AttentionConfig` or a *layer pattern*, a short text a person can
type on the command line (``--config.model.layers=...``) that expands to one :class:`LayerAttention` per layer::

    pattern := item ("," item)*           item  := atom ["*" [COUNT]]
    atom    := entry | "(" pattern ")"    entry := [SCHEME] ["[" option ("," option)* "]"]
    option  := FIELD ["=" VALUE]          (FIELD alone means FIELD=true)

An entry starts from the model's base attention config; ``SCHEME`` replaces its scheme and each option one of its
fields (``kv`` is short for ``num_kv_heads``). The option ``kv_from=J`` makes the layer read the keys and values
of layer J (J < 0 counts back from this layer) instead of projecting its own: Cross-Layer Attention (Brandon et
al. 2024, arXiv:2405.12981), and the K/V sharing of Gemma 3n/4's last layers. Such a layer has no K/V kernels
and no cache of its own, and takes its donor's scheme, ``num_kv_heads``, ``head_dim`` and ``dtype`` unless the
entry sets them; chains resolve to the layer that produces the K/V. Examples, 12 layers::

    separate*4, shared_kv*8         layers 0-3 separate, 4-11 K = V
    (separate, [kv_from=-1])*6      CLA2: K/V shared by pairs of adjacent layers
    (separate, [kv_from=-1])*       the same on any even number of layers: '*' without a count repeats its atom to
                                    fill the layers the rest of the pattern leaves (one such item per pattern)
    [qk_norm,v_norm]*5, shared_kv[kv=1,qk_norm,v_norm], [qk_norm,v_norm]*2,
        [qk_norm,v_norm,kv_from=7]*3, [qk_norm,v_norm,kv_from=5]
                                    Gemma-4-like: local layers and a K = V global layer with QK-norm, the last
                                    four reading the K/V of the last earlier layer of their kind

A pattern that expands to one entry applies to every layer.
"""

from __future__ import annotations

import dataclasses
import re
import typing

from qkvjax import checks
from qkvjax.attention.config import AttentionConfig
from qkvjax.attention.schemes import SCHEMES
from qkvjax.parse import parse_bool

ALIASES = {"kv": "num_kv_heads"}
# the deepest stacks trained are about a thousand layers (DeepNet); a typo's 10^9 (a num_layers, or a pattern's
# '*COUNT') would fill the memory with per-layer configs before any other check could refuse it
MAX_LAYERS = 1 << 16
INHERITED = (
    "scheme",
    "num_kv_heads",
    "head_dim",
    "v_head_dim",
    "dtype",
)  # what a K/V reader takes from its donor by default


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """One layer's attention: its config, and the earlier layer whose keys and values it reads (None: its own).

    ``kv_from`` is always the layer that *produces* the K/V (never another sharer).
    """

    config: AttentionConfig
    kv_from: int | None = None

    @property
    def produces_kv(self) -> bool:
        return self.kv_from is None


def expand(pattern: str, base: AttentionConfig, num_layers: int) -> tuple[LayerAttention, ...]:
    """The layers a pattern describes (empty pattern: ``base`` everywhere), validated; errors name the layer."""
    checks.integer_value("num_layers", num_layers, maximum=MAX_LAYERS)
    if not pattern.strip():
        return tuple(LayerAttention(base) for _ in range(num_layers))
    tokens = re.findall(r"\[[^\]]*\]|[(),*]|[^\s(),*\[\]]+|\S", pattern)
    entries, pos = _items(tokens, 0, pattern, num_layers)
    if pos != len(tokens):
        raise ValueError(f"layer pattern {pattern!r}: unexpected {tokens[pos]!r}")
    fills = [i for i, e in enumerate(entries) if isinstance(e, _Fill)]
    if len(fills) > 1:
        raise ValueError(f"layer pattern {pattern!r}: only one item may end in '*' without a count")
    if fills:
        atom, fixed = entries[fills[0]].atom, len(entries) - 1
        times, left = divmod(num_layers - fixed, len(atom))
        if times < 1 or left:
            raise ValueError(
                f"layer pattern {pattern!r}: its '*' item of {len(atom)} layer(s) cannot fill the {num_layers - fixed} "
                f"layer(s) the rest leaves of num_layers={num_layers}; allowed: a num_layers that leaves a multiple "
                f"of {len(atom)}, or '*N'"
            )
        entries = entries[: fills[0]] + atom * times + entries[fills[0] + 1 :]
    if len(entries) == 1:
        entries = entries * num_layers
    if len(entries) != num_layers:
        raise ValueError(
            f"layer pattern {pattern!r} describes {len(entries)} layers but the model has num_layers={num_layers}; "
            "give one entry per layer (use '*N' to repeat) or a single entry for all"
        )
    layers: list[LayerAttention] = []
    for i, (scheme, options) in enumerate(entries):
        fields = dict(options)
        kv_from = fields.pop("kv_from", None)
        j = None if kv_from is None else _donor_index(i, kv_from, layers, pattern)
        # A reader takes its K/V layout (scheme, K, H, dtype) from its donor unless the entry says otherwise.
        inherited = {} if j is None else {f: getattr(layers[j].config, f) for f in INHERITED}
        try:
            typed = _typed(fields) | ({"scheme": scheme} if scheme else {})
            config = dataclasses.replace(base, **(inherited | typed))
        except (TypeError, ValueError) as e:
            raise ValueError(f"layer {i} of pattern {pattern!r}: {e}") from None
        if j is not None:
            _check_reader(f"layer {i} of pattern {pattern!r}: kv_from={kv_from}", config, j, layers[j].config)
        layers.append(LayerAttention(config, j))
    return tuple(layers)


@dataclasses.dataclass(frozen=True)
class _Fill:
    """An atom followed by '*' without a count: repeated to fill the layers the rest of the pattern leaves."""

    atom: list


def _items(tokens: list[str], pos: int, pattern: str, num_layers: int, depth: int = 0) -> tuple[list, int]:
    """The entries of ``tokens[pos:]`` up to a closing ')' and where it stopped; a count that would make more than
    ``num_layers`` entries is refused before they are made (a typo's '*1000000000' would fill the memory)."""
    out = []
    while pos < len(tokens) and tokens[pos] != ")":
        if tokens[pos] == ",":
            pos += 1
            continue
        if tokens[pos] == "(":
            atom, pos = _items(tokens, pos + 1, pattern, num_layers, depth + 1)
            if pos >= len(tokens):
                raise ValueError(f"layer pattern {pattern!r}: '(' is never closed")
            if not atom:  # '()*' would fill the stack with nothing
                raise ValueError(f"layer pattern {pattern!r}: an empty group '()'; allowed: one or more entries in it")
            pos += 1
        else:
            scheme = None
            if not tokens[pos].startswith("["):
                scheme = tokens[pos]
                if scheme not in SCHEMES:
                    raise ValueError(
                        f"layer pattern {pattern!r}: unknown scheme {scheme!r}; allowed: {sorted(SCHEMES)}"
                    )
                pos += 1
            options = ()
            if pos < len(tokens) and tokens[pos].startswith("["):
                options = _options(tokens[pos], pattern)
                pos += 1
            atom = [(scheme, options)]
        if pos < len(tokens) and tokens[pos] == "*":
            count = tokens[pos + 1] if pos + 1 < len(tokens) else ""
            if count in ("", ",", ")"):  # no count: fill the stack (resolved by expand)
                if depth:
                    raise ValueError(f"layer pattern {pattern!r}: '*' without a count only at the top level")
                atom, pos = [_Fill(atom)], pos + 1
            elif not count.isdigit() or int(count) < 1:
                raise ValueError(f"layer pattern {pattern!r}: '*' needs a count >= 1 (or none, to fill), got {count!r}")
            elif len(out) + len(atom) * int(count) > num_layers:
                raise ValueError(
                    f"layer pattern {pattern!r}: '*{count}' makes {len(out) + len(atom) * int(count)} or more layers, "
                    f"more than num_layers={num_layers}; allowed: counts that add up to num_layers"
                )
            else:
                atom, pos = atom * int(count), pos + 2
        out.extend(atom)
        if pos < len(tokens) and tokens[pos] not in (",", ")"):
            raise ValueError(f"layer pattern {pattern!r}: expected ',' between entries, got {tokens[pos]!r}")
    return out, pos


def _options(text: str, pattern: str) -> tuple[tuple[str, str], ...]:
    if not text.endswith("]"):
        raise ValueError(f"layer pattern {pattern!r}: '[' is never closed")
    names = {f.name for f in dataclasses.fields(AttentionConfig)} - {"scheme"}
    out = []
    for part in filter(None, (p.strip() for p in text[1:-1].split(","))):
        key, _, value = part.partition("=")
        key = ALIASES.get(key.strip(), key.strip())
        if key not in names and key != "kv_from":
            raise ValueError(
                f"layer pattern {pattern!r}: unknown option {key!r}; allowed: kv_from, kv, {', '.join(sorted(names))}"
            )
        out.append((key, value.strip() if value else "true"))
    return tuple(out)


def _typed(fields: dict[str, str]) -> dict:
    """Option texts as the types AttentionConfig declares."""
    hints = typing.get_type_hints(AttentionConfig)
    out = {}
    for key, raw in fields.items():
        kinds = typing.get_args(hints[key]) or (hints[key],)
        if type(None) in kinds and raw.lower() == "none":
            out[key] = None
        elif bool in kinds:
            try:
                out[key] = parse_bool(raw)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
        elif int in kinds:
            try:
                out[key] = int(raw)
            except ValueError:
                raise ValueError(f"{key}={raw!r}; allowed: an integer") from None
        elif float in kinds:
            try:
                out[key] = float(raw)
            except ValueError:
                raise ValueError(f"{key}={raw!r}; allowed: a number") from None
        else:
            out[key] = raw
    return out


def _donor_index(i: int, raw: str, earlier: list[LayerAttention], pattern: str) -> int:
    """The producing layer a ``kv_from`` option names (a chain of readers resolves to its producer)."""
    where = f"layer {i} of pattern {pattern!r}: kv_from={raw}"
    try:
        j = int(raw)
    except ValueError:
        raise ValueError(f"{where}; allowed: an earlier layer's index, or -n for n layers back") from None
    j = i + j if j < 0 else j
    if i == 0:
        raise ValueError(f"{where}: the first layer has no earlier layer to read K/V from; it must make its own")
    if not 0 <= j < i:
        raise ValueError(f"{where} is not an earlier layer; allowed: 0 to {i - 1}, or -1 to -{i}")
    return j if earlier[j].kv_from is None else earlier[j].kv_from


def _check_reader(where: str, config: AttentionConfig, j: int, donor: AttentionConfig) -> None:
    scheme = config.tying
    if scheme.ties_query_to_kv or scheme.bilinear:
        raise ValueError(
            f"{where}: scheme {config.scheme!r} makes keys or values from the query projection (or from no "
            "projection), so they cannot come from another layer; allowed: "
            f"{sorted(n for n, s in SCHEMES.items() if not (s.ties_query_to_kv or s.bilinear or s.latent))}"
        )
    if scheme.latent or donor.tying.latent:
        raise ValueError(
            f"{where}: cross-layer K/V with a latent scheme ({config.scheme!r} reading layer {j}'s "
            f"{donor.scheme!r}) is not supported: a latent layer caches its latent, not K and V"
        )
    mine = (scheme.kv_groups, config.kv_heads, config.head_dim, config.dtype, config.value_dim)
    theirs = (donor.tying.kv_groups, donor.kv_heads, donor.head_dim, donor.dtype, donor.value_dim)
    if mine != theirs:
        raise ValueError(
            f"{where}: layer {j}'s K/V (groups {theirs[0]}, K={theirs[1]}, H={theirs[2]}, {theirs[3]}, "
            f"value width {theirs[4]}) do not fit this layer's (groups {mine[0]}, K={mine[1]}, H={mine[2]}, "
            f"{mine[3]}, value width {mine[4]}); give both the same scheme family, num_kv_heads, head_dim, "
            "v_head_dim and dtype (or leave them out: a reader inherits its donor's)"
        )


def example_layouts(num_layers: int, num_heads: int) -> dict[str, str]:
    """Named layer patterns that answer "which K/V saving?" at one model size (those that fit it):

    K = V tying, GQA with half the K/V heads, cross-layer sharing by pairs (CLA2) -- each of the three halves the
    cache -- their combinations, and a Gemma-4-like stack (our reading of it, not its exact sizes): 5 local layers
    to 1 global, local layers GQA with K = N/2, global layers K = V with K = N/4, QK-norm and a scale-free V-norm
    everywhere, and the last third of the layers reading the K/V of the last earlier layer of their kind; and
    DeepSeek-V2's MLA (a latent of 4 H per token, with or without its decoupled rotary key of H / 2).
    """
    out = {"separate": "", "shared_kv": "shared_kv"}
    gqa = f"GQA-{num_heads // 2}"  # half as many K/V heads: the same cache as K = V or CLA2
    if num_heads % 2 == 0:
        out[gqa] = f"[kv={num_heads // 2}]"
        out[f"{gqa} + shared_kv"] = f"shared_kv[kv={num_heads // 2}]"
    if num_layers % 2 == 0:
        out["CLA2"] = f"(separate, [kv_from=-1])*{num_layers // 2}"
        out["CLA2 + shared_kv"] = f"(shared_kv, [kv_from=-1])*{num_layers // 2}"
        if num_heads % 2 == 0:
            out[f"{gqa} + CLA2"] = f"([kv={num_heads // 2}], [kv_from=-1])*{num_layers // 2}"
    if num_layers % 6 == 0 and num_heads % 4 == 0:
        kinds = ["global" if i % 6 == 5 else "local" for i in range(num_layers)]
        entry = {
            "local": f"[kv={num_heads // 2},qk_norm,v_norm]",
            "global": f"shared_kv[kv={num_heads // 4},qk_norm,v_norm]",
        }
        own = num_layers - num_layers // 3
        parts = []
        for i, kind in enumerate(kinds):
            if i < own:
                parts.append(entry[kind])
            else:
                donor = max(j for j in range(own) if kinds[j] == kind)
                parts.append(f"[qk_norm,v_norm,kv_from={donor}]")
        runs: list[list] = []
        for part in parts:  # run-length encoded, as a person would write it
            if runs and runs[-1][0] == part:
                runs[-1][1] += 1
            else:
                runs.append([part, 1])
        out["Gemma-4-like"] = ", ".join(p if n == 1 else f"{p}*{n}" for p, n in runs)
    out["MLA (latent 4H)"] = "mla"  # DeepSeek-V2's latent width d_c = 4 d_h ...
    out["MLA + rotary"] = "mla[rope]"  # ... and its decoupled rotary key of d_h / 2
    return out


def producers(layers: tuple[LayerAttention, ...]) -> tuple[int, ...]:
    """Indices of the layers that produce (and cache) keys and values, in order."""
    return tuple(i for i, layer in enumerate(layers) if layer.produces_kv)
