"""Chat templates (qkvjax.chat): where a folder's template and token strings are found, how a template renders,
and what is refused. That a template renders as transformers renders it, and that a model answers the rendered
prompt as transformers' generate does, is in tests/test_hf.py (it needs the hf extra)."""

import json

import pytest

from qkvjax.chat import conversation, read_folder, read_messages, render

CHATML = (  # trim_blocks and lstrip_blocks decide every line break and indent here
    "{% for message in messages %}\n"
    "    {% if message.content %}\n"
    "<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n"
    "    {% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "<|im_start|>assistant\n"
    "{% endif %}"
)


def test_render_is_jinja_with_transformers_environment():
    text = render(CHATML, conversation("hi there", system="be brief"), {})
    assert (
        text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    )
    # tokens by name, loop controls, namespace, tojson keeping non-ASCII and < > as they are, tools passed as none
    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}"
        "{% endif %}{% set ns.n = ns.n + 1 %}{{ m | tojson }}{% endfor %}{{ ns.n }}{{ tools is none }}"
    )
    out = render(template, conversation("café <b>", system="s"), {"bos_token": "<s>"})
    assert out == '<s>{"role": "user", "content": "café <b>"}1True'
    turns = [*conversation("q"), {"role": "assistant", "content": "a"}]  # transformers' training-mask tag
    template = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert render(template, turns, {}) == "[q][a]"


def test_a_begun_reply_is_continued_where_its_text_ends():
    turns = [*conversation("hi", history=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]),
             {"role": "assistant", "content": "Sure, "}]  # fmt: skip
    text = render(CHATML, turns, {}, continue_final=True)  # spacing kept: cut right after "Sure, "
    turn = "<|im_start|>{}\n{}<|im_end|>\n".format
    assert text == turn("user", "q") + turn("assistant", "a") + turn("user", "hi") + "<|im_start|>assistant\nSure, "
    trimming = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</>{% endfor %}"  # the marker's space too
    assert render(trimming, turns[-2:], {}, continue_final=True) == "<user>hi</><assistant>Sure,"
    dropping = "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}"  # never writes replies
    with pytest.raises(ValueError, match=r"does not write the final assistant turn's text.*allowed: a conversation"):
        render(dropping, turns, {}, continue_final=True)


def test_read_messages_takes_openai_turns_and_refuses_in_one_line(tmp_path, monkeypatch):
    file = tmp_path / "chat.json"
    turns = [{"role": "system", "content": "s"}, {"role": "user", "content": "é", "name": "ann"}]
    file.write_text(json.dumps(turns))
    assert read_messages(str(file)) == turns  # other keys go to the template as they are
    with open(file) as stdin:  # "-": standard input, as a pipe gives it
        monkeypatch.setattr("sys.stdin", stdin)
        assert read_messages("-") == turns
    monkeypatch.setattr("qkvjax.chat.MAX_MESSAGES_BYTES", len(file.read_bytes()) - 1)
    with pytest.raises(ValueError, match=r"chat.json has more than [0-9,]+ bytes; allowed: at most that"):
        read_messages(str(file))
    monkeypatch.undo()
    for content, match in (
        ("{not json", r"chat.json is not JSON text"),
        (json.dumps({"role": "user", "content": "x"}), r"holds a dict; allowed: a list of turns"),
        (json.dumps([turns[0], {"role": "user", "content": [{"type": "text"}]}]),
         r'turn 1 is \{"role": "user", "content": \[.*allowed: an object with string "role" and "content"'),
    ):  # fmt: skip
        file.write_text(content)
        with pytest.raises(ValueError, match=match) as e:
            read_messages(str(file))
        assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "template, match",
    [
        (
            "{{ raise_exception('only user and assistant roles') }}",
            r"failed \(TemplateError\): only user and assistant",
        ),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", r"failed \(SecurityError\)"),  # the sandbox holds
        ("{% for m in messages %}", r"failed \(TemplateSyntaxError\)"),
        ("{% set x = messages.append(1) %}", r"failed \(SecurityError\)"),  # immutable: the caller's list stays
    ],
)
def test_a_failing_template_is_refused_in_one_line(template, match):
    with pytest.raises(ValueError, match=match) as e:
        render(template, conversation("hi"), {})
    assert "\n" not in str(e.value)


def test_a_save_that_fails_part_way_leaves_the_earlier_file_whole(tmp_path):
    """``/save`` over an earlier save, failing part-way as on a full disk (a process limited to 1,000-byte files:
    the kernel's EFBIG once the limit is reached, SIGXFSZ ignored; no root needed): the earlier save still reads
    whole and nothing else is left in the folder. Until 2026-12-01 the file was truncated first, then written."""
    import subprocess
    import sys

    from qkvjax.chat import save_messages

    saved = tmp_path / "turns.json"
    first = [{"role": "user", "content": "h\u00e9llo"}, {"role": "assistant", "content": "b\u00f8njour"}]
    save_messages(str(saved), first)
    assert read_messages(str(saved)) == first and "h\u00e9llo" in saved.read_text(encoding="utf-8")  # not escaped
    longer = [*first, {"role": "user", "content": "x" * 5000}]
    code = (
        "import json, resource, signal, sys; from qkvjax.chat import save_messages; "
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000)); "
        "save_messages(sys.argv[1], json.loads(sys.argv[2]))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(saved), json.dumps(longer)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "File too large" in proc.stderr, proc.stderr[-1000:]
    assert read_messages(str(saved)) == first
    assert [p.name for p in tmp_path.iterdir()] == ["turns.json"]
    save_messages(str(saved), longer)  # without the limit: replaced
    assert read_messages(str(saved)) == longer


def test_read_folder_finds_what_transformers_finds(tmp_path):
    assert read_folder(str(tmp_path)) == (None, {})  # a base model: no template, no strings
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": {"content": "<|im_end|>", "special": True},  # an AddedToken, as older folders save it
                "pad_token": None,
                "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
            }
        )
    )
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<other>", "unk_token": "<unk>"}))
    template, tokens = read_folder(str(tmp_path))
    assert template == "D" and tokens == {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>"}
    (tmp_path / "chat_template.jinja").write_text("J")  # the file wins over tokenizer_config.json, as in transformers
    assert read_folder(str(tmp_path))[0] == "J"


def test_read_folder_refuses_in_one_line(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not JSON"):
        read_folder(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 7}))
    with pytest.raises(ValueError, match=r"chat_template is a int; allowed: a Jinja template string"):
        read_folder(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_bytes(b'{"chat_template": "\xff"}')
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not UTF-8 text: invalid start byte at byte 19"):
        read_folder(str(tmp_path))
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "chat_template.jinja").symlink_to("/etc/hostname")
    with pytest.raises(ValueError, match=r"points outside|symbolic link"):
        read_folder(str(tmp_path))


def test_an_interactive_session_answers_each_line_after_the_turns_so_far(tmp_path):
    """``Session.run`` on text streams, against :func:`qkvjax.sample.generate` given each turn's whole rendered
    conversation (the reply kept as the assistant's turn, turn i sampled with seed + i): commands, a turn past the
    context refused with the conversation kept, ``/reset``, ``/save`` in the format --messages reads."""
    import io

    import jax
    import jax.numpy as jnp

    from qkvjax import AttentionConfig, DecoderLM, ModelConfig
    from qkvjax.chat import Session
    from qkvjax.data.tokenizer import ByteTokenizer
    from qkvjax.sample import encode, generate

    att = AttentionConfig(num_heads=3, head_dim=6, num_kv_heads=1, rope=True)
    model = DecoderLM(ModelConfig(attention=att, vocab_size=256, d_model=15, num_layers=2, mlp_dim=21, max_len=97))
    params = jax.jit(model.init)(jax.random.PRNGKey(2), jnp.zeros((1, 5), jnp.int32))["params"]
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    )
    tok, saved = ByteTokenizer(), tmp_path / "turns.json"
    sampling = {"temperature": 1.0, "top_k": None, "top_p": 0.9}
    session = Session(model, params, tok, template, {}, system="be brief", num_tokens=7, seed=5, **sampling)
    lines = [
        "hi",
        "/bogus x",
        f"/save {saved}",
        f"/save {tmp_path}/no/such/dir/t.json",
        "/save",
        "and then?",
        "x" * 90,
        "",
        "/reset",
        "hi",
        "/exit",
        "never read",
    ]
    out, notes = io.StringIO(), io.StringIO()
    session.run(io.StringIO("".join(f"{line}\n" for line in lines)), out, notes)

    def expected(history: list[dict], line: str, seed: int) -> str:
        prompt = encode(render(template, conversation(line, "be brief", history), {}), tok, add_special_tokens=False)
        new, stats = generate(model, params, prompt, min(7, 97 - len(prompt)), seed=seed, **sampling)
        return tok.continuation(prompt.tolist(), new[: stats["lengths"]].tolist())

    first = expected([], "hi", 5)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first}]
    second = expected(turns, "and then?", 6)  # after the first exchange, the next seed
    again = expected([], "hi", 5)  # after /reset: the first turn again
    assert out.getvalue() == f"{first}\n{second}\n{again}\n"
    assert session.turns() == conversation(None, "be brief", [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": again}])  # fmt: skip
    assert read_messages(str(saved)) == conversation(None, "be brief", turns)  # saved after the first exchange
    text = notes.getvalue()
    assert "unknown command '/bogus'; allowed: /reset forgets the turns" in text
    assert "no/such/dir/t.json: No such file or directory; the conversation is kept" in text
    assert "/save needs a FILE; allowed: /save FILE" in text
    assert "refused: the conversation with this turn has" in text and "max_len=97 (/reset starts again)" in text
    assert "> " not in text  # input from a file or pipe: no prompts

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    notes = io.StringIO()
    session.run(Terminal("/reset\n/exit\nnever read\n"), io.StringIO(), notes)
    assert notes.getvalue().count("> ") == 2  # a prompt per line read, none after /exit

    class CtrlC(io.StringIO):  # Ctrl-C while the first reply is written
        def write(self, text: str) -> int:
            if not getattr(self, "hit", False):
                self.hit = True
                raise KeyboardInterrupt
            return super().write(text)

    notes, out = io.StringIO(), CtrlC()
    session.run(io.StringIO("hi\nhi\n"), out, notes)
    assert "(interrupted: this turn is dropped)" in notes.getvalue() and out.getvalue() == f"{again}\n"
    assert len(session.history) == 2  # (reset above) the second "hi" and its reply only: the first turn dropped
    with pytest.raises(ValueError, match="top_p=1.5; allowed: None or a number in"):
        Session(model, params, tok, template, {}, top_p=1.5)  # refused before any line is read


@pytest.mark.parametrize("window", [None, 5])
def test_a_session_prefills_only_what_follows_the_tokens_its_cache_holds(window):
    """Each turn reuses the last reply's cache for the longest prefix it shares with the newly rendered
    conversation: all of it where the template only appends, rewound to where a template that rewrites earlier
    turns parts (a sliding window's ring cannot rewind: begun again); every reply is the one sampled from the whole
    conversation, its repetition penalty on every token of it included."""
    import io

    import jax
    import jax.numpy as jnp

    from qkvjax import AttentionConfig, DecoderLM, ModelConfig
    from qkvjax.chat import Session
    from qkvjax.data.tokenizer import ByteTokenizer
    from qkvjax.sample import encode, generate

    att = AttentionConfig(num_heads=3, head_dim=6, num_kv_heads=1, rope=True, sliding_window=window)
    cfg = ModelConfig(attention=att, vocab_size=256, d_model=15, num_layers=2, mlp_dim=21, max_len=127,
                      learned_positions=False)  # fmt: skip
    model = DecoderLM(cfg)
    params = jax.jit(model.init)(jax.random.PRNGKey(4), jnp.zeros((1, 5), jnp.int32))["params"]
    appends = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    rewrites = appends.replace("<{{ m.role }}>", "<{{ m.role }}{{ loop.revindex }}>")  # every turn renumbered
    # ASCII replies: their text re-encodes alike; the penalty reads the tokens the cache holds, given by the session
    sampling = {"temperature": 1.0, "top_k": None, "vocab_limit": 128, "repetition_penalty": 1.3}
    tok = ByteTokenizer()
    for template in (appends, rewrites):
        session = Session(model, params, tok, template, {}, system="s", num_tokens=6, seed=3, **sampling)
        held, reused, history = [], [], []
        for turn, line in enumerate(["hi", "and then?", "ok"]):
            out = io.StringIO()
            session.run(io.StringIO(line + "\n"), out, io.StringIO())
            prompt = encode(render(template, conversation(line, "s", history), {}), tok, add_special_tokens=False)
            # streamed in buckets of 64, as the session decodes: its compiled programs
            new, _ = generate(model, params, prompt, 6, seed=3 + turn, on_token=lambda t: None, prompt_bucket=64,
                              **sampling)  # fmt: skip
            text = tok.continuation(prompt.tolist(), new.tolist())
            assert out.getvalue() == text + "\n"  # the whole conversation's sample
            shared = next((i for i, (a, b) in enumerate(zip(held, prompt.tolist(), strict=False)) if a != b), len(held))
            reused.append(session.reused)
            if shared < len(held) and window:  # a ring cannot forget its newest tokens
                assert session.reused == 0
            else:
                assert session.reused == shared
            held = [*prompt.tolist(), *new.tolist()[:5]]  # all but the last token drawn went through the model
            assert session.held == held and int(session.cache.lengths[0]) == len(held)
            history += [{"role": "user", "content": line}, {"role": "assistant", "content": text}]
        first = len(encode(render(template, conversation("hi", "s"), {}), tok, add_special_tokens=False))
        if template == appends:  # all the last turn held: its prompt and 5 of its 6 tokens
            assert reused[0] == 0 and reused[1] == first + 5
        else:  # the tokens part at the first turn's number
            assert reused[1] == (0 if window else len("<system"))
    if window:  # what the session steers around: a ring asked to forget
        with pytest.raises(ValueError, match=r"a ring of a sliding window's last 5 tokens cannot forget its newest"):
            session.cache.rewound([len(session.held) - 1])
    session.run(io.StringIO("/reset\n"), io.StringIO(), io.StringIO())
    assert session.cache is None and session.held == []
