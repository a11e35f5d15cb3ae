"""Client SDK and CLI for the bundle's models over tritonclient HTTP or gRPC."""
from client.sdk import Client

__all__ = ["Client"]
