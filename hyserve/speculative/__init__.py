"""Speculative decoding: proposers guess tokens, the target verifies them in one pass (see ``engine/llm_engine.py``)."""
