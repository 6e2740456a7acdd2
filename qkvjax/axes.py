"""The shape legend and the logical axis names that go with it.

One legend is used everywhere: in einsum strings, in reshape and transpose comments (``BSKH -> BKSH``), in
shape annotations (``Float[Array, "B T N H"]``) and in logical axis names. Each letter has one meaning.

====  =============================================================  ====================
axis  meaning                                                        logical axis name
====  =============================================================  ====================
B     batch                                                          ``batch``
T     query position                                                 ``length``
S     key position (a cache's slot)                                  ``length``
Q     folded query rows, T * G (the G heads of a K/V head, t-major)  (activations only)
D     model width                                                    ``embed``
E     a second model-width axis: a bilinear form's key side, W_QK    (``embed``)
      (N, D, E), or the output side of a (D, E) map
N     query heads                                                    ``heads``
K     key/value heads                                                ``kv_heads``
G     N // K, query heads per K/V head                               (never a parameter axis)
H     head width of queries and keys                                 ``head_dim``
U     head width of values (``v_head_dim``; "Hv" in prose)           ``head_dim``
J     a second head-width axis: a map between two heads' features,   (converted weights only)
      (K, J, H)
P     a latent scheme's decoupled rotary width ("H_r" in prose)      ``head_dim``
R     latent rank (MLA's K/V latent; "Rq" in prose for queries')     ``latent``
M     the largest relative offset of a relative bias: (N, 2 M + 1)   (none)
F     MLP hidden width                                               ``mlp``
V     vocabulary                                                     ``vocab``
C     classes (an encoder's outputs)                                 (none)
L     layers                                                         (none)
====  =============================================================  ====================

``tests/test_axes.py`` reads every einsum string and arrow comment in the package and fails on a letter that is
not here.

Parameters carry logical names (``flax.linen.with_logical_partitioning``); :data:`DEFAULT_RULES` maps them to
the mesh axes ``data``, ``fsdp`` and ``tensor``, so a new tying scheme needs no new sharding code.
"""

LEGEND = "BTSQDENKGHUJPRMFVCL"  # the letters above, in their order

BATCH = "batch"
LENGTH = "length"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
LATENT = "latent"

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axis (or axes). Activations' batch is split over every data-like axis; parameters are
# split over `fsdp` along the model width (ZeRO-3 style) and over `tensor` along heads / MLP / vocab (Megatron).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    (BATCH, ("data", "fsdp")),
    (LENGTH, None),
    (EMBED, "fsdp"),
    (HEADS, "tensor"),
    (KV_HEADS, "tensor"),
    (HEAD_DIM, None),
    (MLP, "tensor"),
    (VOCAB, "tensor"),
    (LATENT, None),  # a latent is shared by every head: replicated, so decode never gathers it across devices
)
