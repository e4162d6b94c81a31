"""builtin://tiny-qwen3-code: a tiny model that can hold a coding-agent harness's prompt (a tokenizer trained on
code and English, 131,072 tokens of context)."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def code_model(tiny_model_path):  # tiny_model_path points RLX_CACHE at this session's private cache
    from rlx.models.tiny import resolve_model_path

    return resolve_model_path("builtin://tiny-qwen3-code")


def test_its_folder_names_the_python_whose_library_trained_the_tokenizer(code_model):
    from rlx.models.tiny import stdlib_fingerprint

    fingerprint = stdlib_fingerprint()
    assert Path(code_model).name.endswith(f"-py{sys.version_info[0]}{sys.version_info[1]}-{fingerprint}")
    assert len(fingerprint) == 8 and fingerprint == stdlib_fingerprint()
    config = json.loads((Path(code_model) / "config.json").read_text())
    assert config["max_position_embeddings"] == 131072 and config["vocab_size"] == 16384


def test_text_it_never_saw_takes_about_four_characters_a_token(code_model):
    """rlx's own code, prose and a tool schema, none of which is in the standard library it was trained on (the
    arithmetic tokenizer of tiny-qwen3 takes under 2 characters a token on the same text)."""
    from transformers import AutoTokenizer

    from rlx.models.tiny import build_tokenizer

    tok, arithmetic = AutoTokenizer.from_pretrained(code_model), build_tokenizer()
    tool = json.dumps({"name": "Bash", "description": "Run a shell command in the task's folder and return what it "
                       "printed.", "input_schema": {"type": "object", "properties": {"command": {
                           "type": "string", "description": "The command line to run"}}, "required": ["command"]}})
    texts = {"code": (ROOT / "core/rlx/config/schema.py").read_text(), "prose": (ROOT / "README.md").read_text(),
             "tool": tool}
    for name, text in texts.items():
        per_token = len(text) / len(tok.encode(text, add_special_tokens=False))
        assert per_token > {"code": 3.0, "prose": 2.7, "tool": 3.3}[name], (name, per_token)
        assert len(text) / len(arithmetic.encode(text, add_special_tokens=False)) < 2.0, name
    assert tok.decode(tok.encode(texts["code"], add_special_tokens=False)) == texts["code"]  # byte-level: lossless


def test_positions_far_into_the_context_run_and_the_cache_continues_them(code_model):
    """A prompt placed at position 100,000 (rope at 1e6 theta), and one step more from its KV, agree with the
    whole sequence run at once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(code_model, dtype=torch.float32).eval()
    ids = torch.randint(3, 16000, (1, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(100_000, 100_009)[None]
    with torch.no_grad():
        whole = model(input_ids=ids, position_ids=pos).logits
        first = model(input_ids=ids[:, :8], position_ids=pos[:, :8], use_cache=True)
        step = model(input_ids=ids[:, 8:], position_ids=pos[:, 8:], past_key_values=first.past_key_values).logits
    assert torch.isfinite(whole).all()
    assert torch.allclose(step[0, -1], whole[0, -1], atol=1e-5)
