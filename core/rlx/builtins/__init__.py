"""Built-in plugins: ordinary plugin modules that `rlx.plugins.build_plugins` registers first."""

BUILTIN_PLUGINS = (
    "rlx.builtins.rewards",
    "rlx.builtins.generators",
    "rlx.builtins.agents",
    "rlx.builtins.advantages",
    "rlx.builtins.losses",
    "rlx.builtins.balancers",
    "rlx.builtins.models",
    "rlx.builtins.transports",
    "rlx.builtins.loggers",
    "rlx.builtins.kernels",
)
