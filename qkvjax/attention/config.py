"""AttentionConfig: everything one attention layer needs, validated once, before anything is traced."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from qkvjax import checks
from qkvjax.attention.schemes import SCHEMES, Scheme, get_scheme

DTYPES = ("float32", "bfloat16", "float16", "float64")  # float64: host references (needs jax_enable_x64)
IMPLEMENTATIONS = (None, "einsum", "chunked", "xla", "cudnn", "auto")
ROPE_LAYOUTS = ("half", "interleaved")


def resolve_implementation(configured: str | None, backend: str) -> str:
    """The kernel choice a layer traces with on ``backend`` (``jax.default_backend()``): the configured one, else
    'einsum' on CPU (the grouped einsums beat XLA's attention there), 'auto' on a GPU (cuDNN flash attention where
    jax takes the call, else XLA's: :func:`qkvjax.attention.kernels.dot_product`), 'xla' elsewhere. On an H100 and
    an H200 cuDNN's kernel trained ``gpt2_small`` 2.5x faster than XLA's in 31% of its memory
    (benchmarks/README.md, "GPU: the second visit")."""
    if configured is not None:
        return configured
    return {"cpu": "einsum", "gpu": "auto"}.get(backend, "xla")


def _canonical_dtype(value, field: str) -> str:
    try:
        name = "None" if value is None else jnp.dtype(value).name  # numpy reads None as float64
    except TypeError:
        name = str(value)
    if name not in DTYPES:
        raise ValueError(f"AttentionConfig.{field}={value!r} is not supported; allowed: {list(DTYPES)}")
    return name


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """One attention layer.

    Attributes:
      num_heads: N, query heads.
      head_dim: H, width of each query and key head.
      v_head_dim: width of each value head (and of the output projection's input), None = H. Differs from H only
        where values have their own projection (not tied to queries or keys), as in DeepSeek-V2's attention.
      num_kv_heads: K, key/value heads. None means K = N (multi-head); 1 is multi-query (Shazeer 2019);
        otherwise grouped-query (Ainslie et al. 2023) and K must divide N.
      scheme: the tying scheme, a key of ``qkvjax.SCHEMES``.
      use_bias: biases on the query, key and value projections, and on the output projection unless
        ``output_bias`` says otherwise.
      output_bias: a bias on the output projection; None = ``use_bias`` (Qwen2 has q/k/v biases and none here).
      dropout_rate: dropout on the attention weights (needs a ``dropout`` RNG when not deterministic).
      rope: rotary position embedding on queries and keys (Su et al. 2021, arXiv:2104.09864).
      rope_base: the rotary wavelength base.
      rope_layout: which features rotate together: 'half' (feature i with i + H/2, the ``rotate_half`` layout of
        Hugging Face's Llama and GPT-NeoX) or 'interleaved' (2i with 2i + 1, as in Su et al. and Meta's Llama).
      dtype: compute dtype; softmax is always taken in float32 (float64, with ``jax_enable_x64``, is for
        references computed on the host: its matmuls run in float64, its softmax, norms and rotary in float32).
      param_dtype: dtype of the parameters.
      relative_bias: M > 0 adds a learned bias per head and relative offset, b_n(clip(s - t, -M, M)), to every
        score (a T5-style term without buckets, Raffel et al. 2020). b(d) and b(-d) are separate, so it breaks the
        symmetry s(t, s) = s(s, t) of shared-QK scores; 0 (default) is off.
      qk_norm: RMS-normalise queries and keys over the head dim, each with a learned (H,) scale, before rotary
        (Dehghani et al. 2023, arXiv:2302.05442; Gemma 3 and 4).
      learned_temperature: a learned per-head scale on the scores, ``score_n * exp(tau_n)`` with ``tau: (N,)``
        initialised to 0 (applied to the queries). Reformer's unit-length keys cap every score at ||q|| / sqrt(H);
        this frees the temperature from the query norm (which weight decay pulls down).
      v_norm: RMS-normalise values over the head dim without a scale (Gemma 4, whose global layers tie K = V
        and normalise the one tensor as keys and as values separately).
      implementation: how plain q.k attention is computed: 'einsum' (this package's grouped einsums, the path
        every scheme can take), 'chunked' (the same maths over blocks of ``chunk_size`` keys with an online
        softmax, never holding the (B, N, T, S) scores: for long contexts and large batches), or 'xla' / 'cudnn'
        (``jax.nn.dot_product_attention``; 'cudnn' is cuDNN flash attention on NVIDIA GPUs), or 'auto': cuDNN's
        flash kernel wherever jax takes the call (16-bit compute, a head width it supports, cuDNN present: jax
        checks when tracing), XLA's attention otherwise, and XLA's too for the rest of a training or eval process
        whose program holding cuDNN's kernel failed to compile (:func:`kernels.falls_back_from_cudnn`; an explicit
        'cudnn' fails instead). None picks per backend (:func:`resolve_implementation`):
        'einsum' on CPU, 'auto' on a GPU, 'xla' elsewhere. Schemes with custom logits (bilinear, Reformer's self-mask, a
        relative bias), attention dropout, decoding from a cache and analysis collecting the (T, S) weights
        (``mutable=["intermediates"]``) always take 'einsum'.
      chunk_size: keys per block of the 'chunked' implementation.
      causal_block: the 'einsum' implementation's causal self-attention (no other mask, custom logits or
        dropout) is computed in blocks of this many queries, each scored only against the keys up to its last
        position, so the scores above the diagonal are never computed (:func:`core.causal_attention`; about half
        of them at long context); used when T >= 2 ``causal_block``. Decoding from a cache likewise reads only the
        first ``causal_block`` x 2^i slots that hold the longest row (:func:`core.within_prefix`). 0 turns both off:
        the full (T, S) square, masked.
      kv_rank: R, the width of the shared K/V latent of a latent scheme (``mla``); None = 4 H (DeepSeek-V2's
        d_c = 4 d_h). Only latent schemes take it.
      q_rank: a latent scheme's low-rank query path: queries from a (D, q_rank) down-projection, its norm, and
        per-head up-projections; None = one (D, N, H) query projection.
      rope_head_dim: H_r, the width of a latent scheme's decoupled rotary part (a rotated key of H_r shared by all
        heads, and H_r more per query head), used when ``rope``; None = H / 2 (DeepSeek-V2). Latent keys cannot
        be rotated themselves: a rotation between W^UQ and W^UK would stop them from being absorbed.
      rope_key_per_head: a latent scheme's decoupled rotary key per KV head ((D, K, H_r), K H_r more cache per
        token) instead of one shared by all heads: MHA2MLA's partial RoPE (Ji et al. 2025, arXiv:2502.14837), the
        form a rotary model converts to (``qkvjax convert --to mla --rope-dim``), whose keys differ per head.
      latent_norm: RMS norm with a learned scale on a latent scheme's latents (as DeepSeek-V2); False makes the
        latent a plain low-rank factor (an MLA converted from MHA by SVD starts so, computing the same function).
      sliding_window: W: a query sees only keys fewer than W positions away (with causal attention: the last W
        tokens, itself included; Mistral's ``sliding_window``, Gemma's sliding layers); None = the whole context.
        Causal self-attention over fresh keys runs the ``window`` kernel (blocks of queries scored against a band
        of keys, :func:`core.banded_attention`); its decode cache is a ring of the last W tokens
        (:func:`cache.ring_view`) where every layer reading it has a window too.
      rope_pairs: rotate only the first ``rope_pairs`` of the H/2 feature pairs (the highest frequencies, each at
        the frequency it has in a whole rotation); the rest carry no position. Gemma 4's full-attention layers
        ("proportional" rotary, ``partial_rotary_factor`` = 2 rope_pairs / H). None = every pair.
      norm_eps: the epsilon of the layer's own RMS norms (QK-norm, V-norm, a latent scheme's latent norms):
        ``x / sqrt(mean(x^2) + eps)``; imported models carry theirs (Qwen3's and DeepSeek-V2's ``rms_norm_eps``).
    """

    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    scheme: str = "separate"
    v_head_dim: int | None = None
    use_bias: bool = False
    output_bias: bool | None = None
    dropout_rate: float = 0.0
    rope: bool = False
    rope_base: float = 10000.0
    rope_layout: str = "half"
    dtype: str = "float32"
    param_dtype: str = "float32"
    implementation: str | None = None
    relative_bias: int = 0
    qk_norm: bool = False
    v_norm: bool = False
    learned_temperature: bool = False
    chunk_size: int = 256
    causal_block: int = 64
    kv_rank: int | None = None
    q_rank: int | None = None
    rope_head_dim: int | None = None
    rope_key_per_head: bool = False
    latent_norm: bool = True
    sliding_window: int | None = None
    rope_pairs: int | None = None
    norm_eps: float = 1e-6

    def __post_init__(self):
        checks.integer(self, "num_heads")
        checks.integer(self, "head_dim")
        checks.integer(self, "num_kv_heads", none="")
        kv = self.num_kv_heads
        if kv is not None and self.num_heads % kv:
            divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ValueError(
                f"AttentionConfig.num_kv_heads={kv} does not divide num_heads={self.num_heads}; "
                f"allowed: None or one of {divisors}"
            )
        for name in (
            "use_bias",
            "rope",
            "qk_norm",
            "v_norm",
            "learned_temperature",
            "latent_norm",
            "rope_key_per_head",
        ):
            checks.flag(self, name)
        checks.flag(self, "output_bias", none="= use_bias")
        checks.number(self, "dropout_rate", low=0, high=1, open_high=True)
        checks.number(self, "rope_base", low=0, open_low=True)
        checks.choice(self, "rope_layout", ROPE_LAYOUTS)
        checks.integer(self, "relative_bias", minimum=0, allowed="0 (off) or a maximum offset R >= 1")
        checks.integer(self, "chunk_size", allowed="an integer >= 1 (keys per block)")
        checks.integer(self, "causal_block", minimum=0, allowed="0 (off) or an integer >= 1 (queries)")
        checks.integer(self, "sliding_window", none="the whole context")
        checks.integer(self, "v_head_dim", none="= head_dim")
        for name in ("kv_rank", "q_rank", "rope_head_dim"):
            checks.integer(self, name, none="")
        checks.choice(self, "implementation", IMPLEMENTATIONS[1:], none="per backend")
        object.__setattr__(self, "dtype", _canonical_dtype(self.dtype, "dtype"))
        object.__setattr__(self, "param_dtype", _canonical_dtype(self.param_dtype, "param_dtype"))
        self._check_rotary_and_norms()
        checks.choice(self, "scheme", sorted(SCHEMES))
        scheme = get_scheme(self.scheme)
        if scheme.ties_query_to_kv and self.kv_heads != self.num_heads:
            shared = next(g for g in scheme.groups if "q" in g and len(g) > 1)
            raise ValueError(
                f"scheme {self.scheme!r} uses one projection w_{shared} for queries and "
                f"{'keys' if 'k' in shared else 'values'}, so it needs num_kv_heads == num_heads "
                f"({self.num_heads}); got num_kv_heads={kv}. Use None, or a scheme without a shared query "
                f"projection: {sorted(n for n, s in SCHEMES.items() if not s.ties_query_to_kv)}"
            )
        if scheme.bilinear and self.rope:
            raise ValueError(
                f"scheme {self.scheme!r} merges W^Q (W^K)^T into one (D, D) form per head, so there are no "
                "separate queries and keys to rotate; rope=True is not allowed with it"
            )
        vh = self.v_head_dim
        if vh is not None and vh != self.head_dim and scheme.group_of("v") != "v" and not scheme.latent:
            raise ValueError(
                f"scheme {self.scheme!r} makes values with the projection w_{scheme.group_of('v')}, shared with "
                f"{'queries' if 'q' in scheme.group_of('v') else 'keys'}, so v_head_dim must equal head_dim "
                f"({self.head_dim}); got v_head_dim={vh}. Use None, or a scheme with its own W^V: "
                f"{sorted(n for n, s in SCHEMES.items() if s.group_of('v') == 'v' or s.latent)}"
            )
        if scheme.bilinear and self.qk_norm:
            raise ValueError(
                f"scheme {self.scheme!r} has no separate queries and keys to normalise; qk_norm=True is not allowed"
            )
        if self.learned_temperature and (scheme.bilinear or scheme.latent):
            raise ValueError(
                f"learned_temperature=True needs queries to scale; scheme {self.scheme!r} "
                f"({'a merged form' if scheme.bilinear else 'a latent scheme'}) does not take it"
            )
        if self.rope and self.head_dim % 2 and not scheme.latent:  # a latent scheme rotates rope_dim only
            raise ValueError(f"rope=True needs an even head_dim; got head_dim={self.head_dim}")
        self._check_latent(scheme)

    def _check_rotary_and_norms(self) -> None:
        """``rope_pairs`` (a count of pairs within H / 2, with rope) and ``norm_eps``."""
        half = self.head_dim // 2
        checks.integer(
            self, "rope_pairs", minimum=0, maximum=half, none="", allowed=f"an integer from 0 to H/2 = {half}"
        )
        if self.rope_pairs is not None and not self.rope:
            raise ValueError(f"AttentionConfig.rope_pairs={self.rope_pairs} needs rope=True")
        checks.number(self, "norm_eps", low=0, high=1, open_low=True, open_high=True)

    def _check_latent(self, scheme: Scheme) -> None:
        latent = sorted(n for n, s in SCHEMES.items() if s.latent)
        for name in ("kv_rank", "q_rank", "rope_head_dim"):
            value = getattr(self, name)
            if value is not None and not scheme.latent:
                raise ValueError(
                    f"AttentionConfig.{name}={value!r} is for latent schemes {latent}; "
                    f"scheme {self.scheme!r} takes None"
                )
        if self.rope_key_per_head and not (scheme.latent and self.rope):
            raise ValueError(
                "AttentionConfig.rope_key_per_head=True is for a latent scheme's decoupled rotary key; "
                f"scheme {self.scheme!r} with rope={self.rope} has none (allowed: a latent scheme with rope=True)"
            )
        if not scheme.latent:
            return
        if self.rope_head_dim is not None and not self.rope:
            raise ValueError(
                f"AttentionConfig.rope_head_dim={self.rope_head_dim} needs rope=True (it is the width "
                "of the decoupled rotary part); pass rope=True or rope_head_dim=None"
            )
        if self.rope and self.rope_dim % 2:
            raise ValueError(
                f"the decoupled rotary width of scheme {self.scheme!r} must be even; got "
                f"rope_head_dim={self.rope_dim}" + (" (H / 2)" if self.rope_head_dim is None else "")
            )
        for name, why in (
            ("qk_norm", "its keys come out of the latent"),
            ("v_norm", "its values come out of the latent"),
            ("relative_bias", "its decode path scores in the latent space"),
            ("rope_pairs", "its rotary part is rope_head_dim wide, every pair turning"),
        ):
            if getattr(self, name) or (name == "rope_pairs" and self.rope_pairs is not None):
                raise ValueError(
                    f"scheme {self.scheme!r} does not take {name}={getattr(self, name)!r}: {why}; "
                    "leave it off (latent_norm normalises the latent)"
                )

    @property
    def latent_dim(self) -> int:
        """R of a latent scheme, with None resolved to 4 H."""
        return 4 * self.head_dim if self.kv_rank is None else self.kv_rank

    @property
    def rope_dim(self) -> int:
        """H_r of a latent scheme's decoupled rotary part: 0 without rope, else rope_head_dim or H / 2."""
        if not self.rope:
            return 0
        return max(1, self.head_dim // 2) if self.rope_head_dim is None else self.rope_head_dim

    @property
    def rope_key_heads(self) -> int:
        """How many decoupled rotary keys a latent scheme makes per token: 1 (shared, DeepSeek-V2) or K."""
        return self.kv_heads if self.rope_key_per_head else 1

    @property
    def rope_interleaved(self) -> bool:
        return self.rope_layout == "interleaved"

    @property
    def has_output_bias(self) -> bool:
        """Whether ``w_o`` has a bias ``b_o``: ``output_bias``, or ``use_bias`` when that is None."""
        return self.use_bias if self.output_bias is None else self.output_bias

    @property
    def kv_heads(self) -> int:
        """K, with None resolved to N."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def key_dim(self) -> int:
        """Width of a query or key head: H, plus a latent scheme's decoupled rotary part (MLA's H + H_r)."""
        return self.head_dim + (self.rope_dim if self.tying.latent else 0)

    @property
    def value_dim(self) -> int:
        """Width of a value head, with None resolved to H."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def width(self, group: str) -> int:
        """Head width of a projection group's kernel: the value width for a value-only group, else H."""
        return self.value_dim if group == "v" else self.head_dim

    @property
    def group_size(self) -> int:
        """G = N // K."""
        return self.num_heads // self.kv_heads

    @property
    def tying(self) -> Scheme:
        return get_scheme(self.scheme)
