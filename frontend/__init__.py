"""OpenAI-compatible HTTP frontend over tritonserver (`make openai`)."""
