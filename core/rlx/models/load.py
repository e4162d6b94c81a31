"""The transformers config and model of an HF checkpoint: for model bridges, the embedded engine, and the tests that
check a bridge against transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_config(path: str | Path) -> Any:
    """``AutoConfig``, or, for a ``model_type`` transformers does not know whose ``architectures`` name a class it has
    (Kimi-K2's ``kimi_k2``, a ``DeepseekV3ForCausalLM``), that class's config, keeping the checkpoint's
    ``model_type`` (which bridges claim)."""
    import transformers
    from transformers import AutoConfig

    stand_in = _stand_in(path)
    if stand_in is None:
        return AutoConfig.from_pretrained(str(path))
    config = getattr(transformers, stand_in).config_class.from_pretrained(str(path))
    config.model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
    return config


def load_lm(path: str | Path, dtype: Any) -> Any:
    """``AutoModelForCausalLM``; for a vision-language wrapper transformers builds only whole (Kimi-K2.5), the whole
    model from ``AutoModelForImageTextToText``, which generates from text alone; for a ``model_type`` transformers
    does not know, the class its ``architectures`` name (`load_config`)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    stand_in = _stand_in(path)
    if stand_in is not None:
        cls = getattr(transformers, stand_in)
        config = cls.config_class.from_pretrained(str(path))
        config.model_type = cls.config_class.model_type  # transformers picks the weights' conversions by it
        return cls.from_pretrained(str(path), config=config, dtype=dtype)
    config = load_config(path)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and hasattr(config, "text_config"):
        return AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def _stand_in(path: str | Path) -> str | None:
    """The transformers class named in ``architectures`` when transformers does not know the ``model_type``."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = json.loads((Path(path) / "config.json").read_text())
    if raw.get("model_type") in CONFIG_MAPPING:
        return None
    return next((a for a in raw.get("architectures") or [] if hasattr(transformers, a)), None)


def vocab_differs(a: str | Path, b: str | Path) -> int:
    """How many vocabulary entries (token, id) the tokenizers of two model folders do not share (0: the same): a
    draft model or a teacher reads the ids the model writes."""
    from transformers import AutoTokenizer

    va, vb = (AutoTokenizer.from_pretrained(str(d)).get_vocab() for d in (a, b))
    return len(va.items() ^ vb.items())
