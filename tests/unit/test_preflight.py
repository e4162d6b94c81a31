"""Checks before start-up: what `rl config validate` and the first second of `rl train` catch from the files
a config names, each located at its key in the config file."""

import json

import pytest

from rlx.config import load_config
from rlx.errors import ConfigError
from rlx.preflight import config_checks

GOOD = json.dumps({"prompt": "what is 1 + 1", "label": "2"})


def model(tmp_path, heads=8, kv=4, layers=6, **more):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_attention_heads": heads, "num_key_value_heads": kv,
                                                    "num_hidden_layers": layers, **more}))
    return folder


def problems(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p, checks=config_checks(files=True))
    return dict(e.value.problems), p


def test_a_good_config_passes_and_without_preflight_files_are_not_read(tmp_path):
    m = model(tmp_path)
    (tmp_path / "d.jsonl").write_text(GOOD + "\n")
    p = tmp_path / "c.yaml"
    p.write_text(f"model: {{path: {m}}}\ndata: {{path: d.jsonl}}\ntrain: {{parallel: {{tp: 2, pp: 3, world_size: 6}}}}\n")
    assert load_config(p, checks=config_checks(files=True)).train.parallel.tp == 2
    p.write_text("model: {path: /does/not/exist}\n")
    assert load_config(p).model.path == "/does/not/exist"  # parsing alone never touches the files


def test_missing_model_not_an_hf_folder_and_bad_prompt_files_are_all_reported(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "d.jsonl").write_bytes(GOOD.encode() + b"\n{x\n" + b'{"prompt": "\xff"}\n')
    got, p = problems(tmp_path, "model: {path: nowhere}\n"
                                "data: {path: d.jsonl}\n"
                                "rollout: {engines: [{model_path: empty}]}\n"
                                "eval: {datasets: [{name: h, path: missing.jsonl}]}\n")
    assert got[f"{p}:1: model.path"] == f"{tmp_path / 'nowhere'} does not exist"
    assert got[f"{p}:3: rollout.engines[0].model_path"].endswith("has no config.json: not an HF model folder")
    rows = got[f"{p}:2: data.path"]
    assert rows.startswith("2 bad data rows") and ":2: not valid JSON" in rows and ":3: not valid UTF-8" in rows
    assert "missing.jsonl does not exist" in got[f"{p}:4: eval.datasets[0].path"]


def test_a_mixtures_datasets_are_found_beside_the_config_and_checked_with_their_own_columns(tmp_path):
    m = model(tmp_path)
    (tmp_path / "a.jsonl").write_text(GOOD + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"q": "x"}) + "\n" + json.dumps({"prompt": "y"}) + "\n")
    got, p = problems(tmp_path, f"model: {{path: {m}}}\n"
                                "data:\n"
                                "  mix:\n"
                                "    - {path: a.jsonl, weight: 3}\n"
                                "    - {path: b.jsonl, prompt_key: q}\n")
    assert list(got) == [f"{p}:5: data.mix[1].path"]
    assert got[f"{p}:5: data.mix[1].path"].endswith(f"{tmp_path / 'b.jsonl'}:2: 'q' must be a non-empty string, is missing")
    (tmp_path / "b.jsonl").write_text(json.dumps({"q": "x"}) + "\n")
    cfg = load_config(p, checks=config_checks(files=True))
    assert [s.path for s in cfg.data.mix] == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]


@pytest.mark.parametrize(("shape", "par", "message"), [
    ({"heads": 8, "kv": 4, "layers": 6}, "tp: 3, world_size: 3", "3 does not divide the model's 8 attention heads"),
    ({"heads": 8, "kv": 2, "layers": 6}, "tp: 4, world_size: 4", "4 does not divide the model's 2 key-value heads"),
    ({"heads": 8, "kv": 4, "layers": 6}, "pp: 4, world_size: 4", "4 does not divide the model's 6 layers"),
    # megatron's expert layout: ep * etp ranks within each stage (etp defaults to tp), ep dividing the experts
    ({"num_experts": 8}, "tp: 2, ep: 4, world_size: 4", "ep*etp = 4*2 does not divide the 4 ranks of a pipeline"),
    ({"num_experts": 6}, "ep: 4, world_size: 4", "4 does not divide the model's 6 experts"),
    ({"n_routed_experts": 6}, "tp: 2, ep: 4, etp: 1, world_size: 4", "4 does not divide the model's 6 experts"),
])
def test_a_parallel_layout_that_does_not_fit_the_model(tmp_path, shape, par, message):
    m = model(tmp_path, **shape)
    got, p = problems(tmp_path, f"model: {{path: {m}}}\ntrain:\n  parallel: {{{par}}}\n")
    (where, text), = got.items()
    assert where.startswith(f"{p}:3: train.parallel.") and text.startswith(message)


def test_a_critic_layout_of_its_own_is_checked_against_the_model_and_needs_ray(tmp_path):
    m = model(tmp_path)
    text = (f"model: {{path: {m}}}\ntrain:\n  objective: {{advantage: gae}}\n"
            f"  critic: {{parallel: {{tp: 3, pp: 4, world_size: 13}}}}\n")
    got, p = problems(tmp_path, text)
    assert got[f"{p}:4: train.critic.parallel.tp"].startswith("3 does not divide the model's 8 attention heads")
    assert got[f"{p}:4: train.critic.parallel.pp"].startswith("4 does not divide the model's 6 layers")
    assert got[f"{p}:4: train.critic.parallel.world_size"] == "13 is not a multiple of tp*pp = 12"
    got, p = problems(tmp_path, text + "ray: {enabled: false}\n")
    assert got[f"{p}:4: train.critic.parallel"].startswith("a critic layout of its own runs in processes of its own")


def test_a_hub_id_is_its_snapshot_in_the_hugging_face_cache_or_says_how_to_get_it(tmp_path, monkeypatch):
    """``org/name`` whose ``org`` is no folder beside the config is a Hub id: taken from the cache where it is there
    whole (the layout huggingface_hub writes), checked as a folder; else downloaded once the config has no other
    problem (`download_models`), or, where the Hub cannot be reached, a located error naming the command that
    downloads it. `rl config validate` (no download) leaves an uncached one to the run."""
    from huggingface_hub import constants  # which reads HF_HUB_CACHE and HF_HUB_OFFLINE once, when imported

    from rlx.preflight import download_models

    cache = tmp_path / "hf"
    for name, files in (("tiny", ["config.json", "model.safetensors"]), ("partial", ["config.json"])):
        snap = cache / f"models--acme--{name}" / "snapshots" / "abc123"
        snap.mkdir(parents=True)
        (cache / f"models--acme--{name}" / "refs").mkdir()
        (cache / f"models--acme--{name}" / "refs" / "main").write_text("abc123")
        for f in files:
            (snap / f).write_text(json.dumps({"num_attention_heads": 8, "num_hidden_layers": 3}))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what an unreachable Hub gives, without trying the network
    (tmp_path / "p.jsonl").write_text(GOOD + "\n")
    p = tmp_path / "c.yaml"
    p.write_text("model: {path: acme/tiny}\ndata: {path: p.jsonl}\ntrain: {parallel: {world_size: 2, pp: 2}}\n")
    snap = cache / "models--acme--tiny" / "snapshots" / "abc123"
    with pytest.raises(ConfigError) as e:  # the cached checkpoint is checked like a folder
        load_config(p, checks=config_checks(files=True))
    assert dict(e.value.problems) == {f"{p}:3: train.parallel.pp": f"2 does not divide the model's 3 layers (pipeline "
                                      f"stages split the layers evenly; {snap / 'config.json'})"}
    cfg = load_config(p, ["train.parallel.pp=1"], checks=config_checks(files=True))
    assert cfg.model.path == str(snap)

    for name in ("other", "partial"):  # not cached, or cached without its weights (what AutoConfig leaves)
        p.write_text(f"model: {{path: acme/{name}}}\ndata: {{path: p.jsonl}}\n")
        cfg = load_config(p, checks=config_checks(files=True))
        assert cfg.model.path == f"acme/{name}"  # validate: left to the run
        with pytest.raises(ConfigError) as e:
            download_models(cfg, p)
        (where, why), = e.value.problems
        assert where == f"{p}: model.path" and why.startswith(f"'acme/{name}' is not a folder beside the config and "
                                                              "was taken for a Hugging Face Hub id")
        assert why.endswith(f"run `hf download acme/{name}` (into the cache: HF_HOME) and copy the cache here, or set "
                            "model.path to the model's folder")
    (tmp_path / "acme").mkdir()  # a folder of that name beside the config: a local path, which must exist
    assert dict(problems(tmp_path, p.read_text())[0]) == {
        f"{p}:1: model.path": f"{tmp_path / 'acme' / 'partial'} does not exist"}


def test_fp8_export_needs_an_fp8_checkpoint(tmp_path):
    m = model(tmp_path)
    got, p = problems(tmp_path, f"model:\n  path: {m}\n  export_weights: fp8\n")
    assert got[f"{p}:3: model.export_weights"].startswith("fp8 writes the weights an FP8 checkpoint stores quantised")
    (m / "config.json").write_text(json.dumps({"num_attention_heads": 8, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}))
    assert load_config(p, checks=config_checks(files=True)).model.export_weights == "fp8"


def test_an_indexer_loss_needs_a_sparse_attention_model(tmp_path):
    m = model(tmp_path)
    got, p = problems(tmp_path, f"model: {{path: {m}}}\ntrain:\n  objective: {{indexer_kl_coef: 0.5}}\n")
    assert got[f"{p}:3: train.objective.indexer_kl_coef"].endswith("has no sparse-attention indexer to train (no "
                                                                     "index_topk in its config.json); leave it at 0")


def test_an_mtp_loss_needs_mtp_layers_and_one_pipeline_stage(tmp_path):
    m = model(tmp_path)
    text = f"model: {{path: {m}}}\ntrain:\n  objective: {{mtp_loss_coef: 0.2}}\n"
    got, p = problems(tmp_path, text)
    assert got[f"{p}:3: train.objective.mtp_loss_coef"].endswith("has no multi-token-prediction layers to train (no "
                                                                   "num_nextn_predict_layers in its config.json); "
                                                                   "leave it at 0")
    (m / "config.json").write_text(json.dumps({"num_attention_heads": 8, "num_key_value_heads": 4,
                                               "num_hidden_layers": 6, "num_nextn_predict_layers": 1}))
    assert load_config(tmp_path / "c.yaml", checks=config_checks(files=True)).train.objective.mtp_loss_coef == 0.2
    got, p = problems(tmp_path, text + "  parallel: {pp: 2, world_size: 2}\n")
    assert got[f"{p}:3: train.objective.mtp_loss_coef"].startswith("multi-token-prediction layers train with one "
                                                                     "pipeline stage (train.parallel.pp is 2)")


def test_speculative_drafts_need_their_source_and_the_same_tokenizer(tmp_path, tiny_model_path):
    """mtp drafts need MTP layers in the checkpoint; a draft model must share the tokenizer (here one whose
    vocabulary swaps two ids is refused, a copy passes); SGLang's drafts cannot record routing (R3)."""
    import shutil

    m = model(tmp_path)
    got, p = problems(tmp_path, f"model: {{path: {m}}}\nrollout:\n  engines: [{{backend: sglang, speculative: "
                                f"{{method: mtp}}}}]\n")
    assert got[f"{p}:3: rollout.engines[0].speculative.method"].endswith(
        "has no multi-token-prediction layers to draft with (no num_nextn_predict_layers in its config.json); use "
        "ngram or draft_model")
    from rlx.testing.models import other_tokenizer

    same = tmp_path / "same"
    shutil.copytree(tiny_model_path, same)
    other = other_tokenizer(tiny_model_path, tmp_path / "other")
    text = (f"model: {{path: {tiny_model_path}}}\nrollout:\n  engines: [{{backend: sglang, speculative: "
            f"{{method: draft_model, draft_model: DRAFT}}}}]\n")
    assert load_config(_write(tmp_path, text.replace('DRAFT', str(same))), checks=config_checks(files=True))
    got, p = problems(tmp_path, text.replace('DRAFT', str(other)))
    assert got[f"{p}:3: rollout.engines[0].speculative.draft_model"].startswith(
        f"the draft model in {other} has another tokenizer than the model it drafts for")
    got, p = problems(tmp_path, text.replace('DRAFT', str(same)) + "  routed_experts: true\n")
    assert "does not count the verify forward's tokens" in got[f"{p}:3: rollout.engines[0].speculative.method"]
    got, p = problems(tmp_path, f"model: {{path: {m}}}\nrollout:\n  engines: [{{speculative: {{method: mtp}}}}]\n")
    assert "has no multi-token-prediction layers to draft with" in got[f"{p}:3: rollout.engines[0].speculative.method"]


def test_what_the_embedded_engine_cannot_draft_with_is_refused_at_preflight(tmp_path, tiny_model_path):
    """For the embedded engine: MTP layers declared but not stored; MTP drafts beside quantised rollout; a target with
    linear-attention layers; a draft model with sliding-window layers."""
    import shutil

    m = model(tmp_path, num_nextn_predict_layers=1)
    text = f"model: {{path: {m}}}\nrollout:\n  engines: [{{speculative: {{method: mtp}}}}]\n"
    got, p = problems(tmp_path, text)
    assert "declares multi-token-prediction layers but its checkpoint stores none (no model.layers.6.*" in got[
        f"{p}:3: rollout.engines[0].speculative.method"]
    from safetensors.torch import save_file
    import torch

    save_file({"model.layers.6.eh_proj.weight": torch.zeros(2, 2)}, str(m / "model.safetensors"))
    assert load_config(_write(tmp_path, text), checks=config_checks(files=True))
    got, p = problems(tmp_path, text + "  quantization: fp8\n")
    assert "MTP drafts with rollout.quantization fp8" in got[f"{p}:3: rollout.engines[0].speculative.method"]
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, "layer_types": ["linear_attention", "full_attention"] * 3}))
    got, p = problems(tmp_path, text.replace("mtp", "ngram"))
    assert "has linear-attention layers" in got[f"{p}:3: rollout.engines[0].speculative.method"]
    draft = tmp_path / "draft"
    shutil.copytree(tiny_model_path, draft)
    dcfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**dcfg, "layer_types": ["sliding_attention", "full_attention"]}))
    got, p = problems(tmp_path, f"model: {{path: {tiny_model_path}}}\nrollout:\n  engines: [{{speculative: {{method: "
                                f"draft_model, draft_model: {draft}}}}}]\n")
    assert "has sliding_attention layers" in got[f"{p}:3: rollout.engines[0].speculative.draft_model"]


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_a_trained_mtp_layer_with_quantised_rollout_is_refused_for_the_embedded_engine(tmp_path):
    m = model(tmp_path, num_nextn_predict_layers=1)
    got, p = problems(tmp_path, f"model: {{path: {m}}}\nrollout: {{quantization: int4}}\ntrain:\n"
                                f"  qat: int4\n  objective: {{mtp_loss_coef: 0.2}}\n")
    assert "pushed quantised with rollout.quantization int4, and the embedded engine holds them unquantised" in got[
        f"{p}:5: train.objective.mtp_loss_coef"]
