"""The LLM engine: paged KV cache, continuous batching, streaming. Read engine.py first (LLMEngine.step)."""
