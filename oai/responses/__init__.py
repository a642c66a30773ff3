"""OpenAI's Responses API (`POST /v1/responses`) over the chat route (docs/adr/0101-responses-api.md).

A request carries its conversation in `input`, or continues a kept response (`references`,
oai.response_items) by `previous_response_id` and `item_reference` items. `request` translates a
Responses body into a chat completions body and screens it with the chat route's rules (errors name
the Responses paths); `reply` renders the delivered reply as a `response` object; `events` turns
the chat route's stream into the Responses API's typed events. The run itself (admission, wait,
relay, cancels) is the chat route's.
"""
