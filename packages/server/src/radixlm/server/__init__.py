"""radixlm.server: OpenAI-compatible and SGLang-native HTTP routes over any EngineClient."""

from radixlm.server._version import __version__
from radixlm.server.app import ApiKeyMiddleware, create_app
from radixlm.server.config import ServerConfig
from radixlm.server.errors import APIError
from radixlm.server.protocol import EngineClient
from radixlm.server.tool_calls import ToolCallReader

__all__ = [
    "APIError",
    "ApiKeyMiddleware",
    "EngineClient",
    "ServerConfig",
    "ToolCallReader",
    "__version__",
    "create_app",
]
