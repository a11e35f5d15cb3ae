"""Whisper speech recognition: features, batched greedy decoding with a KV cache, long-audio chunking."""
