"""Built-in plugins: ordinary plugin modules that `rlx.plugins.build_plugins` registers first (listed in
`rlx.plugins.BUILTIN_PLUGINS`)."""
