import json

import pytest

from rlx.config import DataConfig
from rlx.data.datasets import PromptDataset, tokenize_prompt
from rlx.errors import RLXError


def write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD = json.dumps({"prompt": "what is 1 + 1", "label": "2"})


def test_bad_rows_are_fatal_with_their_line_by_default(tmp_path):
    p = write(tmp_path, [GOOD, "{not json", GOOD])
    with pytest.raises(RLXError, match=rf"{p}:2: not valid JSON"):
        PromptDataset(DataConfig(), p)


def test_every_bad_row_is_reported_at_once_non_utf8_included(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b"\n".join([GOOD.encode(), b"{not json", '{"prompt": "caf\xe9"}'.encode("latin-1"), GOOD.encode(),
                              json.dumps({"prompt": 3}).encode()]) + b"\n")
    with pytest.raises(RLXError) as e:
        PromptDataset(DataConfig(), p)
    text = str(e.value)
    assert text.startswith("3 bad data rows")
    assert f"{p}:2: not valid JSON" in text and f"{p}:3: not valid UTF-8 (byte 0xe9 at column 16)" in text
    assert f"{p}:5: 'prompt' must be a non-empty string" in text
    skipped = PromptDataset(DataConfig(on_bad_row="skip"), p)  # skip mode skips the undecodable row too
    assert [r.line for r in skipped.rows] == [1, 4] and len(skipped.skipped) == 3
    many = tmp_path / "many.jsonl"
    many.write_text("\n".join([GOOD] + ["{bad"] * 30) + "\n")
    with pytest.raises(RLXError, match=r"30 bad data rows[\s\S]*\.\.\. and 10 more"):
        PromptDataset(DataConfig(), many)


def test_bad_rows_are_skipped_and_reported_when_asked(tmp_path):
    p = write(tmp_path, [GOOD, "{not json", json.dumps({"prompt": 3}), "[1]", "", json.dumps({"q": "x"}), GOOD])
    ds = PromptDataset(DataConfig(on_bad_row="skip"), p)
    assert len(ds) == 2
    assert [s.split(": ", 1)[0] for s in ds.skipped] == [f"{p}:2", f"{p}:3", f"{p}:4", f"{p}:6"]
    assert "'prompt' must be a non-empty string, is missing" in ds.skipped[3]
    assert [r.line for r in ds.rows] == [1, 7]


def test_messages_key_and_metadata(tmp_path):
    row = {"msgs": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
           "answer": 5, "meta": {"k": 1}}
    p = write(tmp_path, [json.dumps(row)])
    ds = PromptDataset(DataConfig(messages_key="msgs", label_key="answer", metadata_key="meta"), p)
    r = ds.next()
    assert r.messages == row["msgs"] and r.label == 5 and r.metadata == {"k": 1}


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "", "c"], "label": ["1", "2", "3"]}), p)
    ds = PromptDataset(DataConfig(on_bad_row="skip", shuffle=False), p)
    assert [r.prompt for r in ds.rows] == ["a", "c"] and ds.skipped[0].startswith(f"{p}:2:")


def test_shuffled_order_is_a_permutation_per_epoch_and_resumes_exactly(tmp_path):
    p = write(tmp_path, [json.dumps({"prompt": f"p{i}", "label": i}) for i in range(7)])
    ds = PromptDataset(DataConfig(), p, seed=3)
    first_epoch = [ds.next().label for _ in range(7)]
    assert sorted(first_epoch) == list(range(7)) and first_epoch != list(range(7))
    ds.next(), ds.next()
    state = ds.state_dict()
    rest = [ds.next().label for _ in range(9)]
    again = PromptDataset(DataConfig(), p, seed=3)
    again.load_state_dict(state)
    assert [again.next().label for _ in range(9)] == rest


def test_unknown_extension_and_missing_file(tmp_path):
    with pytest.raises(RLXError, match="does not exist"):
        PromptDataset(DataConfig(), tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(RLXError, match="expected a .jsonl or .parquet"):
        PromptDataset(DataConfig(), tmp_path / "x.csv")


def test_chat_template_is_applied_with_the_tokenizer(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    p = write(tmp_path, [GOOD])
    row = PromptDataset(DataConfig(), p).next()
    ids = tokenize_prompt(tok, row, chat=True)
    assert tok.decode(ids) == "<|im_start|>user\nwhat is 1 + 1<|im_end|>\n<|im_start|>assistant\n"
    assert tokenize_prompt(tok, row, chat=False) == tok.encode("what is 1 + 1", add_special_tokens=False)
