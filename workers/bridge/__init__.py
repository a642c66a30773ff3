"""The reference worker: `python -m workers.bridge` connects an OpenAI-compatible backend to a horde.

A volunteer points it at a horde (the native API under /api/v2/) and at the LLM backend they
already run (llama.cpp's server, vLLM, Ollama, koboldcpp, TabbyAPI, or any server with an
OpenAI-compatible /v1/chat/completions and /v1/completions), and it serves chat jobs and text jobs.
`--backend scripted` answers without any LLM, deterministically from the request (demo, tests).

A program of its own (README.md beside this file): a client of the native API like any
third-party worker, it imports nothing of the project but `contract` and never Django, nothing of
the server imports it (both checked by import-linter), and it talks HTTP through the standard
library's http.client.

Modules:
  cli          the command: flags and environment -> config, start, exit status
  config       settings from flags and BRIDGE_* environment variables
  connections  HTTP: a keep-alive http.client connection per thread, proxies, streamed answers
  horde        the native API client (find_user, pop, submit, progress)
  backends     the OpenAI-compatible backend client: capability probe, requests, error classes
  scripted     the built-in scripted backend (no LLM)
  jobs         job payload -> backend request, backend reply -> structured submit, reasoning split
  progress     streamed generation: deltas batched into progress posts
  worker       the loop: threads, backoff, leases, signals, progress lines and the summary
"""

from __future__ import annotations

BRIDGE_NAME = "horde-bridge"
BRIDGE_VERSION = "1"
BRIDGE_URL = "https://github.com/Haidra-Org/AI-Horde"
# bridge_agent "name:version:url"; the name is one of contract.text.VALIDATED_TEXT_BRIDGES.
BRIDGE_AGENT = f"{BRIDGE_NAME}:{BRIDGE_VERSION}:{BRIDGE_URL}"
