"""The shape legend and the logical axis names that go with it.

One legend is used everywhere: in einsum strings, in annotations and in logical axis names.

====  ===================  ====================
axis  meaning              logical axis name
====  ===================  ====================
B     batch                ``batch``
T     query position       ``length``
S     key position         ``length``
D     model width          ``embed``
N     query heads          ``heads``
K     key/value heads      ``kv_heads``
G     N // K               (never a parameter axis)
H     head dim             ``head_dim``
F     MLP hidden width     ``mlp``
V     vocabulary           ``vocab``
R     latent rank (MLA)    ``latent``
====  ===================  ====================

Parameters carry logical names (``flax.linen.with_logical_partitioning``); :data:`DEFAULT_RULES` maps them to
the mesh axes ``data``, ``fsdp`` and ``tensor``, so a new tying scheme needs no new sharding code.
"""

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
