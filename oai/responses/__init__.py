"""OpenAI's Responses API (`POST /v1/responses`) over the chat route (docs/adr/0101-responses-api.md).

The front stores no responses: a request carries its whole conversation in `input`, as a client
with `store: false` sends it. `request` translates a Responses body into a chat completions body
and screens it with the chat route's rules (errors name the Responses paths); `reply` renders the
delivered reply as a `response` object; `events` turns the chat route's stream into the Responses
API's typed events. The run itself (admission, wait, relay, cancels) is the chat route's.
"""
