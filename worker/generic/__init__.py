"""The generic path: a decoder whose `model_type` has no family in worker/models/ runs through transformers' own
modelling code on Lockstep's sharded layers and paged KV cache (docs/models.md, "The generic path"): `model.py` (the
CausalLM), `attention.py` (the attention function), `tp_plan.py` and `sharded.py` (the plan's linears),
`tensors.py` (checkpoint names), `refusals.py` (what it cannot serve)."""
