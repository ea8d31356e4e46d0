"""Tokenizers: a tiny character tokenizer for the synthetic task (CPU demo), and ``load_tokenizer`` for HF ones.

    tok = load_tokenizer(None)                                   # the char tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "07+45="}], add_generation_prompt=True)
    tok.decode(ids)                                              # "<bos>Q: 07+45="
    tok = load_tokenizer("/models/Qwen2.5-7B")                   # transformers.AutoTokenizer, local files only

The char tokenizer speaks the subset of the HF API the project uses (``encode``/``decode``/``batch_decode``/
``__call__``/``apply_chat_template``/``save_pretrained``, ``eos_token_id``, ``pad_token_id``, ``vocab_size``). Special
tokens appear in text as ``<pad>``, ``<bos>``, ``<eos>`` (as HF chat templates write theirs), so rendering a chat to
text and encoding that text give the same ids as tokenizing directly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
# Everything the compact synthetic task writes: "Q: 07+45=" -> " Answer: 52".
CHAR_SYMBOLS = tuple("0123456789") + ("Q", ":", " ", "+", "=", "A", "n", "s", "w", "e", "r", "\n")
# "char:tools": enough more to spell a tool call (data/tool_mul.py): the lowercase letters and JSON's punctuation
TOOL_SYMBOLS = CHAR_SYMBOLS + tuple(c for c in 'abcdefghijklmnopqrstuvwxyz{}",*<>/_' if c not in CHAR_SYMBOLS)
NAMED_SYMBOLS = {"char": CHAR_SYMBOLS, "char:tools": TOOL_SYMBOLS}
CHAR_TOKENIZER_FILE = "char_tokenizer.json"
UNKNOWN = "<unk>"

_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


class CharTokenizer:
    """One id per character; ids 0, 1, 2 are ``<pad>``, ``<bos>``, ``<eos>``. See the module docstring."""

    name_or_path = "char"

    def __init__(self, symbols: Sequence[str] = CHAR_SYMBOLS):
        self.vocab: list[str] = [*SPECIAL_TOKENS, *symbols]
        if len(set(self.vocab)) != len(self.vocab):
            raise ValueError(f"char tokenizer: duplicate symbols in {self.vocab!r}")
        if any(len(s) != 1 for s in symbols):
            raise ValueError(f"char tokenizer: symbols must be single characters, got {list(symbols)!r}")
        self.token_to_id = {s: i for i, s in enumerate(self.vocab)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = (self.token_to_id[t] for t in SPECIAL_TOKENS)
        self.pad_token, self.bos_token, self.eos_token = SPECIAL_TOKENS
        self.all_special_ids = [self.pad_token_id, self.bos_token_id, self.eos_token_id]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)

    # -- text <-> ids ---------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text`` (``<bos>``-style markers become their ids); ``add_special_tokens`` prepends ``<bos>``."""
        ids = [self.bos_token_id] if add_special_tokens else []
        pos = 0
        for match in [*_SPECIAL_RE.finditer(text), None]:
            end = match.start() if match else len(text)
            for offset, ch in enumerate(text[pos:end]):
                tid = self.token_to_id.get(ch)
                if tid is None:
                    raise ValueError(
                        f"char tokenizer: character {ch!r} at position {pos + offset} of {text[:60]!r} is not in its "
                        f"vocabulary {''.join(self.vocab[3:])!r}; it only serves the compact synthetic task "
                        "(set model.tokenizer to an HF tokenizer for real text)"
                    )
                ids.append(tid)
            if match:
                ids.append(self.token_to_id[match.group()])
                pos = match.end()
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; ids outside the vocabulary (padded model vocab) decode to ``<unk>``."""
        special = set(self.all_special_ids) if skip_special_tokens else set()
        out = []
        for i in ids:
            i = int(i)
            if i in special:
                continue
            out.append(self.vocab[i] if 0 <= i < len(self.vocab) else UNKNOWN)
        return "".join(out)

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def __call__(self, texts: str | Sequence[str], add_special_tokens: bool = False, **_: Any) -> dict:
        """HF-style batch call: ``{"input_ids": [...]}`` (a list of lists for a list of texts)."""
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in texts]}

    # -- chat -----------------------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **_: Any,
    ) -> list[int] | str:
        """Compact rendering: ``<bos>`` then each user turn as ``Q: {content}``, assistant turns as
        ``{content}<eos>``, system turns as ``{content}\\n``. The answer continues right after the question, so
        ``add_generation_prompt`` adds nothing."""
        del add_generation_prompt  # accepted for HF compatibility; the answer follows the "=" directly
        parts = [BOS]
        for i, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if not isinstance(content, str):
                raise ValueError(f"char chat template: message {i} has no string content: {message!r}")
            if role == "user":
                parts.append(f"Q: {content}")
            elif role == "assistant":
                parts.append(f"{content}{EOS}")
            elif role == "system":
                parts.append(f"{content}\n")
            else:
                raise ValueError(f"char chat template: message {i} has unknown role {role!r}")
        text = "".join(parts)
        return self.encode(text) if tokenize else text

    # -- persistence ----------------------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``char_tokenizer.json`` into ``directory`` (created if needed); returns the file."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / CHAR_TOKENIZER_FILE
        path.write_text(json.dumps({"type": "char", "version": 1, "symbols": self.vocab[len(SPECIAL_TOKENS) :]}))
        return path

    save = save_pretrained

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> CharTokenizer:
        path = Path(directory) / CHAR_TOKENIZER_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"char tokenizer: {path} not found") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"char tokenizer: {path}: not valid JSON: {e}") from e
        if data.get("type") != "char" or not isinstance(data.get("symbols"), list):
            raise ValueError(f"char tokenizer: {path}: expected {{'type': 'char', 'symbols': [...]}}")
        return cls(data["symbols"])

    load = from_pretrained

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.vocab == self.vocab

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def is_char_tokenizer_dir(path: str | Path) -> bool:
    return (Path(path) / CHAR_TOKENIZER_FILE).is_file()


def is_char_tokenizer(path: str | Path | None) -> bool:
    """True for every tokenizer ``load_tokenizer`` builds as a ``CharTokenizer`` (None, a named symbol set, a saved dir)."""
    return path is None or str(path) in NAMED_SYMBOLS or is_char_tokenizer_dir(path)


def load_tokenizer(path: str | Path | None) -> Any:
    """``None`` / ``"char"`` -> ``CharTokenizer``; ``"char:tools"`` -> one that spells tool calls; a directory with ``char_tokenizer.json`` -> that char tokenizer;
    anything else -> ``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)`` (never the hub).

    HF tokenizers without a pad token get ``pad_token = eos_token`` (batched generation needs one).
    """
    if path is None or str(path) in NAMED_SYMBOLS:
        return CharTokenizer(NAMED_SYMBOLS[str(path or "char")])
    if is_char_tokenizer_dir(path):
        return CharTokenizer.from_pretrained(path)
    if not Path(path).exists():
        raise FileNotFoundError(f"tokenizer {str(path)!r}: no such directory (model.tokenizer; None = char tokenizer)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
