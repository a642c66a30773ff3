"""`python -m workers.bridge`: read the settings, pick the backend, run until stopped."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from workers.bridge.backends import Backend, OpenAIBackend
from workers.bridge.config import BridgeConfig, ConfigError, load_config
from workers.bridge.scripted import SCRIPTED_CONTEXT, ScriptedBackend
from workers.bridge.worker import Bridge


def make_backend(config: BridgeConfig) -> Backend:
    if config.is_scripted:
        return ScriptedBackend(context=config.max_context_length or SCRIPTED_CONTEXT)
    return OpenAIBackend(
        config.backend,
        api_key=config.backend_key,
        kind=config.backend_kind,
        timeout=config.backend_timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as error:
        print(f"python -m workers.bridge: {error}", file=sys.stderr)
        return 2
    return Bridge(config, make_backend(config)).run()
