"""Text to token ids for ``megaray prepare``: UTF-8 bytes, or a Hugging Face ``tokenizer.json``,
and chat rendering for SFT records (the tokenizer's chat template, else the documented one)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from megaray.errors import DataError

BYTE_EOS = 0            # the byte-level tokenizer's end of sequence (NUL)
# The documented chat template used when the tokenizer has none (Jinja2, like Hugging Face's).
# Each message is "<|role|>\n" + content (+ the end-of-sequence token after an assistant's) + "\n".
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


class BadRow(Exception):
    """One input record cannot be used; ``reason`` is the counted category."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class TextTokenizer:
    """UTF-8 bytes (vocab 256, end of sequence = NUL), or a Hugging Face ``tokenizer.json``."""

    def __init__(self, model_dir: str | None = None):
        self.model_dir = model_dir
        self.hf = None
        self.chat_template: str | None = None
        self.eos_token, self.bos_token = "\x00", ""
        if model_dir is None:
            self.vocab_size, self.eos_id = 256, BYTE_EOS
            return
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise DataError(f"{model_dir}: no tokenizer.json")
        from tokenizers import Tokenizer

        self.hf = Tokenizer.from_file(path)
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        tc_path = os.path.join(model_dir, "tokenizer_config.json")
        tc = json.loads(Path(tc_path).read_text()) if os.path.isfile(tc_path) else {}
        tok = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731
        self.eos_token = tok(tc.get("eos_token")) or ""
        self.bos_token = tok(tc.get("bos_token")) or ""
        eos = self.hf.token_to_id(self.eos_token) if self.eos_token else None
        if eos is None:
            raise DataError(f"{tc_path}: no eos_token that the tokenizer knows; packing needs one")
        self.eos_id = eos
        tmpl = tc.get("chat_template")
        self.chat_template = tmpl if isinstance(tmpl, str) else None

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.hf is None:
            return [list(t.encode("utf-8")) for t in texts]
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise BadRow("chat template error", f"the chat template refused the messages: {msg}")

        env.globals["raise_exception"] = raise_exception
        t = env.from_string(self.chat_template or CHAT_TEMPLATE)
        return t.render(messages=messages, add_generation_prompt=add_generation_prompt,
                        eos_token=self.eos_token, bos_token=self.bos_token)


def model_tokenizer(model_dir: str | None):
    """The ``tokenizers.Tokenizer`` of a model directory, or None (byte-level)."""
    if not model_dir or not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
