"""`dspark.models.tokenizer.Tokenizer` against `transformers.AutoTokenizer` on the same directory.

The tokenizer is a tiny byte-level BPE trained here with the settings of
`dspark.training.tokenizer_training.train_tokenizer` (which reads the whole stdlib: too slow).
"""

from __future__ import annotations

import inspect
import json
import json.decoder
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from dspark.models.tokenizer import Tokenizer
from dspark.training.corpus import SEPARATOR

TEXTS = [
    "def f(x: int) -> int:\n    return x * 2  # double\n",
    "class A:\n\tpass\n\n\n",
    "naïve café — 東京 🙂 Ünïcödé \u200b zero-width",
    "",
    " ",
    "  \t\n\n   x   \r\n",
    "unseen words: zyzzyva quokka",
    f"first{SEPARATOR}second",
]


def _train(out: Path, bos: bool) -> Path:
    lines = inspect.getsource(json.decoder).splitlines()[:300]
    lines += ["naïve café — 東京 🙂", "    indented\tline", "x = {'a': [1, 2, 3]}"] * 3
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[SEPARATOR],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    if bos:  # a post-processor that prepends a special token, as many real tokenizers do
        tok.post_processor = processors.TemplateProcessing(
            single=f"{SEPARATOR} $A", special_tokens=[(SEPARATOR, tok.token_to_id(SEPARATOR))]
        )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {  # what train_tokenizer writes
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": SEPARATOR,
        "bos_token": None,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "bos-post-processor"])
def tok_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("tok"), bos=request.param)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_auto_tokenizer(tok_dir: Path, text: str) -> None:
    ours = Tokenizer(tok_dir).encode(text)
    ref = AutoTokenizer.from_pretrained(tok_dir)(text)["input_ids"]
    assert ours == ref


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok_dir: Path, text: str) -> None:
    tok = Tokenizer(tok_dir)
    ids = tok.encode(text)
    # Special tokens are dropped by default, so the separator itself does not come back.
    assert tok.decode(ids) == text.replace(SEPARATOR, "")
    assert tok.decode(ids, skip_special_tokens=False).endswith(text)
    assert tok.decode(ids) == AutoTokenizer.from_pretrained(tok_dir).decode(
        ids, skip_special_tokens=True
    )


def test_special_ids_and_vocab_size(tok_dir: Path) -> None:
    tok, ref = Tokenizer(tok_dir), AutoTokenizer.from_pretrained(tok_dir)
    assert tok.eos_token_id is not None
    assert tok.eos_token_id == ref.eos_token_id == ref.convert_tokens_to_ids(SEPARATOR)
    assert tok.vocab_size == len(ref) == 400
    # The BPE really merged something: code is shorter in tokens than in bytes.
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0].encode()) * 0.7
