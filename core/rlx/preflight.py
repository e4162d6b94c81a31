"""Checks of a config beyond its schema, before anything starts (no Ray, no engines), passed to
`rlx.config.load_config` by `config_checks`:

* against the installed plugins (`check_components`): every component name exists and its args validate against
  its ``Config``; ``model.kernels`` names kernels that exist; critic settings only with an estimator that has one;
* against the files it names (`check`): the model folder exists and is an HF model, its shape fits the parallel
  layout (TP divides the attention and key-value heads, PP the layers), and every prompt file parses, with every
  bad row reported by line (not only the first, non-UTF-8 bytes included). `rl config validate` runs them, and
  `rl train`, `rl rollout` and `rl eval` first thing.

Each problem is (key path in the config, message), located in the config file by `rlx.config`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from rlx.config import COMPONENT_FIELDS, CriticConfig, component_config, describe_error
from rlx.errors import ConfigError, RLXError
from rlx.models.load import vocab_differs

if TYPE_CHECKING:
    from rlx.config import Config, DataConfig, ParallelConfig
    from rlx.plugins import Plugins

Problem = tuple[tuple[Any, ...], str]


def config_checks(plugins: Plugins | None = None, files: bool = False) -> list[Any]:
    """The checks `load_config(checks=...)` runs after the schema's: the components against `plugins` (when
    given), and the files the config names (with `files`); every problem of each is reported at once. A model
    named by Hugging Face Hub id is taken from the Hugging Face cache where it is there whole (`rlx.models.hub`)
    and checked as a folder; one that is not is left to `download_models`, once the config has no problem."""
    out: list[Any] = []
    if plugins is not None:
        out.append(lambda cfg: check_components(cfg, plugins))
    if files:
        out += [lambda cfg: hub_models(cfg, download=False), check]
    return out


def download_models(cfg: Config, source: Path, files: bool = True) -> None:
    """Download the models the config still names by Hub id (none were in the cache whole), then, with `files`,
    check them as folders; a `ConfigError` naming the key where that fails. For a config that passed its checks,
    so that no download waits on a mistake found in a second."""
    from rlx.config import format_path

    problems = hub_models(cfg, download=True)
    if not problems and files:
        problems = check(cfg)
    if problems:
        raise ConfigError([(f"{source}: {format_path(keys)}", msg) for keys, msg in problems], source=str(source))


def check_components(cfg: Config, plugins: Plugins) -> list[Problem]:
    """Every component name exists, and its args validate against the component's ``Config``."""
    problems: list[Problem] = []
    fields: list[tuple[tuple[Any, ...], str, Any]] = []
    for path, kind in COMPONENT_FIELDS:
        value: Any = cfg
        for key in path:
            value = getattr(value, key)
        fields.append((path, kind, value))
    fields += [(("eval", "datasets", i, "rewards"), "rewards", d.rewards)
               for i, d in enumerate(cfg.eval.datasets) if d.rewards is not None]
    fields += [(("train", "lora", "adapters", i, "rewards"), "rewards", a.rewards)
               for i, a in enumerate(cfg.train.lora.adapters if cfg.train.lora else []) if a.rewards is not None]
    for path, kind, value in fields:
        specs = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, spec in specs:
            base = path + ((i,) if i is not None else ())
            if spec.name not in plugins.components[kind]:
                problems.append((base + ("name",), plugins.unknown_message(kind, spec.name)))
                continue
            component = plugins.get(kind, spec.name)
            try:
                component_config(component, spec.args)
            except ValidationError as e:
                conf_cls = getattr(component, "Config", None)
                known = [f.alias or n for n, f in conf_cls.model_fields.items()] if conf_cls is not None else []
                for err in e.errors():
                    loc = base + ("args",) + tuple(err["loc"])
                    problems.append((loc, describe_error(err, loc, known if len(err["loc"]) == 1 else None)))
    return problems + _check_critic(cfg, plugins) + _check_kernels(cfg, plugins)


def _check_kernels(cfg: Config, plugins: Plugins) -> list[Problem]:
    """``model.kernels`` names ops some installed kernel runs, and for each a kernel of that op or auto."""
    from rlx.train.kernel_choice import candidates

    problems: list[Problem] = []
    for op, choice in cfg.model.kernels.items():
        names = [k.name.removeprefix(f"{op}-") for k in candidates(plugins, op)]
        if not names:
            problems.append((("model", "kernels", op), f"no installed kernel runs {op!r} (`rl plugins` lists the "
                                                        f"kernels)"))
        elif choice != "auto" and choice not in names:
            problems.append((("model", "kernels", op), f"unknown {op} kernel {choice!r}; installed: "
                                                        f"{', '.join(names)} (or auto)"))
    return problems


def _check_critic(cfg: Config, plugins: Plugins) -> list[Problem]:
    """``train.critic`` and ``kl_in_reward`` apply to estimators with a critic only (never silently ignored)."""
    name = cfg.train.objective.advantage.name
    if name not in plugins.components["advantages"]:
        return []
    problems: list[Problem] = []
    obj = cfg.train.objective
    if getattr(plugins.get("advantages", name), "needs_critic", False):
        if obj.kl_in_reward and not obj.kl_coef:
            problems.append((("train", "objective", "kl_in_reward"), "needs a KL penalty: set kl_coef > 0"))
        if cfg.train.lora is not None and cfg.train.lora.adapters:
            problems.append((("train", "objective", "advantage"), f"{name!r} trains a critic, which would be one for "
                             f"every adapter of train.lora.adapters (their rewards differ): multi-LoRA is built for "
                             f"critic-free estimators (grpo, rloo, reinforce++ and their kin)"))
        return problems
    why = f"applies to advantage estimators with a critic (gae); train.objective.advantage is {name!r}"
    default = CriticConfig().model_dump()
    problems += [(("train", "critic", k), why) for k, v in cfg.train.critic.model_dump().items() if v != default[k]]
    if obj.kl_in_reward:
        problems.append((("train", "objective", "kl_in_reward"), why))
    return problems


def check(cfg: Config) -> list[Problem]:
    problems: list[Problem] = []
    model_dir = _model_dir(cfg.model.path, ("model", "path"), problems)
    if cfg.model.tokenizer:
        tok = Path(cfg.model.tokenizer)
        if tok.is_absolute() and not tok.is_dir():  # (not a URL, nor a Hub id left to the run)
            problems.append((("model", "tokenizer"), f"{tok} does not exist"))
    for i, g in enumerate(cfg.rollout.engines):
        if g.model_path:
            _model_dir(g.model_path, ("rollout", "engines", i, "model_path"), problems)
        if g.speculative is not None:
            problems += _speculative(cfg, g, ("rollout", "engines", i, "speculative"),
                                     _model_dir(g.model_path, (), []) if g.model_path else model_dir, problems)
    _teachers(cfg, model_dir, problems)
    if model_dir is not None:
        problems += _shape(model_dir, ("train", "parallel"), cfg.train.parallel)
    if model_dir is not None and cfg.train.objective.indexer_kl_coef > 0:
        hf = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").is_file() else {}
        if "index_topk" not in hf.get("text_config", hf):
            problems.append((("train", "objective", "indexer_kl_coef"), f"the model in {model_dir} has no "
                             f"sparse-attention indexer to train (no index_topk in its config.json); leave it at 0"))
    if model_dir is not None and cfg.train.objective.mtp_loss_coef > 0:
        hf = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").is_file() else {}
        if not hf.get("text_config", hf).get("num_nextn_predict_layers"):
            problems.append((("train", "objective", "mtp_loss_coef"), f"the model in {model_dir} has no multi-token-"
                             f"prediction layers to train (no num_nextn_predict_layers in its config.json); leave it "
                             f"at 0"))
        elif cfg.rollout.quantization is not None and any(g.backend == "embedded" for g in cfg.rollout.engines):
            problems.append((("train", "objective", "mtp_loss_coef"), f"trained multi-token-prediction layers are "
                             f"pushed quantised with rollout.quantization {cfg.rollout.quantization}, and the embedded "
                             f"engine holds them unquantised (for its drafts): leave them frozen (0) with quantised "
                             f"rollout"))
        elif cfg.train.parallel.pp > 1:
            problems.append((("train", "objective", "mtp_loss_coef"), f"multi-token-prediction layers train with one "
                             f"pipeline stage (train.parallel.pp is {cfg.train.parallel.pp}): they need the first "
                             f"stage's word embeddings"))
    if model_dir is not None and cfg.model.export_weights == "fp8":
        from rlx.models.fp8 import block_size

        if block_size(model_dir) is None:
            problems.append((("model", "export_weights"), f"fp8 writes the weights an FP8 checkpoint stores quantised, "
                             f"in its block size: {model_dir} is not one (no quantization_config with quant_method "
                             f"fp8 in its config.json)"))
    if cfg.train.critic.parallel is not None:  # the critic's own layout, against the critic's checkpoint
        critic_dir = (_model_dir(cfg.train.critic.model_path, ("train", "critic", "model_path"), problems)
                      if cfg.train.critic.model_path else model_dir)
        if critic_dir is not None:
            problems += _shape(critic_dir, ("train", "critic", "parallel"), cfg.train.critic.parallel)
    elif cfg.train.critic.model_path:
        _model_dir(cfg.train.critic.model_path, ("train", "critic", "model_path"), problems)
    if cfg.data.path and cfg.rollout.source == "generate":
        problems += _rows(cfg, Path(cfg.data.path), ("data", "path"))
    for i, source in enumerate(cfg.data.mix if cfg.rollout.source == "generate" else []):
        problems += _rows(cfg, Path(source.path), ("data", "mix", i, "path"), cfg.data.reading(source))
    for i, a in enumerate(cfg.train.lora.adapters if cfg.train.lora and cfg.rollout.source == "generate" else []):
        problems += _rows(cfg, Path(a.data.path), ("train", "lora", "adapters", i, "data", "path"),
                          cfg.data.reading(a.data))
    for i, d in enumerate(cfg.eval.datasets):
        problems += _rows(cfg, Path(d.path), ("eval", "datasets", i, "path"))
    return problems


def _speculative(cfg: Config, g: Any, at: tuple[Any, ...], target: Path | None, problems: list[Problem]
                 ) -> list[Problem]:
    """An engine group's drafts can come from what it names (MTP layers in its checkpoint, a draft model with the
    same tokenizer), and its engines report routing under them."""
    from rlx.config import records_routing

    spec, out = g.speculative, []
    embedded = g.backend == "embedded"
    hf = json.loads((target / "config.json").read_text()) if target and (target / "config.json").is_file() else {}
    text = hf.get("text_config", hf)
    if embedded and "linear_attention" in (text.get("layer_types") or []):
        out.append(((*at, "method"), f"the model in {target} has linear-attention layers, whose recurrent state the "
                    f"embedded engine cannot take back from refused drafts"))
    if spec.method == "mtp" and target is not None and hf:
        n = text.get("num_hidden_layers")
        stored = embedded and any(k.startswith(f"model.layers.{n}.") for k in _tensor_names(target))
        if not (text.get("num_nextn_predict_layers") or (not embedded and text.get("mtp_num_hidden_layers"))):
            out.append(((*at, "method"), f"the model in {target} has no multi-token-prediction layers to draft with "
                        f"(no num_nextn_predict_layers in its config.json); use ngram or draft_model"))
        elif embedded and not stored:
            out.append(((*at, "method"), f"the model in {target} declares multi-token-prediction layers but its "
                        f"checkpoint stores none (no model.layers.{n}.* tensors); use ngram or draft_model"))
        elif embedded and text.get("index_topk"):
            out.append(((*at, "method"), f"the model in {target} has a sparse-attention MTP layer (index_topk in its "
                        f"config.json), whose indexer cache the embedded engine does not draft with; use ngram or "
                        f"draft_model, or SGLang"))
        elif embedded and cfg.rollout.quantization is not None:
            out.append(((*at, "method"), f"MTP drafts with rollout.quantization {cfg.rollout.quantization}: the "
                        f"embedded engine's MTP layer computes with the tensors it holds unquantised; use ngram or "
                        f"draft_model drafts with quantised rollout"))
    if spec.method == "draft_model":
        draft = _model_dir(spec.draft_model, (*at, "draft_model"), problems)
        kinds = set()
        if draft is not None:
            dcfg = json.loads((draft / "config.json").read_text())
            kinds = set(dcfg.get("text_config", dcfg).get("layer_types") or []) - {"full_attention"}
        if embedded and kinds:
            out.append(((*at, "draft_model"), f"the draft model in {draft} has {sorted(kinds)[0]} layers: the "
                        f"embedded engine keeps a draft's keys and values beside the target's, full attention only"))
        differ = vocab_differs(target, draft) if draft is not None and target is not None else 0
        if differ:
            out.append(((*at, "draft_model"), f"the draft model in {draft} has another tokenizer than the model "
                        f"it drafts for ({target}; {differ} vocabulary entries differ): its draft ids would be "
                        f"other words"))
    if g.backend == "sglang" and records_routing(cfg):
        out.append(((*at, "method"), "routing replay (rollout.routed_experts) with SGLang's speculative decoding: "
                    "SGLang 0.5.23 does not count the verify forward's tokens in the routing it records (a FIXME in "
                    "its routed_experts capturer); use the embedded engine, or no speculative decoding"))
    return out


def _teachers(cfg: Config, student: Path | None, problems: list[Problem]) -> None:
    """Each teacher's checkpoint exists and has the student's tokenizer: it scores the student's token ids (here
    where both are folders already; `rlx.rollout.teachers` checks the rest at start)."""
    if cfg.model.tokenizer and Path(cfg.model.tokenizer).is_dir():
        student = Path(cfg.model.tokenizer)
    for i, t in enumerate(cfg.rollout.teachers):
        at = ("rollout", "teachers", i, "model_path")
        teacher = _model_dir(t.model_path, at, problems) if t.model_path else None
        differ = vocab_differs(student, teacher) if student is not None and teacher is not None else 0
        if differ:
            problems.append((at, f"teacher {t.name!r} ({teacher}) has another tokenizer than the student ({student}; "
                             f"{differ} vocabulary entries differ): it would score other words than the student "
                             f"wrote. Distil from a teacher of the student's family"))


def _tensor_names(folder: Path) -> list[str]:
    """The tensor names a checkpoint folder stores (its safetensors index, or the files' headers)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file() and not (folder / "model.safetensors").is_file():  # (transformers reads the latter then)
        return list(json.loads(index.read_text()).get("weight_map", {}))
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            names += list(h.keys())
    return names


def hub_models(cfg: Config, download: bool) -> list[Problem]:
    """Each model named by Hub id becomes its folder in the Hugging Face cache (downloaded first with `download`)."""
    from rlx.config import format_path
    from rlx.models.hub import cached, is_hub_id, local_folder

    fields: list[tuple[Any, tuple[Any, ...]]] = [(cfg.model, ("model", "path")), (cfg.model, ("model", "tokenizer")),
                                                (cfg.train.critic, ("train", "critic", "model_path"))]
    fields += [(g, ("rollout", "engines", i, "model_path")) for i, g in enumerate(cfg.rollout.engines)]
    fields += [(t, ("rollout", "teachers", i, "model_path")) for i, t in enumerate(cfg.rollout.teachers)]
    problems: list[Problem] = []
    for node, keys in fields:
        value = getattr(node, keys[-1])
        if not value or value.startswith("/") or not is_hub_id(value):
            continue
        weights = keys[-1] != "tokenizer"
        try:
            folder = local_folder(value, format_path(keys), weights) if download else cached(value, weights)
        except RLXError as e:
            problems.append((keys, str(e)))
            continue
        if folder is not None:
            setattr(node, keys[-1], folder)
    return problems


def _model_dir(path: str, where: tuple[Any, ...], problems: list[Problem]) -> Path | None:
    if path.startswith("builtin://"):
        from rlx.models.tiny import SCHEME, SHAPES, check_builtin, resolve_model_path

        try:  # the built-in tiny models build in a moment; a warm, packaged or plugin's one may take a while: not here
            check_builtin(path)
            return Path(resolve_model_path(path)) if path[len(SCHEME):] in SHAPES else None
        except RLXError as e:
            problems.append((where, str(e)))
            return None
    if "://" in path or not path.startswith("/"):  # a URL, or a Hub id not downloaded yet (`hub_models`)
        return None
    p = Path(path)
    if not p.exists():
        problems.append((where, f"{p} does not exist"))
    elif not (p / "config.json").is_file():
        problems.append((where, f"{p} has no config.json: not an HF model folder"))
    else:
        return p
    return None


def _shape(model_dir: Path, key: tuple[Any, ...], par: ParallelConfig) -> list[Problem]:
    """The layout `par` (a ParallelConfig at `key`) against the model's shape: TP divides the heads, PP the
    layers, and world_size is a multiple of tp*pp."""
    try:
        hf = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        return [(("model", "path"), f"{model_dir / 'config.json'} is unreadable: {e}")]
    hf = hf.get("text_config", hf)  # multimodal checkpoints keep the language model's shape inside
    out: list[Problem] = []
    heads, layers = hf.get("num_attention_heads"), hf.get("num_hidden_layers")
    kv = hf.get("num_key_value_heads", heads)
    if isinstance(heads, int) and heads % par.tp:
        out.append(((*key, "tp"), f"{par.tp} does not divide the model's {heads} attention heads "
                                  f"({model_dir / 'config.json'})"))
    elif isinstance(kv, int) and kv % par.tp:
        out.append(((*key, "tp"), f"{par.tp} does not divide the model's {kv} key-value heads "
                                  f"({model_dir / 'config.json'})"))
    if isinstance(layers, int) and layers % par.pp:
        out.append(((*key, "pp"), f"{par.pp} does not divide the model's {layers} layers (pipeline "
                                  f"stages split the layers evenly; {model_dir / 'config.json'})"))
    if par.world_size % (par.tp * par.pp):
        out.append(((*key, "world_size"), f"{par.world_size} is not a multiple of tp*pp = {par.tp * par.pp}"))
    elif par.ep > 1 and (par.world_size // par.pp) % (par.ep * par.expert_tp):
        out.append(((*key, "ep"), f"ep*etp = {par.ep}*{par.expert_tp} does not divide the {par.world_size // par.pp} "
                                  f"ranks of a pipeline stage (world_size / pp; etp defaults to tp)"))
    experts = next((hf[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if k in hf), None)
    if isinstance(experts, int) and experts % par.ep:
        out.append(((*key, "ep"), f"{par.ep} does not divide the model's {experts} experts "
                                  f"({model_dir / 'config.json'})"))
    return out


def _rows(cfg: Config, path: Path, where: tuple[Any, ...], data: DataConfig | None = None) -> list[Problem]:
    from rlx.data.datasets import PromptDataset

    try:
        PromptDataset(data or cfg.data, path, cfg.run.seed)
    except RLXError as e:
        return [(where, str(e))]
    return []
