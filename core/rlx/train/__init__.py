"""Training: losses and advantages, packing, balancing, and the Megatron trainer."""
