"""Text from a workdir's model, as ``qkvjax sample`` writes it: a :class:`Request` (the command's flags, checked when
it is made, before anything is restored or compiled) and :func:`complete`, which restores the checkpoint, renders
chat turns in the model's template, decodes every prompt's continuations in one batch with the KV cache
(:func:`qkvjax.sample.generate_batch`) and prints them, or holds a conversation on standard input
(:class:`qkvjax.chat.Session`). Errors name the flags, as the command takes them."""

from __future__ import annotations

import dataclasses
import sys
from typing import TextIO

from qkvjax import checks


@dataclasses.dataclass(frozen=True)
class Request:
    """One ``qkvjax sample`` call. ``prompts``: texts to continue (with ``chat``, each a user turn after ``system``'s
    and the ``messages`` file's turns; ``-`` reads that file from standard input). ``interactive``: a conversation,
    one user turn a line of standard input. ``num_samples`` continuations per prompt; a sampling setting left None
    is the workdir's own (an imported model's generation_config.json), else :class:`qkvjax.sample.Sampling`'s;
    ``top_k`` 0, ``top_p`` 1 and ``repetition_penalty`` 1 turn theirs off. ``ignore_eos``: rows go on past the
    model's end-of-sequence ids. ``step``: a checkpoint (None: the newest)."""

    workdir: str
    prompts: tuple[str, ...] = ()
    num_tokens: int = 200
    step: int | None = None
    num_samples: int = 1
    seed: int = 0
    chat: bool = False
    system: str | None = None
    messages: str | None = None
    interactive: bool = False
    ignore_eos: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "prompts", tuple(self.prompts or ()))  # argparse's append gives a list or None
        for flag, value in (("--system", self.system), ("--messages", self.messages),
                            ("--interactive", self.interactive)):  # fmt: skip
            if value not in (None, False) and not self.chat:
                raise ValueError(f"{flag} gives chat turns; allowed: with --chat only")
        if self.interactive and (self.prompts or self.messages == "-"):
            flag = "--prompt" if self.prompts else "--messages -"
            raise ValueError(f"--interactive reads the user's turns from standard input; allowed: without {flag}")
        if not self.prompts and self.messages is None and not self.interactive:
            raise ValueError("sample needs a --prompt TEXT (or, with --chat, a --messages FILE or --interactive); "
                             "allowed: one of them")  # fmt: skip
        if self.num_samples < 1:
            raise ValueError(f"--num-samples {self.num_samples}; allowed: an int >= 1")
        checks.seed("--seed", self.seed)

    def sampling(self, defaults: dict):
        """The sampling settings as a :class:`~qkvjax.sample.Sampling` (refused here in one line, before anything is
        restored or compiled): each one given, else ``defaults`` (an imported model's own), else the library's."""
        from qkvjax.sample import Sampling

        given = {k: getattr(self, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
        given = {k: v for k, v in given.items() if v is not None}
        for name, off in (("top_k", 0), ("repetition_penalty", 1.0)):
            if given.get(name) == off:
                given[name] = None
        return Sampling(**(defaults | given))


def _template(request: Request, chat) -> tuple[str, dict[str, str]]:
    if chat is None:
        raise ValueError(
            f"--chat: {request.workdir} has no chat template (qkvjax import keeps one from a model folder's "
            "chat_template.jinja or tokenizer_config.json); allowed: a prompt as typed, without --chat"
        )
    return chat


def _history(request: Request) -> list[dict]:
    """--messages' turns (none without it), refused beside --system when they hold a system turn."""
    from qkvjax.chat import read_messages

    history = read_messages(request.messages) if request.messages is not None else []
    if request.system is not None and any(turn["role"] == "system" for turn in history):
        raise ValueError(f"--system and a system turn in --messages {request.messages}; allowed: one of them")
    return history


def _vocab_limit(tokenizer, config, err: TextIO) -> int | None:
    """256 for a model whose text is bytes but whose table is wider, with a note; for a run on a prepared corpus,
    its tokenizer's vocabulary (GPT-2's 50,257 in a table padded to 50,304: the padding ids decode to nothing);
    else None (an imported model draws from its whole table, as transformers does)."""
    from qkvjax.data.tokenizer import ByteTokenizer

    if config.model.vocab_size <= tokenizer.vocab_size:
        return None
    if not isinstance(tokenizer, ByteTokenizer):
        return tokenizer.vocab_size if config.data.prepared is not None else None
    print(f"note: the model has {config.model.vocab_size} tokens and no tokenizer.json, so its text is bytes: only "
          "ids 0-255 are drawn", file=err)  # fmt: skip
    return 256


def _chat_prompts(request: Request, chat) -> list[str]:
    """Each prompt as the user's turn after --system's and --messages' turns, in the model's chat template, ready
    for its reply; without a prompt, the --messages conversation itself, continued when it ends in the assistant's
    turn (a reply begun)."""
    from qkvjax.chat import conversation, render

    template, tokens = _template(request, chat)
    history = _history(request)
    if request.prompts:
        return [render(template, conversation(p, request.system, history), tokens) for p in request.prompts]
    if not history:
        raise ValueError(f"--messages {request.messages} holds no turns; allowed: at least one, or a --prompt")
    turns = conversation(None, request.system, history)
    return [render(template, turns, tokens, continue_final=turns[-1]["role"] == "assistant")]


def _converse(request: Request, saved, tokenizer, stops, chat, sampling, streams) -> None:
    """--interactive: a :class:`~qkvjax.chat.Session` on the streams, its replies kept for the next turn."""
    from qkvjax.chat import Session
    from qkvjax.evaluate import restore_params

    template, special = _template(request, chat)
    history = _history(request)
    model, params, config, step = restore_params(request.workdir, request.step)
    sampling = dataclasses.replace(sampling, vocab_limit=_vocab_limit(tokenizer, config, streams[2]))
    session = Session(model, params, tokenizer, template, special, system=request.system, history=history,
                      stop_ids=stops, num_tokens=request.num_tokens, seed=request.seed,
                      **dataclasses.asdict(sampling))  # fmt: skip
    session.run(*streams, f"{request.workdir} (step {step})")


def complete(request: Request, stdin: TextIO | None = None, out: TextIO | None = None, err: TextIO | None = None):
    """Carries out ``request`` on the workdir's model: its continuations on ``out`` (one prompt streamed as it is
    made; several, each under a ``=== prompt i ===`` header) and a line of what was decoded, at what speed, on
    ``err``; with ``interactive``, a conversation read from ``stdin``. The streams default to the process's."""
    import jax

    from qkvjax.config import require_decoder
    from qkvjax.data.tokenizer import check_vocab, run_tokenizer
    from qkvjax.evaluate import restore_params
    from qkvjax.models.lm import DecodeCache
    from qkvjax.sample import check_request, describe_sampling, encode, generate_batch
    from qkvjax.workdir import chat_template, load_config, sampling_defaults, stop_ids

    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    r = request
    saved = load_config(r.workdir)
    require_decoder(saved, "sample")
    stops = () if r.ignore_eos else stop_ids(r.workdir)
    tokenizer = run_tokenizer(saved.data, r.workdir)
    if saved.data.tokenizer is not None or saved.data.prepared is not None:
        check_vocab(tokenizer, saved.model.vocab_size)
    defaults = sampling_defaults(r.workdir)
    sampling = r.sampling(defaults)
    if r.num_samples > 1 and (r.interactive or sampling.temperature == 0):
        why = "--interactive (one reply a turn)" if r.interactive else "--temperature 0 (greedy: one continuation)"
        raise ValueError(f"--num-samples {r.num_samples} with {why}; allowed: 1, or a temperature > 0 without "
                         "--interactive")  # fmt: skip
    if own := describe_sampling({k: getattr(sampling, k) for k in defaults if getattr(r, k) is None}):
        # said before anything is drawn: these are not the defaults --help shows
        print(f"note: sampling with {own} ({r.workdir}'s own, from its generation_config.json; a flag overrides "
              "each)", file=err)  # fmt: skip
    chat = chat_template(r.workdir)
    if r.interactive:
        return _converse(r, saved, tokenizer, stops, chat, sampling, (stdin, out, err))
    texts = _chat_prompts(r, chat) if r.chat else list(r.prompts)
    # refuse an empty prompt before restoring anything; a rendered template writes its own special tokens
    prompts = [encode(p, tokenizer, add_special_tokens=not r.chat) for p in texts]
    n = r.num_samples
    try:  # the rows' cache must fit before they are made (a typo's --num-samples 10^9 filled the memory)
        jax.eval_shape(lambda: DecodeCache.empty(saved.model, len(prompts) * n))
    except ValueError as e:
        raise ValueError(f"--num-samples {n} x {len(prompts)} prompt(s): {e}") from None
    texts = [t.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for t in texts]  # echoed: bytes that
    # are not UTF-8 (given on the command line to a byte model) print as U+FFFD on any terminal's encoding
    texts, prompts = [t for t in texts for _ in range(n)], [p for p in prompts for _ in range(n)]  # prompt-major
    model, params, config, step = restore_params(r.workdir, r.step)
    check_request(model, prompts, r.num_tokens)  # before the prompt is echoed
    if chat is not None and not r.chat:  # an instruct model given raw text continues it rather than answer
        print(f"note: {r.workdir} has a chat template: --chat writes each prompt as a user turn in it; the prompt "
              "is continued as typed", file=err)  # fmt: skip
    sampling = dataclasses.replace(sampling, vocab_limit=_vocab_limit(tokenizer, config, err))  # before the first token
    stream = len(prompts) == 1
    streamer = tokenizer.streamer(lambda s: (out.write(s), out.flush()), prompts[0])
    if stream:
        out.write(texts[0])
    tokens, stats = generate_batch(
        model,
        params,
        prompts,
        r.num_tokens,
        seed=r.seed,
        on_token=streamer if stream else None,
        stop_ids=stops,
        share_prefix=True,  # one sample of one prompt shares nothing: a row of its own
        **dataclasses.asdict(sampling),
    )
    if stream:
        streamer.flush()
    else:
        for i, (prompt, row) in enumerate(zip(texts, tokens, strict=True)):
            text = tokenizer.continuation(prompts[i].tolist(), row[: stats["lengths"][i]].tolist())
            name = f"prompt {i // n}" + (f", sample {i % n}" if n > 1 else "")
            print(f"{'' if i == 0 else chr(10)}=== {name} ===\n{prompt}{text}", file=out)
    layout = config.model.attention.scheme + (f", layers {config.model.layers!r}" if config.model.layers else "")
    shared = stats["shared_prefix"] and f", the first {stats['shared_prefix']} prompt tokens read once for all rows"
    if any(length < r.num_tokens for length in stats["lengths"]):
        print(
            f"\n--- stopped at the end-of-sequence token (eos_token_id {list(stops)}) after {stats['lengths']} new "
            "tokens (--ignore-eos goes on)",
            file=err,
        )
    print(
        f"\n--- step {step}, scheme {layout}: {len(prompts)} x {stats['decode_steps']} tokens at "
        f"{stats['tokens_per_s']:,.1f} tokens/s (after {stats['prefill_and_compile_s']:.2f}s prefill + compile"
        f"{shared or ''}); KV cache {stats['cache_bytes']:,} bytes",
        file=err,
    )
