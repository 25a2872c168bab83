"""The `jaxengine` command (`python -m jaxengine`): offline generation and chat, the server, and
lm-eval.

main.py    the parser and the subcommands (`generate`, `chat`, `serve`, `eval`); `main`, the
           console script's entry point (`jaxengine.cli.main:main`)
checks.py  the command's flag checks made before the model loads, its output labels

The engine's flags (one table from flag to `EngineConfig` field, which `EngineArgs` shares) are
`jaxengine/engine/engine_flags.py`; `jaxengine serve`'s own flags and its server are
`jaxengine/entrypoints/serve.py`.
"""
