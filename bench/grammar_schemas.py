"""A set of real-world JSON schemas (the shapes apps send as response_format / tool parameters), each with
a valid instance: the grammar benchmarks compile the schemas and walk a matcher through the instances'
tokens. Shared by bench.bench_grammar (engine against engine) and bench.structured_outputs (the stack)."""

from __future__ import annotations

SCHEMAS: dict[str, tuple[dict, dict]] = {
    "person": (
        {"type": "object",
         "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                        "email": {"type": "string", "format": "email"},
                        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
         "required": ["name", "age"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "engines"]}),
    "order": (
        {"type": "object",
         "properties": {
             "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
             "status": {"enum": ["pending", "paid", "shipped", "delivered"]},
             "customer": {"type": "object",
                          "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
                          "required": ["id", "name"]},
             "items": {"type": "array", "minItems": 1,
                       "items": {"type": "object",
                                 "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                                                "price": {"type": "number"}},
                                 "required": ["sku", "qty", "price"]}},
             "total": {"type": "number"}},
         "required": ["order_id", "status", "customer", "items", "total"]},
        {"order_id": "ABC-1234", "status": "paid", "customer": {"id": 7, "name": "Bo"},
         "items": [{"sku": "x-1", "qty": 2, "price": 3.5}, {"sku": "y-2", "qty": 1, "price": 10}], "total": 17.0}),
    "weather_tool": (
        {"type": "object",
         "properties": {"location": {"type": "string", "description": "City and country"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
         "required": ["location", "unit"], "additionalProperties": False},
        {"location": "Paris, France", "unit": "celsius", "days": 3}),
    "github_issue": (
        {"type": "object",
         "properties": {"title": {"type": "string", "maxLength": 120}, "body": {"type": "string"},
                        "labels": {"type": "array", "items": {"enum": ["bug", "feature", "docs", "question"]}},
                        "assignees": {"type": "array", "items": {"type": "string"}},
                        "milestone": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
         "required": ["title", "body", "labels"]},
        {"title": "Crash on start", "body": "It fails when the cache is empty.", "labels": ["bug"],
         "assignees": ["ana"], "milestone": None}),
    "calendar_event": (
        {"type": "object",
         "properties": {"summary": {"type": "string"},
                        "start": {"type": "string", "format": "date-time"},
                        "end": {"type": "string", "format": "date-time"},
                        "attendees": {"type": "array", "items": {
                            "type": "object", "properties": {"email": {"type": "string"},
                                                             "optional": {"type": "boolean"}},
                            "required": ["email"]}},
                        "recurrence": {"enum": ["none", "daily", "weekly", "monthly"]}},
         "required": ["summary", "start", "end"]},
        {"summary": "Standup", "start": "2026-11-25T09:00:00Z", "end": "2026-11-25T09:15:00Z",
         "attendees": [{"email": "a@b.co", "optional": False}], "recurrence": "daily"}),
    "product_catalog": (
        {"type": "object",
         "properties": {"products": {"type": "array", "items": {"$ref": "#/$defs/product"}}},
         "required": ["products"],
         "$defs": {"product": {"type": "object",
                               "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                                              "price": {"type": "number", "minimum": 0},
                                              "dimensions": {"type": "object",
                                                             "properties": {"w": {"type": "number"},
                                                                            "h": {"type": "number"}},
                                                             "required": ["w", "h"]},
                                              "in_stock": {"type": "boolean"}},
                               "required": ["id", "name", "price"]}}},
        {"products": [{"id": 1, "name": "Lamp", "price": 19.99, "dimensions": {"w": 10, "h": 30},
                       "in_stock": True}]}),
    "sentiment": (
        {"type": "object",
         "properties": {"sentiment": {"enum": ["positive", "neutral", "negative"]},
                        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                        "aspects": {"type": "array", "items": {"type": "string"}}},
         "required": ["sentiment", "confidence"]},
        {"sentiment": "positive", "confidence": 0.92, "aspects": ["price", "speed"]}),
    "config_file": (
        {"type": "object",
         "properties": {"version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+$"},
                        "server": {"type": "object",
                                   "properties": {"host": {"type": "string"},
                                                  "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                                  "tls": {"type": "boolean"}},
                                   "required": ["host", "port"]},
                        "features": {"type": "object", "additionalProperties": {"type": "boolean"}},
                        "log_level": {"enum": ["debug", "info", "warning", "error"]}},
         "required": ["version", "server"]},
        {"version": "1.2", "server": {"host": "0.0.0.0", "port": 8000, "tls": False},
         "features": {"beta": True}, "log_level": "info"}),
}

# the schema of the must-show tests and the stack benchmark: a nested object, an array, an enum, required fields
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "owner": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["city", "age"], "additionalProperties": False},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "kind", "owner", "toys"],
    "additionalProperties": False,
}
