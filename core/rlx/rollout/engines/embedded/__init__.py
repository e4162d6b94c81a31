"""The embedded engine: SGLang's native HTTP API served from a torch model on CPU or one GPU.

Run it as SGLang is run: ``python -m rlx.rollout.engines.embedded --model-path DIR --port N``.
"""
