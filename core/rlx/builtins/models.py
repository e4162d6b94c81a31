"""Built-in model bridges: the Llama family (Llama, Qwen2, Qwen3, Mistral) on megatron-core."""

from rlx import hookimpl


@hookimpl
def register_models(register):
    from rlx.train.bridge import LlamaBridge

    register(LlamaBridge)
