"""OpenAPI schemas of the contract's pydantic models (docs/adr/0031-chat-api-schema-from-contract.md).

A view names a contract model in `extend_schema` as it would a serializer. drf-spectacular's
pydantic support (drf_spectacular.contrib.pydantic) lets pydantic write the model's JSON Schema;
pydantic writes JSON Schema 2020-12, and the document drf-spectacular serves is OpenAPI 3.0, so
this extension asks pydantic for 3.0's dialect of the same schema.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.contrib.pydantic import PydanticExtension
from drf_spectacular.plumbing import ResolvedComponent
from drf_spectacular.utils import OpenApiParameter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, model_json_schema
from pydantic_core import core_schema

from contract.front_lease import FRONT_ID_HEADER, FRONT_UNDELIVERED_HEADER, FRONT_UNDELIVERED_VALUE
from contract.rate_limits import PROXY_PASSKEY_HEADER

_REF_TEMPLATE = "#/components/schemas/{model}"


class OpenApi30JsonSchema(GenerateJsonSchema):
    """pydantic's JSON Schema in OpenAPI 3.0's words: `nullable` for a null branch, a one-value
    `enum` for `const`, exclusive bounds as booleans beside the bound; no per-field titles."""

    def nullable_schema(self, schema: core_schema.NullableSchema) -> JsonSchemaValue:
        inner = self.generate_inner(schema["schema"])
        if "$ref" in inner:  # 3.0 ignores a reference's siblings
            return {"allOf": [inner], "nullable": True}
        return {**inner, "nullable": True}

    def literal_schema(self, schema: core_schema.LiteralSchema) -> JsonSchemaValue:
        generated = super().literal_schema(schema)
        if "const" in generated:
            # A one-value tag (a message's role, a part's type) stays with its model: as a bare
            # property enum drf-spectacular's enum hook would lift it into a component shared by
            # every model with that tag, a naming collision `check --deploy` warns about.
            generated["enum"] = [generated.pop("const")]
            return {"allOf": [generated]}
        return generated

    @staticmethod
    def _exclusive_bounds(generated: JsonSchemaValue) -> JsonSchemaValue:
        for bound, key in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            if key in generated:
                generated[bound] = generated.pop(key)
                generated[key] = True
        return generated

    def int_schema(self, schema: core_schema.IntSchema) -> JsonSchemaValue:
        return self._exclusive_bounds(super().int_schema(schema))

    def float_schema(self, schema: core_schema.FloatSchema) -> JsonSchemaValue:
        return self._exclusive_bounds(super().float_schema(schema))

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


class ContractModelExtension(PydanticExtension):
    """The contract's models (every one a ChatShape), in OpenAPI 3.0's dialect; other pydantic
    models keep drf-spectacular's own handling."""

    target_class = "contract.chat_shapes.ChatShape"
    match_subclasses = True
    priority = 1  # before PydanticExtension, which also matches these

    def map_serializer(self, auto_schema, direction):
        schema = model_json_schema(
            self.target,
            ref_template=_REF_TEMPLATE,
            schema_generator=OpenApi30JsonSchema,
            mode="validation" if direction == "request" else "serialization",
        )
        # Nested models become components of their own, as drf-spectacular does for pydantic.
        for name, sub_schema in schema.pop("$defs", {}).items():
            auto_schema.registry.register_on_missing(
                ResolvedComponent(name=name, type=ResolvedComponent.SCHEMA, object=name, schema=sub_schema)
            )
        return schema


def undelivered_cancel_headers() -> list[OpenApiParameter]:
    """The headers a stopping front's cancel carries (docs/adr/0086): honoured only with a proxy
    passkey the horde knows, for a request leased under the same front id; any other cancel is the
    spec's."""
    return [
        OpenApiParameter(
            FRONT_UNDELIVERED_HEADER,
            str,
            OpenApiParameter.HEADER,
            enum=[FRONT_UNDELIVERED_VALUE],
            description="A stopping front's cancel of a reply it can no longer deliver: the jobs in "
            "flight end unpaid. Needs a known proxy passkey and the request's front id.",
        ),
        OpenApiParameter(FRONT_ID_HEADER, str, OpenApiParameter.HEADER, description="The front's process id."),
        OpenApiParameter(
            PROXY_PASSKEY_HEADER, str, OpenApiParameter.HEADER, description="A proxy passkey this horde knows."
        ),
    ]
