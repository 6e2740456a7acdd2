"""Hugging Face models in and out: GPT-2, the Llama family (Llama, Mistral, Qwen2) and BERT.

* :func:`load_pretrained` reads a model folder (``config.json`` + safetensors, sharded or not) into a qkvjax
  config and parameter tree that compute the same function (a ``DecoderLM``, or for BERT an ``Encoder`` that
  returns the hidden states).
* :func:`import_folder` writes the model into an ordinary workdir (``config.json``, ``params/0``, and the
  folder's ``tokenizer.json``, eos ids and chat template when it has them). A decoder: ``qkvjax eval``,
  ``sample``, ``info``, ``analyze``, ``convert`` read it and ``qkvjax train --workdir`` uptrains from it. BERT's
  encoder (no LM head: its masked-LM head is not imported): ``info``, ``analyze``, ``convert`` (K = V, GQA, MLA
  retrofits with their errors) and ``export``; ``eval``, ``sample`` and ``train`` refuse it in one line.
* :func:`export_workdir` writes a workdir's model back in the GPT-2, Llama or BERT layout where that layout can
  express it (:mod:`qkvjax.hf.layouts`: one entry per family, for import and export alike).

No torch or transformers at run time: ``safetensors`` and ``tokenizers`` only.
"""

from __future__ import annotations

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from qkvjax.chat import TOKENIZER_CONFIG
from qkvjax.chat import read_folder as read_chat
from qkvjax.hf.folder import (
    GENERATION_CONFIG,
    TOKENIZER,
    Tensors,
    checked_tokenizer,
    generation_sampling,
    read_config,
    read_tensors,
    special_ids,
    write_folder,
)
from qkvjax.hf.layouts import LAYOUTS, check_exportable, export, infer_format, layout_of
from qkvjax.models.encoder import model_of
from qkvjax.workdir import CHAT_TEMPLATE_FILE, SAMPLING_FILE, SPECIAL_IDS_FILE


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """'block_0/attention/w_q' -> shape, of the parameters the module creates (traced, nothing computed)."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    abstract = jax.eval_shape(lambda: model_of(config).init(jax.random.PRNGKey(0), tokens))["params"]
    return {_path(p): tuple(v.shape) for p, v in jax.tree_util.tree_leaves_with_path(nn.meta.unbox(abstract))}


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def check_tree(params: dict, config) -> None:
    """Raises one line naming the first parameter that is missing, extra or of another shape than the module's."""
    want = expected_shapes(config)
    got = {_path(p): tuple(np.shape(v)) for p, v in jax.tree_util.tree_leaves_with_path(params)}
    for name in sorted(set(want) | set(got)):
        if want.get(name) != got.get(name):
            raise ValueError(f"parameter {name}: the checkpoint gives {got.get(name)}, the model has {want.get(name)}")


SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
MAX_CONTEXT = 1 << 20  # positions a model may be imported with (a decode cache is (B, K, max_len, H) per layer)


def expected_params(config) -> int:
    """The parameter count the config describes: no tensor of the folder may hold more values than that."""
    from qkvjax.models.encoder import parameter_count

    return parameter_count(config)


def check_runnable(config) -> None:
    """Sizes that cannot run here are refused at import, naming the number and the limit: a context beyond
    MAX_CONTEXT (a rotary model takes ``--max-len`` to import at a shorter one), or parameters that do not fit in
    this machine's memory as float32."""
    if config.max_len > MAX_CONTEXT:
        raise ValueError(
            f"max_len={config.max_len:,} positions; allowed: at most {MAX_CONTEXT:,} (import a rotary model at a "
            "shorter context with --max-len N)"
        )
    need, have = 4 * expected_params(config), os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have:
        raise ValueError(
            f"the config describes {need // 4:,} parameters ({need / 2**30:,.1f} GiB as float32); this machine has "
            f"{have / 2**30:,.1f} GiB of memory"
        )


def load_pretrained(folder: str, max_len: int | None = None):
    """(config, params) of a Hugging Face model folder: a ``ModelConfig`` (GPT-2, Llama, Mistral, Qwen2) or an
    ``EncoderConfig`` (BERT, ``num_classes=0``), and float32 numpy parameters in the module's tree. ``max_len``
    sets a rotary model's context (default: ``max_position_embeddings``)."""
    hf = read_config(folder)
    layout = layout_of(hf)
    config = _layout_config(folder, layout, hf, max_len)
    check_runnable(config)
    raw = read_tensors(folder, max_elements=expected_params(config))
    prefix = next((p for p in layout.prefixes if any(k.startswith(p) for k in raw)), "")
    tensors = Tensors(raw, prefix)
    params = layout.params(tensors, config)
    tensors.check_all_taken(layout.ignore)
    check_tree(params, config)
    return config, params


def _layout_config(folder: str, layout, hf: dict, max_len: int | None):
    """The layout's model config of ``hf``; a field the layout needs and the file lacks (``KeyError``), or a nested
    one of the wrong kind or size (``TypeError``, ``OverflowError``: the layouts check top-level fields first),
    refused in one line naming the file."""
    file = os.path.join(folder, "config.json")
    try:
        return layout.config(hf, max_len)
    except KeyError as e:
        raise ValueError(f"{file} has no {e.args[0]!r}, which a model_type={hf.get('model_type')!r} config needs; "
                         "allowed: the config.json transformers writes for that model") from None  # fmt: skip
    except (TypeError, OverflowError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{file}: a field of the wrong kind or size ({type(e).__name__}: {first}); allowed: the "
                         "config.json transformers writes for that model") from None  # fmt: skip


def import_folder(folder: str, workdir: str, max_len: int | None = None):
    """Writes the model of ``folder`` (a decoder LM, or BERT's encoder) as a workdir; returns its run Config."""
    from qkvjax.config import Config, DataConfig, to_json
    from qkvjax.workdir import CONFIG_FILE, export_params, path, require_empty, whole_or_absent, write_text

    out = path(workdir)
    require_empty(out)  # refused before anything is read
    model, params = load_pretrained(folder, max_len)
    tokenizer = checked_tokenizer(folder)
    data = DataConfig(tokenizer=TOKENIZER if tokenizer else None)
    if not tokenizer and model.vocab_size != 256:
        print(f"note: {folder} has no {TOKENIZER}; text is byte-level (token ids are bytes)")
    config = Config(model=model, data=data)
    ids = special_ids(folder, SPECIAL_IDS)
    template, strings = read_chat(folder)  # an instruct model's prompt format, and the token strings it names
    sampling = generation_sampling(folder)  # what generate draws with, where the folder asks for sampling
    with whole_or_absent(out, "files") as staging:
        if tokenizer:
            (staging / TOKENIZER).write_bytes(tokenizer)
        if ids or strings:  # transformers' generate stops at eos_token_id: an export writes them back
            (staging / SPECIAL_IDS_FILE).write_text(json.dumps(ids | strings, indent=2) + "\n")
        if template is not None:
            (staging / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
        if sampling:
            (staging / SAMPLING_FILE).write_text(json.dumps(sampling, indent=2) + "\n")
        export_params(staging, 0, jax.tree.map(jnp.asarray, params))
        write_text(staging / CONFIG_FILE, to_json(config))
    return config


def export_workdir(workdir: str, folder: str, fmt: str | None = None, step: int | None = None) -> str:
    """Writes a workdir's model (its newest checkpoint, or ``step``) as a Hugging Face folder; returns the format."""
    from qkvjax.evaluate import restore_params
    from qkvjax.workdir import (
        chat_template,
        path,
        require_empty,
        run_config,
        sampling_defaults,
        special_tokens,
        whole_or_absent,
    )

    # every refusal before anything is restored, on the model the checkpoint holds (not a hand-edited config.json)
    model = run_config(workdir).model
    fmt = fmt or infer_format(model)
    check_exportable(model, fmt)
    require_empty(folder)
    _, params, config, _ = restore_params(workdir, step)
    hf, tensors = export(config.model, jax.tree.map(np.asarray, nn.meta.unbox(params)), fmt)
    tokenizer = checked_tokenizer(os.fspath(path(workdir))) if config.data.tokenizer else None
    # the imported model's bos/eos/pad ids, so that generate() stops where it did
    hf |= {k: v for k, v in special_tokens(workdir).items() if k in SPECIAL_IDS}
    sampling = sampling_defaults(workdir)
    generation = generation_config(sampling, {k: v for k, v in hf.items() if k in SPECIAL_IDS}) if sampling else None
    # as transformers 5's save_pretrained writes them: the template alone in chat_template.jinja, the token strings it
    # names (bos_token, eos_token, ...) in tokenizer_config.json
    chat = chat_template(workdir)
    if fmt == "bert":
        print(
            "note: a qkvjax encoder has no pooler (the hidden states do not use it); transformers' BertModel makes "
            "one with random weights and warns that it is missing: use the hidden states, not pooler_output"
        )
    with whole_or_absent(folder, "files") as staging:
        write_folder(os.fspath(staging), hf, tensors)
        if tokenizer:
            (staging / TOKENIZER).write_bytes(tokenizer)
        if generation:
            (staging / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
        if chat:
            (staging / CHAT_TEMPLATE_FILE).write_text(chat[0], encoding="utf-8")
        if chat and chat[1]:
            text = json.dumps(chat[1], indent=2, ensure_ascii=False) + "\n"
            (staging / TOKENIZER_CONFIG).write_text(text, encoding="utf-8")
    return fmt


def generation_config(sampling: dict, ids: dict) -> dict:
    """``generation_config.json`` for an imported model's own sampling settings (``sampling``, Sampling fields),
    written so that transformers' ``generate`` draws as the model's source folder asked: ``do_sample``, every cut
    written out, one that is off as off (``top_k`` 0, ``top_p`` 1: left out, generate would cut at its top_k of 50),
    and the special ids, which generate then reads from this file rather than from config.json. A model whose folder
    asked only for a repetition penalty (greedy, :func:`~qkvjax.hf.folder.generation_sampling`) gets that back
    with ``do_sample`` false."""
    extra = {k: sampling[k] for k in ("min_p", "repetition_penalty") if sampling.get(k)}  # left out when off
    if "temperature" not in sampling:
        return ids | {"do_sample": False} | extra
    cuts = {"top_k": sampling.get("top_k") or 0, "top_p": sampling.get("top_p") or 1.0}
    return ids | {"do_sample": True, "temperature": sampling["temperature"]} | cuts | extra


__all__ = [
    "checked_tokenizer",
    "LAYOUTS",
    "check_exportable",
    "check_tree",
    "export",
    "infer_format",
    "export_workdir",
    "import_folder",
    "load_pretrained",
    "model_of",
]
