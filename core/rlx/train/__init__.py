"""Training: losses and advantages, packing, balancing, and the Megatron trainer."""

from rlx.train.megatron_patches import jit as _jit

_jit.install()  # before anything here imports megatron (rlx.train.megatron_patches.jit)
