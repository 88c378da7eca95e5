"""load_tokenizer: the bundled model's tokenizer loads without AutoConfig (and torch), and is
AutoTokenizer's."""

import subprocess
import sys

from transformers import AutoTokenizer

from radixserve.tokenizer import apply_chat_template, load_tokenizer

TEXTS = [
    "Hello, world!",
    "Déjà vu: 数据库 🚀 <|im_end|> done",
    "  leading spaces\n\ttabs",
    "def f(x):\n    return x",
]


def test_direct_load_equals_auto_tokenizer(model_dir):
    direct, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert type(direct) is type(auto) and len(direct) == len(auto)
    assert (direct.eos_token_id, direct.bos_token_id, direct.pad_token_id) == (
        auto.eos_token_id,
        auto.bos_token_id,
        auto.pad_token_id,
    )
    for text in TEXTS:
        for special in (True, False):
            ids = direct.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special)
            assert direct.decode(ids) == auto.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[1]}]
    assert apply_chat_template(direct, messages) == apply_chat_template(auto, messages)


def test_direct_load_does_not_import_torch(model_dir):
    code = (
        "import sys; from radixserve.tokenizer import load_tokenizer; "
        f"load_tokenizer({str(model_dir)!r}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
