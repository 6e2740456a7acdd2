"""Chat templates: an instruct model's prompt format, rendered as transformers' ``apply_chat_template`` renders it.

An instruct model (Qwen2.5-Instruct, Llama 3 Instruct, Gemma -it) was trained on conversations laid out by a Jinja
template that ships with its tokenizer: ``chat_template.jinja`` in the folder, or the ``chat_template`` entry of
``tokenizer_config.json`` (a string, or named templates of which ``default`` is the one used). ``qkvjax import``
keeps it in the workdir with the tokenizer's special-token strings (``bos_token``, ``eos_token``, ...), which
templates refer to; ``qkvjax sample --chat`` renders each prompt as a user message (after an optional system
message) with ``add_generation_prompt=True`` and encodes the text without adding special tokens, since the
template writes them itself. ``--messages FILE`` gives earlier turns (a JSON list in OpenAI's message format, which
``apply_chat_template`` takes) that each prompt follows; a file ending in an assistant turn, without ``--prompt``,
is that reply begun, which the model goes on with (``continue_final_message``). ``sample --chat --interactive``
(:class:`Session`) takes the user's turns from standard input, a line each, and keeps every reply for the next.

Templates come from the Hub and are untrusted code: they run in Jinja's immutable sandbox, with the environment
transformers gives them (``trim_blocks``, ``lstrip_blocks``, loop controls, a ``tojson`` that keeps non-ASCII
text, ``raise_exception``, ``strftime_now``, the ``generation`` tag), so that the same template gives the same
text in both.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
from typing import TextIO

import numpy as np

from qkvjax import checks
from qkvjax.workdir import SPECIAL_TOKENS

TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.43 saves a single template
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # older folders name the special tokens here
MAX_TEMPLATE_BYTES = 1 << 20  # the largest templates on the Hub (tool use, reasoning) are tens of kB
MAX_FILE_BYTES = 64 << 20  # a tokenizer_config.json may list every added token (Llama 3's: 50 kB)
MAX_MESSAGES_BYTES = 16 << 20  # a conversation longer than any model's context, still read at once
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker: where the final message's text ends


def read_folder(folder: str) -> tuple[str | None, dict[str, str]]:
    """(chat template or None, special-token strings) of a Hugging Face model folder, where transformers'
    ``AutoTokenizer`` finds them: ``chat_template.jinja`` before ``tokenizer_config.json``'s ``chat_template``;
    the token strings from ``tokenizer_config.json``, then ``special_tokens_map.json`` for those it lacks."""
    from qkvjax.hf.folder import read_bounded

    def read(name: str) -> str | None:
        data = read_bounded(folder, name, "tokenizer file", MAX_FILE_BYTES)
        try:
            return None if data is None else data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{os.path.join(folder, name)} is not UTF-8 text: {e.reason} at byte {e.start}") from None

    def parsed(name: str) -> dict:
        text = read(name)
        try:
            value = json.loads(text) if text is not None else {}
        except ValueError as e:
            raise ValueError(f"{os.path.join(folder, name)} is not JSON: {e}") from None
        return value if isinstance(value, dict) else {}

    config, tokens = parsed(TOKENIZER_CONFIG), {}
    for source in (config, parsed(SPECIAL_TOKENS_MAP)):
        for name in SPECIAL_TOKENS:
            value = source.get(name)
            value = value.get("content") if isinstance(value, dict) else value  # an AddedToken as a dict
            if isinstance(value, str):
                tokens.setdefault(name, value)
    template = read(TEMPLATE_FILE)
    if template is None:
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: apply_chat_template uses "default" unless told otherwise
            template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder}: chat_template is a {type(template).__name__}; allowed: a Jinja template string")
    if template is not None and len(template.encode()) > MAX_TEMPLATE_BYTES:
        raise ValueError(f"{folder}: the chat template has {len(template.encode()):,} bytes; allowed: at most "
                         f"{MAX_TEMPLATE_BYTES:,}")  # fmt: skip
    return template, tokens


def read_messages(path: str) -> list[dict]:
    """The turns of a conversation file (``-``: standard input): a JSON list of objects with string ``role`` and
    ``content`` (other keys, such as ``name``, are passed to the template as they are)."""
    try:
        with open(sys.stdin.fileno() if path == "-" else path, "rb", closefd=path != "-") as f:
            data = f.read(MAX_MESSAGES_BYTES + 1)  # a pipe has no size to ask first
        if len(data) > MAX_MESSAGES_BYTES:
            raise ValueError(f"--messages {path} has more than {MAX_MESSAGES_BYTES:,} bytes; allowed: at most that")
        turns = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--messages {path} is not JSON text: {e}") from None
    if not isinstance(turns, list):
        raise ValueError(f"--messages {path} holds a {type(turns).__name__}; allowed: a list of turns "
                         '[{"role": ..., "content": ...}, ...]')  # fmt: skip
    for i, turn in enumerate(turns):
        if not (isinstance(turn, dict) and all(isinstance(turn.get(k), str) for k in ("role", "content"))):
            raise ValueError(f"--messages {path}: turn {i} is {json.dumps(turn)[:80]}; allowed: an object with "
                             'string "role" and "content"')  # fmt: skip
    return turns


def save_messages(path: str, turns: list[dict]) -> None:
    """Writes ``turns`` as :func:`read_messages` reads them (a JSON list, non-ASCII text kept), into a file beside
    ``path`` renamed over it: a full disk or a kill while writing leaves the file that was there whole."""
    from qkvjax.workdir import replace_file

    data = (json.dumps(turns, ensure_ascii=False, indent=1) + "\n").encode("utf-8")

    def write(target: str) -> None:
        with open(target, "wb") as f:
            f.write(data)

    replace_file(path, write)


def conversation(prompt: str | None, system: str | None = None, history: list[dict] = ()) -> list[dict]:
    """A system turn when ``system`` is given, the ``history`` turns, then ``prompt`` as the user's turn when given
    (OpenAI's message format, which templates read)."""
    return [
        *([{"role": "system", "content": system}] if system is not None else []),
        *history,
        *([{"role": "user", "content": prompt}] if prompt is not None else []),
    ]


def render(template: str, messages: list[dict], tokens: dict[str, str], continue_final: bool = False) -> str:
    """The text of ``messages`` in the model's format, ending where the assistant's reply begins
    (``add_generation_prompt``); with ``continue_final``, the last message is that reply begun, and the text ends
    right after its content, as transformers' ``continue_final_message`` cuts it (so no end-of-turn token closes
    it). A template that does not parse, reaches outside the sandbox, raises, or drops the text to continue is
    refused in one line."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters (<, >, &), which would change a prompt's text
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``, which templates put around the assistant's part (transformers
        tracks it for training masks): rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, Generation]
    )
    env.filters["tojson"] = tojson
    env.globals |= {"raise_exception": raise_exception, "strftime_now": lambda f: datetime.datetime.now().strftime(f)}
    if continue_final:  # mark where the final message's text ends, to cut there after rendering
        final = messages[-1]["content"]
        messages = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]
    try:
        # tools and documents are None as transformers passes them (a template may test `tools is not none`)
        compiled = env.from_string(template)
        text = compiled.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=not continue_final, **tokens)  # fmt: skip
    except jinja2.exceptions.TemplateError as e:  # syntax errors, sandbox refusals and raise_exception alike
        raise ValueError(f"the model's chat template failed ({type(e).__name__}): {e}") from None
    if not continue_final:
        return text
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ValueError("the model's chat template does not write the final assistant turn's text as given, so it "
                         "cannot be continued; allowed: a conversation ending in a user turn")  # fmt: skip
    at = text.rindex(CONTINUE_TAG.strip())
    # a template that keeps spacing writes the whole marker; one that trims it (`| trim`) loses the trailing space
    return text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


class Session:
    """A conversation on text streams: each line read is the user's turn, rendered after every turn so far (a system
    turn first, when given) and answered; the reply is streamed as it is made and kept as the assistant's turn. The
    whole conversation is rendered and encoded again each turn, the message list a chat server is given with each
    request (a template may write earlier turns differently once a later one follows), and only what follows the
    longest prefix of those tokens that the decode cache holds goes through the prefill (a chat server's prefix
    cache: the last reply's cache is kept, rewound to where the tokens part, or begun again where a sliding window's
    ring cannot rewind); the programs are compiled once per bucket of ``PROMPT_BUCKET`` new tokens and reused
    (:func:`qkvjax.sample.generate_batch`). A turn whose text leaves no room in the context is refused in one line,
    the conversation kept. Lines starting with ``/`` are commands (:data:`COMMANDS`); turn ``i`` samples with seed
    ``seed + i``; ``**sampling``: the fields of a :class:`qkvjax.sample.Sampling` (refused at once when out of
    range)."""

    COMMANDS = "/reset forgets the turns, /save FILE writes them (as --messages reads them), /exit or end of input ends"
    PROMPT_BUCKET = 64

    def __init__(self, model, params, tokenizer, template: str, special: dict[str, str], *, system: str | None = None,
                 history: list[dict] = (), stop_ids=(), num_tokens: int = 200, seed: int = 0, **sampling):  # fmt: skip
        from qkvjax.sample import Sampling

        self.model, self.params, self.tokenizer = model, params, tokenizer
        self.template, self.special, self.system, self.history = template, special, system, list(history)
        self.stop_ids, self.num_tokens, self.seed = stop_ids, num_tokens, checks.seed("seed", seed)
        self.sampling = Sampling(**sampling)  # checked before the first line is read
        self.cache, self.held = None, []  # the last reply's decode cache (one row) and the tokens it holds
        self.reused = 0  # the tokens the last turn took from the cache instead of the prefill
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens}; allowed: >= 1 (each reply's most, cut to the context left)")

    def turns(self) -> list[dict]:
        """The conversation so far, in the format ``--messages`` reads."""
        return conversation(None, self.system, self.history)

    def reply(self, line: str, write) -> str:
        """The model's answer to ``line`` after the turns so far, each piece passed to ``write`` as it is made; the
        two turns are kept."""
        from qkvjax.sample import encode, generate

        prompt = encode(render(self.template, conversation(line, self.system, self.history), self.special),
                        self.tokenizer, add_special_tokens=False)  # fmt: skip
        max_len = self.model.config.max_len
        if len(prompt) >= max_len:
            raise ValueError(f"the conversation with this turn has {len(prompt)} tokens; allowed: fewer than the "
                             f"context, max_len={max_len} (/reset starts again)")  # fmt: skip
        streamer = self.tokenizer.streamer(write, prompt)
        turn = len(self.history) // 2
        cache, reused = self._reusable(prompt)
        self.cache, self.held = None, []  # given to the call below (donated); kept again once the reply is made
        seed = (self.seed + turn) % (checks.SEED_MAX + 1)  # each turn draws anew; the range wraps
        tokens, stats = generate(self.model, self.params, prompt[reused:], min(self.num_tokens, max_len - len(prompt)),
                                 seed=seed, on_token=streamer, stop_ids=self.stop_ids,
                                 prompt_bucket=self.PROMPT_BUCKET, cache=cache, cached_tokens=[prompt[:reused]],
                                 **dataclasses.asdict(self.sampling))  # fmt: skip
        streamer.flush()
        self.cache, self.reused = stats["cache"], reused
        self.held = [*prompt.tolist(), *tokens.tolist()][: int(self.cache.lengths[0])]  # all but the last drawn
        text = self.tokenizer.continuation(prompt.tolist(), tokens[: stats["lengths"]].tolist())
        self.history += [{"role": "user", "content": line}, {"role": "assistant", "content": text}]
        return text

    def _reusable(self, prompt: np.ndarray):
        """(cache, n): the cache to answer ``prompt`` (tokens) from, holding its first n tokens: the kept cache
        rewound to the longest prefix it shares with the prompt (leaving the prefill one token at least), or an
        empty cache where none is kept, nothing is shared, or a ring would have to forget."""
        from qkvjax.models.lm import DecodeCache

        n = min(len(self.held), len(prompt) - 1)
        parted = np.flatnonzero(np.asarray(self.held[:n], np.int32) != prompt[:n])
        common = int(parted[0]) if parted.size else n
        if self.cache is None or common == 0 or (common < len(self.held) and any(self.cache.rings)):
            return DecodeCache.empty(self.model.config, 1), 0
        return self.cache.rewound([common]), common

    def _save(self, path: str, notes: TextIO) -> None:
        """``/save FILE``; a path that cannot be written is said in one line, the conversation kept."""
        if not path:
            print("/save needs a FILE; allowed: /save FILE", file=notes)
            return
        try:
            save_messages(path, self.turns())
        except OSError as e:
            reason = os.strerror(e.errno) if e.errno else str(e)  # the file named once, not again as "while writing"
            print(f"/save {path}: {reason}; the conversation is kept, try another FILE", file=notes)
            return
        print(f"saved {len(self.turns())} turns to {path}", file=notes)

    def run(self, lines: TextIO, out: TextIO, notes: TextIO, name: str = "the model") -> None:
        """Reads turns from ``lines`` until end of input or ``/exit``; replies go to ``out``, a line each, and the
        notes and refusals to ``notes`` (so ``out`` holds the replies alone), with a ``> `` prompt before each line
        when ``lines`` is a terminal. Ctrl-C during a reply stops it and drops that turn; at the prompt, it ends."""

        def write(piece: str) -> None:
            out.write(piece)
            out.flush()

        print(f"chat with {name}, context {self.model.config.max_len} tokens: a line is your turn; {self.COMMANDS}",
              file=notes)  # fmt: skip
        while True:
            if lines.isatty():
                print("> ", end="", file=notes, flush=True)
            try:
                line = lines.readline()
            except KeyboardInterrupt:  # Ctrl-C at the prompt ends the conversation, as end of input does
                print(file=notes)
                return
            command, _, rest = line.strip().partition(" ")
            if not line or command in ("/exit", "/quit"):
                return
            if command == "/reset":
                self.history, self.cache, self.held = [], None, []
            elif command == "/save":
                self._save(rest.strip(), notes)
            elif command.startswith("/"):
                print(f"unknown command {command!r}; allowed: {self.COMMANDS}", file=notes)
            elif line.strip():
                try:
                    self.reply(line.rstrip("\n"), write)
                except ValueError as e:  # a turn too long for the context: said, and the conversation goes on
                    print(f"refused: {e}", file=notes)
                    continue
                except KeyboardInterrupt:  # Ctrl-C during a reply stops it; the turn is dropped, the rest kept
                    print("\n(interrupted: this turn is dropped)", file=notes)
                    continue
                write("\n")
