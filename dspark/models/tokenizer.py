"""Tokenizer loaded from an HF directory's `tokenizer.json` with the `tokenizers` library.

Encoding applies the file's own post-processor (BOS and the like), which is what
`AutoTokenizer.from_pretrained(dir)(text)` does for fast tokenizers; tests check the two agree.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self._tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        self._config = json.loads(config_file.read_text()) if config_file.exists() else {}
        eos = self._config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id: int | None = self._tok.token_to_id(eos) if eos else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
