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


def test_a_folder_datasets_saved_reads_as_its_rows_and_a_dataset_dict_names_its_splits(tmp_path):
    """What `datasets` itself writes (save_to_disk: Arrow stream files and state.json), read without it; bad rows
    numbered from 1 as in a file."""
    import datasets

    rows = [{"question": f"q{i}", "answer": str(i), "meta": {"k": i}} for i in range(5)]
    rows.append({"question": "", "answer": "x", "meta": {"k": 9}})
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"), max_shard_size="1KB")
    cfg = DataConfig(prompt_key="question", label_key="answer", metadata_key="meta", shuffle=False, on_bad_row="skip")
    ds = PromptDataset(cfg, tmp_path / "ds")
    assert [(r.prompt, r.label, r.metadata, r.line) for r in ds.rows] == [
        (f"q{i}", str(i), {"k": i}, i + 1) for i in range(5)]
    assert ds.skipped == [f"{tmp_path / 'ds'}:6: 'question' must be a non-empty string, is a str"]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2]), "test": datasets.Dataset.from_list(rows[:1])}
                         ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(RLXError, match=rf"a DatasetDict: name one split's folder, one of {tmp_path / 'dd'}/test, "):
        PromptDataset(cfg, tmp_path / "dd")
    assert len(PromptDataset(cfg, tmp_path / "dd" / "train")) == 2
    (tmp_path / "plain").mkdir()
    with pytest.raises(RLXError, match="a folder must be one `datasets` saved"):
        PromptDataset(cfg, tmp_path / "plain")


def test_a_rows_sampling_overrides_are_checked_where_they_are_read(tmp_path):
    p = write(tmp_path, [json.dumps({"prompt": "a", "m": {"sampling": {"temperature": 0.5, "max_new_tokens": 9}}}),
                         json.dumps({"prompt": "b", "m": {"sampling": {"temprature": 0.5}}}),
                         json.dumps({"prompt": "c", "m": {"sampling": {"top_p": 2}}})])
    with pytest.raises(RLXError) as e:
        PromptDataset(DataConfig(metadata_key="m"), p)
    text = str(e.value)
    assert f"{p}:2: m.sampling overrides rollout.sampling, and temprature: Extra inputs are not permitted" in text
    assert f"{p}:3: m.sampling overrides rollout.sampling, and top_p: Input should be less than or equal to 1" in text
    assert PromptDataset(DataConfig(metadata_key="m", on_bad_row="skip"), p).rows[0].metadata["sampling"] == {
        "temperature": 0.5, "max_new_tokens": 9}


def mixture(tmp_path, weights=(3, 1)):
    from rlx.config import DataSource

    a = write(tmp_path, [json.dumps({"prompt": f"a{i}", "label": "a"}) for i in range(5)], "a.jsonl")
    b = write(tmp_path, [json.dumps({"q": f"b{i}", "label": "b"}) for i in range(3)], "b.jsonl")
    return DataConfig(mix=[DataSource(path=str(a), weight=weights[0]), DataSource(path=str(b), weight=weights[1],
                                                                                  prompt_key="q")])


def test_a_mixture_draws_by_weight_in_a_reproducible_order_that_resumes_exactly(tmp_path):
    """3:1 over 4000 draws: the first source's share is 0.75 within sampling error (sd 0.007); each source reads its
    own columns and keeps its own shuffled cursor (epochs of 5 and of 3 rows); rows are numbered after the sources
    before them; two mixtures with one seed draw alike, another seed otherwise; a saved position continues exactly."""
    from rlx.config import Config, ModelConfig
    from rlx.data.datasets import MixedDataset, open_dataset

    cfg = mixture(tmp_path)
    m = open_dataset(Config(model=ModelConfig(path="m"), data=cfg), seed=4)
    assert isinstance(m, MixedDataset) and len(m) == 8
    rows = [m.next() for _ in range(4000)]
    share = sum(r.label == "a" for r in rows) / len(rows)
    assert abs(share - 0.75) < 0.03, share
    assert {r.prompt for r in rows if r.label == "b"} == {"b0", "b1", "b2"}
    assert {r.index for r in rows if r.label == "a"} == set(range(5)) and {r.index for r in rows if r.label == "b"} == {
        5, 6, 7}
    b_rows = [r.prompt for r in rows if r.label == "b"]
    assert sorted(b_rows[:3]) == sorted(b_rows[3:6]) == ["b0", "b1", "b2"]  # an epoch of the source, then the next
    assert rows[0].where == f"{tmp_path / ('a.jsonl' if rows[0].label == 'a' else 'b.jsonl')}:{rows[0].line}"
    again = MixedDataset(cfg, seed=4)
    assert [again.next().prompt for _ in range(50)] == [r.prompt for r in rows[:50]]
    other = MixedDataset(cfg, seed=5)
    assert [other.next().prompt for _ in range(50)] != [r.prompt for r in rows[:50]]
    state = again.state_dict()
    resumed = MixedDataset(cfg, seed=4)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint holds it
    assert [resumed.next().prompt for _ in range(100)] == [r.prompt for r in rows[50:150]]
    with pytest.raises(RLXError, match="not of this mixture of 2 datasets"):
        MixedDataset(cfg, seed=4).load_state_dict(PromptDataset(DataConfig(), cfg.mix[0].path).state_dict())
    with pytest.raises(RLXError, match="is of a mixture of datasets"):
        PromptDataset(DataConfig(), cfg.mix[0].path).load_state_dict(state)


def test_one_dataset_or_a_mixture_not_both(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="set data.path .one dataset. or data.mix .several., not both"):
        DataConfig(path="x.jsonl", mix=mixture(tmp_path).mix)


def test_each_adapter_of_a_multi_lora_run_draws_its_own_prompts_in_turn_by_weight(tmp_path):
    """``train.lora.adapters``: rows come from each adapter's own file in turn, weights 2:1 giving exactly two of the
    first per one of the second in every three draws (smooth weighted round-robin), each row marked with its adapter and
    read with its own columns; rows are numbered after the adapters before them; a saved position continues exactly,
    and one saved for other adapters is refused by name."""
    from rlx.config import Config, DataSource, LoRAAdapterConfig, LoRAConfig, ModelConfig
    from rlx.data.datasets import AdapterDatasets, open_dataset

    a = write(tmp_path, [json.dumps({"prompt": f"a{i}", "label": "a"}) for i in range(5)], "a.jsonl")
    b = write(tmp_path, [json.dumps({"q": f"b{i}", "label": "b"}) for i in range(3)], "b.jsonl")
    adapters = [LoRAAdapterConfig(name="add", data=DataSource(path=str(a), weight=2)),
                LoRAAdapterConfig(name="sub", data=DataSource(path=str(b), prompt_key="q"))]
    cfg = Config(model=ModelConfig(path="m"), train={"lora": LoRAConfig(adapters=adapters)})
    d = open_dataset(cfg, seed=4)
    assert isinstance(d, AdapterDatasets) and len(d) == 8
    rows = [d.next() for _ in range(30)]
    assert [r.lora for r in rows[:6]] == ["add", "sub", "add", "add", "sub", "add"]
    assert all([r.lora for r in rows[i:i + 3]].count("add") == 2 for i in range(0, 30, 3))
    assert all(r.label == r.prompt[0] == {"add": "a", "sub": "b"}[r.lora] for r in rows)
    assert {r.index for r in rows if r.lora == "sub"} == {5, 6, 7}
    state = json.loads(json.dumps(d.state_dict()))
    more = [d.next().prompt for _ in range(12)]
    resumed = AdapterDatasets(cfg.data, adapters, seed=4)
    resumed.load_state_dict(state)
    assert [resumed.next().prompt for _ in range(12)] == more
    with pytest.raises(RLXError, match=r"not of the adapters \['sub', 'add'\]"):
        AdapterDatasets(cfg.data, adapters[::-1], seed=4).load_state_dict(state)
