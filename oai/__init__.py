"""The OpenAI-compatible front (spec: chat_front.md): /v1/chat/completions and /v1/models over the
native chat routes. It imports nothing of the project but `contract`; it reaches the native API over
HTTP and the completion signal over Redis, exactly as a separately deployed front would."""
