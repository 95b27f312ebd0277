"""JSON schemas the structured-output tests hold outputs to: nested objects, arrays, enums, required fields, numbers
(bounded, and with multipleOf, so a random model cannot write digits forever)."""

SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "pos"],
     "properties": {"name": {"type": "string", "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                    "pos": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                            "properties": {"x": {"type": "number", "multipleOf": 0.5, "minimum": -10, "maximum": 10},
                                           "y": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 1}}}}},
    {"type": "array", "minItems": 1, "maxItems": 4,
     "items": {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
               "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                              "kind": {"enum": ["cat", "dog", None]}}}},
    {"type": "object", "additionalProperties": False, "required": ["status"],
     "properties": {"status": {"enum": ["ok", "error", "unknown"]},
                    "score": {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 5},
                    "items": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 4}}}},
]
